//! What a simulated GPU reads at a moment: the numbers the fake
//! libnvidia-ml answers and the simulated backend samples, from one function
//! so that both tell the same story.
//!
//! Gauges come from the description (`telemetry:`) and do not move, so a
//! test can expect them exactly; counters grow with time since the library
//! was loaded (energy at the described power, PCIe replays, NVLink traffic),
//! so a test sees them rise. A reading the description leaves out is absent
//! (NVML's "not supported").

use crate::GpuDesc;

/// SM clock when the description does not say (MHz).
pub const DEFAULT_SM_CLOCK_MHZ: u32 = 1980;
/// Memory clock when the description does not say (MHz).
pub const DEFAULT_MEM_CLOCK_MHZ: u32 = 2619;
/// PCIe replays per minute on every simulated GPU.
pub const PCIE_REPLAYS_PER_MIN: f64 = 6.0;
/// NVLink data sent and received per active link, KiB/s.
pub const NVLINK_KIB_PER_S_PER_LINK: f64 = 1024.0;
/// Framebuffer the driver reserves, MiB (NVML's `reserved`).
pub const FB_RESERVED_MIB: u64 = 512;

/// One GPU's readings at `secs` seconds after the library was loaded.
#[derive(Clone, Debug, PartialEq)]
pub struct Readings {
    pub sm_clock_mhz: u32,
    pub mem_clock_mhz: u32,
    pub gpu_temp_c: Option<u32>,
    /// HBM temperature: the GPU's plus 5 °C, on GPUs with HBM (the name says so).
    pub mem_temp_c: Option<u32>,
    pub power_mw: Option<u32>,
    /// Energy since load, mJ: the described power times the time.
    pub energy_mj: Option<u64>,
    pub pcie_replays: u64,
    pub gpu_util: Option<u32>,
    pub mem_util: Option<u32>,
    /// Encoder and decoder utilisation, % (0 unless described).
    pub enc_util: u32,
    pub dec_util: u32,
    pub fb_total_mib: u64,
    pub fb_reserved_mib: u64,
    pub fb_used_mib: u64,
    /// NVLink data since load, KiB, over all active links (`None`: no NVLink).
    pub nvlink_tx_kib: Option<u64>,
    pub nvlink_rx_kib: Option<u64>,
    /// GPM (Hopper and newer): percentages and PCIe MiB/s.
    pub gpm: Option<Gpm>,
}

/// GPU performance-monitoring figures over the last interval.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gpm {
    pub graphics_util_pct: f64,
    pub tensor_util_pct: f64,
    pub dram_bw_util_pct: f64,
    pub pcie_tx_mib_s: f64,
    pub pcie_rx_mib_s: f64,
}

impl GpuDesc {
    /// The readings at `secs` seconds after load.
    pub fn readings(&self, secs: f64) -> Readings {
        let t = &self.telemetry;
        let secs = secs.max(0.0);
        let links: u32 = self.nvlinks.iter().map(|l| l.links).sum();
        let nvlink =
            (links > 0).then_some((secs * NVLINK_KIB_PER_S_PER_LINK * links as f64) as u64);
        let util = t.utilization_gpu.unwrap_or(0) as f64;
        let hopper = self
            .compute_capability()
            .is_some_and(|(major, _)| major >= 9);
        Readings {
            sm_clock_mhz: t.sm_clock_mhz.unwrap_or(DEFAULT_SM_CLOCK_MHZ),
            mem_clock_mhz: t.mem_clock_mhz.unwrap_or(DEFAULT_MEM_CLOCK_MHZ),
            gpu_temp_c: t.temperature_c,
            mem_temp_c: t
                .temperature_c
                .filter(|_| self.name.contains("HBM"))
                .map(|c| c + 5),
            power_mw: t.power_mw,
            energy_mj: t.power_mw.map(|mw| (mw as f64 * secs) as u64),
            pcie_replays: (secs / 60.0 * PCIE_REPLAYS_PER_MIN) as u64,
            gpu_util: t.utilization_gpu,
            mem_util: t.utilization_memory,
            enc_util: t.utilization_encoder.unwrap_or(0),
            dec_util: t.utilization_decoder.unwrap_or(0),
            fb_total_mib: self.memory_mib,
            fb_reserved_mib: FB_RESERVED_MIB.min(self.memory_mib),
            fb_used_mib: self.memory_used_mib,
            nvlink_tx_kib: nvlink,
            nvlink_rx_kib: nvlink,
            gpm: hopper.then_some(Gpm {
                graphics_util_pct: util,
                tensor_util_pct: util / 2.0,
                dram_bw_util_pct: t.utilization_memory.unwrap_or(0) as f64,
                pcie_tx_mib_s: 100.0 + util,
                pcie_rx_mib_s: 200.0 + util,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::NodeDescription;

    #[test]
    fn counters_grow_and_gauges_hold() {
        let node = NodeDescription::load("h100-sxm-8").unwrap();
        let g = &node.gpus[0];
        let (a, b) = (g.readings(10.0), g.readings(70.0));
        assert_eq!(a.gpu_temp_c, b.gpu_temp_c);
        assert_eq!(a.power_mw, b.power_mw);
        assert!(b.energy_mj.unwrap() > a.energy_mj.unwrap());
        assert_eq!(b.pcie_replays - a.pcie_replays, 6);
        assert!(b.nvlink_tx_kib.unwrap() > a.nvlink_tx_kib.unwrap());
        assert_eq!(a.mem_temp_c, a.gpu_temp_c.map(|c| c + 5));
        assert!(a.gpm.is_some(), "an H100 has GPM");
        let t4 = NodeDescription::load("t4-4").unwrap();
        let r = t4.gpus[0].readings(5.0);
        assert!(r.gpm.is_none(), "a T4 has no GPM");
        assert_eq!(r.nvlink_tx_kib, None);
        assert_eq!(r.mem_temp_c, None);
    }
}
