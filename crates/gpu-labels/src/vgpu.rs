//! `nvidia.com/vgpu.*`: whether the node's GPUs are NVIDIA vGPUs, and the
//! host's vGPU manager driver they run on, from each GPU's PCI
//! configuration space (NVIDIA's vendor-specific capability with the `VF`
//! signature; read by `hostlib::vgpu` at discovery), as GPU feature
//! discovery's vGPU labeller writes them (k8s-device-plugin
//! `internal/lm/vgpu.go`, `internal/vgpu`):
//!
//! - `vgpu.present`: `true` when a GPU is a vGPU, else `false` (GFD writes
//!   it on every node it labels: `false` on bare metal and for a GPU passed
//!   through whole).
//! - `vgpu.host-driver-version`, `vgpu.host-driver-branch`: the host's
//!   driver as the capability names it (`550.54.16`, `r550_00`); with
//!   several vGPUs, the last one's (GFD visits sysfs in address order and
//!   the last wins).
//!
//! Where gpu-agent differs, on purpose:
//! - A configuration space that could not be read (an unprivileged
//!   reader's 64 bytes): GFD writes no vGPU label and logs; gpu-agent too
//!   leaves `vgpu.present` out (unknown is not `false`) unless another GPU
//!   is a vGPU, and names the file in discovery's warnings.
//! - A vGPU whose capability does not hold the host driver's record
//!   readably: GFD fails the whole relabel; gpu-agent writes
//!   `vgpu.present=true` without the driver labels (discovery warns).
//! - GFD reads every NVIDIA PCI function (audio, NVSwitch); gpu-agent reads
//!   the GPUs', the only functions a vGPU is.

use std::collections::BTreeMap;

use hostlib::vgpu::VgpuState;

use gpu_model::inventory::Gpu;

/// Puts the `nvidia.com/vgpu.*` labels of `gpus` into `out`.
pub(super) fn labels(gpus: &[Gpu], out: &mut BTreeMap<String, String>) {
    let mut present = Some(false);
    let mut host = (None, None);
    for g in gpus {
        match &g.vgpu {
            Some(VgpuState::Guest {
                host_driver_version,
                host_driver_branch,
            }) => {
                present = Some(true);
                if host_driver_version.is_some() && host_driver_branch.is_some() {
                    host = (
                        host_driver_version.as_deref(),
                        host_driver_branch.as_deref(),
                    );
                }
            }
            Some(VgpuState::Physical) => {}
            None if present == Some(false) => present = None,
            None => {}
        }
    }
    if let Some(p) = present {
        out.insert("nvidia.com/vgpu.present".into(), p.to_string());
    }
    if let (Some(version), Some(branch)) = host {
        out.insert("nvidia.com/vgpu.host-driver-version".into(), version.into());
        out.insert("nvidia.com/vgpu.host-driver-branch".into(), branch.into());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node_labels;
    use crate::test_support::inventory_of;
    use gpu_resources::config::DevicePluginSpec;

    fn guest(version: Option<&str>, branch: Option<&str>) -> Option<VgpuState> {
        Some(VgpuState::Guest {
            host_driver_version: version.map(String::from),
            host_driver_branch: branch.map(String::from),
        })
    }

    /// A simulated node's GPUs have configuration spaces (discovery reads
    /// them): physical GPUs say `vgpu.present=false`, as GFD does.
    #[test]
    fn physical_gpus_say_no_vgpu() {
        let inv = inventory_of("t4-4");
        assert!(
            inv.gpus.iter().all(|g| g.vgpu == Some(VgpuState::Physical)),
            "{:?}",
            inv.gpus.iter().map(|g| &g.vgpu).collect::<Vec<_>>()
        );
        let l = node_labels(&inv, &DevicePluginSpec::default(), None).unwrap();
        assert_eq!(l["nvidia.com/vgpu.present"], "false");
        assert!(!l.contains_key("nvidia.com/vgpu.host-driver-version"));
    }

    /// A vGPU guest's configuration space, written by materialize from the
    /// description's `vgpu`, read back through the host root.
    #[test]
    fn a_vgpu_guest_is_labelled_with_its_host_driver() {
        let dir = tempfile::tempdir().unwrap();
        let text = include_str!("../../../simnode/nodes/a10g-1.yaml").replace(
            "    computeCapability:",
            "    vgpu: { hostDriverVersion: 550.54.16, hostDriverBranch: r550_00 }\n    computeCapability:",
        );
        let desc = simnode::NodeDescription::from_yaml(&text, "vgpu node").unwrap();
        desc.materialize(dir.path()).unwrap();
        let root = hostlib::HostRoot::new(dir.path()).unwrap();
        let backend = gpu_backend::sim::SimulatedBackend::new(desc);
        let inv = gpu_backend::discover::discover(&root, &backend);
        assert_eq!(inv.gpus[0].vgpu, guest(Some("550.54.16"), Some("r550_00")));
        let l = node_labels(&inv, &DevicePluginSpec::default(), None).unwrap();
        assert_eq!(l["nvidia.com/vgpu.present"], "true");
        assert_eq!(l["nvidia.com/vgpu.host-driver-version"], "550.54.16");
        assert_eq!(l["nvidia.com/vgpu.host-driver-branch"], "r550_00");
        assert!(inv.warnings.is_empty(), "{:?}", inv.warnings);
    }

    #[test]
    fn unknown_is_not_false_and_the_last_vgpu_names_the_host() {
        let mut inv = inventory_of("t4-4");
        let set = |inv: &mut gpu_model::inventory::Inventory, states: [Option<VgpuState>; 4]| {
            for (g, s) in inv.gpus.iter_mut().zip(states) {
                g.vgpu = s;
            }
        };
        let phys = || Some(VgpuState::Physical);
        // One GPU's configuration space unreadable: unknown, no label.
        set(&mut inv, [phys(), None, phys(), phys()]);
        let mut l = BTreeMap::new();
        labels(&inv.gpus, &mut l);
        assert!(l.is_empty(), "{l:?}");
        // A vGPU beside it: present, whatever the unknown one is.
        set(
            &mut inv,
            [
                guest(Some("535.161.05"), Some("r535_00")),
                None,
                guest(Some("550.54.16"), Some("r550_00")),
                guest(None, None),
            ],
        );
        let mut l = BTreeMap::new();
        labels(&inv.gpus, &mut l);
        assert_eq!(l["nvidia.com/vgpu.present"], "true");
        assert_eq!(l["nvidia.com/vgpu.host-driver-version"], "550.54.16");
        assert_eq!(l["nvidia.com/vgpu.host-driver-branch"], "r550_00");
        // A vGPU without a readable driver record: present, no driver.
        set(
            &mut inv,
            [guest(None, Some("r550_00")), phys(), phys(), phys()],
        );
        let mut l = BTreeMap::new();
        labels(&inv.gpus, &mut l);
        assert_eq!(l.len(), 1, "{l:?}");
        assert_eq!(l["nvidia.com/vgpu.present"], "true");
    }
}
