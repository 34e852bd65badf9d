//! The PCIe root complex a PCI device sits under, as the Kubernetes
//! standard device attribute `resource.kubernetes.io/pcieRoot` has it:
//! `pci<domain>:<bus>` (`pci0000:00`), the first component under
//! `/sys/devices` of the device's canonical sysfs path.
//!
//! Read as `k8s.io/dynamic-resource-allocation/deviceattribute` reads it
//! (`GetPCIeRootAttributeByPCIBusID`, `resolvePCIeRoot` in `pci_linux.go`,
//! tag v0.36.2), the library NVIDIA's DRA driver calls for its GPUs:
//! - the bus ID must be `dddd:bb:dd.f` in lower case with a four-digit
//!   domain (its `bdfRegexp`);
//! - `/sys/bus/pci/devices/<bus ID>` must be a symbolic link, read once
//!   (`os.Readlink`), a relative target joined to the link's directory and
//!   cleaned (`filepath.Join`);
//! - the target must start with `/sys/devices/pci` and end with the bus ID;
//! - the root is the target's first component after `/sys/devices/`.
//!
//! Anything else is an error and the attribute is left out, never guessed
//! (a fixture whose `bus/pci/devices` entries are directories, a Hyper-V
//! guest whose devices hang under `/sys/devices/LNXSYSTM:00/…`).

use std::path::{Component, Path, PathBuf};

use crate::pci::PciAddress;
use crate::root::{HostError, HostRoot};

const SYSFS_PCI_DEVICES: &str = "/sys/bus/pci/devices";
const SYSFS_DEVICES: &str = "/sys/devices/";

/// Why a device's PCIe root is unknown. Each names the sysfs link.
#[derive(Debug, thiserror::Error)]
pub enum PcieRootError {
    /// The link could not be read (it does not exist, or reading it failed).
    #[error("cannot read {link}: {source}")]
    Read {
        link: PathBuf,
        #[source]
        source: HostError,
    },
    /// The entry is there but is not a symbolic link, so the device's place
    /// under `/sys/devices` is not said.
    #[error("{link} is not a symbolic link, so the device's place under /sys/devices is unknown")]
    NotALink { link: PathBuf },
    /// The link leads somewhere other than a device under a root complex.
    #[error("{link} points to {target}, not to /sys/devices/pci…/…/{address}")]
    Elsewhere {
        link: PathBuf,
        target: PathBuf,
        address: PciAddress,
    },
    /// The domain has more than four hex digits (Intel VMD domains start at
    /// 0x10000): not a bus ID the Kubernetes attribute accepts.
    #[error(
        "{address}: the PCI domain is wider than the four hex digits resource.kubernetes.io/pcieRoot accepts"
    )]
    WideDomain { address: PciAddress },
}

/// `pci<domain>:<bus>` of the root complex `address` sits under.
pub fn pcie_root(root: &HostRoot, address: PciAddress) -> Result<String, PcieRootError> {
    if address.domain > 0xffff {
        return Err(PcieRootError::WideDomain { address });
    }
    let bus_id = address.to_string();
    let link = PathBuf::from(format!("{SYSFS_PCI_DEVICES}/{bus_id}"));
    let target = match root.read_link(&link) {
        Ok(t) => t,
        Err(HostError::Io { source, .. }) if source.raw_os_error() == Some(libc::EINVAL) => {
            return Err(PcieRootError::NotALink { link });
        }
        Err(source) => return Err(PcieRootError::Read { link, source }),
    };
    let absolute = join_clean(Path::new(SYSFS_PCI_DEVICES), &target);
    let elsewhere = || PcieRootError::Elsewhere {
        link: link.clone(),
        target: absolute.clone(),
        address,
    };
    let text = absolute.to_str().ok_or_else(elsewhere)?;
    let ends_with_bus = absolute.file_name().and_then(|n| n.to_str()) == Some(bus_id.as_str());
    if !text.starts_with("/sys/devices/pci") || !ends_with_bus {
        return Err(elsewhere());
    }
    let first = text[SYSFS_DEVICES.len()..]
        .split('/')
        .next()
        .unwrap_or_default();
    Ok(first.to_string())
}

