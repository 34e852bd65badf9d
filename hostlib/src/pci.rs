//! NVIDIA PCI functions from sysfs (`/sys/bus/pci/devices/*`).

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::root::{HostError, HostRoot};

/// NVIDIA's PCI vendor id.
pub const NVIDIA_VENDOR: u16 = 0x10de;
/// PCI class "VGA compatible controller" (a GPU in graphics mode).
pub const CLASS_VGA: u16 = 0x0300;
/// PCI class "3D controller" (a GPU in compute mode).
pub const CLASS_3D: u16 = 0x0302;

const SYSFS_PCI_DEVICES: &str = "/sys/bus/pci/devices";

/// A PCI address, `domain:bus:device.function`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PciAddress {
    pub domain: u32,
    pub bus: u8,
    pub device: u8,
    pub function: u8,
}

/// A string that is not a PCI address.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a PCI address (expected DDDD:BB:DD.F, e.g. 0000:18:00.0)")]
pub struct BadPciAddress(pub String);

impl FromStr for PciAddress {
    type Err = BadPciAddress;

    /// Accepts sysfs's `0000:18:00.0`, NVML's `00000000:18:00.0` and a bare
    /// `18:00.0` (domain 0), in either case.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || BadPciAddress(s.to_string());
        let parts: Vec<&str> = s.split(':').collect();
        let (domain, bus, devfn) = match parts.as_slice() {
            [d, b, df] => (u32::from_str_radix(d, 16).map_err(|_| bad())?, *b, *df),
            [b, df] => (0, *b, *df),
            _ => return Err(bad()),
        };
        let (dev, func) = devfn.split_once('.').ok_or_else(bad)?;
        let hex8 = |x: &str| {
            if x.is_empty() || x.len() > 2 {
                return Err(bad());
            }
            u8::from_str_radix(x, 16).map_err(|_| bad())
        };
        let addr = PciAddress {
            domain,
            bus: hex8(bus)?,
            device: hex8(dev)?,
            function: hex8(func)?,
        };
        if addr.device > 0x1f || addr.function > 7 {
            return Err(bad());
        }
        Ok(addr)
    }
}

impl fmt::Display for PciAddress {
    /// sysfs's form: `0000:18:00.0`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}.{:x}",
            self.domain, self.bus, self.device, self.function
        )
    }
}

impl PciAddress {
    /// NVML's form: `00000000:18:00.0` (8-digit domain, upper case).
    pub fn nvml_bus_id(&self) -> String {
        format!(
            "{:08X}:{:02X}:{:02X}.{:X}",
            self.domain, self.bus, self.device, self.function
        )
    }
}

impl Serialize for PciAddress {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for PciAddress {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// One PCI function as sysfs shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PciFunction {
    pub address: PciAddress,
    pub vendor: u16,
    pub device: u16,
    /// The 24-bit class code (`0x030200`).
    pub class: u32,
    pub subsystem_vendor: Option<u16>,
    pub subsystem_device: Option<u16>,
    /// `None` where sysfs says -1 (no NUMA affinity) or has no such file.
    pub numa_node: Option<u32>,
    pub iommu_group: Option<u32>,
    /// The bound kernel driver (`nvidia`, `vfio-pci`, `nouveau`), if any.
    pub driver: Option<String>,
}

impl PciFunction {
    /// The class without the programming interface (`0x0302`).
    pub fn base_class(&self) -> u16 {
        (self.class >> 8) as u16
    }

