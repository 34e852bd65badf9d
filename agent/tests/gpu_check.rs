//! `scripts/gpu-check`, the check meant for a real GPU node (docs/real-gpu.md),
//! run whole here without a GPU: over the captured H100 host
//! (`tests/fixtures/hosts/h100-pcie-vm`) with the fake libnvidia-ml answering
//! as that GPU (`tests/fixtures/real-hosts/h100-pcie-vm/node.yaml`), the
//! built gpu-agent, and the Python grpcio venv as the kubelet stand-in's
//! interpreter. Its summary table must hold every row with a value.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use common::{fake_nvml, host_fixture, json, python, repo, run};

const HOST: &str = "h100-pcie-vm";

/// The summary table's rows: check -> (result, value). Columns are separated
/// by two spaces or more; the header row is left out.
fn summary(out: &str) -> BTreeMap<String, (String, String)> {
    let table = out
        .split("== summary ==\n")
        .nth(1)
        .unwrap_or_else(|| panic!("no summary table in:\n{out}"));
    let mut rows = BTreeMap::new();
    for line in table.lines().skip(1).take_while(|l| !l.trim().is_empty()) {
        let cols: Vec<&str> = line
            .split("  ")
            .map(str::trim)
            .filter(|c| !c.is_empty())
            .collect();
        assert!(cols.len() >= 3, "not `check  result  value`: {line:?}");
        rows.insert(
            cols[0].to_string(),
            (cols[1].to_string(), cols[2..].join("  ")),
        );
    }
    rows
}

/// The first number in `text` after `after`.
fn number_after(text: &str, after: &str) -> f64 {
    let rest = &text[text
        .find(after)
        .unwrap_or_else(|| panic!("no {after:?} in {text:?}"))
        + after.len()..];
    let num: String = rest
        .trim_start()
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    num.parse()
        .unwrap_or_else(|_| panic!("no number after {after:?} in {text:?}"))
}

/// A line of the NVML costs table: `<name> p50 <n> us  max <n> us  [error]`.
fn cost_line(table: &str, name: &str) -> (f64, f64) {
    let line = table
        .lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .unwrap_or_else(|| panic!("no {name} line in the NVML costs:\n{table}"));
    let w: Vec<&str> = line[name.len()..].split_whitespace().collect();
    assert!(
        w.len() >= 6 && w[0] == "p50" && w[2] == "us" && w[3] == "max" && w[5] == "us",
        "not the costs format: {line:?}"
    );
    (w[1].parse().unwrap(), w[4].parse().unwrap())
}

