//! The NVIDIA kernel driver's state as `/proc` shows it: the version line in
//! `/proc/driver/nvidia/version`, the loaded modules in `/proc/modules`, and
//! the character-device majors in `/proc/devices`.

use std::collections::BTreeMap;
use std::path::PathBuf;

use procfs_core::{FromRead, KernelModules};
use serde::{Deserialize, Serialize};

use crate::pci::PciAddress;
use crate::root::{HostError, HostRoot};

const PROC_VERSION: &str = "/proc/driver/nvidia/version";
const PROC_MODULES: &str = "/proc/modules";
const PROC_DEVICES: &str = "/proc/devices";
const PROC_GPUS: &str = "/proc/driver/nvidia/gpus";

/// The kernel modules that belong to the NVIDIA driver stack, in load order.
pub const NVIDIA_MODULES: &[&str] = &[
    "nvidia",
    "nvidia_uvm",
    "nvidia_modeset",
    "nvidia_drm",
    "nvidia_peermem",
    "nvidia_fs",
    "nvidia_vgpu_vfio",
    "gdrdrv",
];

/// Open (GPL, Turing and newer) or proprietary kernel modules.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DriverFlavour {
    Open,
    Proprietary,
}

/// One loaded kernel module.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadedModule {
    pub name: String,
    pub refcount: i32,
    pub used_by: Vec<String>,
}

/// What `/proc` says about the NVIDIA driver.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriverState {
    /// The kernel module's version (`550.54.15`), when the driver is loaded.
    pub version: Option<String>,
    pub flavour: Option<DriverFlavour>,
    /// Loaded NVIDIA modules, in [`NVIDIA_MODULES`] order.
    pub modules: Vec<LoadedModule>,
    /// Character majors of NVIDIA devices (`nvidia-frontend`, `nvidia-uvm`,
    /// `nvidia-caps`, ...), by name.
    pub char_majors: BTreeMap<String, u32>,
    /// `nouveau` is loaded: it claims the GPUs and the NVIDIA driver cannot.
    pub nouveau_loaded: bool,
    /// What the loaded driver says of each GPU it drives
    /// (`/proc/driver/nvidia/gpus/<bus>/information`).
    pub gpus: Vec<ProcGpu>,
}

/// One GPU as `/proc/driver/nvidia/gpus/<bus>/information` shows it; known
/// without NVML, as long as the kernel module is loaded.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcGpu {
    pub bus_id: PciAddress,
    pub model: Option<String>,
    pub uuid: Option<String>,
    /// `/dev/nvidiaN`'s N.
    pub minor: Option<u32>,
}

/// Errors reading driver state. Each names the file.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    #[error(transparent)]
    Read(#[from] HostError),
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
}

impl DriverState {
    /// Reads the driver state from `/proc` under `root`.
    pub fn read(root: &HostRoot) -> Result<Self, DriverError> {
        let mut state = DriverState::default();
        if let Some(text) = root.read_optional(PROC_VERSION)? {
            let (version, flavour) =
                parse_version_file(&text).ok_or_else(|| DriverError::Parse {
                    path: resolved(root, PROC_VERSION),
                    message: "no \"NVRM version:\" line with a version number".into(),
                })?;
            state.version = Some(version);
            state.flavour = Some(flavour);
        }
        let modules =
            KernelModules::from_read(root.open(PROC_MODULES)?).map_err(|e| DriverError::Parse {
                path: resolved(root, PROC_MODULES),
                message: e.to_string(),
            })?;
        for name in NVIDIA_MODULES {
            if let Some(m) = modules.0.get(*name) {
                let mut used_by = m.used_by.clone();
                used_by.sort();
                state.modules.push(LoadedModule {
                    name: m.name.clone(),
                    refcount: m.refcount,
                    used_by,
                });
            }
        }
        state.nouveau_loaded = modules.0.contains_key("nouveau");
        let devices = procfs_core::Devices::from_read(root.open(PROC_DEVICES)?).map_err(|e| {
            DriverError::Parse {
                path: resolved(root, PROC_DEVICES),
                message: e.to_string(),
            }
        })?;
        for d in devices.char_devices {
            if d.name.starts_with("nvidia") {
                state.char_majors.insert(d.name, d.major);
            }
        }
        state.gpus = read_proc_gpus(root)?;
        Ok(state)
    }

    /// True when the `nvidia` module is loaded.
    pub fn is_loaded(&self) -> bool {
        self.modules.iter().any(|m| m.name == "nvidia")
    }

