//! The real-host tier: gpu-agent over the files of a real GPU machine.
//!
//! `tests/fixtures/hosts/h100-pcie-vm` is the capture of a real H100 VM
//! (kernel without module unloading: `-` reference counts in /proc/modules;
//! driver 580.159.04 under /usr/local/nvidia; MIG capabilities 0400/0444),
//! unchanged (`tests/fixtures/real-hosts/make-fixtures`). What a test needs
//! beyond those files is made here from the capture's own notes
//! (`tests/fixtures/real-hosts/h100-pcie-vm/facts.txt`): the device nodes
//! with the modes the driver gave them (real mknod, as root), the driver's
//! file layout and the linker's configuration. NVML answers through the
//! fake libnvidia-ml from `node.yaml`, what nvidia-smi said on that host,
//! at the per-call costs measured there.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{at, fake_nvml, json, repo, run, stage};

/// `status`'s exit code when no running agent answered (it inspected the
/// host instead).
const NOT_RUNNING: i32 = 3;

const HOST: &str = "h100-pcie-vm";
const UUID: &str = "GPU-737e5539-645b-5e0c-7b3f-7fedac348dc4";
/// The host's driver, as everything agreed on it.
const DRIVER_POLICY: &str =
    "spec:\n  driver:\n    enabled: false\n  toolkit:\n    enabled: false\n";

fn notes(file: &str) -> PathBuf {
    repo()
        .join("tests/fixtures/real-hosts")
        .join(HOST)
        .join(file)
}

fn facts() -> String {
    fs::read_to_string(notes("facts.txt")).unwrap()
}

/// One section of facts.txt (`== name` up to the next `==`).
fn section(name: &str) -> Vec<String> {
    let text = facts();
    let start = text
        .find(&format!("== {name}\n"))
        .unwrap_or_else(|| panic!("facts.txt has no section {name}"));
    text[start..]
        .lines()
        .skip(1)
        .take_while(|l| !l.starts_with("== "))
        .map(str::to_string)
        .collect()
}

/// A private copy of the captured host, with the driver's files (empty, at
/// the paths facts.txt lists) and the linker's directories as captured.
fn real_host() -> tempfile::TempDir {
    let dir = common::copy_host_fixture(HOST);
    let root = dir.path();
    let sec = section("driver files");
    let paths: Vec<&str> = sec
        .iter()
        .map(String::as_str)
        .filter(|l| l.starts_with("/usr/local/nvidia"))
        .collect();
    for p in &paths {
        let full = root.join(&p[1..]);
        if paths.iter().any(|q| q.starts_with(&format!("{p}/"))) {
            fs::create_dir_all(&full).unwrap();
        } else {
            fs::create_dir_all(full.parent().unwrap()).unwrap();
            fs::write(&full, "").unwrap();
        }
    }
    // ldconfig -p's other copies (`=> /lib/libnvidia-ml.so.1`).
    for l in &sec {
        if let Some((_, target)) = l.split_once("=> ")
            && target.starts_with("/lib/")
        {
            let full = root.join(&target[1..]);
            fs::create_dir_all(full.parent().unwrap()).unwrap();
            fs::write(full, "").unwrap();
        }
    }
    // /etc/ld.so.conf as captured: its include line, then what the included
    // files held.
    let include = sec.iter().position(|l| l.starts_with("include")).unwrap();
    fs::create_dir_all(root.join("etc/ld.so.conf.d")).unwrap();
    fs::write(root.join("etc/ld.so.conf"), format!("{}\n", sec[include])).unwrap();
    let dirs: Vec<&str> = sec[include + 1..]
        .iter()
        .map(String::as_str)
        .filter(|l| l.starts_with('/') || l.starts_with('#'))
        .collect();
    fs::write(
        root.join("etc/ld.so.conf.d/captured.conf"),
        dirs.join("\n") + "\n",
    )
    .unwrap();
    dir
}

