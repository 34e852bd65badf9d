//! Discovery: the model's inventory of the node's GPUs, read from sysfs,
//! `/proc` and a GPU backend, once; every front end reads it and none
//! re-discovers.

use hostlib::pci;
use hostlib::vgpu::VgpuState;
use hostlib::{DriverState, HostRoot};

use crate::GpuBackend;
use gpu_model::inventory::{Inventory, build};

const DMI_PRODUCT_NAME: &str = "/sys/class/dmi/id/product_name";

/// Reads sysfs and `/proc` under `sys` and asks `backend`, then builds the
/// inventory. Nothing here fails the whole: a backend that cannot answer
/// leaves the GPUs sysfs shows, with the reason in [`BackendInfo::error`];
/// a host file or line that cannot be read is in [`Inventory::unreadable`]
/// (and a warning) and everything else is still read.
pub fn discover(sys: &HostRoot, backend: &dyn GpuBackend) -> Inventory {
    let scan = pci::scan_nvidia_gpus(sys);
    let driver = DriverState::read(sys);
    let mut unreadable: Vec<hostlib::Unreadable> =
        scan.unreadable.iter().map(|e| e.unreadable()).collect();
    unreadable.extend(driver.unreadable.iter().cloned());
    let machine = match sys.read_optional(DMI_PRODUCT_NAME) {
        Ok(m) => m.map(|s| s.trim().to_string()).filter(|s| !s.is_empty()),
        Err(e) => {
            unreadable.push(hostlib::Unreadable::from_host_error(
                sys,
                DMI_PRODUCT_NAME,
                &e,
            ));
            None
        }
    };
    let snapshot = backend.snapshot();
    let mut inv = build(machine, scan.functions, driver, backend.name(), snapshot);
    read_vgpu(sys, &mut inv, &mut unreadable);
    read_pcie_roots(sys, &mut inv, &mut unreadable);
    for u in &unreadable {
        inv.warnings.push(format!(
            "cannot read {u}; what it holds is unknown, the rest of the node was read"
        ));
    }
    inv.unreadable = unreadable;
    inv
}

/// Reads each GPU's PCI configuration space for NVIDIA's vGPU capability
/// ([`Gpu::vgpu`]). A file that cannot be read (or only in part) leaves the
/// GPU's vGPU state unknown and is named in `unreadable`.
fn read_vgpu(sys: &HostRoot, inv: &mut Inventory, unreadable: &mut Vec<hostlib::Unreadable>) {
    for g in inv.gpus.iter_mut().filter(|g| g.pci.is_some()) {
        match hostlib::vgpu::read(sys, g.bus_id) {
            Ok(state) => g.vgpu = state,
            Err(e) => unreadable.push(e.unreadable()),
        }
        if let Some(VgpuState::Guest {
            host_driver_version,
            host_driver_branch,
        }) = &g.vgpu
            && (host_driver_version.is_none() || host_driver_branch.is_none())
        {
            inv.warnings.push(format!(
                "GPU {} is an NVIDIA vGPU, but its vGPU capability does not name the host's driver version and branch readably; no nvidia.com/vgpu.host-driver-* labels",
                g.id()
            ));
        }
    }
}

