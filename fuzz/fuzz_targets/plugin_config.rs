//! NVIDIA's device-plugin config (the time-slicing / MPS ConfigMap): parsed
//! and checked, or refused naming the file. Never a panic.
#![no_main]

use gpu_agent::plugin::config::PluginConfig;
use libfuzzer_sys::fuzz_target;

const ORIGIN: &str = "fuzz/plugin-config.yaml";

fuzz_target!(|data: &[u8]| {
    let Some(text) = gpu_agent_fuzz::text(data) else {
        return;
    };
    match PluginConfig::from_yaml(text, ORIGIN) {
        Ok(config) => {
            let _ = config.sharing_strategy();
            if let Err(e) = config.check(ORIGIN, "") {
                let shown = e.to_string();
                assert!(
                    shown.contains(ORIGIN),
                    "error does not name the file: {shown}"
                );
            }
        }
        Err(e) => {
            let shown = e.to_string();
            assert!(
                shown.contains(ORIGIN),
                "error does not name the file: {shown}"
            );
        }
    }
});
