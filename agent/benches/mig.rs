//! MIG layout benchmark (run by hand: `cargo bench -p gpu-agent --bench mig`).
//!
//! Through the real NVML path (nvml-wrapper and nvml-wrapper-sys) against
//! the fake libnvidia-ml simulating 8 H100 80GB (`h100-sxm-8`):
//! - all-disabled → all-balanced on all 8 GPUs (MIG mode on, then per GPU
//!   1g.10gb x2 + 2g.20gb + 3g.40gb), plan + apply + check, wall time
//!   p50/p99 over 20 rounds (each round starts from all-disabled);
//! - a no-op: all-balanced planned again on a node that has it, wall time
//!   p50/p99 over 200 plans (nothing is applied: the plan says so).
//!
//! The fake answers in microseconds, so these figures are gpu-agent's own
//! cost (planning, placement search, NVML calls); a real GPU adds the
//! driver's time to create instances.

use std::time::{Duration, Instant};

use gpu_agent::backend::GpuBackend;
use gpu_agent::backend::nvml::NvmlBackend;
use gpu_agent::inventory;
use gpu_agent::mig::config::MigPartedConfig;
use gpu_agent::mig::{self, Applied, ApplyEnv};
use hostlib::HostRoot;
use hostlib::command::RecordingRunner;

#[path = "../tests/common/mod.rs"]
mod common;
mod support;
use support::{ms, pct};

fn report(what: &str, mut v: Vec<Duration>) {
    v.sort();
    println!(
        "{what:<60} p50 {:>8.3} ms  p99 {:>8.3} ms  (n={})",
        ms(pct(&v, 0.5)),
        ms(pct(&v, 0.99)),
        v.len()
    );
}

fn main() {
    println!("gpu-agent MIG layout benchmark");
    println!("NVML: the fake libnvidia-ml, {}", support::nvml_costs());
    let (_dir, lib) = common::fake_nvml();
    let state = tempfile::tempdir().unwrap();
    // SAFETY: set before NVML is loaded, while this is the only thread.
    #[allow(unsafe_code)]
    unsafe {
        std::env::set_var("FAKE_NVML_NODE", "h100-sxm-8");
        std::env::set_var("FAKE_NVML_MIG", state.path().join("mig.json"));
    };
    let host = HostRoot::new(common::host_fixture("h100-sxm-8")).unwrap();
    let backend = NvmlBackend::open(Some(&lib)).unwrap();
    let control = backend.mig_control().unwrap();
    let config = MigPartedConfig::builtin();
    let origin = "built-in";
    let runner = RecordingRunner::default();
    let env = ApplyEnv {
        host: &host,
        runner: &runner,
        reboot: false,
    };
    let to = |layout: &str| -> Duration {
        let t = Instant::now();
        let inv = inventory::discover(&host, &backend);
        let plan = mig::plan(control, &inv, &config, origin, layout).unwrap();
        if !plan.is_noop() {
            match mig::apply(control, &env, &plan).unwrap() {
                Applied::Done(_) => {}
                other => panic!("{other:?}"),
            }
        }
        t.elapsed()
    };
    let mut change = Vec::new();
    for _ in 0..20 {
        to("all-disabled");
        change.push(to("all-balanced"));
    }
    let inv = inventory::discover(&host, &backend);
    assert_eq!(
        inv.gpus.iter().map(|g| g.mig_devices.len()).sum::<usize>(),
        32,
        "8 GPUs x (2 + 1 + 1) MIG devices"
    );
    report(
        "all-disabled → all-balanced, 8x H100 (discover+plan+apply)",
        change,
    );
    let mut noop = Vec::new();
    for _ in 0..200 {
        let t = Instant::now();
        let inv = inventory::discover(&host, &backend);
        let plan = mig::plan(control, &inv, &config, origin, "all-balanced").unwrap();
        assert!(plan.is_noop());
        noop.push(t.elapsed());
    }
    report("all-balanced again: a no-op (discover+plan)", noop);
}
