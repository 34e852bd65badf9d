//! Docker's daemon.json: the patched file parses as JSON and keeps every key
//! of the input (but for the `nvidia` runtime's own entry, which gpu-agent
//! writes whole), and planning again changes nothing; or the input is
//! refused with an error naming the file. Never a panic.
//!
//! The first byte: bit 0 make `nvidia` the default, bit 1 enable CDI, bit 2
//! the host has nvidia-container-runtime. The rest is daemon.json.
#![no_main]

use gpu_agent::runtime::RuntimeError;
use gpu_agent::runtime::docker::{self, Options};
use gpu_agent_fuzz::{Host, json_keys, under};
use libfuzzer_sys::fuzz_target;

const CONFIG: &str = "/etc/docker/daemon.json";

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let Some(text) = gpu_agent_fuzz::text(rest) else {
        return;
    };
    let opts = Options {
        config: CONFIG.into(),
        runtime_name: "nvidia".into(),
        runtime_path: (flags & 4 != 0).then(|| "/usr/bin/nvidia-container-runtime".to_string()),
        set_as_default: flags & 1 != 0,
        enable_cdi: flags & 2 != 0,
    };
    let host = Host::new();
    host.put(CONFIG, text);
    let changes = match docker::plan(&host.root, &opts) {
        Ok(c) => c,
        Err(e @ (RuntimeError::Parse { .. } | RuntimeError::Invalid { .. })) => {
            let shown = e.to_string();
            assert!(
                shown.starts_with(CONFIG),
                "error does not name the file: {shown}"
            );
            return;
        }
        Err(RuntimeError::NoInjection(_)) if opts.runtime_path.is_none() && !opts.enable_cdi => {
            return;
        }
        Err(e) => panic!("unexpected error: {e}"),
    };
    let before = match text.trim() {
        "" => Default::default(),
        t => json_keys(&serde_json::from_str(t).expect("plan parsed it")),
    };
    for change in &changes {
        assert_eq!(change.path, CONFIG);
        let out: serde_json::Value = serde_json::from_str(&change.after).unwrap_or_else(|e| {
            panic!(
                "daemon.json does not parse after the patch: {e}\n{}",
                change.after
            )
        });
        let after = json_keys(&out);
        for k in before.iter().filter(|k| !under(k, &["runtimes", "nvidia"])) {
            assert!(after.contains(k), "the patch lost {k:?}\n{}", change.after);
        }
        host.put(&change.path, &change.after);
    }
    let again = docker::plan(&host.root, &opts)
        .unwrap_or_else(|e| panic!("the patched daemon.json is refused: {e}"));
    assert!(again.is_empty(), "planning again changes daemon.json");
});
