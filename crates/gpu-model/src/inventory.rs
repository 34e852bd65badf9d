//! The one model of the node's GPUs. Discovery (gpu-backend's) builds it
//! once from sysfs, `/proc` and a GPU backend, through [`build`]; every front
//! end (status, device plugin, CDI, labels, metrics, report) reads it and
//! none re-discovers.
//!
//! Whole GPUs for now; MIG devices, replicas and health hang off [`Gpu`] later.

use std::collections::BTreeMap;

use hostlib::pci::PciFunction;
use hostlib::vgpu::VgpuState;
use hostlib::{DriverState, PciAddress};
use serde::{Deserialize, Serialize};

use crate::backend::{
    BackendError, BackendSnapshot, ComputeCapability, CudaVersion, GpuFabric, MigDevice, MigMode,
    PcieLevel, Telemetry,
};

/// The node's GPUs and driver, as discovered.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Inventory {
    /// DMI product name (`DGX H100`, `g5.xlarge`), when the host has one.
    pub machine: Option<String>,
    /// What `/proc` says about the kernel driver.
    pub driver: DriverState,
    /// Which backend answered, and what went wrong if it did not.
    pub backend: BackendInfo,
    /// The CUDA version the driver supports (from the backend).
    pub cuda_version: Option<CudaVersion>,
    /// GPUs by NVML index (PCI order where the backend did not answer).
    pub gpus: Vec<Gpu>,
    /// Every pair of GPUs with a known link, `a < b` by index.
    pub pairs: Vec<GpuPair>,
    /// Things an operator should know, in plain words.
    pub warnings: Vec<String>,
    /// Host files (or lines) discovery could not read: what they hold is
    /// unknown, everything else was read. A stage that needs one of them
    /// says so, naming the file and line.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unreadable: Vec<hostlib::Unreadable>,
}

/// The backend that answered.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackendInfo {
    pub name: String,
    /// The driver version the backend reports.
    pub driver_version: Option<String>,
    /// Why the backend could not answer.
    pub error: Option<String>,
    /// NVML indices of GPUs the backend has lost (fallen off the bus).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lost: Vec<u32>,
}

/// One whole GPU.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gpu {
    /// NVML index; `None` when NVML did not answer.
    pub index: Option<u32>,
    /// `/dev/nvidiaN`'s N, from the driver's /proc files.
    pub minor: Option<u32>,
    pub uuid: Option<String>,
    /// Product name, `NVIDIA H100 80GB HBM3`.
    pub model: Option<String>,
    pub bus_id: PciAddress,
    /// NUMA node from sysfs; `None` where the platform reports none.
    pub numa_node: Option<u32>,
    /// What sysfs shows of the PCI function; `None` if sysfs does not list it.
    pub pci: Option<PciFunction>,
    pub memory_mib: Option<u64>,
    pub compute_capability: Option<ComputeCapability>,
    /// `None`: not MIG-capable.
    pub mig: Option<MigMode>,
    /// Active NVLinks.
    pub nvlinks: u32,
    pub telemetry: Telemetry,
    /// MIG devices, while MIG is enabled.
    #[serde(default)]
    pub mig_devices: Vec<MigDevice>,
    /// What its PCI configuration space says of NVIDIA vGPU; `None`: not
    /// known (sysfs has no `config` file for it, or too little of it could
    /// be read).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vgpu: Option<VgpuState>,
    /// Its registration with an NVLink fabric spanning nodes; `None`: none
    /// (NVML: not supported, as on every PCIe GPU).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fabric: Option<GpuFabric>,
    /// NVML's brand as NVIDIA's DRA driver spells it (`Nvidia`, `Tesla`);
    /// `None`: not known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub brand: Option<String>,
    /// NVML's architecture as NVIDIA's DRA driver spells it (`Hopper`,
    /// `Ampere`, `Ada Lovelace`); `None`: not known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub architecture: Option<String>,
    /// The PCIe root complex the GPU sits under, `pci<domain>:<bus>`
    /// (`pci0000:00`), as the Kubernetes attribute
    /// `resource.kubernetes.io/pcieRoot` has it (hostlib's
    /// [`pcie_root`](hostlib::pcie_root::pcie_root)); `None`: sysfs does not
    /// say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pcie_root: Option<String>,
}

impl Gpu {
    /// A short name for logs: the UUID, else the bus id.
    pub fn id(&self) -> String {
        self.uuid.clone().unwrap_or_else(|| self.bus_id.to_string())
    }
}

/// How two GPUs reach each other.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuPair {
    pub a: u32,
    pub b: u32,
    /// NVLinks between them, directly or through a shared NVSwitch.
    pub nvlinks: u32,
    pub pcie: Option<PcieLevel>,
}