/// The device nodes facts.txt lists (`crw-rw-rw- 1 root root 195, 0 … nvidia0`):
/// (path, major, minor, mode).
fn captured_nodes() -> Vec<(String, u32, u32, u32)> {
    let mut out = Vec::new();
    let mut dir = "/dev".to_string();
    for l in section("dev") {
        if let Some(d) = l.strip_suffix(':') {
            dir = d.to_string();
            continue;
        }
        let Some(perms) = l.strip_prefix('c') else {
            continue;
        };
        let mut mode = 0;
        for (i, c) in perms[..9].chars().enumerate() {
            if c != '-' {
                mode |= 1 << (8 - i);
            }
        }
        let f: Vec<&str> = l.split_whitespace().collect();
        let major: u32 = f[4].trim_end_matches(',').parse().unwrap();
        let minor: u32 = f[5].parse().unwrap();
        out.push((format!("{dir}/{}", f[f.len() - 1]), major, minor, mode));
    }
    out
}

/// Makes the captured nodes (real character devices, with their modes).
fn make_captured_nodes(root: &Path) {
    for (path, major, minor, mode) in captured_nodes() {
        let p = root.join(&path[1..]);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        nix::sys::stat::mknod(
            &p,
            nix::sys::stat::SFlag::S_IFCHR,
            nix::sys::stat::Mode::from_bits_truncate(mode),
            nix::sys::stat::makedev(u64::from(major), u64::from(minor)),
        )
        .unwrap();
        fs::set_permissions(&p, fs::Permissions::from_mode(mode)).unwrap();
    }
}

/// `gpu-agent` over `root` with NVML from the fake library answering as the
/// captured host's GPU.
fn agent(root: &Path, lib: &Path, policy: &Path) -> Command {
    let mut c = at(root);
    c.env("FAKE_NVML_NODE", notes("node.yaml"))
        .arg("--nvml-lib")
        .arg(lib)
        .arg("--policy")
        .arg(policy);
    c
}

fn policy_file(dir: &Path, text: &str) -> PathBuf {
    let p = dir.join("policy.yaml");
    fs::write(&p, text).unwrap();
    p
}

/// Mode, owner, numbers, inode and modification time of every file under
/// `dir` (a rewrite changes the inode or the time).
fn snapshot(dir: &Path) -> BTreeMap<String, (u32, u32, u64, u64, i64, i64)> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = fs::read_dir(&d) else {
            continue;
        };
        for e in entries {
            let p = e.unwrap().path();
            let m = fs::symlink_metadata(&p).unwrap();
            if m.is_dir() {
                stack.push(p.clone());
            }
            out.insert(
                p.display().to_string(),
                (
                    m.mode(),
                    m.uid(),
                    m.rdev(),
                    m.ino(),
                    m.mtime(),
                    m.mtime_nsec(),
                ),
            );
        }
    }
    out
}

#[test]
fn the_fixture_is_the_capture_unchanged() {
    let fixture = common::host_fixture(HOST);
    // What made this fixture necessary is in it.
    let modules = fs::read_to_string(fixture.join("proc/modules")).unwrap();
    assert!(
        modules.starts_with("nvidia_uvm 1830912 - - Live "),
        "{modules}"
    );
    let capture = repo().join("../shared/real-hosts").join(HOST).join("host");
    if !capture.is_dir() {
        // CI always has ../shared beside the checkout; a copy elsewhere may not.
        eprintln!(
            "{}: not here; only the fixture's own contents were checked",
            capture.display()
        );
        return;
    }
    let mut compared = 0;
    let mut stack = vec![capture.clone()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let rel = p.strip_prefix(&capture).unwrap();
            let mine = fixture.join(rel);
            if p.is_dir() {
                stack.push(p);
                continue;
            }
            let theirs = fs::read(&p).unwrap();
            let m = fs::symlink_metadata(&mine)
                .unwrap_or_else(|_| panic!("{} is missing from the fixture", rel.display()));
            if m.file_type().is_symlink() {
                // The capture holds a link as its target's text.
                assert_eq!(
                    fs::read_link(&mine).unwrap().as_os_str().as_encoded_bytes(),
                    &theirs[..],
                    "{}",
                    rel.display()
                );
            } else {
                assert_eq!(
                    fs::read(&mine).unwrap(),
                    theirs,
                    "{} differs",
                    rel.display()
                );
            }
            compared += 1;
        }
    }
    assert!(compared > 50, "only {compared} files compared");
    // The notes too.
    for n in ["facts.txt", "nvml-costs.txt", "README.md"] {
        assert_eq!(
            fs::read(notes(n)).unwrap(),
            fs::read(capture.parent().unwrap().join(n)).unwrap(),
            "{n}"
        );
    }
}