/// Each GPU's PCIe root complex from its sysfs link ([`Gpu::pcie_root`]),
/// as the Kubernetes attribute `resource.kubernetes.io/pcieRoot` has it. A
/// link that cannot be read is named in `unreadable`; one that does not
/// lead into `/sys/devices/pci…` is a warning (NVIDIA's DRA driver warns
/// too): the root stays unknown, never guessed.
///
/// [`Gpu::pcie_root`]: gpu_model::inventory::Gpu::pcie_root
fn read_pcie_roots(sys: &HostRoot, inv: &mut Inventory, unreadable: &mut Vec<hostlib::Unreadable>) {
    use hostlib::pcie_root::{PcieRootError, pcie_root};
    for g in inv.gpus.iter_mut().filter(|g| g.pci.is_some()) {
        match pcie_root(sys, g.bus_id) {
            Ok(root) => g.pcie_root = Some(root),
            Err(PcieRootError::Read { link, source }) => unreadable.push(
                hostlib::Unreadable::from_host_error(sys, &link.to_string_lossy(), &source),
            ),
            Err(e) => inv.warnings.push(format!(
                "GPU {}: its PCIe root is unknown ({e}); its DRA device has no resource.kubernetes.io/pcieRoot attribute",
                g.id()
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::SimulatedBackend;
    use crate::test_support::inventory_of;
    use crate::{MigMode, PcieLevel};
    use gpu_model::backend::{BackendError, BackendSnapshot};
    use simnode::NodeDescription;

    #[test]
    fn h100_node_all_to_all_nvlink() {
        let inv = inventory_of("h100-sxm-8");
        assert_eq!(inv.gpus.len(), 8);
        assert!(inv.warnings.is_empty(), "{:?}", inv.warnings);
        assert_eq!(inv.machine.as_deref(), Some("DGX H100"));
        assert_eq!(inv.pairs.len(), 28);
        assert!(inv.pairs.iter().all(|p| p.nvlinks == 18));
        assert_eq!(inv.pair(0, 1).unwrap().pcie, Some(PcieLevel::SingleSwitch));
        assert_eq!(inv.pair(0, 2).unwrap().pcie, Some(PcieLevel::MultiSwitch));
        assert_eq!(inv.pair(3, 4).unwrap().pcie, Some(PcieLevel::CrossNuma));
        let g = &inv.gpus[0];
        assert_eq!(g.index, Some(0));
        assert_eq!(g.numa_node, Some(0));
        assert_eq!(g.pci.as_ref().unwrap().driver.as_deref(), Some("nvidia"));
        assert_eq!(
            g.mig,
            Some(MigMode {
                current: false,
                pending: false
            })
        );
        assert_eq!(inv.models_summary(), "8x NVIDIA H100 80GB HBM3");
        assert_eq!(inv.cuda_version.unwrap().to_string(), "12.4");
    }

    /// What NVIDIA's DRA driver publishes as `brand`, `architecture` and
    /// `resource.kubernetes.io/pcieRoot`, in its spellings.
    #[test]
    fn gpus_carry_brand_architecture_and_pcie_root() {
        for (node, brand, architecture) in [
            ("h100-sxm-8", "Nvidia", "Hopper"),
            ("t4-4", "Tesla", "Turing"),
            ("a10g-1", "Nvidia", "Ampere"),
        ] {
            let inv = inventory_of(node);
            assert!(!inv.gpus.is_empty());
            for g in &inv.gpus {
                assert_eq!(
                    (
                        g.brand.as_deref(),
                        g.architecture.as_deref(),
                        g.pcie_root.as_deref()
                    ),
                    // simnode puts every device directly under pci0000:00.
                    (Some(brand), Some(architecture), Some("pci0000:00")),
                    "{node} {}",
                    g.bus_id
                );
            }
        }
    }

    /// A sysfs entry that is a directory, not a link into /sys/devices:
    /// the root is unknown, said once, never guessed.
    #[test]
    fn a_pci_entry_that_is_not_a_link_leaves_the_pcie_root_unknown() {
        let dir = tempfile::tempdir().unwrap();
        NodeDescription::load("a10g-1")
            .unwrap()
            .materialize(dir.path())
            .unwrap();
        let entry = dir.path().join("sys/bus/pci/devices/0000:00:1e.0");
        std::fs::remove_file(&entry).unwrap();
        std::fs::rename(
            dir.path().join("sys/devices/pci0000:00/0000:00:1e.0"),
            &entry,
        )
        .unwrap();
        let root = HostRoot::new(dir.path()).unwrap();
        let desc = NodeDescription::load("a10g-1").unwrap();
        let inv = discover(&root, &SimulatedBackend::new(desc));
        assert_eq!(inv.gpus.len(), 1);
        let g = &inv.gpus[0];
        assert!(g.pci.is_some(), "sysfs still lists the GPU");
        assert_eq!(g.pcie_root, None);
        assert_eq!(g.architecture.as_deref(), Some("Ampere"));
        assert_eq!(
            inv.warnings,
            [format!(
                "GPU {}: its PCIe root is unknown (/sys/bus/pci/devices/0000:00:1e.0 is not a symbolic link, so the device's place under /sys/devices is unknown); its DRA device has no resource.kubernetes.io/pcieRoot attribute",
                g.id()
            )]
        );
        assert!(inv.unreadable.is_empty(), "{:?}", inv.unreadable);
    }

    #[test]
    fn t4_pairs_by_switch() {
        let inv = inventory_of("t4-4");
        assert_eq!(inv.pair(0, 1).unwrap().pcie, Some(PcieLevel::SingleSwitch));
        assert_eq!(inv.pair(1, 2).unwrap().pcie, Some(PcieLevel::CrossNuma));
        assert!(inv.pairs.iter().all(|p| p.nvlinks == 0));
        assert!(inv.gpus.iter().all(|g| g.mig.is_none()));
    }

    #[test]
    fn no_gpu_node_is_empty_without_warnings() {
        let inv = inventory_of("no-gpu");
        assert!(inv.gpus.is_empty());
        assert!(inv.warnings.is_empty());
        assert!(inv.backend.error.is_some());
    }

    #[test]
    fn gpus_without_a_driver_are_still_listed_with_the_reason() {
        let dir = tempfile::tempdir().unwrap();
        let mut desc = NodeDescription::load("a10g-1").unwrap();
        desc.driver = None;
        desc.materialize(dir.path()).unwrap();
        let root = HostRoot::new(dir.path()).unwrap();
        let inv = discover(&root, &SimulatedBackend::new(desc));
        assert_eq!(inv.gpus.len(), 1);
        assert_eq!(inv.gpus[0].uuid, None);
        assert_eq!(inv.gpus[0].bus_id.to_string(), "0000:00:1e.0");
        assert_eq!(inv.warnings.len(), 1);
        assert!(
            inv.warnings[0].contains("driver is not loaded"),
            "{:?}",
            inv.warnings
        );
    }

    /// What NVML could not say about one GPU reaches discovery's warnings
    /// (said once while they hold by the running agent's log memory), not a
    /// log line at every reconcile.
    #[test]
    fn a_backends_notes_on_a_gpu_are_discovery_warnings() {
        #[derive(Debug)]
        struct Noting(SimulatedBackend);
        impl GpuBackend for Noting {
            fn name(&self) -> &'static str {
                self.0.name()
            }
            fn snapshot(&self) -> Result<BackendSnapshot, BackendError> {
                let mut s = self.0.snapshot()?;
                s.gpus[1]
                    .notes
                    .push("NVML's fabric info query failed (return code 999)".into());
                Ok(s)
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let desc = NodeDescription::load("t4-4").unwrap();
        desc.materialize(dir.path()).unwrap();
        let root = HostRoot::new(dir.path()).unwrap();
        let inv = discover(&root, &Noting(SimulatedBackend::new(desc)));
        assert_eq!(inv.gpus.len(), 4);
        let bus = inv.gpus[1].bus_id;
        assert_eq!(
            inv.warnings,
            [format!(
                "GPU 1 ({bus}): NVML's fabric info query failed (return code 999)"
            )]
        );
    }
}
