//! The NVIDIA kernel driver's state as `/proc` shows it: the version line in
//! `/proc/driver/nvidia/version`, the loaded modules in `/proc/modules`, and
//! the character-device majors in `/proc/devices`.

pub use crate::unreadable::Unreadable;
use std::collections::BTreeMap;
use std::path::PathBuf;

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
    /// The reference count; `None` where the kernel shows `-` (built
    /// without module unloading: nothing can be unloaded).
    pub refcount: Option<i32>,
    pub used_by: Vec<String>,
}

/// Whether `/proc/modules` was there to say which modules are loaded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ModuleList {
    /// Read (lines that could not be read are in [`DriverState::unreadable`]).
    #[default]
    Read,
    /// There is no `/proc/modules`: the kernel has no loadable-module
    /// support, so a driver can only be built in.
    NoModuleSupport,
    /// `/proc/modules` could not be read (see [`DriverState::unreadable`]).
    Unreadable,
}

/// What `/proc` says about the NVIDIA driver.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriverState {
    /// The kernel module's version (`550.54.15`), when the driver is loaded.
    pub version: Option<String>,
    pub flavour: Option<DriverFlavour>,
    /// Loaded NVIDIA modules, in [`NVIDIA_MODULES`] order.
    pub modules: Vec<LoadedModule>,
    /// Whether [`Self::modules`] could be read at all.
    #[serde(default)]
    pub module_list: ModuleList,
    /// Character majors of NVIDIA devices (`nvidia-frontend`, `nvidia-uvm`,
    /// `nvidia-caps`, ...), by name.
    pub char_majors: BTreeMap<String, u32>,
    /// `nouveau` is loaded: it claims the GPUs and the NVIDIA driver cannot.
    pub nouveau_loaded: bool,
    /// What the loaded driver says of each GPU it drives
    /// (`/proc/driver/nvidia/gpus/<bus>/information`).
    pub gpus: Vec<ProcGpu>,
    /// Files and lines that could not be read; what they hold is missing
    /// above, and everything else was read.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unreadable: Vec<Unreadable>,
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
    /// Reads the driver state from `/proc` under `root`. Never fails: each
    /// file is read on its own, and a file or line that cannot be read is
    /// in [`Self::unreadable`] while the rest is still read.
    pub fn read(root: &HostRoot) -> Self {
        let mut state = DriverState::default();
        let mut bad = Vec::new();
        match root.read_optional(PROC_VERSION) {
            Ok(Some(text)) => match parse_version_file(&text) {
                Some((version, flavour)) => {
                    state.version = Some(version);
                    state.flavour = Some(flavour);
                }
                None => bad.push(Unreadable {
                    path: resolved(root, PROC_VERSION),
                    line: None,
                    message: "no \"NVRM version:\" line with a version number".into(),
                }),
            },
            Ok(None) => {}
            Err(e) => bad.push(Unreadable::from_host_error(root, PROC_VERSION, &e)),
        }
        match root.read_optional(PROC_MODULES) {
            Ok(Some(text)) => {
                let parsed = crate::procfiles::parse_modules(&text);
                bad.extend(Unreadable::lines(root, PROC_MODULES, parsed.bad_lines));
                for name in NVIDIA_MODULES {
                    if let Some(m) = parsed.modules.get(*name) {
                        state.modules.push(LoadedModule {
                            name: m.name.clone(),
                            refcount: m.refcount.count(),
                            used_by: m.used_by.clone(),
                        });
                    }
                }
                state.nouveau_loaded = parsed.modules.contains_key("nouveau");
            }
            Ok(None) => state.module_list = ModuleList::NoModuleSupport,
            Err(e) => {
                state.module_list = ModuleList::Unreadable;
                bad.push(Unreadable::from_host_error(root, PROC_MODULES, &e));
            }
        }
        match root.read_optional(PROC_DEVICES) {
            Ok(Some(text)) => {
                let parsed = crate::procfiles::parse_devices(&text);
                bad.extend(Unreadable::lines(root, PROC_DEVICES, parsed.bad_lines));
                state.char_majors = parsed
                    .char_majors
                    .into_iter()
                    .filter(|(name, _)| name.starts_with("nvidia"))
                    .collect();
            }
            Ok(None) => bad.push(Unreadable {
                path: resolved(root, PROC_DEVICES),
                line: None,
                message: "no such file: the device majors are unknown".into(),
            }),
            Err(e) => bad.push(Unreadable::from_host_error(root, PROC_DEVICES, &e)),
        }
        state.gpus = read_proc_gpus(root, &mut bad);
        state.unreadable = bad;
        state
    }

    /// True when the `nvidia` module is loaded: listed in `/proc/modules`,
    /// or (built in, or `/proc/modules` unreadable) its version file is there,
    /// which only the loaded driver makes.
    pub fn is_loaded(&self) -> bool {
        self.modules.iter().any(|m| m.name == "nvidia") || self.version.is_some()
    }

    /// Whether `module` is loaded: `Some` from `/proc/modules`; where that
    /// could not be read, what the module itself shows (`nvidia` its version
    /// file, `nvidia_uvm` and the others their `/proc/devices` major), and
    /// `None` where nothing tells.
    pub fn module_loaded(&self, module: &str) -> Option<bool> {
        if self.modules.iter().any(|m| m.name == module) {
            return Some(true);
        }
        if self.module_list == ModuleList::Read {
            return Some(module == "nvidia" && self.version.is_some());
        }
        match module {
            "nvidia" => Some(self.version.is_some()),
            "nvidia_uvm" => self.char_majors.contains_key("nvidia-uvm").then_some(true),
            _ => None,
        }
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

fn read_proc_gpus(root: &HostRoot, bad: &mut Vec<Unreadable>) -> Vec<ProcGpu> {
    let names = match root.read_dir_names(PROC_GPUS) {
        Ok(n) => n,
        Err(e) if e.is_not_found() => return Vec::new(),
        Err(e) => {
            bad.push(Unreadable::from_host_error(root, PROC_GPUS, &e));
            return Vec::new();
        }
    };
    let mut gpus = Vec::new();
    for name in names {
        let path = format!("{PROC_GPUS}/{name}/information");
        let text = match root.read_optional(&path) {
            Ok(Some(t)) => t,
            Ok(None) => continue,
            Err(e) => {
                bad.push(Unreadable::from_host_error(root, &path, &e));
                continue;
            }
        };
        let Ok(bus_id) = name.parse() else {
            bad.push(Unreadable {
                path: resolved(root, &path),
                line: None,
                message: format!("directory name {name:?} is not a PCI address"),
            });
            continue;
        };
        gpus.push(parse_information(bus_id, &text));
    }
    gpus
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
        let s = DriverState::read(&root);
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
        let s = DriverState::read(&root);
        assert!(!s.is_loaded());
        assert_eq!(s.version, None);
        assert!(s.char_majors.is_empty());
        assert!(s.nouveau_loaded);
    }

    #[test]
    fn unparseable_version_names_the_file_and_the_rest_is_read() {
        let (_d, root) = proc_tree(Some("hello\n"), "nvidia 1 0 - Live 0x0\n", DEVICES);
        let s = DriverState::read(&root);
        assert_eq!(s.unreadable.len(), 1, "{:?}", s.unreadable);
        let err = s.unreadable[0].to_string();
        assert!(err.contains("proc/driver/nvidia/version"), "{err}");
        assert_eq!(s.frontend_major(), Some(195));
        assert!(s.is_loaded());
    }

    /// The real H100 host's kernel has no module unloading: `-` counts.
    #[test]
    fn reference_counts_of_dash_and_bad_lines() {
        let modules = "nvidia_uvm 1830912 - - Live 0xffffffffc080c000 (O)\nnvidia 14299136 - - Live 0xffffffffc0400000 (O)\nnvidia_drm 1 zz - Live 0x0\n";
        let (_d, root) = proc_tree(None, modules, DEVICES);
        let s = DriverState::read(&root);
        let names: Vec<&str> = s.modules.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, ["nvidia", "nvidia_uvm"]);
        assert_eq!(s.modules[0].refcount, None);
        assert_eq!(s.module_list, ModuleList::Read);
        assert_eq!(s.unreadable.len(), 1);
        let err = s.unreadable[0].to_string();
        assert!(err.ends_with("proc/modules: line 3: nvidia_drm: reference count \"zz\" is neither a number nor \"-\""), "{err}");
    }

    #[test]
    fn a_kernel_without_proc_modules_is_a_fact_not_a_failure() {
        let (d, root) = proc_tree(
            Some(
                "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build\n",
            ),
            "",
            DEVICES,
        );
        std::fs::remove_file(d.path().join("proc/modules")).unwrap();
        let s = DriverState::read(&root);
        assert_eq!(s.module_list, ModuleList::NoModuleSupport);
        assert!(s.unreadable.is_empty(), "{:?}", s.unreadable);
        // Built in: the version file tells that the driver is there.
        assert!(s.is_loaded());
        assert_eq!(s.module_loaded("nvidia"), Some(true));
        assert_eq!(s.module_loaded("nvidia_uvm"), Some(true));
        assert_eq!(s.module_loaded("nvidia_modeset"), None);
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
