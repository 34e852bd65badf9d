//! mig-parted configs (`mig-configs:` layouts): parsed and checked, each
//! layout looked up, or refused naming the file. Never a panic.
#![no_main]

use gpu_agent::mig::config::{DeviceFilter, MigPartedConfig, ProfileKey};
use libfuzzer_sys::fuzz_target;

const ORIGIN: &str = "fuzz/mig-config.yaml";

fuzz_target!(|data: &[u8]| {
    let Some(text) = gpu_agent_fuzz::text(data) else {
        return;
    };
    match MigPartedConfig::from_yaml(text, ORIGIN) {
        Ok(config) => {
            for name in config.mig_configs.keys() {
                if let Err(e) = config.layout(name, ORIGIN, "mig-configs") {
                    let shown = e.to_string();
                    assert!(
                        shown.contains(ORIGIN),
                        "error does not name the file: {shown}"
                    );
                }
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
    // The small grammars inside: device filters and profile names.
    for word in text.split_whitespace() {
        let _ = DeviceFilter::parse(word);
        let _ = ProfileKey::parse(word);
    }
});
