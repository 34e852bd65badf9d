//! CRI-O: crio.conf is read (never written) and a drop-in made that carries
//! the default runtime's settings into the `nvidia` runtime: the drop-in
//! parses as TOML and has every key of the runtime it copies, planning
//! again changes nothing; or crio.conf is refused with an error naming the
//! file. Never a panic.
//!
//! The first byte: bit 0 make `nvidia` the default, bit 1 the host has
//! nvidia-container-runtime. The rest is crio.conf.
#![no_main]

use gpu_agent::runtime::RuntimeError;
use gpu_agent::runtime::crio::{self, Options};
use gpu_agent_fuzz::{Host, toml_keys};
use libfuzzer_sys::fuzz_target;

const CONFIG: &str = "/etc/crio/crio.conf";
const DROP_IN: &str = "/etc/crio/crio.conf.d/99-nvidia.conf";

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let Some(text) = gpu_agent_fuzz::text(rest) else {
        return;
    };
    let opts = Options {
        drop_in: DROP_IN.into(),
        config: CONFIG.into(),
        runtime_name: "nvidia".into(),
        runtime_path: (flags & 2 != 0).then(|| "/usr/bin/nvidia-container-runtime".to_string()),
        set_as_default: flags & 1 != 0,
    };
    let host = Host::new();
    host.put(CONFIG, text);
    let changes = match crio::plan(&host.root, &opts) {
        Ok(c) => c,
        Err(e @ (RuntimeError::Parse { .. } | RuntimeError::Invalid { .. })) => {
            let shown = e.to_string();
            assert!(
                shown.starts_with(CONFIG),
                "error does not name the file: {shown}"
            );
            return;
        }
        Err(e) => panic!("unexpected error: {e}"),
    };
    let input = toml_edit::Document::parse(text.to_string()).expect("plan parsed it");
    // The runtime copied: the default one (unless it is ours), else runc, else crun.
    let runtimes = input
        .get("crio")
        .and_then(|c| c.get("runtime"))
        .and_then(|r| r.get("runtimes"));
    let default = input
        .get("crio")
        .and_then(|c| c.get("runtime"))
        .and_then(|r| r.get("default_runtime"))
        .and_then(toml_edit::Item::as_str)
        .filter(|d| *d != "nvidia");
    let copied = default.into_iter().chain(["runc", "crun"]).find_map(|n| {
        runtimes
            .and_then(|r| r.get(n))
            .and_then(toml_edit::Item::as_table)
    });
    for change in &changes {
        assert_eq!(change.path, DROP_IN, "crio.conf itself is never written");
        let out = toml_edit::Document::parse(change.after.clone())
            .unwrap_or_else(|e| panic!("{} does not parse: {e}\n{}", change.path, change.after));
        if let Some(base) = copied {
            let ours = out["crio"]["runtime"]["runtimes"]["nvidia"]
                .as_table()
                .expect("the drop-in has the nvidia runtime");
            let have = toml_keys(ours);
            // runtime_path and runtime_type are gpu-agent's own (a string
            // each, whatever the copied runtime had there: an array in one
            // found by this target), so only their presence is compared.
            let set = |k: &Vec<String>| {
                k.len() > 1 && matches!(k[0].as_str(), "runtime_path" | "runtime_type")
            };
            for k in toml_keys(base).into_iter().filter(|k| !set(k)) {
                assert!(
                    have.contains(&k),
                    "the drop-in lost {k:?}\n{}",
                    change.after
                );
            }
        }
        host.put(&change.path, &change.after);
    }
    let again =
        crio::plan(&host.root, &opts).unwrap_or_else(|e| panic!("planning again is refused: {e}"));
    assert!(again.is_empty(), "planning again changes the drop-in");
});
