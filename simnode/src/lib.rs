//! Node description files: a YAML description of a GPU node (its GPUs, their
//! PCI placement, NVLinks, MIG, driver) that
//! - the simulated GPU backend serves directly (demo, fast tests),
//! - the project's fake `libnvidia-ml.so.1` serves through the NVML C API, so
//!   the real nvml-wrapper backend runs in CI without a GPU,
//! - [`NodeDescription::materialize`] turns into a sysfs/procfs tree under a
//!   sandbox root, so the real discovery code reads it.
//!
//! Keys are camelCase; unknown keys are rejected with their path.

pub mod config_space;
pub mod mig;
pub mod readings;

use std::collections::HashMap;
use std::fs;
use std::io;
use std::os::unix::fs::symlink;
use std::path::Path;

use hostlib::strict::YamlError;
use hostlib::{DriverFlavour, PciAddress, PciFunction};

mod desc;

pub use desc::*;

impl NodeDescription {
    /// Parses and validates YAML; `origin` names the source in errors.
    pub fn from_yaml(text: &str, origin: &str) -> Result<Self, DescError> {
        let desc: NodeDescription = hostlib::strict::from_yaml(text, origin)?;
        desc.validate(origin)?;
        Ok(desc)
    }

    /// Reads a description file.
    pub fn from_file(path: &Path) -> Result<Self, DescError> {
        let text = fs::read_to_string(path).map_err(|source| DescError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_yaml(&text, &path.display().to_string())
    }

    /// A built-in description by name, or a file by path.
    pub fn load(name_or_path: &str) -> Result<Self, DescError> {
        if let Some((name, text)) = BUILTIN.iter().find(|(n, _)| *n == name_or_path) {
            return Self::from_yaml(text, &format!("built-in {name}"));
        }
        let path = Path::new(name_or_path);
        if path.exists() {
            return Self::from_file(path);
        }
        Err(DescError::Unknown(name_or_path.to_string()))
    }

    fn validate(&self, origin: &str) -> Result<(), YamlError> {
        let invalid = |field: String, message: String| YamlError::invalid(origin, field, message);
        let mut by_bus: HashMap<PciAddress, usize> = HashMap::new();
        let mut by_uuid: HashMap<&str, usize> = HashMap::new();
        for (i, g) in self.gpus.iter().enumerate() {
            if let Some(j) = by_bus.insert(g.bus_id, i) {
                return Err(invalid(
                    format!("gpus[{i}].busId"),
                    format!("{} is also gpus[{j}].busId", g.bus_id),
                ));
            }
            if !g.uuid.starts_with("GPU-") || g.uuid.len() > 80 {
                return Err(invalid(
                    format!("gpus[{i}].uuid"),
                    format!("{:?} does not look like GPU-<uuid>", g.uuid),
                ));
            }
            if let Some(j) = by_uuid.insert(&g.uuid, i) {
                return Err(invalid(
                    format!("gpus[{i}].uuid"),
                    format!("{} is also gpus[{j}].uuid", g.uuid),
                ));
            }
            if g.compute_capability().is_none() {
                return Err(invalid(
                    format!("gpus[{i}].computeCapability"),
                    format!("{:?} is not MAJOR.MINOR", g.compute_capability),
                ));
            }
            if g.mig.enabled && !g.mig.capable {
                return Err(invalid(
                    format!("gpus[{i}].mig.enabled"),
                    "MIG cannot be enabled on a GPU that is not MIG-capable".into(),
                ));
            }
            if !g.mig.enabled && !g.mig.devices.is_empty() {
                return Err(invalid(
                    format!("gpus[{i}].mig.devices"),
                    "MIG devices exist only while MIG is enabled".into(),
                ));
            }
            let slices: u32 = g.mig.devices.iter().map(|m| m.gi_slices).sum();
            if slices > 7 {
                return Err(invalid(
                    format!("gpus[{i}].mig.devices"),
                    format!("{slices} GPU-instance slices; a GPU has at most 7"),
                ));
            }
            let mut gi_ids = std::collections::BTreeSet::new();
            for (k, m) in g.mig.devices.iter().enumerate() {
                if m.gi_id(k) > 14 || m.ci_id() > 7 || !gi_ids.insert(m.gi_id(k)) {
                    return Err(invalid(
                        format!("gpus[{i}].mig.devices[{k}].giId"),
                        "GPU instance IDs are 0..=14 and unique on their GPU, compute instance IDs 0..=7".into(),
                    ));
                }
                if !m.uuid.starts_with("MIG-") {
                    return Err(invalid(
                        format!("gpus[{i}].mig.devices[{k}].uuid"),
                        format!("{:?} does not look like MIG-<uuid>", m.uuid),
                    ));
                }
                if by_uuid.insert(&m.uuid, i).is_some() {
                    return Err(invalid(
                        format!("gpus[{i}].mig.devices[{k}].uuid"),
                        format!("{} is not unique on this node", m.uuid),
                    ));
                }
                if m.gi_slices == 0
                    || m.ci_slices() == 0
                    || m.ci_slices() > m.gi_slices
                    || m.memory_mib > g.memory_mib
                {
                    return Err(invalid(
                        format!("gpus[{i}].mig.devices[{k}]"),
                        "slices must be 1..=7 with ciSlices <= giSlices, memory within the GPU's"
                            .into(),
                    ));
                }
            }
            // The devices must be GPU instances of the model's profiles
            // that fit on it together (an unknown model is taken as an
            // H100 80GB).
            if let Err(e) = mig::state::GpuMig::from_desc(g) {
                let (field, message) = e.split_once(": ").unwrap_or(("devices", e.as_str()));
                return Err(invalid(
                    format!("gpus[{i}].mig.{field}"),
                    message.to_string(),
                ));
            }
            if let Some(v) = &g.vgpu {
                for (field, value) in [
                    ("hostDriverVersion", &v.host_driver_version),
                    ("hostDriverBranch", &v.host_driver_branch),
                ] {
                    if value.is_empty()
                        || value.len() > 10
                        || !value.bytes().all(|b| b.is_ascii_graphic())
                    {
                        return Err(invalid(
                            format!("gpus[{i}].vgpu.{field}"),
                            format!(
                                "{value:?} must be 1 to 10 printable ASCII characters (the capability's field)"
                            ),
                        ));
                    }
                }
            }
            if let Some(f) = &g.fabric
                && f.cluster_uuid_bytes().is_none()
            {
                return Err(invalid(
                    format!("gpus[{i}].fabric.clusterUuid"),
                    format!("{:?} is not a UUID (8-4-4-4-12 hex digits)", f.cluster_uuid),
                ));
            }
            if g.name.is_empty() || g.name.len() >= 96 {
                return Err(invalid(
                    format!("gpus[{i}].name"),
                    "must be 1 to 95 bytes".into(),
                ));
            }
        }
        for (i, s) in self.nvswitches.iter().enumerate() {
            if by_bus.contains_key(s) {
                return Err(invalid(
                    format!("nvswitches[{i}]"),
                    format!("{s} is also a GPU's busId"),
                ));
            }
        }
        for (i, g) in self.gpus.iter().enumerate() {
            let mut total = 0;
            for (k, l) in g.nvlinks.iter().enumerate() {
                if l.remote == g.bus_id {
                    return Err(invalid(
                        format!("gpus[{i}].nvlinks[{k}].remote"),
                        "a GPU cannot link to itself".into(),
                    ));
                }
                if !by_bus.contains_key(&l.remote) && !self.nvswitches.contains(&l.remote) {
                    return Err(invalid(
                        format!("gpus[{i}].nvlinks[{k}].remote"),
                        format!("{} is neither a GPU nor an NVSwitch of this node", l.remote),
                    ));
                }
                if l.links == 0 {
                    return Err(invalid(
                        format!("gpus[{i}].nvlinks[{k}].links"),
                        "must be at least 1".into(),
                    ));
                }
                total += l.links;
            }
            if total > MAX_NVLINKS {
                return Err(invalid(
                    format!("gpus[{i}].nvlinks"),
                    format!("{total} links; a GPU has at most {MAX_NVLINKS}"),
                ));
            }
        }
        Ok(())
    }

    /// The GPU at `bus_id`.
    pub fn gpu_by_bus(&self, bus_id: PciAddress) -> Option<&GpuDesc> {
        self.gpus.iter().find(|g| g.bus_id == bus_id)
    }

    /// NVML's topology level between GPUs `a` and `b` (indices), from their
    /// PCIe placement: same board, first switch, any switch, host bridge,
    /// NUMA node, else across CPUs.
    pub fn pcie_level(&self, a: usize, b: usize) -> u32 {
        use topology_level::*;
        let (ga, gb) = (&self.gpus[a], &self.gpus[b]);
        let (pa, pb) = (&ga.pcie, &gb.pcie);
        if a == b || (pa.board.is_some() && pa.board == pb.board) {
            INTERNAL
        } else if !pa.switches.is_empty() && pa.switches.first() == pb.switches.first() {
            SINGLE
        } else if pa.switches.iter().any(|s| pb.switches.contains(s)) {
            MULTIPLE
        } else if pa.host_bridge.is_some() && pa.host_bridge == pb.host_bridge {
            HOSTBRIDGE
        } else if ga.numa_node.is_some() && ga.numa_node == gb.numa_node {
            NODE
        } else {
            SYSTEM
        }
    }

    /// Each GPU's NVLinks laid out by link number: link `n` leads to the
    /// returned address. Links are numbered in the order the description
    /// lists them.
    pub fn nvlink_remotes(gpu: &GpuDesc) -> Vec<PciAddress> {
        gpu.nvlinks
            .iter()
            .flat_map(|l| std::iter::repeat_n(l.remote, l.links as usize))
            .collect()
    }

    /// Writes the sysfs and procfs files this node would show under `root`
    /// (a sandbox directory, never a real host): PCI functions of the GPUs and
    /// NVSwitches plus one host bridge, DMI product name, and, when a driver
    /// is described, `/proc/driver/nvidia/version`, `/proc/modules` and
    /// `/proc/devices`.
    pub fn materialize(&self, root: &Path) -> io::Result<()> {
        let devices = root.join("sys/bus/pci/devices");
        fs::create_dir_all(&devices)?;
        let loaded = self.driver.is_some();
        let nvidia = hostlib::pci::NVIDIA_VENDOR;
        let function = |address,
                        vendor,
                        device,
                        class,
                        subsystem_device,
                        numa_node,
                        iommu_group,
                        driver: Option<&str>| PciFunction {
            address,
            vendor,
            device,
            class,
            subsystem_vendor: Some(vendor),
            subsystem_device,
            numa_node,
            iommu_group,
            driver: driver.map(String::from),
        };
        let mut functions = vec![function(
            "0000:00:00.0".parse().expect("literal"),
            0x8086,
            0x09a2,
            0x060000,
            None,
            None,
            None,
            None,
        )];
        for g in &self.gpus {
            functions.push(function(
                g.bus_id,
                nvidia,
                g.device_id.0,
                u32::from(g.pci_class.0) << 8,
                g.subsystem_id.map(|s| s.0),
                g.numa_node,
                g.iommu_group,
                loaded.then_some("nvidia"),
            ));
        }
        for s in &self.nvswitches {
            functions.push(function(
                *s, nvidia, 0x22a3, 0x068000, None, None, None, None,
            ));
        }
        for f in functions {
            let addr = f.address;
            let rel = format!("devices/pci{:04x}:{:02x}/{addr}", addr.domain, 0);
            let dir = root.join("sys").join(&rel);
            fs::create_dir_all(&dir)?;
            fs::write(dir.join("vendor"), format!("{:#06x}\n", f.vendor))?;
            fs::write(dir.join("device"), format!("{:#06x}\n", f.device))?;
            fs::write(dir.join("class"), format!("{:#08x}\n", f.class))?;
            fs::write(
                dir.join("subsystem_vendor"),
                format!("{:#06x}\n", f.subsystem_vendor.unwrap_or(0)),
            )?;
            fs::write(
                dir.join("subsystem_device"),
                format!("{:#06x}\n", f.subsystem_device.unwrap_or(0)),
            )?;
            let numa = f.numa_node.map_or("-1".to_string(), |n| n.to_string());
            fs::write(dir.join("numa_node"), format!("{numa}\n"))?;
            // A GPU's function reset (the agent writes "1" to reset it):
            // made empty and never rewritten, so that a reset written into
            // the tree keeps its time (the fake NVML reads it).
            let reset = dir.join("reset");
            if f.vendor == nvidia && f.class >> 16 == 0x03 && !reset.exists() {
                fs::write(&reset, "")?;
            }
            if let Some(group) = f.iommu_group {
                let gdir = root.join(format!("sys/kernel/iommu_groups/{group}"));
                fs::create_dir_all(&gdir)?;
                fs::write(gdir.join("type"), "DMA-FQ\n")?;
                replace_symlink(
                    &format!("../../../kernel/iommu_groups/{group}"),
                    &dir.join("iommu_group"),
                )?;
            }
            if let Some(drv) = &f.driver {
                let ddir = root.join(format!("sys/bus/pci/drivers/{drv}"));
                fs::create_dir_all(&ddir)?;
                fs::write(ddir.join("uevent"), "")?;
                replace_symlink(
                    &format!("../../../bus/pci/drivers/{drv}"),
                    &dir.join("driver"),
                )?;
            }
            replace_symlink(&format!("../../../{rel}"), &devices.join(addr.to_string()))?;
        }
        // Each GPU's PCI configuration space (its 256-byte header), where
        // a vGPU shows itself.
        for g in &self.gpus {
            let addr = g.bus_id;
            let dir = root.join(format!(
                "sys/devices/pci{:04x}:{:02x}/{addr}",
                addr.domain, 0
            ));
            fs::write(dir.join("config"), config_space::header(g))?;
        }
        let dmi = root.join("sys/class/dmi/id");
        fs::create_dir_all(&dmi)?;
        fs::write(
            dmi.join("product_name"),
            format!("{}\n", self.machine.as_deref().unwrap_or("Simulated node")),
        )?;
        let proc = root.join("proc");
        fs::create_dir_all(&proc)?;
        let mut modules = String::new();
        let mut devices_txt =
            String::from("Character devices:\n  1 mem\n  4 /dev/vc/0\n  5 /dev/tty\n");
        if let Some(d) = &self.driver {
            let nv = root.join("proc/driver/nvidia");
            fs::create_dir_all(&nv)?;
            let kind = match d.flavour {
                DriverFlavour::Open => "Open Kernel Module for x86_64",
                DriverFlavour::Proprietary => "x86_64 Kernel Module",
            };
            fs::write(
                nv.join("version"),
                format!(
                    "NVRM version: NVIDIA UNIX {kind}  {}  Release Build  (simulated)\nGCC version:  gcc version 12.2.0 (Debian 12.2.0-14+deb12u1)\n",
                    d.version
                ),
            )?;
            // The device-file settings, as the driver publishes them (its
            // defaults: 0666, root:root, nodes may be made).
            fs::write(
                nv.join("params"),
                "ModifyDeviceFiles: 1\nDeviceFileUID: 0\nDeviceFileGID: 0\nDeviceFileMode: 438\n",
            )?;
            // nvidia is used by every other NVIDIA module loaded.
            let users: Vec<&str> = d
                .modules
                .iter()
                .map(String::as_str)
                .filter(|m| *m != "nvidia")
                .collect();
            for m in d.modules.iter().rev() {
                if m == "nvidia" {
                    let used = if users.is_empty() {
                        "-".to_string()
                    } else {
                        format!("{},", users.join(","))
                    };
                    modules.push_str(&format!(
                        "nvidia 56524800 {} {used} Live 0x0000000000000000\n",
                        users.len()
                    ));
                } else {
                    modules.push_str(&format!("{m} 1527808 0 - Live 0x0000000000000000\n"));
                }
            }
            for (i, g) in self.gpus.iter().enumerate() {
                let dir = nv.join("gpus").join(g.bus_id.to_string());
                fs::create_dir_all(&dir)?;
                fs::write(
                    dir.join("information"),
                    format!(
                        "Model: \t\t {}\nIRQ:   \t\t {}\nGPU UUID: \t {}\nVideo BIOS: \t ??.??.??.??.??\nBus Type: \t PCIe\nDMA Size: \t 52 bits\nDMA Mask: \t 0xfffffffffffff\nBus Location: \t {}\nDevice Minor: \t {i}\nGPU Excluded:\t No\n",
                        g.name,
                        200 + i,
                        g.uuid,
                        g.bus_id
                    ),
                )?;
            }
            self.materialize_user_space(root, d)?;
            devices_txt.push_str("195 nvidia-frontend\n");
            if d.modules.iter().any(|m| m == "nvidia_uvm") {
                devices_txt.push_str("234 nvidia-uvm\n");
            }
            devices_txt.push_str("237 nvidia-caps\n");
        }
        modules.push_str("ext4 1003520 1 - Live 0x0000000000000000\n");
        devices_txt.push_str("\nBlock devices:\n  8 sd\n");
        fs::write(proc.join("modules"), modules)?;
        fs::write(proc.join("devices"), devices_txt)?;
        Ok(())
    }
}

/// The driver's user-space files a simulated node has, relative to the
/// root (libraries under `usr/lib/x86_64-linux-gnu`, suffixed with the
/// driver version).
const SIM_LIBRARIES: &[&str] = &[
    "libcuda.so",
    "libcudadebugger.so",
    "libnvidia-ml.so",
    "libnvidia-ptxjitcompiler.so",
    "libnvidia-nvvm.so",
    "libnvidia-opencl.so",
    "libnvidia-encode.so",
    "libnvcuvid.so",
    "libnvidia-cfg.so",
];
const SIM_BINARIES: &[&str] = &["nvidia-smi", "nvidia-debugdump", "nvidia-persistenced"];

impl NodeDescription {
    /// What a host with this driver installed has besides /proc and /sys:
    /// device nodes (as empty files: a test tree cannot hold real ones),
    /// the driver's libraries in a merged-/usr layout with an ld.so.conf,
    /// its binaries, GSP firmware and the persistenced socket (a file
    /// standing in), and `/proc/driver/nvidia-caps/mig-minors`.
    fn materialize_user_space(&self, root: &Path, d: &DriverDesc) -> io::Result<()> {
        let v = &d.version;
        let dev = root.join("dev");
        fs::create_dir_all(&dev)?;
        let mut nodes = vec!["nvidiactl".to_string(), "nvidia-modeset".into()];
        if d.modules.iter().any(|m| m == "nvidia_uvm") {
            nodes.extend(["nvidia-uvm".into(), "nvidia-uvm-tools".into()]);
        }
        nodes.extend((0..self.gpus.len()).map(|i| format!("nvidia{i}")));
        for n in nodes {
            fs::write(dev.join(n), "")?;
        }
        let libdir = root.join("usr/lib/x86_64-linux-gnu");
        fs::create_dir_all(libdir.join("vdpau"))?;
        for lib in SIM_LIBRARIES {
            fs::write(libdir.join(format!("{lib}.{v}")), "")?;
        }
        fs::write(libdir.join(format!("vdpau/libvdpau_nvidia.so.{v}")), "")?;
        // Merged /usr: /lib is a link, so the same directory is reachable twice.
        replace_symlink("usr/lib", &root.join("lib"))?;
        let conf = root.join("etc/ld.so.conf.d");
        fs::create_dir_all(&conf)?;
        fs::write(
            root.join("etc/ld.so.conf"),
            "include /etc/ld.so.conf.d/*.conf\n",
        )?;
        fs::write(
            conf.join("x86_64-linux-gnu.conf"),
            "# Multiarch support\n/usr/local/lib/x86_64-linux-gnu\n/lib/x86_64-linux-gnu\n/usr/lib/x86_64-linux-gnu\n",
        )?;
        let bin = root.join("usr/bin");
        fs::create_dir_all(&bin)?;
        for b in SIM_BINARIES {
            fs::write(bin.join(b), "")?;
        }
        let fw = root.join(format!("usr/lib/firmware/nvidia/{v}"));
        fs::create_dir_all(&fw)?;
        for f in ["gsp_ga10x.bin", "gsp_tu10x.bin"] {
            fs::write(fw.join(f), "")?;
        }
        let persistenced = root.join("run/nvidia-persistenced");
        fs::create_dir_all(&persistenced)?;
        fs::write(persistenced.join("socket"), "")?;
        if self.gpus.iter().any(|g| g.mig.capable) {
            let caps = root.join("proc/driver/nvidia-caps");
            fs::create_dir_all(&caps)?;
            let mut text = String::from("config 1\nmonitor 2\n");
            for gpu in 0..self.gpus.len() as u32 {
                for gi in 0..15 {
                    text.push_str(&format!(
                        "gpu{gpu}/gi{gi}/access {}\n",
                        mig_cap_minor(gpu, gi, None)
                    ));
                    for ci in 0..8 {
                        text.push_str(&format!(
                            "gpu{gpu}/gi{gi}/ci{ci}/access {}\n",
                            mig_cap_minor(gpu, gi, Some(ci))
                        ));
                    }
                }
            }
            fs::write(caps.join("mig-minors"), text)?;
            // The capability files a real driver publishes (modes as on a
            // real H100 host: config 0400, monitor and access 0444).
            let capfile = |rel: String, minor: u32, mode: u32| -> io::Result<()> {
                let p = root.join("proc/driver/nvidia/capabilities").join(rel);
                fs::create_dir_all(p.parent().expect("a capability file has a parent"))?;
                fs::write(
                    p,
                    format!(
                        "DeviceFileMinor: {minor}\nDeviceFileMode: {mode}\nDeviceFileModify: 1\n"
                    ),
                )
            };
            capfile("mig/config".into(), 1, 256)?;
            capfile("mig/monitor".into(), 2, 292)?;
            for (gpu, g) in self.gpus.iter().enumerate() {
                for (k, m) in g.mig.devices.iter().enumerate() {
                    // (Only where there are nodes: git keeps no empty directories.)
                    fs::create_dir_all(dev.join("nvidia-caps"))?;
                    let gi = m.gi_id(k);
                    for (rel, minor) in [
                        (
                            format!("gpu{gpu}/mig/gi{gi}/access"),
                            mig_cap_minor(gpu as u32, gi, None),
                        ),
                        (
                            format!("gpu{gpu}/mig/gi{gi}/ci{}/access", m.ci_id()),
                            mig_cap_minor(gpu as u32, gi, Some(m.ci_id())),
                        ),
                    ] {
                        fs::write(dev.join(format!("nvidia-caps/nvidia-cap{minor}")), "")?;
                        capfile(rel, minor, 292)?;
                    }
                }
            }
        }
        Ok(())
    }
}

fn replace_symlink(target: &str, link: &Path) -> io::Result<()> {
    match fs::remove_file(link) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    symlink(target, link)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mig_engines_default_to_an_h100s_and_can_be_described() {
        let h = NodeDescription::load("h100-mig-2").unwrap();
        let three_g = &h.gpus[0].mig.devices[0];
        assert_eq!(three_g.gi_slices, 3);
        assert_eq!(
            three_g.engines(),
            MigEngines {
                copy: 3,
                decoder: 3,
                encoder: 0,
                jpeg: 3,
                ofa: 0
            }
        );
        assert_eq!(
            MigEngines::h100(7),
            MigEngines {
                copy: 8,
                decoder: 7,
                encoder: 0,
                jpeg: 7,
                ofa: 1
            }
        );
        let text = "name: x\ngpus:\n  - busId: \"0000:18:00.0\"\n    name: NVIDIA H100 80GB HBM3\n    uuid: GPU-1\n    deviceId: \"0x2330\"\n    memoryMib: 81559\n    computeCapability: \"9.0\"\n    mig:\n      capable: true\n      enabled: true\n      devices:\n        - { uuid: MIG-1, giSlices: 1, memoryMib: 9856, engines: { encoder: 1, ofa: 1 } }\n";
        let d = NodeDescription::from_yaml(text, "t").unwrap();
        assert_eq!(
            d.gpus[0].mig.devices[0].engines(),
            MigEngines {
                copy: 1,
                decoder: 1,
                encoder: 1,
                jpeg: 1,
                ofa: 1
            }
        );
        let bad = text.replace("ofa: 1", "nvenc: 1");
        assert!(NodeDescription::from_yaml(&bad, "t").is_err());
    }

    #[test]
    fn builtins_parse_and_validate() {
        for (name, _) in BUILTIN {
            let d = NodeDescription::load(name).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(!d.name.is_empty());
        }
        let h = NodeDescription::load("h100-sxm-8").unwrap();
        assert_eq!(h.gpus.len(), 8);
        assert!(h.gpus.iter().all(|g| g.mig.capable));
        // 18 NVLinks per GPU, all to the four NVSwitches.
        for g in &h.gpus {
            let remotes = NodeDescription::nvlink_remotes(g);
            assert_eq!(remotes.len(), 18);
            assert!(remotes.iter().all(|r| h.nvswitches.contains(r)));
        }
        let t4 = NodeDescription::load("t4-4").unwrap();
        assert_eq!(t4.pcie_level(0, 1), topology_level::SINGLE);
        assert_eq!(t4.pcie_level(0, 2), topology_level::SYSTEM);
        assert!(t4.gpus.iter().all(|g| g.nvlinks.is_empty()));
        assert_eq!(NodeDescription::load("a10g-1").unwrap().gpus.len(), 1);
        assert!(NodeDescription::load("no-gpu").unwrap().gpus.is_empty());
    }

    #[test]
    fn unknown_key_is_named_with_its_path() {
        let text = include_str!("../nodes/a10g-1.yaml").replace("memoryMib:", "memoryMibs:");
        let err = NodeDescription::from_yaml(&text, "x.yaml")
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with(
                "x.yaml: gpus[0].memoryMibs: unknown key (expected one of: busId, name,"
            ),
            "{err}"
        );
    }