/// Go's `filepath.Join(dir, target)` for an absolute `dir`: `target` as is
/// when absolute, else joined to `dir`; then cleaned lexically (`.` dropped,
/// `..` removes the component before it and stops at `/`).
fn join_clean(dir: &Path, target: &Path) -> PathBuf {
    let joined = if target.is_absolute() {
        target.to_path_buf()
    } else {
        dir.join(target)
    };
    let mut out = PathBuf::from("/");
    for c in joined.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::ParentDir => {
                out.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::os::unix::fs::symlink;

    fn addr(s: &str) -> PciAddress {
        s.parse().unwrap()
    }

    /// A device at `/sys/devices/<path>` (its last component the bus ID),
    /// linked from `/sys/bus/pci/devices/` with `link` as the link's text.
    fn device(root: &Path, path: &str, link: &str) {
        fs::create_dir_all(root.join("sys/devices").join(path)).unwrap();
        let devices = root.join("sys/bus/pci/devices");
        fs::create_dir_all(&devices).unwrap();
        let name = path.rsplit('/').next().unwrap();
        symlink(link, devices.join(name)).unwrap();
    }

    #[test]
    fn the_root_is_the_first_component_under_sys_devices() {
        let dir = tempfile::tempdir().unwrap();
        // As the H100 PCIe VM's capture has it.
        device(
            dir.path(),
            "pci0000:00/0000:00:06.0",
            "../../../devices/pci0000:00/0000:00:06.0",
        );
        // An HGX GPU behind a PCIe switch: bridges between root and GPU.
        device(
            dir.path(),
            "pci0000:17/0000:17:01.0/0000:18:00.0/0000:19:00.0/0000:1b:00.0",
            "../../../devices/pci0000:17/0000:17:01.0/0000:18:00.0/0000:19:00.0/0000:1b:00.0",
        );
        let root = HostRoot::new(dir.path()).unwrap();
        assert_eq!(
            pcie_root(&root, addr("0000:00:06.0")).unwrap(),
            "pci0000:00"
        );
        assert_eq!(
            pcie_root(&root, addr("0000:1b:00.0")).unwrap(),
            "pci0000:17"
        );
    }

    #[test]
    fn a_root_in_another_domain() {
        let dir = tempfile::tempdir().unwrap();
        device(
            dir.path(),
            "pci0001:00/0001:00:00.0/0001:01:00.0",
            "../../../devices/pci0001:00/0001:00:00.0/0001:01:00.0",
        );
        // An absolute link target is taken as it is.
        device(
            dir.path(),
            "pci000a:80/000a:80:02.0/000a:81:00.0",
            "/sys/devices/pci000a:80/000a:80:02.0/000a:81:00.0",
        );
        let root = HostRoot::new(dir.path()).unwrap();
        assert_eq!(
            pcie_root(&root, addr("0001:01:00.0")).unwrap(),
            "pci0001:00"
        );
        assert_eq!(
            pcie_root(&root, addr("000A:81:00.0")).unwrap(),
            "pci000a:80"
        );
    }

    #[test]
    fn an_entry_that_is_not_a_link_leaves_the_root_unknown() {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir_all(dir.path().join("sys/bus/pci/devices/0000:18:00.0")).unwrap();
        let root = HostRoot::new(dir.path()).unwrap();
        let e = pcie_root(&root, addr("0000:18:00.0")).unwrap_err();
        assert!(matches!(e, PcieRootError::NotALink { .. }), "{e:?}");
        assert_eq!(
            e.to_string(),
            "/sys/bus/pci/devices/0000:18:00.0 is not a symbolic link, so the device's place under /sys/devices is unknown"
        );
    }

    #[test]
    fn a_link_elsewhere_leaves_the_root_unknown() {
        let dir = tempfile::tempdir().unwrap();
        // A Hyper-V guest: the root bus hangs under the VMBus device.
        device(
            dir.path(),
            "LNXSYSTM:00/LNXSYBUS:00/VMBUS:00/abcd/pci7870:00/7870:00:00.0",
            "../../../devices/LNXSYSTM:00/LNXSYBUS:00/VMBUS:00/abcd/pci7870:00/7870:00:00.0",
        );
        // A link whose last component is another device.
        device(
            dir.path(),
            "pci0000:00/0000:00:07.0",
            "../../../devices/pci0000:00/0000:00:07.0",
        );
        fs::rename(
            dir.path().join("sys/bus/pci/devices/0000:00:07.0"),
            dir.path().join("sys/bus/pci/devices/0000:00:08.0"),
        )
        .unwrap();
        let root = HostRoot::new(dir.path()).unwrap();
        for a in ["7870:00:00.0", "0000:00:08.0"] {
            let e = pcie_root(&root, addr(a)).unwrap_err();
            assert!(matches!(e, PcieRootError::Elsewhere { .. }), "{a}: {e:?}");
        }
        assert_eq!(
            pcie_root(&root, addr("7870:00:00.0"))
                .unwrap_err()
                .to_string(),
            "/sys/bus/pci/devices/7870:00:00.0 points to /sys/devices/LNXSYSTM:00/LNXSYBUS:00/VMBUS:00/abcd/pci7870:00/7870:00:00.0, not to /sys/devices/pci…/…/7870:00:00.0"
        );
    }

    #[test]
    fn a_missing_link_or_a_wide_domain_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let root = HostRoot::new(dir.path()).unwrap();
        match pcie_root(&root, addr("0000:18:00.0")).unwrap_err() {
            PcieRootError::Read { link, source } => {
                assert_eq!(link, Path::new("/sys/bus/pci/devices/0000:18:00.0"));
                assert!(source.is_not_found(), "{source}");
            }
            other => panic!("{other:?}"),
        }
        let e = pcie_root(&root, addr("10000:01:00.0")).unwrap_err();
        assert!(matches!(e, PcieRootError::WideDomain { .. }), "{e:?}");
    }

    #[test]
    fn joining_cleans_like_go() {
        let dir = Path::new("/sys/bus/pci/devices");
        assert_eq!(
            join_clean(dir, Path::new("../../../devices/pci0000:00/./0000:00:01.0")),
            Path::new("/sys/devices/pci0000:00/0000:00:01.0")
        );
        assert_eq!(
            join_clean(dir, Path::new("../../../../../../x")),
            Path::new("/x")
        );
        assert_eq!(join_clean(dir, Path::new("/a/../b")), Path::new("/b"));
    }

    #[test]
    fn the_host_fixtures_have_their_roots() {
        // tests/fixtures/hosts: generated trees and the real capture; every
        // GPU's entry is a link into /sys/devices/pci0000:00.
        let hosts = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hosts");
        for (host, bus) in [
            ("h100-pcie-vm", "0000:00:06.0"),
            ("h100-sxm-8", "0000:db:00.0"),
            ("a10g-1", "0000:00:1e.0"),
        ] {
            let root = HostRoot::new(hosts.join(host)).unwrap();
            assert_eq!(
                pcie_root(&root, addr(bus)).unwrap(),
                "pci0000:00",
                "{host} {bus}"
            );
        }
    }
}