#[test]
fn discovery_and_labels_read_the_real_host() {
    let (_lib_dir, lib) = fake_nvml();
    let dir = real_host();
    let pol = policy_file(dir.path(), DRIVER_POLICY);
    let (code, out, err) = run(agent(dir.path(), &lib, &pol).args(["inventory", "-o", "json"]));
    assert_eq!(code, 0, "{err}");
    let inv = json(&out);
    assert_eq!(inv["unreadable"], serde_json::Value::Null, "{inv:#}");
    assert_eq!(inv["warnings"], serde_json::json!([]), "{inv:#}");
    let gpus = inv["gpus"].as_array().unwrap();
    assert_eq!(gpus.len(), 1);
    assert_eq!(gpus[0]["uuid"], UUID);
    assert_eq!(gpus[0]["bus_id"], "0000:00:06.0");
    assert_eq!(gpus[0]["model"], "NVIDIA H100 80GB HBM3");
    assert_eq!(gpus[0]["minor"], 0);
    assert_eq!(gpus[0]["numa_node"], serde_json::Value::Null);
    assert_eq!(gpus[0]["pci"]["driver"], "nvidia");
    assert_eq!(gpus[0]["pci"]["iommu_group"], serde_json::Value::Null);
    assert_eq!(inv["driver"]["version"], "580.159.04");
    assert_eq!(inv["driver"]["flavour"], "open");
    assert_eq!(inv["driver"]["module_list"], "read");
    let mods: Vec<(String, serde_json::Value)> = inv["driver"]["modules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["name"].as_str().unwrap().to_string(),
                m["refcount"].clone(),
            )
        })
        .collect();
    assert_eq!(
        mods,
        [
            ("nvidia".to_string(), serde_json::Value::Null),
            ("nvidia_uvm".to_string(), serde_json::Value::Null)
        ]
    );
    assert_eq!(inv["driver"]["char_majors"]["nvidia"], 195);
    assert_eq!(inv["driver"]["char_majors"]["nvidia-caps"], 241);
    // The fake's description agrees with what nvidia-smi said there.
    let smi = fs::read_to_string(notes("nvidia-smi-q.xml")).unwrap();
    assert!(smi.contains(&format!("<uuid>{UUID}</uuid>")));
    assert!(smi.contains(&format!(
        "<total>{} MiB</total>",
        gpus[0]["memory_mib"].as_u64().unwrap()
    )));

    // GFD's labels, as on the real GPU (26 there).
    let (code, out, err) = run(agent(dir.path(), &lib, &pol).args(["labels", "-o", "json"]));
    assert_eq!(code, 0, "{err}");
    let labels = json(&out);
    let labels = labels.as_object().unwrap();
    assert_eq!(labels.len(), 26, "{labels:#?}");
    assert_eq!(labels["nvidia.com/gpu.product"], "NVIDIA-H100-80GB-HBM3");
    assert_eq!(labels["nvidia.com/gpu.count"], "1");
    assert_eq!(labels["nvidia.com/gpu.memory"], "81559");
    assert_eq!(labels["nvidia.com/cuda.driver.major"], "580");
    assert_eq!(labels["nvidia.com/cuda.runtime.major"], "13");
    assert_eq!(labels["nvidia.com/mig.capable"], "true");

    // Without NVML the driver's own /proc files still name the GPU.
    let (code, out, err) = run(agent(
        dir.path(),
        Path::new("/nonexistent/libnvidia-ml.so.1"),
        &pol,
    )
    .args(["inventory", "-o", "json"]));
    assert_eq!(code, 0, "{err}");
    let inv = json(&out);
    assert_eq!(inv["gpus"][0]["uuid"], UUID);
    assert_eq!(inv["gpus"][0]["model"], "NVIDIA H100 80GB HBM3");
}

