//! NVIDIA vGPU, as a GPU's PCI configuration space shows it.
//!
//! A virtual GPU that NVIDIA's vGPU manager gives a virtual machine carries
//! a vendor-specific capability (capability ID `0x09`) whose data starts
//! with the signature `VF` (`0x56 0x46`, at bytes 3 and 4 of the
//! capability). Records follow from byte 5, each `[type, length, data…]`
//! with the length counting the two header bytes; the record of type 0
//! holds the host's vGPU manager driver version (10 bytes) and branch (10
//! bytes), NUL-padded. A physical GPU, on bare metal or passed through to a
//! VM whole, has a vendor-specific capability without the signature.
//! GPU feature discovery reads the same bytes for its `nvidia.com/vgpu.*`
//! labels (k8s-device-plugin `internal/vgpu`).
//!
//! The capability list lives in the first 256 bytes of the configuration
//! space; Linux gives an unprivileged reader only the first 64 of sysfs's
//! `config` file, so a short read is "unknown", never "not a vGPU".

use std::io::Read;

use serde::{Deserialize, Serialize};

use crate::pci::{PciAddress, PciError};
use crate::root::{HostError, HostRoot};

/// The configuration header, where the capability list is.
pub const CONFIG_HEADER_LEN: usize = 256;
/// PCI's capability ID of a vendor-specific capability.
pub const CAP_VENDOR_SPECIFIC: u8 = 0x09;
/// The status register (offset 6) bit saying a capability list exists.
const STATUS_CAP_LIST: u8 = 0x10;
/// Where the pointer to the first capability is.
const CAP_POINTER: usize = 0x34;
/// The vGPU signature, `VF`, at bytes 3 and 4 of the capability.
const SIGNATURE: [u8; 2] = *b"VF";
/// The first record, after the capability header and the signature.
const FIRST_RECORD: usize = 5;
/// The host driver record: version and branch, 10 bytes each.
const FIELD_LEN: usize = 10;

/// What a GPU's configuration space says of vGPU.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum VgpuState {
    /// No vGPU signature: a physical GPU (bare metal or passed through).
    Physical,
    /// An NVIDIA vGPU in a guest. The host's vGPU manager version and branch
    /// (`550.54.16`, `r550_00`), where the capability holds them readably.
    Guest {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        host_driver_version: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        host_driver_branch: Option<String>,
    },
}

impl VgpuState {
    pub fn is_guest(&self) -> bool {
        matches!(self, VgpuState::Guest { .. })
    }
}

/// The sysfs file holding a function's configuration space.
pub fn config_path(address: PciAddress) -> String {
    format!("/sys/bus/pci/devices/{address}/config")
}

