//! What a simulated GPU reads at a moment: the numbers the fake
//! libnvidia-ml answers and the simulated backend samples, from one function
//! so that both tell the same story.
//!
//! Gauges come from the description (`telemetry:`) and do not move, so a
//! test can expect them exactly; counters grow with time since the library
//! was loaded (energy at the described power, PCIe replays, NVLink traffic,
//! clock-throttle time), so a test sees them rise. A reading the description
//! leaves out is absent (NVML's "not supported"), and so is one the GPU's
//! generation lacks: GPM before Hopper, NVLink counters without NVLinks,
//! retired pages from Ampere on (which remaps rows instead).
//!
//! Error counts (ECC, retired pages, NVLink) are constants that differ from
//! GPU to GPU (by the last digit of the UUID), so a test tells one GPU's and
//! one counter's figure from another's.

use crate::desc::{GpuDesc, NodeDescription};

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
/// NVLink error counts per active link (NVML's CRC flit, CRC data, replay
/// and recovery counters); a GPU's totals are these times its links.
pub const NVLINK_ERRORS_PER_LINK: NvlinkErrors = NvlinkErrors {
    crc_flit: 2,
    crc_data: 1,
    replay: 3,
    recovery: 0,
};
/// Clock-throttle time per second of wall time, by reason (ns/s): the GPU
/// is held back by its power cap 2% of the time, by heat 0.5%, by the board
/// limit 0.1%, by low utilisation 1%, never by sync boost or reliability.
pub const THROTTLE_NS_PER_S: Violations = Violations {
    power: 20_000_000,
    thermal: 5_000_000,
    sync_boost: 0,
    board_limit: 1_000_000,
    low_util: 10_000_000,
    reliability: 0,
};

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
    /// Active NVLinks (NVML's link numbers 0 to this, less one).
    pub nvlink_links: u32,
    /// NVLink data since load on each active link, KiB, each way (NVML's
    /// throughput counters with a link number as scope).
    pub nvlink_link_kib: Option<u64>,
    /// NVLink error counters summed over the active links (`None`: no NVLink).
    pub nvlink_errors: Option<NvlinkErrors>,
    /// GPM (Hopper and newer): percentages and PCIe MiB/s.
    pub gpm: Option<Gpm>,
    /// ECC error counts (every simulated GPU has ECC on).
    pub ecc: Ecc,
    /// Retired pages (before Ampere; `None` from Ampere on, as the real
    /// H100 answers NOT_SUPPORTED). Pending retirement comes from the fake's
    /// `retired-pending` condition, not from here.
    pub retired: Option<Retired>,
    /// Time the clocks were held back since load, ns, by reason.
    pub throttle_ns: Violations,
    /// DCGM's vGPU licence status: 0, a bare-metal GPU has no GRID licence
    /// (NVML's licensable features say `isGridLicenseSupported` 0).
    pub vgpu_license: u32,
}

/// ECC error counts: single-bit (corrected) and double-bit (uncorrected),
/// volatile (since the driver loaded) and aggregate (the board's life).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ecc {
    pub sbe_volatile: u64,
    pub dbe_volatile: u64,
    pub sbe_aggregate: u64,
    pub dbe_aggregate: u64,
}

/// Pages retired after single-bit and double-bit errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Retired {
    pub sbe: u64,
    pub dbe: u64,
}

/// NVLink error counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NvlinkErrors {
    pub crc_flit: u64,
    pub crc_data: u64,
    pub replay: u64,
    pub recovery: u64,
}

/// Clock-throttle time by reason (NVML's perf-policy counters, ns).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Violations {
    pub power: u64,
    pub thermal: u64,
    pub sync_boost: u64,
    pub board_limit: u64,
    pub low_util: u64,
    pub reliability: u64,
}

impl Violations {
    /// Each reason's time after `secs` seconds at [`THROTTLE_NS_PER_S`].
    fn after(secs: f64) -> Violations {
        let r = THROTTLE_NS_PER_S;
        let t = |ns_per_s: u64| (ns_per_s as f64 * secs) as u64;
        Violations {
            power: t(r.power),
            thermal: t(r.thermal),
            sync_boost: t(r.sync_boost),
            board_limit: t(r.board_limit),
            low_util: t(r.low_util),
            reliability: t(r.reliability),
        }
    }
}

/// What NVML says of the board: constant facts, labels in DCGM's series.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Board {
    /// NVML's `nvmlBrandType_t`: 14 (`NVML_BRAND_NVIDIA`), or 2
    /// (`NVML_BRAND_TESLA`) for a GPU named `Tesla …`.
    pub brand: u32,
    /// NVML's `nvmlDeviceArchitecture_t`, from the compute capability
    /// ([`nvml_architecture`]): 9 (Hopper) for an H100, 7 (Ampere) for an
    /// A100 or A10G, 6 (Turing) for a T4.
    pub architecture: u32,
    /// The board's serial number (13 digits, from the UUID).
    pub serial: String,
    pub vbios: String,
    pub inforom_image: String,
    pub inforom_oem: String,
    pub inforom_ecc: String,
    /// The power-management InfoROM object's version: none from Ampere on
    /// (nvidia-smi -q on the real H100 says N/A), 3.0 before.
    pub inforom_power: Option<String>,
}