    /// The major of `/dev/nvidia*` and `/dev/nvidiactl`: `nvidia-frontend`,
    /// or `nvidia` on drivers that name it so.
    pub fn frontend_major(&self) -> Option<u32> {
        self.char_majors
            .get("nvidia-frontend")
            .or_else(|| self.char_majors.get("nvidia"))
            .copied()
    }
}

fn read_proc_gpus(root: &HostRoot) -> Result<Vec<ProcGpu>, DriverError> {
    let names = match root.read_dir_names(PROC_GPUS) {
        Ok(n) => n,
        Err(e) if e.is_not_found() => return Ok(Vec::new()),
        Err(e) => return Err(e.into()),
    };
    let mut gpus = Vec::new();
    for name in names {
        let path = format!("{PROC_GPUS}/{name}/information");
        let Some(text) = root.read_optional(&path)? else {
            continue;
        };
        let bus_id = name.parse().map_err(|_| DriverError::Parse {
            path: resolved(root, &path),
            message: format!("directory name {name:?} is not a PCI address"),
        })?;
        gpus.push(parse_information(bus_id, &text));
    }
    Ok(gpus)
}

/// Parses the `Key: value` lines of a GPU's `information` file.
pub fn parse_information(bus_id: PciAddress, text: &str) -> ProcGpu {
    let mut gpu = ProcGpu {
        bus_id,
        model: None,
        uuid: None,
        minor: None,
    };
    for line in text.lines() {
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        match key.trim() {
            "Model" => gpu.model = Some(value.to_string()),
            "GPU UUID" => gpu.uuid = Some(value.to_string()),
            "Device Minor" => gpu.minor = value.parse().ok(),
            _ => {}
        }
    }
    gpu
}

/// Where the driver lists the `/dev/nvidia-caps` minor of every MIG
/// capability (`config 1`, `gpu0/gi1/access 12`, `gpu0/gi1/ci0/access 13`, …).
pub const PROC_MIG_MINORS: &str = "/proc/driver/nvidia-caps/mig-minors";

/// [`PROC_MIG_MINORS`] as a map from capability to minor; `None` when the
/// file does not exist (no MIG-capable driver loaded). A malformed line is an
/// error naming the file and the line.
pub fn read_mig_minors(root: &HostRoot) -> Result<Option<BTreeMap<String, u32>>, DriverError> {
    let Some(text) = root.read_optional(PROC_MIG_MINORS)? else {
        return Ok(None);
    };
    let mut map = BTreeMap::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let parsed = line
            .split_once(' ')
            .and_then(|(k, v)| Some((k.to_string(), v.trim().parse::<u32>().ok()?)));
        let Some((k, v)) = parsed else {
            return Err(DriverError::Parse {
                path: PROC_MIG_MINORS.into(),
                message: format!("line {}: {line:?} is not `<name> <minor>`", n + 1),
            });
        };
        map.insert(k, v);
    }
    Ok(Some(map))
}

fn resolved(root: &HostRoot, p: &str) -> PathBuf {
    root.resolve(p).unwrap_or_else(|_| p.into())
}