/// Joins sysfs's PCI functions with the backend's GPUs by bus id.
pub fn build(
    machine: Option<String>,
    functions: Vec<PciFunction>,
    driver: DriverState,
    backend_name: &str,
    snapshot: Result<BackendSnapshot, BackendError>,
) -> Inventory {
    let mut warnings = Vec::new();
    let mut by_bus: BTreeMap<PciAddress, PciFunction> =
        functions.into_iter().map(|f| (f.address, f)).collect();
    let (snapshot, error) = match snapshot {
        Ok(s) => (Some(s), None),
        Err(e) => (None, Some(e.to_string())),
    };
    let lost = snapshot
        .as_ref()
        .map(|s| s.lost.clone())
        .unwrap_or_default();
    if let Some(err) = &error
        && !by_bus.is_empty()
    {
        warnings.push(format!(
            "{} GPU(s) on the PCI bus, but {backend_name} cannot describe them: {err}",
            by_bus.len()
        ));
    }
    if driver.nouveau_loaded && !by_bus.is_empty() {
        warnings.push("the nouveau driver is loaded; it must be unloaded (and blacklisted) before the NVIDIA driver can bind the GPUs".into());
    }
    let mut gpus = Vec::new();
    let mut pairs = Vec::new();
    let mut cuda_version = None;
    let mut driver_version = None;
    if let Some(snap) = snapshot {
        cuda_version = snap.cuda_version;
        driver_version = snap.driver_version.clone();
        if let (Some(kernel), Some(lib)) = (&driver.version, &snap.driver_version)
            && kernel != lib
        {
            warnings.push(format!(
                    "kernel module is version {kernel} but NVML reports {lib}; the user-space driver does not match the loaded module"
                ));
        }
        let gpu_buses: Vec<PciAddress> = snap.gpus.iter().map(|g| g.bus_id).collect();
        for g in &snap.gpus {
            for note in &g.notes {
                warnings.push(format!("GPU {} ({}): {note}", g.index, g.bus_id));
            }
            let pci = by_bus.remove(&g.bus_id);
            if pci.is_none() {
                warnings.push(format!(
                    "GPU {} ({}) is reported by {backend_name} but not listed in sysfs",
                    g.index, g.bus_id
                ));
            }
            let proc_gpu = driver.gpus.iter().find(|p| p.bus_id == g.bus_id);
            gpus.push(Gpu {
                index: Some(g.index),
                minor: proc_gpu.and_then(|p| p.minor),
                uuid: Some(g.uuid.clone()),
                model: Some(g.name.clone()),
                bus_id: g.bus_id,
                numa_node: pci.as_ref().and_then(|p| p.numa_node),
                pci,
                memory_mib: g.memory_total_mib,
                compute_capability: g.compute_capability,
                mig: g.mig,
                nvlinks: g.nvlink_remotes.len() as u32,
                telemetry: g.telemetry.clone(),
                mig_devices: g.mig_devices.clone(),
                vgpu: None,
                fabric: g.fabric.clone(),
                brand: g.brand.clone(),
                architecture: g.architecture.clone(),
                // Discovery reads it from sysfs.
                pcie_root: None,
            });
        }
        let pcie: BTreeMap<(u32, u32), PcieLevel> =
            snap.pcie.iter().map(|&(a, b, l)| ((a, b), l)).collect();
        for (i, ga) in snap.gpus.iter().enumerate() {
            for gb in &snap.gpus[i + 1..] {
                let nvlinks = nvlinks_between(
                    &ga.nvlink_remotes,
                    &gb.nvlink_remotes,
                    gb.bus_id,
                    ga.bus_id,
                    &gpu_buses,
                );
                let level = pcie
                    .get(&(ga.index.min(gb.index), ga.index.max(gb.index)))
                    .copied();
                if nvlinks > 0 || level.is_some() {
                    pairs.push(GpuPair {
                        a: ga.index.min(gb.index),
                        b: ga.index.max(gb.index),
                        nvlinks,
                        pcie: level,
                    });
                }
            }
        }
    }
    // GPUs sysfs shows that the backend did not describe.
    for (_, f) in by_bus {
        if error.is_none() && lost.is_empty() {
            warnings.push(format!(
                "GPU at {} is on the PCI bus (bound to {}) but {backend_name} does not see it",
                f.address,
                f.driver.as_deref().unwrap_or("no driver")
            ));
        }
        // Without NVML, the driver's /proc files still name the GPU.
        let proc_gpu = driver.gpus.iter().find(|p| p.bus_id == f.address);
        gpus.push(Gpu {
            index: None,
            minor: proc_gpu.and_then(|p| p.minor),
            uuid: proc_gpu.and_then(|p| p.uuid.clone()),
            model: proc_gpu.and_then(|p| p.model.clone()),
            bus_id: f.address,
            numa_node: f.numa_node,
            pci: Some(f),
            memory_mib: None,
            compute_capability: None,
            mig: None,
            nvlinks: 0,
            telemetry: Telemetry::default(),
            mig_devices: Vec::new(),
            vgpu: None,
            fabric: None,
            brand: None,
            architecture: None,
            pcie_root: None,
        });
    }
    if let Some(w) = clique_disagreement(&gpus) {
        warnings.push(w);
    }
    Inventory {
        machine,
        driver,
        backend: BackendInfo {
            name: backend_name.to_string(),
            driver_version,
            error,
            lost,
        },
        cuda_version,
        gpus,
        pairs,
        warnings,
        unreadable: Vec::new(),
    }
}