#[test]
fn gpu_check_runs_whole_over_the_captured_h100_and_the_fake_nvml() {
    let py = python();
    let (_lib_dir, lib) = fake_nvml();
    let node = repo()
        .join("tests/fixtures/real-hosts")
        .join(HOST)
        .join("node.yaml");
    let dir = tempfile::tempdir().unwrap();
    let out_file = dir.path().join("check.txt");
    let fixture = host_fixture(HOST);
    let before = listing(&fixture);
    let (code, out, err) = run(Command::new(repo().join("scripts/gpu-check"))
        .arg("--binary")
        .arg(env!("CARGO_BIN_EXE_gpu-agent"))
        .arg("--host-root")
        .arg(&fixture)
        .arg("--nvml-lib")
        .arg(&lib)
        .arg("--python")
        .arg(&py)
        .arg("--out")
        .arg(&out_file)
        .args(["--starts", "2", "--allocations", "20", "--calls", "5"])
        .args(["--idle-seconds", "0.5", "--load-seconds", "1"])
        .env("FAKE_NVML_NODE", &node)
        // The fake's default: the captured host's NVML costs.
        .env_remove("FAKE_NVML_COSTS")
        // The venv has no PyTorch: the CUDA load says it is skipped.
        .env("GPU_CHECK_TORCH_PYTHON", &py)
        .current_dir(dir.path()));
    assert_eq!(code, 0, "gpu-check failed:\n{out}\nstderr:\n{err}");

    // Everything printed is in the file too.
    let written = std::fs::read_to_string(&out_file).unwrap();
    assert_eq!(
        written, out,
        "the output file differs from what was printed"
    );
    let rows = summary(&out);
    let row = |check: &str| -> String {
        let (result, value) = rows
            .get(check)
            .unwrap_or_else(|| panic!("no row {check:?} in the summary:\n{out}"));
        assert_eq!(result, "ok", "{check}: {value}\n{out}");
        value.clone()
    };

    assert!(row("binary").starts_with("gpu-agent "));
    assert!(
        row("inventory").starts_with("1 GPU(s): 1x NVIDIA H100 80GB HBM3; driver 580.159.04"),
        "{out}"
    );
    // As many labels as the agent itself gives for the host.
    let (_, labels, _) = run(common::at(&fixture)
        .arg("--nvml-lib")
        .arg(&lib)
        .env("FAKE_NVML_NODE", &node)
        .args(["labels", "-o", "json"]));
    let n_labels = json(&labels).as_object().unwrap().len();
    assert!(n_labels > 0);
    assert!(
        row("labels").starts_with(&format!("{n_labels} label(s)")),
        "{out}"
    );
    assert!(row("status").contains("discover done"), "{out}");
    // One GPU by index and UUID, and `all`.
    assert!(row("cdi generate").starts_with("3 device(s)"), "{out}");

    // The run: both starts timed, the GPU listed and allocated.
    let register = row("run: start -> Register");
    let ms = number_after(&register, "");
    assert!(ms > 0.0 && ms < 60_000.0, "{register}");
    assert!(register.contains("2 start(s)"), "{register}");
    assert!(register.contains("fake NVML"), "{register}");
    let list = row("run: start -> first ListAndWatch");
    assert!(
        number_after(&list, "") >= ms,
        "listed before registering? {list} / {register}"
    );
    assert!(list.contains("1 device(s) listed, 1 healthy"), "{list}");
    assert!(number_after(&row("run: Allocate p50"), "") > 0.0);
    assert!(number_after(&row("run: RSS"), "") > 1.0);
    row("run: CPU while idle");
    let stages = row("run: stages");
    for on in ["discover done", "plugin done", "metrics done"] {
        assert!(stages.contains(on), "{stages}");
    }
    // What the run's policy keeps off: no host file, no GPU setting changed.
    assert!(
        stages.ends_with("off: mig, runtime, cdi, labels"),
        "{stages}"
    );
    assert!(number_after(&row("metrics scrape"), "") > 0.0);
    assert!(row("run: stop (SIGTERM)").starts_with("exit 0"));
    let (load, why) = &rows["metrics under CUDA load"];
    assert!(
        load == "skipped" && why.contains("PyTorch is not importable"),
        "{load}: {why}"
    );

    // NVML's costs: a row, the lines in the output and a table file in the
    // format of the captured host's nvml-costs.txt.
    let costs = row("NVML costs");
    assert!(number_after(&costs, "") > 10.0, "{costs}");
    assert!(costs.contains("nvmlInit"), "{costs}");
    let table = std::fs::read_to_string(dir.path().join("check-nvml-costs.txt")).unwrap();
    assert!(out.contains(&table), "the costs table is not in the output");
    assert!(number_after(&table, "nvmlInit (first)") > 0.0);
    assert!(number_after(&table, "nvmlInit (again)") > 0.0);
    for name in [
        "nvmlDeviceGetCount",
        "nvmlDeviceGetHandleByIndex",
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetMigMode",
        "nvmlDeviceGetPowerUsage",
        "event set create+register+free",
        "GPM sample alloc+get+free",
    ] {
        let (p50, max) = cost_line(&table, name);
        assert!(p50 > 0.0 && max >= p50, "{name}: p50 {p50} max {max}");
    }
    // The fake charges a real H100's costs: MIG mode takes ~164 us there.
    assert!(
        cost_line(&table, "nvmlDeviceGetMigMode").0 > 100.0,
        "{table}"
    );
    assert!(table.contains("NVMLError_Timeout:Timeout"), "{table}");

    // The CDI spec and the agent's log beside the output.
    let spec = json(&std::fs::read_to_string(dir.path().join("check-cdi.json")).unwrap());
    assert_eq!(spec["kind"], "nvidia.com/gpu");
    let log = std::fs::read_to_string(dir.path().join("check-agent.log")).unwrap();
    assert_eq!(log.matches("=== start ").count(), 2, "{log}");

    // The run had a copy of the host: the fixture is as it was.
    assert_eq!(listing(&fixture), before);
}

/// Every path under `dir` with its kind and size.
fn listing(dir: &Path) -> Vec<(String, bool, u64)> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let m = std::fs::symlink_metadata(e.path()).unwrap();
            if m.is_dir() {
                todo.push(e.path());
            }
            out.push((e.path().display().to_string(), m.is_file(), m.len()));
        }
    }
    out.sort();
    out
}

#[test]
fn gpu_check_names_what_is_missing() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-gpu-agent");
    let (code, _, err) = run(Command::new(repo().join("scripts/gpu-check"))
        .arg("--binary")
        .arg(&missing)
        .current_dir(dir.path()));
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains(&format!("no gpu-agent binary at {}", missing.display()))
            && err.contains("cargo build --release -p gpu-agent"),
        "{err}"
    );
    let (code, _, err) = run(Command::new(repo().join("scripts/gpu-check"))
        .args(["bundle"])
        .current_dir(dir.path()));
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("usage: gpu-check bundle DIR"), "{err}");
    let (code, _, err) = run(Command::new(repo().join("scripts/gpu-check"))
        .arg("bundle")
        .arg(dir.path().join("b"))
        .arg("--binary")
        .arg(&missing)
        .current_dir(dir.path()));
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains(&format!("no release binary at {}", missing.display())),
        "{err}"
    );
    assert!(
        !dir.path().join("b").exists(),
        "a failed bundle left a directory"
    );
}