/// Parses `/proc/driver/nvidia/version`:
/// `NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar 5 ...`
/// or `NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.54.15  Release Build ...`.
pub fn parse_version_file(text: &str) -> Option<(String, DriverFlavour)> {
    let line = text.lines().find(|l| l.starts_with("NVRM version:"))?;
    let flavour = if line.contains("Open Kernel Module") {
        DriverFlavour::Open
    } else {
        DriverFlavour::Proprietary
    };
    let version = line.split_whitespace().find(|w| {
        let mut parts = w.split('.');
        let all_digits = |p: &str| !p.is_empty() && p.chars().all(|c| c.is_ascii_digit());
        w.contains('.') && parts.all(all_digits)
    })?;
    Some((version.to_string(), flavour))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    #[test]
    fn version_line_both_flavours() {
        let prop = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.183.01  Sun May 12 19:39:15 UTC 2024\nGCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n";
        assert_eq!(
            parse_version_file(prop),
            Some(("535.183.01".into(), DriverFlavour::Proprietary))
        );
        let open = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.54.15  Release Build  (dvs-builder@U16-I3-B03-4-3)  Tue Mar  5 22:19:11 UTC 2024\n";
        assert_eq!(
            parse_version_file(open),
            Some(("550.54.15".into(), DriverFlavour::Open))
        );
        assert_eq!(parse_version_file("garbage"), None);
    }

    fn proc_tree(
        version: Option<&str>,
        modules: &str,
        devices: &str,
    ) -> (tempfile::TempDir, HostRoot) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path();
        fs::create_dir_all(p.join("proc/driver/nvidia")).unwrap();
        if let Some(v) = version {
            fs::write(p.join("proc/driver/nvidia/version"), v).unwrap();
        }
        fs::write(p.join("proc/modules"), modules).unwrap();
        fs::write(p.join("proc/devices"), devices).unwrap();
        let root = HostRoot::new(p).unwrap();
        (dir, root)
    }

    const DEVICES: &str = "Character devices:\n  1 mem\n195 nvidia-frontend\n234 nvidia-uvm\n237 nvidia-caps\n\nBlock devices:\n  8 sd\n";

    #[test]
    fn loaded_driver() {
        let modules = "nvidia_uvm 1527808 0 - Live 0x0000000000000000\nnvidia_modeset 1306624 0 - Live 0x0000000000000000\nnvidia 56524800 2 nvidia_uvm,nvidia_modeset, Live 0x0000000000000000\next4 1003520 1 - Live 0x0000000000000000\n";
        let (_d, root) = proc_tree(
            Some(
                "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.54.15  Release Build\n",
            ),
            modules,
            DEVICES,
        );
        let s = DriverState::read(&root).unwrap();
        assert!(s.is_loaded());
        assert_eq!(s.version.as_deref(), Some("550.54.15"));
        assert_eq!(s.flavour, Some(DriverFlavour::Open));
        let names: Vec<&str> = s.modules.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, ["nvidia", "nvidia_uvm", "nvidia_modeset"]);
        assert_eq!(s.modules[0].used_by, ["nvidia_modeset", "nvidia_uvm"]);
        assert_eq!(s.frontend_major(), Some(195));
        assert_eq!(s.char_majors.get("nvidia-uvm"), Some(&234));
        assert!(!s.nouveau_loaded);
    }

    #[test]
    fn gpu_information_file() {
        let text = "Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 310\nGPU UUID: \t GPU-9d3b5a0e-1c7f-4e2a-8b61-0f2c3d4e5a01\nVideo BIOS: \t 96.00.74.00.01\nBus Type: \t PCIe\nDevice Minor: \t 3\nGPU Excluded:\t No\n";
        let g = parse_information("0000:18:00.0".parse().unwrap(), text);
        assert_eq!(g.model.as_deref(), Some("NVIDIA H100 80GB HBM3"));
        assert_eq!(
            g.uuid.as_deref(),
            Some("GPU-9d3b5a0e-1c7f-4e2a-8b61-0f2c3d4e5a01")
        );
        assert_eq!(g.minor, Some(3));
    }

    #[test]
    fn no_driver() {
        let (_d, root) = proc_tree(
            None,
            "nouveau 2000 0 - Live 0x0\n",
            "Character devices:\n  1 mem\n\nBlock devices:\n",
        );
        let s = DriverState::read(&root).unwrap();
        assert!(!s.is_loaded());
        assert_eq!(s.version, None);
        assert!(s.char_majors.is_empty());
        assert!(s.nouveau_loaded);
    }

    #[test]
    fn unparseable_version_names_the_file() {
        let (_d, root) = proc_tree(Some("hello\n"), "", DEVICES);
        let err = DriverState::read(&root).unwrap_err().to_string();
        assert!(err.contains("proc/driver/nvidia/version"), "{err}");
    }

    #[test]
    fn mig_minors_parse_and_bad_lines_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("proc/driver/nvidia-caps");
        std::fs::create_dir_all(&p).unwrap();
        let host = HostRoot::new(dir.path()).unwrap();
        std::fs::write(p.join("mig-minors"), "config 1\ngpu0/gi1/access 12\n").unwrap();
        let m = read_mig_minors(&host).unwrap().unwrap();
        assert_eq!(m["gpu0/gi1/access"], 12);
        std::fs::write(p.join("mig-minors"), "config 1\ngpu0/gi1/access twelve\n").unwrap();
        let err = read_mig_minors(&host).unwrap_err().to_string();
        assert!(
            err.starts_with("/proc/driver/nvidia-caps/mig-minors: line 2:"),
            "{err}"
        );
        std::fs::remove_file(p.join("mig-minors")).unwrap();
        assert_eq!(read_mig_minors(&host).unwrap(), None);
    }
}