    /// True for an NVIDIA GPU (VGA or 3D controller).
    pub fn is_nvidia_gpu(&self) -> bool {
        self.vendor == NVIDIA_VENDOR && matches!(self.base_class(), CLASS_VGA | CLASS_3D)
    }
}

/// Errors from PCI discovery. Each names the sysfs file.
#[derive(Debug, thiserror::Error)]
pub enum PciError {
    #[error("cannot list PCI devices: {0}")]
    List(#[source] HostError),
    #[error(transparent)]
    Read(#[from] HostError),
    #[error("{path}: {value:?} is not {expected}")]
    Parse {
        path: PathBuf,
        value: String,
        /// What the file should hold (`a hex number`).
        expected: &'static str,
    },
    /// Less of the configuration space than its 256-byte header could be
    /// read (Linux gives an unprivileged reader 64 bytes): its capability
    /// list is unknown.
    #[error(
        "{path}: only {len} bytes of the configuration space could be read (its capability list is in the first 256; reading them needs root)"
    )]
    ShortConfig { path: PathBuf, len: usize },
}

/// Every NVIDIA GPU function under `/sys/bus/pci/devices`, sorted by address.
/// Other NVIDIA functions (HDMI audio, NVSwitch bridges) are left out. The
/// first file that cannot be read is an error (see [`scan_nvidia_gpus`] for
/// the reading that goes on past it).
pub fn discover_nvidia_gpus(root: &HostRoot) -> Result<Vec<PciFunction>, PciError> {
    let scan = scan_nvidia_gpus(root);
    match scan.unreadable.into_iter().next() {
        Some(e) => Err(e),
        None => Ok(scan.functions),
    }
}

/// What [`scan_nvidia_gpus`] found, and what it could not read.
#[derive(Debug, Default)]
pub struct PciScan {
    pub functions: Vec<PciFunction>,
    /// Each file that could not be read, naming it. A function whose vendor,
    /// class or device cannot be read is left out; one whose other
    /// attributes cannot be read is kept without them.
    pub unreadable: Vec<PciError>,
}

/// Every NVIDIA GPU function under `/sys/bus/pci/devices`, sorted by
/// address, reading past what cannot be read: one bad sysfs file never
/// hides the other GPUs.
pub fn scan_nvidia_gpus(root: &HostRoot) -> PciScan {
    let mut scan = PciScan::default();
    let names = match root.read_dir_names(SYSFS_PCI_DEVICES) {
        Ok(n) => n,
        Err(e) => {
            scan.unreadable.push(PciError::List(e));
            return scan;
        }
    };
    for name in names {
        let Ok(address) = name.parse::<PciAddress>() else {
            tracing::debug!(entry = %name, "skipping sysfs entry that is not a PCI address");
            continue;
        };
        match read_function(root, address, &name, &mut scan.unreadable) {
            Ok(Some(f)) => scan.functions.push(f),
            Ok(None) => {}
            Err(e) => scan.unreadable.push(e),
        }
    }
    scan.functions.sort_by_key(|f| f.address);
    scan
}

/// One function: `None` when it is not an NVIDIA GPU; an error when what
/// tells (vendor, class, device) cannot be read. The optional attributes
/// that cannot be read go to `bad` and are left unset.
fn read_function(
    root: &HostRoot,
    address: PciAddress,
    name: &str,
    bad: &mut Vec<PciError>,
) -> Result<Option<PciFunction>, PciError> {
    let base = format!("{SYSFS_PCI_DEVICES}/{name}");
    let vendor = read_hex(root, &format!("{base}/vendor"))?;
    if vendor != u32::from(NVIDIA_VENDOR) {
        return Ok(None);
    }
    let class = read_hex(root, &format!("{base}/class"))?;
    let device = read_hex(root, &format!("{base}/device"))? as u16;
    let mut optional = |r: Result<Option<u32>, PciError>| match r {
        Ok(v) => v,
        Err(e) => {
            bad.push(e);
            None
        }
    };
    let subsystem_vendor =
        optional(read_hex_optional(root, &format!("{base}/subsystem_vendor"))).map(|v| v as u16);
    let subsystem_device =
        optional(read_hex_optional(root, &format!("{base}/subsystem_device"))).map(|v| v as u16);
    let numa_node = optional(read_numa(root, &format!("{base}/numa_node")));
    let iommu_group = match link_basename(root, &format!("{base}/iommu_group")) {
        Ok(g) => g.and_then(|g| g.parse().ok()),
        Err(e) => {
            bad.push(e);
            None
        }
    };
    let driver = match link_basename(root, &format!("{base}/driver")) {
        Ok(d) => d,
        Err(e) => {
            bad.push(e);
            None
        }
    };
    let f = PciFunction {
        address,
        vendor: vendor as u16,
        device,
        class,
        subsystem_vendor,
        subsystem_device,
        numa_node,
        iommu_group,
        driver,
    };
    Ok(f.is_nvidia_gpu().then_some(f))
}

impl PciError {
    /// The file this error is about, and what went wrong with it.
    pub fn unreadable(&self) -> crate::unreadable::Unreadable {
        let (path, message) = match self {
            PciError::List(e) | PciError::Read(e) => match e {
                HostError::Io { path, source } => (path.clone(), source.to_string()),
                other => (PathBuf::from(SYSFS_PCI_DEVICES), other.to_string()),
            },
            PciError::Parse {
                path,
                value,
                expected,
            } => (path.clone(), format!("{value:?} is not {expected}")),
            PciError::ShortConfig { path, len } => (
                path.clone(),
                format!(
                    "only {len} bytes of the configuration space could be read (the capability list needs 256; reading them needs root)"
                ),
            ),
        };
        crate::unreadable::Unreadable {
            path,
            line: None,
            message,
        }
    }
}

fn parse_hex(path: &str, root: &HostRoot, text: &str) -> Result<u32, PciError> {
    let t = text.trim();
    let digits = t.strip_prefix("0x").unwrap_or(t);
    u32::from_str_radix(digits, 16).map_err(|_| PciError::Parse {
        path: root.resolve(path).unwrap_or_else(|_| path.into()),
        value: t.to_string(),
        expected: "a hex number",
    })
}

fn read_hex(root: &HostRoot, path: &str) -> Result<u32, PciError> {
    let text = root.read_to_string(path)?;
    parse_hex(path, root, &text)
}

fn read_hex_optional(root: &HostRoot, path: &str) -> Result<Option<u32>, PciError> {
    match root.read_optional(path)? {
        Some(text) => parse_hex(path, root, &text).map(Some),
        None => Ok(None),
    }
}

fn read_numa(root: &HostRoot, path: &str) -> Result<Option<u32>, PciError> {
    let Some(text) = root.read_optional(path)? else {
        return Ok(None);
    };
    match text.trim().parse::<i64>() {
        Ok(n) if n >= 0 => Ok(Some(n as u32)),
        Ok(_) => Ok(None),
        Err(_) => Err(PciError::Parse {
            path: root.resolve(path).unwrap_or_else(|_| path.into()),
            value: text.trim().to_string(),
            expected: "a NUMA node number",
        }),
    }
}

fn link_basename(root: &HostRoot, path: &str) -> Result<Option<String>, PciError> {
    match root.read_link(path) {
        Ok(target) => Ok(target.file_name().map(|n| n.to_string_lossy().into_owned())),
        Err(e) if e.is_not_found() => Ok(None),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::os::unix::fs::symlink;

    #[test]
    fn addresses_parse_in_all_forms() {
        let a: PciAddress = "0000:18:00.0".parse().unwrap();
        assert_eq!(a, "00000000:18:00.0".parse().unwrap());
        assert_eq!(a, "18:00.0".parse().unwrap());
        assert_eq!(a.to_string(), "0000:18:00.0");
        assert_eq!(a.nvml_bus_id(), "00000000:18:00.0");
        let b: PciAddress = "0001:AB:1f.7".parse().unwrap();
        assert_eq!(b.to_string(), "0001:ab:1f.7");
        for bad in [
            "",
            "18:00",
            "zz:00.0",
            "0000:18:20.0",
            "0000:18:00.8",
            "0000:180:00.0",
        ] {
            assert!(bad.parse::<PciAddress>().is_err(), "{bad}");
        }
    }

    fn write_fn(
        root: &std::path::Path,
        addr: &str,
        vendor: &str,
        class: &str,
        driver: Option<&str>,
    ) {
        let real = root.join("sys/devices/pci0000:00").join(addr);
        fs::create_dir_all(&real).unwrap();
        fs::write(real.join("vendor"), format!("{vendor}\n")).unwrap();
        fs::write(real.join("device"), "0x2330\n").unwrap();
        fs::write(real.join("class"), format!("{class}\n")).unwrap();
        fs::write(real.join("subsystem_vendor"), "0x10de\n").unwrap();
        fs::write(real.join("subsystem_device"), "0x16c1\n").unwrap();
        fs::write(real.join("numa_node"), "-1\n").unwrap();
        if let Some(d) = driver {
            fs::create_dir_all(root.join("sys/bus/pci/drivers").join(d)).unwrap();
            symlink(format!("../../../bus/pci/drivers/{d}"), real.join("driver")).unwrap();
        }
        fs::create_dir_all(root.join("sys/bus/pci/devices")).unwrap();
        symlink(
            format!("../../../devices/pci0000:00/{addr}"),
            root.join("sys/bus/pci/devices").join(addr),
        )
        .unwrap();
    }

    #[test]
    fn finds_gpus_and_skips_other_functions() {
        let dir = tempfile::tempdir().unwrap();
        write_fn(dir.path(), "0000:00:02.0", "0x8086", "0x030000", None);
        write_fn(
            dir.path(),
            "0000:18:00.0",
            "0x10de",
            "0x030200",
            Some("nvidia"),
        );
        write_fn(dir.path(), "0000:18:00.1", "0x10de", "0x040300", None); // HDMI audio
        write_fn(dir.path(), "0000:03:00.0", "0x10de", "0x030000", None);
        let root = HostRoot::new(dir.path()).unwrap();
        let gpus = discover_nvidia_gpus(&root).unwrap();
        let addrs: Vec<String> = gpus.iter().map(|g| g.address.to_string()).collect();
        assert_eq!(addrs, ["0000:03:00.0", "0000:18:00.0"]);
        assert_eq!(gpus[1].driver.as_deref(), Some("nvidia"));
        assert_eq!(gpus[1].device, 0x2330);
        assert_eq!(gpus[1].numa_node, None);
        assert_eq!(gpus[0].driver, None);
        assert_eq!(gpus[0].base_class(), CLASS_VGA);
    }

    #[test]
    fn bad_sysfs_value_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        write_fn(dir.path(), "0000:18:00.0", "0x10de", "garbage", None);
        let root = HostRoot::new(dir.path()).unwrap();
        let err = discover_nvidia_gpus(&root).unwrap_err().to_string();
        assert!(err.contains("0000:18:00.0/class"), "{err}");
        assert!(err.contains("\"garbage\""), "{err}");
    }

    #[test]
    fn a_bad_file_of_one_gpu_leaves_the_others_and_is_named() {
        let dir = tempfile::tempdir().unwrap();
        write_fn(dir.path(), "0000:18:00.0", "0x10de", "garbage", None);
        write_fn(dir.path(), "0000:19:00.0", "0x10de", "0x030200", None);
        write_fn(dir.path(), "0000:1a:00.0", "0x10de", "0x030200", None);
        fs::write(
            dir.path()
                .join("sys/devices/pci0000:00/0000:1a:00.0/numa_node"),
            "many\n",
        )
        .unwrap();
        let root = HostRoot::new(dir.path()).unwrap();
        let scan = scan_nvidia_gpus(&root);
        let addrs: Vec<String> = scan
            .functions
            .iter()
            .map(|g| g.address.to_string())
            .collect();
        assert_eq!(addrs, ["0000:19:00.0", "0000:1a:00.0"]);
        assert_eq!(scan.functions[1].numa_node, None);
        let errs: Vec<String> = scan.unreadable.iter().map(|e| e.to_string()).collect();
        assert_eq!(errs.len(), 2, "{errs:?}");
        assert!(errs[0].contains("0000:18:00.0/class"), "{errs:?}");
        assert!(
            errs[1].contains("0000:1a:00.0/numa_node") && errs[1].contains("\"many\""),
            "{errs:?}"
        );
    }

    #[test]
    fn missing_sysfs_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let root = HostRoot::new(dir.path()).unwrap();
        let err = discover_nvidia_gpus(&root).unwrap_err().to_string();
        assert!(err.contains("sys/bus/pci/devices"), "{err}");
    }
}