    #[test]
    fn bad_values_are_named() {
        let base = include_str!("../nodes/t4-4.yaml");
        let cases = [
            (
                base.replacen(
                    "computeCapability: \"7.5\"",
                    "computeCapability: \"seven\"",
                    1,
                ),
                "gpus[0].computeCapability",
            ),
            (
                base.replacen("busId: \"0000:3b:00.0\"", "busId: \"0000:3b:00.0x\"", 1),
                "gpus[1].busId",
            ),
        ];
        for (text, field) in cases {
            let err = NodeDescription::from_yaml(&text, "t.yaml")
                .unwrap_err()
                .to_string();
            assert!(err.starts_with(&format!("t.yaml: {field}")), "{err}");
        }
        let dup = base.replace(
            "GPU-5f0cf4a3-6a1c-5c37-a7a5-5e54ae0c9a41",
            "GPU-5f0cf4a3-6a1c-5c37-a7a5-5e54ae0c9a40",
        );
        let err = NodeDescription::from_yaml(&dup, "t.yaml")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(
                "gpus[1].uuid: GPU-5f0cf4a3-6a1c-5c37-a7a5-5e54ae0c9a40 is also gpus[0].uuid"
            ),
            "{err}"
        );
    }

    #[test]
    fn mig_devices_must_be_profiles_that_fit_their_model() {
        let base = include_str!("../nodes/h100-mig-2.yaml");
        // Two 3g and a 1g: 7 slices, but no room for the 1g.
        let crowded: String = base
            .replacen(
                "profile: 2g.20gb, giSlices: 2, memoryMib: 19968, multiprocessors: 32",
                "profile: 3g.40gb, giSlices: 3, memoryMib: 40192, multiprocessors: 60",
                1,
            )
            .lines()
            .filter(|l| !l.contains("90a1b2c3d403"))
            .map(|l| format!("{l}\n"))
            .collect();
        let err = NodeDescription::from_yaml(&crowded, "t.yaml")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(
                "gpus[0].mig.devices: 3g.40gb + 3g.40gb + 1g.10gb do not fit on one H100 80GB"
            ),
            "{err}"
        );
        // An A100's profile name on an H100.
        let foreign = base.replacen("profile: 1g.10gb", "profile: 1g.5gb", 1);
        let err = NodeDescription::from_yaml(&foreign, "t.yaml")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("gpus[0].mig.devices[2].profile: 1g.5gb with 1 slices is not a profile of the H100 80GB"),
            "{err}"
        );
        // A 3c inside a 4g does not exist.
        let three_c: String = base
            .replacen(
                "profile: 3g.40gb, giSlices: 3,",
                "profile: 4g.40gb, giSlices: 4, ciSlices: 3,",
                1,
            )
            .lines()
            .filter(|l| !l.contains("90a1b2c3d403"))
            .map(|l| format!("{l}\n"))
            .collect();
        let err = NodeDescription::from_yaml(&three_c, "t.yaml")
            .unwrap_err()
            .to_string();
        assert!(err.contains("gpus[0].mig.devices[0].ciSlices"), "{err}");
    }

    #[test]
    fn unknown_name_says_what_exists() {
        let err = NodeDescription::load("h200-9").unwrap_err().to_string();
        assert!(err.contains("built-in: h100-sxm-8"), "{err}");
    }

    #[test]
    fn materialized_tree_is_read_back_by_discovery() {
        let dir = tempfile::tempdir().unwrap();
        let d = NodeDescription::load("h100-sxm-8").unwrap();
        d.materialize(dir.path()).unwrap();
        let root = hostlib::HostRoot::new(dir.path()).unwrap();
        let gpus = hostlib::pci::discover_nvidia_gpus(&root).unwrap();
        assert_eq!(gpus.len(), 8);
        for (g, want) in gpus.iter().zip(&d.gpus) {
            assert_eq!(g.address, want.bus_id);
            assert_eq!(g.device, want.device_id.0);
            assert_eq!(g.numa_node, want.numa_node);
            assert_eq!(g.driver.as_deref(), Some("nvidia"));
        }
        let state = hostlib::DriverState::read(&root);
        assert_eq!(state.version.as_deref(), Some("550.127.08"));
        assert_eq!(state.frontend_major(), Some(195));
        assert_eq!(state.modules.len(), 3);
    }
}