/// `NVML_BRAND_TESLA`, `NVML_BRAND_NVIDIA`.
pub const BRAND_TESLA: u32 = 2;
pub const BRAND_NVIDIA: u32 = 14;

/// `NVML_DEVICE_ARCH_UNKNOWN`.
pub const ARCH_UNKNOWN: u32 = 0xffff_ffff;

/// The architecture NVML reports for a GPU of this compute capability
/// (`NVML_DEVICE_ARCH_*`): each architecture has its own major version,
/// but for Volta (7.0, 7.2) and Turing (7.5), Ampere (8.0, 8.6), Jetson
/// Orin (8.7, `T23X`) and Ada (8.9). Blackwell is 10.x and 12.x.
pub fn nvml_architecture(compute_capability: Option<(u32, u32)>) -> u32 {
    match compute_capability {
        Some((3, _)) => 2,
        Some((5, _)) => 3,
        Some((6, _)) => 4,
        Some((7, 0..=4)) => 5,
        Some((7, _)) => 6,
        Some((8, 7)) => 11,
        Some((8, 9)) => 8,
        Some((8, _)) => 7,
        Some((9, _)) => 9,
        Some((10 | 12, _)) => 10,
        _ => ARCH_UNKNOWN,
    }
}

/// GPU performance-monitoring figures over the last interval.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gpm {
    pub graphics_util_pct: f64,
    pub tensor_util_pct: f64,
    pub dram_bw_util_pct: f64,
    pub pcie_tx_mib_s: f64,
    pub pcie_rx_mib_s: f64,
    /// SMs busy, warps resident against the most there could be, and the
    /// FP64, FP32 and FP16 pipes busy (%).
    pub sm_util_pct: f64,
    pub sm_occupancy_pct: f64,
    pub fp64_util_pct: f64,
    pub fp32_util_pct: f64,
    pub fp16_util_pct: f64,
}

impl Gpm {
    /// The figures of a GPU (or GPU instance) `util` % busy.
    fn at(util: f64, dram_pct: f64) -> Gpm {
        Gpm {
            graphics_util_pct: util,
            tensor_util_pct: util / 2.0,
            dram_bw_util_pct: dram_pct,
            pcie_tx_mib_s: 100.0 + util,
            pcie_rx_mib_s: 200.0 + util,
            sm_util_pct: util * 0.9,
            sm_occupancy_pct: util * 0.4,
            fp64_util_pct: util * 0.05,
            fp32_util_pct: util * 0.3,
            fp16_util_pct: util * 0.1,
        }
    }
}

/// The last hex digit of a UUID: what makes one GPU's error counts differ
/// from another's.
fn digit(uuid: &str) -> u64 {
    uuid.chars()
        .last()
        .and_then(|c| c.to_digit(16))
        .map_or(0, u64::from)
}

impl NodeDescription {
    /// NVML's own version (`nvmlSystemGetNVMLVersion`): the CUDA major
    /// version and the driver's, `12.550.127.08`.
    pub fn nvml_version(&self) -> Option<String> {
        let d = self.driver.as_ref()?;
        let major = d.cuda_version.split('.').next()?;
        Some(format!("{major}.{}", d.version))
    }
}