#[test]
fn the_cdi_spec_names_the_real_drivers_files() {
    let (_lib_dir, lib) = fake_nvml();
    let dir = real_host();
    let pol = policy_file(dir.path(), DRIVER_POLICY);
    let (code, out, err) = run(agent(dir.path(), &lib, &pol).args(["cdi", "generate"]));
    assert_eq!(code, 0, "{err}");
    let spec = json(&out);
    let mounts: Vec<&str> = spec["containerEdits"]["mounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["hostPath"].as_str().unwrap())
        .collect();
    // As on the real GPU: 26 libraries and 5 programs, all under the
    // driver's own prefix (ldconfig's /lib copies are not taken twice).
    let libs: Vec<&&str> = mounts.iter().filter(|m| m.contains(".so.")).collect();
    let bins: Vec<&&str> = mounts.iter().filter(|m| m.contains("/bin/")).collect();
    assert_eq!(libs.len(), 26, "{mounts:#?}");
    assert_eq!(bins.len(), 5, "{mounts:#?}");
    assert!(
        mounts.iter().all(|m| m.starts_with("/usr/local/nvidia/")),
        "{mounts:#?}"
    );
    assert!(mounts.contains(&"/usr/local/nvidia/lib64/libcuda.so.580.159.04"));
    assert!(mounts.contains(&"/usr/local/nvidia/bin/nvidia-smi"));
    let hooks = spec["containerEdits"]["hooks"].to_string();
    assert!(
        hooks.contains("update-ldcache") && hooks.contains("/usr/local/nvidia/lib64"),
        "{hooks}"
    );
    assert!(
        hooks.contains("libcuda.so.1::/usr/local/nvidia/lib64/libcuda.so"),
        "{hooks}"
    );
    let names: Vec<&str> = spec["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["0", UUID, "all"]);
}

#[test]
#[ignore = "needs root (mknod); scripts/test runs it as root"]
fn every_stage_is_done_and_a_second_start_rewrites_nothing() {
    assert!(nix::unistd::geteuid().is_root(), "needs root: real mknod");
    let (_lib_dir, lib) = fake_nvml();
    let dir = real_host();
    make_captured_nodes(dir.path());
    let pol = policy_file(dir.path(), DRIVER_POLICY);
    let dev_before = snapshot(&dir.path().join("dev"));
    let (code, _, err) = run(agent(dir.path(), &lib, &pol).args(["run", "--once"]));
    assert_eq!(code, 0, "{err}");
    // The driver's nodes were right: none replaced, none made.
    assert!(!err.contains("replaced"), "{err}");
    let (code, out, err2) = run(agent(dir.path(), &lib, &pol).args(["status", "-o", "json"]));
    assert_eq!(code, NOT_RUNNING, "{err2}");
    let st = json(&out);
    for (name, want) in [
        ("discover", "done"),
        ("driver", "done"),
        ("mig", "done"),
        ("devnodes", "done"),
        ("runtime", "disabled"),
        ("cdi", "done"),
        ("validate", "done"),
        ("labels", "done"),
    ] {
        assert_eq!(stage(&st, name)["state"], want, "{name}: {st:#}");
    }
    let dev = snapshot(&dir.path().join("dev"));
    for (path, (mode, ..)) in &dev_before {
        let now = dev.get(path).unwrap_or_else(|| panic!("{path} is gone"));
        assert_eq!(now.0, *mode, "{path}: mode changed");
    }
    let cap1 = fs::metadata(dir.path().join("dev/nvidia-caps/nvidia-cap1")).unwrap();
    assert!(cap1.file_type().is_char_device());
    assert_eq!(cap1.mode() & 0o7777, 0o400, "MIG config stays root's only");
    let cap2 = fs::metadata(dir.path().join("dev/nvidia-caps/nvidia-cap2")).unwrap();
    assert_eq!(cap2.mode() & 0o7777, 0o444);

    // A second start: every file as it was, and nothing said changed.
    let before = snapshot(dir.path());
    let (code, _, err) = run(agent(dir.path(), &lib, &pol).args(["run", "--once"]));
    assert_eq!(code, 0, "{err}");
    let after = snapshot(dir.path());
    let changed: Vec<&String> = before
        .iter()
        .filter(|(p, v)| after.get(*p) != Some(v) && !p.contains("/run/gpu-agent"))
        .map(|(p, _)| p)
        .collect();
    assert!(
        changed.is_empty(),
        "rewritten at the second start: {changed:#?}"
    );
    for word in ["created", "replaced", "wrote"] {
        assert!(
            !err.contains(word),
            "the second start says {word:?}:\n{err}"
        );
    }
}

#[test]
#[ignore = "needs root (mknod); scripts/test runs it as root"]
fn a_node_wider_than_the_driver_chose_is_narrowed() {
    assert!(nix::unistd::geteuid().is_root(), "needs root: real mknod");
    let (_lib_dir, lib) = fake_nvml();
    let dir = real_host();
    make_captured_nodes(dir.path());
    let cap1 = dir.path().join("dev/nvidia-caps/nvidia-cap1");
    // What gpu-agent did before: everyone may configure MIG.
    fs::set_permissions(&cap1, fs::Permissions::from_mode(0o444)).unwrap();
    let pol = policy_file(dir.path(), DRIVER_POLICY);
    let (code, _, err) = run(agent(dir.path(), &lib, &pol).args(["run", "--once"]));
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("replaced a wrong device node") && err.contains("nvidia-cap1"),
        "{err}"
    );
    assert_eq!(fs::metadata(&cap1).unwrap().mode() & 0o7777, 0o400);
}

/// Starts `gpu-agent run` and waits (up to `limit`) for `status --ready`.
fn ready_within(cmd: &mut Command, root: &Path, limit: Duration) -> (bool, String) {
    let mut child = cmd
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let mut last = String::new();
    let mut ready = false;
    while start.elapsed() < limit {
        let (code, out, _) = run(at(root).args(["status", "--ready"]));
        last = out;
        if code == 0 {
            ready = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    common::sigterm(&mut child);
    (ready, last)
}

#[test]
fn a_kernel_without_proc_modules_is_a_fact_and_the_agent_is_ready() {
    // A GPU node whose kernel has no loadable-module support (the driver
    // built in): no /proc/modules at all.
    let (_lib_dir, lib) = fake_nvml();
    let dir = real_host();
    fs::remove_file(dir.path().join("proc/modules")).unwrap();
    // Nothing here needs the kubelet or real device nodes.
    let pol = policy_file(
        dir.path(),
        "spec:\n  driver:\n    enabled: false\n  toolkit:\n    enabled: false\n  devicePlugin:\n    enabled: false\n  dcgmExporter:\n    enabled: false\n  validator:\n    enabled: false\n",
    );
    let (code, out, err) = run(agent(dir.path(), &lib, &pol).args(["inventory", "-o", "json"]));
    assert_eq!(code, 0, "{err}");
    let inv = json(&out);
    assert_eq!(inv["driver"]["module_list"], "no-module-support");
    assert_eq!(inv["gpus"][0]["uuid"], UUID);
    assert_eq!(inv["unreadable"], serde_json::Value::Null, "{inv:#}");
    let (code, out, _) = run(agent(dir.path(), &lib, &pol).args(["status", "-o", "json"]));
    assert_eq!(code, NOT_RUNNING);
    let st = json(&out);
    assert_eq!(stage(&st, "discover")["state"], "done", "{st:#}");
    assert_eq!(stage(&st, "driver")["state"], "done", "{st:#}");

    // The no-GPU node of the EKS values (`affinity: null` puts the agent on
    // every node) on such a kernel: Ready, saying what it found.
    let ng = common::copy_host_fixture("no-gpu");
    fs::remove_file(ng.path().join("proc/modules")).unwrap();
    let (ready, line) = ready_within(
        at(ng.path()).args(["run"]),
        ng.path(),
        Duration::from_secs(20),
    );
    assert!(ready, "never ready: {line}");
    assert!(line.contains("no GPUs"), "{line}");
    let (_, out, _) = run(at(ng.path()).args(["status"]));
    assert!(
        out.contains("no NVIDIA GPU on this node (kernel without loadable-module support)"),
        "{out}"
    );
}

#[test]
fn an_unreadable_host_file_is_named_and_the_rest_goes_on() {
    let (_lib_dir, lib) = fake_nvml();
    let dir = real_host();
    // A line the parser cannot read, and a sysfs attribute that is garbage.
    let modules = dir.path().join("proc/modules");
    let mut text = fs::read_to_string(&modules).unwrap();
    text.push_str("nvidia_drm 90112 ?? - Live 0x0 (O)\n");
    fs::write(&modules, text).unwrap();
    fs::write(
        dir.path()
            .join("sys/devices/pci0000:00/0000:00:06.0/numa_node"),
        "lots\n",
    )
    .unwrap();
    let pol = policy_file(dir.path(), DRIVER_POLICY);
    let (code, out, err) = run(agent(dir.path(), &lib, &pol).args(["status", "-o", "json"]));
    assert_eq!(code, NOT_RUNNING, "{err}");
    let st = json(&out);
    let d = stage(&st, "discover");
    assert_eq!(d["state"], "done", "{st:#}");
    let detail = d["detail"].as_str().unwrap();
    assert!(
        detail.contains("1 GPU(s): 1x NVIDIA H100 80GB HBM3")
            && detail.contains("numa_node: \"lots\" is not a NUMA node number (and 1 more)"),
        "{detail}"
    );
    let warnings = st["inventory"]["warnings"].to_string();
    assert!(
        warnings.contains(
            "proc/modules: line 3: nvidia_drm: reference count \\\"??\\\" is neither a number nor"
        ),
        "{warnings}"
    );
    // Stages that do not need the module list go on.
    assert_eq!(stage(&st, "cdi")["state"], "ready", "{st:#}");
    assert_eq!(stage(&st, "labels")["state"], "ready", "{st:#}");
    let (code, out, err) = run(agent(dir.path(), &lib, &pol).args(["inventory", "-o", "json"]));
    assert_eq!(code, 0, "{err}");
    let inv = json(&out);
    let unreadable: Vec<String> = inv["unreadable"]
        .as_array()
        .unwrap()
        .iter()
        .map(|u| format!("{} {}", u["path"].as_str().unwrap(), u["line"]))
        .collect();
    assert_eq!(unreadable.len(), 2, "{unreadable:?}");
    assert!(
        unreadable
            .iter()
            .any(|u| u.ends_with("0000:00:06.0/numa_node null")),
        "{unreadable:?}"
    );
    assert!(
        unreadable.iter().any(|u| u.ends_with("proc/modules 3")),
        "{unreadable:?}"
    );

    // The driver stage, which does need the whole module list, names it.
    let managed = dir.path().join("managed.yaml");
    fs::write(&managed, "spec:\n  toolkit:\n    enabled: false\n").unwrap();
    let (_, out, _) = run(agent(dir.path(), &lib, &managed).args(["status", "-o", "json"]));
    let st = json(&out);
    let drv = stage(&st, "driver");
    assert_eq!(drv["state"], "failed", "{st:#}");
    assert!(
        drv["detail"]
            .as_str()
            .unwrap()
            .contains("cannot tell which modules are loaded"),
        "{drv:#}"
    );
}