/// Reads the configuration space of the function at `address` and says
/// what it shows of vGPU. `Ok(None)`: sysfs has no `config` file for it
/// (a test tree without one). A file shorter than the 256-byte header (an
/// unprivileged reader's 64 bytes) is an error naming it: the capability
/// list cannot be seen.
pub fn read(root: &HostRoot, address: PciAddress) -> Result<Option<VgpuState>, PciError> {
    let host_path = config_path(address);
    let mut file = match root.open(&host_path) {
        Ok(f) => f,
        Err(e) if e.is_not_found() => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let mut config = Vec::with_capacity(CONFIG_HEADER_LEN);
    let path = || {
        root.resolve(&host_path)
            .unwrap_or_else(|_| host_path.clone().into())
    };
    file.by_ref()
        .take(CONFIG_HEADER_LEN as u64)
        .read_to_end(&mut config)
        .map_err(|e| PciError::Read(HostError::io(path(), e)))?;
    if config.len() < CONFIG_HEADER_LEN {
        return Err(PciError::ShortConfig {
            path: path(),
            len: config.len(),
        });
    }
    Ok(Some(state(&config)))
}

/// What a configuration space (at least its 256-byte header) says: a guest
/// when any vendor-specific capability has the `VF` signature.
pub fn state(config: &[u8]) -> VgpuState {
    match vendor_capabilities(config).find(|c| c.get(3..5) == Some(&SIGNATURE[..])) {
        Some(cap) => {
            let (version, branch) = host_driver(cap);
            VgpuState::Guest {
                host_driver_version: version,
                host_driver_branch: branch,
            }
        }
        None => VgpuState::Physical,
    }
}

/// The vendor-specific capabilities in the list, each as long as its
/// length byte says (at least its 3 header bytes; cut at the end of the
/// 256-byte header). A list that loops or breaks (ID `0xff`) ends there.
pub fn vendor_capabilities(config: &[u8]) -> impl Iterator<Item = &[u8]> {
    let header = &config[..config.len().min(CONFIG_HEADER_LEN)];
    let has_list = header.get(6).is_some_and(|s| s & STATUS_CAP_LIST != 0);
    let mut pos = if has_list {
        header.get(CAP_POINTER).map_or(0, |p| usize::from(p & 0xfc))
    } else {
        0
    };
    let mut visited = [false; CONFIG_HEADER_LEN];
    std::iter::from_fn(move || {
        while pos != 0 && pos + 2 < header.len() && !visited[pos] {
            visited[pos] = true;
            let (id, next) = (header[pos], usize::from(header[pos + 1] & 0xfc));
            if id == 0xff {
                break;
            }
            let here = pos;
            pos = next;
            if id == CAP_VENDOR_SPECIFIC {
                // At least its three header bytes, at most to the header's end.
                let end = (here + usize::from(header[here + 2]).max(3)).min(header.len());
                return Some(&header[here..end]);
            }
        }
        None
    })
}

/// The host driver record (type 0) of a vGPU capability: version and
/// branch, each `None` where it is missing or not printable.
fn host_driver(cap: &[u8]) -> (Option<String>, Option<String>) {
    let mut pos = FIRST_RECORD;
    while let Some(&kind) = cap.get(pos) {
        if kind == 0 {
            // The whole record must be there, as GFD requires.
            if cap.len() < pos + 2 + 2 * FIELD_LEN {
                break;
            }
            let field = |from: usize| {
                let raw = cap.get(from..from + FIELD_LEN)?;
                let text = raw.split(|b| *b == 0).next().unwrap_or_default();
                (!text.is_empty() && text.iter().all(u8::is_ascii_graphic))
                    .then(|| String::from_utf8_lossy(text).into_owned())
            };
            return (field(pos + 2), field(pos + 2 + FIELD_LEN));
        }
        match cap.get(pos + 1) {
            Some(&len) if len >= 2 => pos += usize::from(len),
            _ => break,
        }
    }
    (None, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 256-byte header with capabilities `(offset, bytes)` chained in the
    /// order given.
    fn config(caps: &[(usize, Vec<u8>)]) -> Vec<u8> {
        let mut c = vec![0u8; CONFIG_HEADER_LEN];
        c[0..2].copy_from_slice(&0x10deu16.to_le_bytes());
        c[6] = STATUS_CAP_LIST;
        c[CAP_POINTER] = caps.first().map_or(0, |(o, _)| *o as u8);
        for (i, (off, bytes)) in caps.iter().enumerate() {
            c[*off..off + bytes.len()].copy_from_slice(bytes);
            c[off + 1] = caps.get(i + 1).map_or(0, |(o, _)| *o as u8);
        }
        c
    }

    fn vgpu_cap(version: &[u8], branch: &[u8]) -> Vec<u8> {
        let mut cap = vec![CAP_VENDOR_SPECIFIC, 0, 27, b'V', b'F', 0, 22];
        let mut field = |s: &[u8]| {
            let mut f = s.to_vec();
            f.resize(FIELD_LEN, 0);
            cap.extend(f);
        };
        field(version);
        field(branch);
        cap
    }

    /// A physical GPU: power management, MSI, PCI Express, then a
    /// vendor-specific capability of 20 bytes without the signature.
    fn physical() -> Vec<u8> {
        let mut vendor = vec![CAP_VENDOR_SPECIFIC, 0, 0x14, 0x01];
        vendor.resize(0x14, 0);
        config(&[
            (0x60, vec![0x01, 0, 0x03, 0x00]),
            (0x68, vec![0x05, 0, 0x81, 0x00]),
            (0x78, vec![0x10, 0, 0x02, 0x00]),
            (0xb4, vendor),
        ])
    }

    #[test]
    fn a_physical_gpu_is_not_a_vgpu() {
        let c = physical();
        assert_eq!(vendor_capabilities(&c).count(), 1);
        assert_eq!(vendor_capabilities(&c).next().unwrap().len(), 0x14);
        assert_eq!(state(&c), VgpuState::Physical);
        // No capability list at all.
        let mut none = c.clone();
        none[6] = 0;
        assert_eq!(state(&none), VgpuState::Physical);
    }

    #[test]
    fn a_vgpu_names_its_host_driver() {
        let c = config(&[
            (0x68, vec![0x05, 0, 0x81, 0x00]),
            (0xd0, vgpu_cap(b"550.54.16", b"r550_00")),
        ]);
        assert_eq!(
            state(&c),
            VgpuState::Guest {
                host_driver_version: Some("550.54.16".into()),
                host_driver_branch: Some("r550_00".into()),
            }
        );
        // The vGPU capability first, as GFD's own test data has it.
        let c = config(&[
            (0xd0, vgpu_cap(b"460.16", b"r460_00")),
            (0x68, vec![0x05, 0, 0x81, 0x00]),
        ]);
        let VgpuState::Guest {
            host_driver_version,
            host_driver_branch,
        } = state(&c)
        else {
            panic!("not a guest")
        };
        assert_eq!(host_driver_version.as_deref(), Some("460.16"));
        assert_eq!(host_driver_branch.as_deref(), Some("r460_00"));
    }

    #[test]
    fn records_before_the_driver_record_are_skipped() {
        // A record of type 3 (4 bytes) before the driver record.
        let mut cap = vgpu_cap(b"535.161", b"r535_00");
        cap.splice(5..5, [3, 4, 0xaa, 0xbb]);
        cap[2] = cap.len() as u8;
        let c = config(&[(0xc0, cap)]);
        assert_eq!(
            state(&c),
            VgpuState::Guest {
                host_driver_version: Some("535.161".into()),
                host_driver_branch: Some("r535_00".into()),
            }
        );
    }

    #[test]
    fn a_vgpu_without_a_readable_driver_record_is_still_a_vgpu() {
        // Signature only; a record of length 0 (it would never end); a
        // record cut short; unprintable bytes.
        let bare = vec![CAP_VENDOR_SPECIFIC, 0, 5, b'V', b'F'];
        let zero = vec![CAP_VENDOR_SPECIFIC, 0, 9, b'V', b'F', 7, 0, 0, 0];
        let mut short = vgpu_cap(b"550.54.16", b"r550_00");
        short.truncate(20);
        short[2] = 20;
        let odd = vgpu_cap(b"5\x015", b"r550 00");
        for cap in [bare, zero, short] {
            assert_eq!(
                state(&config(&[(0x80, cap.clone())])),
                VgpuState::Guest {
                    host_driver_version: None,
                    host_driver_branch: None,
                },
                "{cap:x?}"
            );
        }
        assert_eq!(
            state(&config(&[(0x80, odd)])),
            VgpuState::Guest {
                host_driver_version: None,
                host_driver_branch: None,
            }
        );
    }

    #[test]
    fn a_looping_or_broken_list_ends() {
        let mut c = config(&[(0x60, vec![0x01, 0, 3, 0]), (0x68, vec![0x05, 0, 3, 0])]);
        c[0x69] = 0x60; // 0x68 points back at 0x60
        assert_eq!(vendor_capabilities(&c).count(), 0);
        let mut c = physical();
        c[0x60] = 0xff; // broken at the first
        assert_eq!(state(&c), VgpuState::Physical);
        // A capability whose length runs past the header is cut there.
        let c = config(&[(0xf8, vec![CAP_VENDOR_SPECIFIC, 0, 0x40, b'V', b'F'])]);
        assert_eq!(vendor_capabilities(&c).next().unwrap().len(), 8);
        assert!(state(&c).is_guest());
    }

    /// Arbitrary bytes (a capability list pointing anywhere, lengths of
    /// anything): never a panic, every capability inside the header (the
    /// fuzz target `pci_config` checks the same, longer).
    #[test]
    fn arbitrary_bytes_never_panic() {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for round in 0..20_000 {
            let len = (next() % 300) as usize;
            let mut c: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            // Mostly a capability list that exists, with some vendor ones.
            if len > 0x40 && round % 2 == 0 {
                c[6] |= STATUS_CAP_LIST;
                let at = 0x40 + (next() % 0xb0) as usize;
                if at + 5 < len {
                    c[0x34] = at as u8;
                    c[at] = CAP_VENDOR_SPECIFIC;
                    c[at + 3..at + 5].copy_from_slice(b"VF");
                }
            }
            for cap in vendor_capabilities(&c) {
                assert_eq!(cap[0], CAP_VENDOR_SPECIFIC);
                let start = cap.as_ptr() as usize - c.as_ptr() as usize;
                assert!(start + cap.len() <= c.len().min(CONFIG_HEADER_LEN));
            }
            if let VgpuState::Guest {
                host_driver_version,
                host_driver_branch,
            } = state(&c)
            {
                for f in [host_driver_version, host_driver_branch]
                    .into_iter()
                    .flatten()
                {
                    assert!((1..=10).contains(&f.len()), "{f:?}");
                }
            }
        }
    }

    #[test]
    fn sysfs_config_is_read_and_a_short_one_named() {
        let dir = tempfile::tempdir().unwrap();
        let addr: PciAddress = "0000:18:00.0".parse().unwrap();
        let dev = dir.path().join("sys/bus/pci/devices/0000:18:00.0");
        std::fs::create_dir_all(&dev).unwrap();
        let root = HostRoot::new(dir.path()).unwrap();
        assert_eq!(read(&root, addr).unwrap(), None);
        // PCI Express functions show 4096 bytes to root.
        let mut full = config(&[(0xd0, vgpu_cap(b"550.54.16", b"r550_00"))]);
        full.resize(4096, 0);
        std::fs::write(dev.join("config"), &full).unwrap();
        assert!(read(&root, addr).unwrap().unwrap().is_guest());
        // What an unprivileged reader gets.
        std::fs::write(dev.join("config"), &full[..64]).unwrap();
        let err = read(&root, addr).unwrap_err().to_string();
        assert!(
            err.contains("0000:18:00.0/config") && err.contains("64 bytes"),
            "{err}"
        );
    }
}