impl GpuDesc {
    /// The readings at `secs` seconds after load.
    pub fn readings(&self, secs: f64) -> Readings {
        let t = &self.telemetry;
        let secs = secs.max(0.0);
        let links: u32 = self.nvlinks.iter().map(|l| l.links).sum();
        let per_link = (links > 0).then_some((secs * NVLINK_KIB_PER_S_PER_LINK) as u64);
        let nvlink = per_link.map(|k| k * u64::from(links));
        let util = t.utilization_gpu.unwrap_or(0) as f64;
        let major = self.compute_capability().map_or(0, |(major, _)| major);
        let hopper = major >= 9;
        let n = digit(&self.uuid);
        let e = NVLINK_ERRORS_PER_LINK;
        let l = u64::from(links);
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
            nvlink_links: links,
            nvlink_link_kib: per_link,
            nvlink_errors: (links > 0).then_some(NvlinkErrors {
                crc_flit: e.crc_flit * l,
                crc_data: e.crc_data * l,
                replay: e.replay * l,
                recovery: e.recovery * l,
            }),
            gpm: hopper.then(|| Gpm::at(util, t.utilization_memory.unwrap_or(0) as f64)),
            ecc: Ecc {
                sbe_volatile: 2 + n,
                dbe_volatile: 0,
                sbe_aggregate: 10 * (n + 1) + 2 + n,
                dbe_aggregate: n % 2,
            },
            retired: (major < 8).then_some(Retired {
                sbe: n + 1,
                dbe: n % 2,
            }),
            throttle_ns: Violations::after(secs),
            vgpu_license: 0,
        }
    }

    /// The GPM figures of this GPU's GPU instance `gi_id` (MIG, Hopper and
    /// newer): the GPU's utilisation plus 5 points per instance ID, so each
    /// instance reads its own. PCIe traffic is the GPU's, not an instance's
    /// (NVML gives it per GPU only).
    pub fn instance_gpm(&self, gi_id: u32) -> Option<Gpm> {
        let major = self.compute_capability().map_or(0, |(major, _)| major);
        if major < 9 {
            return None;
        }
        let t = &self.telemetry;
        let util = (t.utilization_gpu.unwrap_or(0) as f64 + 5.0 * f64::from(gi_id)).min(100.0);
        let dram = (t.utilization_memory.unwrap_or(0) as f64 + 2.0 * f64::from(gi_id)).min(100.0);
        Some(Gpm::at(util, dram))
    }

    /// The board's facts: brand, serial number, VBIOS and InfoROM versions,
    /// as the model's boards report them.
    pub fn board(&self) -> Board {
        let major = self.compute_capability().map_or(0, |(major, _)| major);
        let (vbios, image, oem, ecc) = match major {
            9.. => ("96.00.99.00.01", "G520.0200.00.05", "2.1", "7.16"),
            8 => ("92.00.45.00.03", "G506.0201.00.03", "2.0", "6.16"),
            _ => ("90.04.96.00.9F", "G183.0200.00.02", "1.1", "5.0"),
        };
        // 13 digits: a prefix and the UUID's last five hex digits in decimal.
        let tail: String = self
            .uuid
            .chars()
            .rev()
            .filter(|c| c.is_ascii_hexdigit())
            .take(5)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        let tail = u64::from_str_radix(&tail, 16).unwrap_or(0);
        Board {
            brand: if self.name.starts_with("Tesla") {
                BRAND_TESLA
            } else {
                BRAND_NVIDIA
            },
            architecture: nvml_architecture(self.compute_capability()),
            serial: format!("16549{:08}", tail % 100_000_000),
            vbios: vbios.to_string(),
            inforom_image: image.to_string(),
            inforom_oem: oem.to_string(),
            inforom_ecc: ecc.to_string(),
            inforom_power: (major < 8).then(|| "3.0".to_string()),
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

    #[test]
    fn error_counts_differ_by_gpu_and_follow_the_generation() {
        let node = NodeDescription::load("h100-sxm-8").unwrap();
        let (a, b) = (node.gpus[0].readings(10.0), node.gpus[1].readings(10.0));
        assert_ne!(a.ecc, b.ecc, "each GPU its own counts");
        assert!(a.ecc.sbe_aggregate >= a.ecc.sbe_volatile);
        assert_eq!(a.retired, None, "Hopper remaps rows, it retires no pages");
        let e = a.nvlink_errors.unwrap();
        assert_eq!(e.crc_flit, 2 * u64::from(a.nvlink_links));
        assert_eq!(
            a.nvlink_tx_kib,
            a.nvlink_link_kib.map(|k| k * u64::from(a.nvlink_links))
        );
        assert_eq!(a.throttle_ns.power, 200_000_000, "2% of 10 s");
        assert_eq!(a.throttle_ns.sync_boost, 0);
        let board = node.gpus[0].board();
        assert_eq!(board.brand, super::BRAND_NVIDIA);
        assert_eq!(board.serial.len(), 13);
        assert_ne!(board.serial, node.gpus[1].board().serial);
        assert_eq!(board.inforom_power, None);
        assert_eq!(node.nvml_version().as_deref(), Some("12.550.127.08"));
        // GPU instances read their own GPM figures.
        let g = &node.gpus[0];
        assert_ne!(g.instance_gpm(1), g.instance_gpm(2));
        let t4 = NodeDescription::load("t4-4").unwrap();
        let r = t4.gpus[0].readings(1.0);
        assert!(r.retired.is_some(), "Turing retires pages");
        assert_eq!(r.nvlink_errors, None);
        assert_eq!(t4.gpus[0].board().brand, super::BRAND_TESLA);
        assert_eq!(t4.gpus[0].board().architecture, 6, "Turing");
        assert_eq!(board.architecture, 9, "Hopper");
        let a10g = NodeDescription::load("a10g-1").unwrap();
        assert_eq!(a10g.gpus[0].board().architecture, 7, "Ampere");
        assert_eq!(super::nvml_architecture(Some((8, 9))), 8, "Ada");
        assert_eq!(super::nvml_architecture(Some((10, 0))), 10, "Blackwell");
        assert_eq!(super::nvml_architecture(None), super::ARCH_UNKNOWN);
        assert_eq!(t4.gpus[0].instance_gpm(0), None);
    }
}