/// The clusters and cliques of the GPUs attached to an NVLink fabric, when
/// they are not all one (GPU feature discovery then writes no
/// `nvidia.com/gpu.clique`, and neither does gpu-agent): the warning.
pub fn clique_disagreement(gpus: &[Gpu]) -> Option<String> {
    let mut cliques: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for g in gpus {
        if let Some(c) = g.fabric.as_ref().and_then(GpuFabric::clique) {
            cliques.entry(c).or_default().push(g.id());
        }
    }
    (cliques.len() > 1).then(|| {
        let each: Vec<String> = cliques
            .iter()
            .map(|(c, ids)| format!("{c} ({})", ids.join(", ")))
            .collect();
        format!(
            "the GPUs are in different NVLink fabric cliques ({}); no nvidia.com/gpu.clique label",
            each.join("; ")
        )
    })
}

/// NVLinks between GPU A and GPU B: A's links that end at B, plus, for each
/// NVSwitch both reach, the smaller of their link counts to it.
fn nvlinks_between(
    a_remotes: &[PciAddress],
    b_remotes: &[PciAddress],
    b_bus: PciAddress,
    a_bus: PciAddress,
    gpu_buses: &[PciAddress],
) -> u32 {
    let count = |remotes: &[PciAddress], target: PciAddress| {
        remotes.iter().filter(|r| **r == target).count() as u32
    };
    let direct = count(a_remotes, b_bus).max(count(b_remotes, a_bus));
    let mut switches: Vec<PciAddress> = a_remotes
        .iter()
        .copied()
        .filter(|r| !gpu_buses.contains(r))
        .collect();
    switches.sort();
    switches.dedup();
    let via_switch: u32 = switches
        .into_iter()
        .map(|s| count(a_remotes, s).min(count(b_remotes, s)))
        .sum();
    direct + via_switch
}

impl Inventory {
    /// The pair record for GPUs `a` and `b` (either order).
    pub fn pair(&self, a: u32, b: u32) -> Option<&GpuPair> {
        let (a, b) = (a.min(b), a.max(b));
        self.pairs.iter().find(|p| p.a == a && p.b == b)
    }

    /// `8x NVIDIA H100 80GB HBM3` or `2x Tesla T4, 1x NVIDIA A10G`.
    pub fn models_summary(&self) -> String {
        let mut counts: BTreeMap<String, usize> = BTreeMap::new();
        for g in &self.gpus {
            *counts
                .entry(g.model.clone().unwrap_or_else(|| "unknown model".into()))
                .or_default() += 1;
        }
        counts
            .into_iter()
            .map(|(m, n)| format!("{n}x {m}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn direct_nvlinks_count_once() {
        let a: PciAddress = "0000:01:00.0".parse().unwrap();
        let b: PciAddress = "0000:02:00.0".parse().unwrap();
        let n = nvlinks_between(&[b, b, b, b], &[a, a, a, a], b, a, &[a, b]);
        assert_eq!(n, 4);
    }

    /// A GPU written before brand, architecture and the PCIe root were
    /// known (an old state file) still reads, without them; unknown ones
    /// are not written.
    #[test]
    fn brand_architecture_and_pcie_root_are_optional_in_files() {
        let old = serde_json::json!({
            "index": 0, "minor": 0, "uuid": "GPU-1", "model": "NVIDIA H100 80GB HBM3",
            "bus_id": "0000:18:00.0", "numa_node": null, "pci": null,
            "memory_mib": 81559, "compute_capability": {"major": 9, "minor": 0},
            "mig": null, "nvlinks": 0,
            "telemetry": {"temperature_c": null, "power_mw": null,
                "utilization_gpu_pct": null, "utilization_memory_pct": null,
                "memory_used_mib": null}
        });
        let mut g: Gpu = serde_json::from_value(old.clone()).unwrap();
        assert_eq!(
            (&g.brand, &g.architecture, &g.pcie_root),
            (&None, &None, &None)
        );
        let written = serde_json::to_value(&g).unwrap();
        for key in ["brand", "architecture", "pcie_root"] {
            assert!(written.get(key).is_none(), "{key}: {written}");
        }
        g.brand = Some("Nvidia".into());
        g.architecture = Some("Hopper".into());
        g.pcie_root = Some("pci0000:00".into());
        let written = serde_json::to_value(&g).unwrap();
        assert_eq!(written["pcie_root"], "pci0000:00");
        assert_eq!(serde_json::from_value::<Gpu>(written).unwrap(), g);
    }
}
