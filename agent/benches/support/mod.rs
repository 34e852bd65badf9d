//! Helpers the benchmarks share: CPU clocks and percentiles.
#![allow(dead_code)]

use std::time::Duration;

/// This thread's CPU time.
pub fn thread_cpu() -> Duration {
    let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID).unwrap();
    Duration::new(t.tv_sec() as u64, t.tv_nsec() as u32)
}

/// The `p` quantile of sorted durations.
pub fn pct(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// What NVML cost the figures carry: the fake libnvidia-ml's, as
/// `FAKE_NVML_COSTS` sets it.
pub fn nvml_costs() -> String {
    match std::env::var("FAKE_NVML_COSTS").as_deref() {
        Ok("off" | "0" | "none") => {
            "answering at once (FAKE_NVML_COSTS=off): NVML's own cost is not in these figures"
                .to_string()
        }
        Ok(t) if !t.is_empty() && t != "on" && t != "h100-pcie-vm" => {
            format!("each call charged its cost from {t} (FAKE_NVML_COSTS)")
        }
        _ => "each call charged what it cost on a real H100 (tests/fake-nvml/costs; FAKE_NVML_COSTS=off to leave NVML's cost out)".to_string(),
    }
}
