//! The policy (`/etc/gpu-agent/policy.yaml`, and a ClusterPolicy's YAML as
//! the controller hands it down): parsed and validated, or refused with an
//! error naming the file. Never a panic.
#![no_main]

use gpu_agent::policy::Policy;
use libfuzzer_sys::fuzz_target;

const ORIGIN: &str = "fuzz/policy.yaml";

fuzz_target!(|data: &[u8]| {
    let Some(text) = gpu_agent_fuzz::text(data) else {
        return;
    };
    if let Err(e) = Policy::from_yaml(text, ORIGIN) {
        let shown = e.to_string();
        assert!(
            shown.contains(ORIGIN),
            "error does not name the file: {shown}"
        );
    }
    match Policy::from_cluster_yaml(text, ORIGIN) {
        Ok((policy, _left_out)) => {
            let _ = policy.module_params();
            let _ = policy.mig_manager.selected_layout();
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
