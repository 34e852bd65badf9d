//! A simulated GPU's PCI configuration space: the 256-byte header sysfs's
//! `config` file starts with, as [`crate::NodeDescription::materialize`]
//! writes it.
//!
//! Identity (vendor, device, class, subsystem) from the description, and a
//! capability list laid out as a data-centre GPU's: power management at
//! `0x60`, MSI at `0x68`, PCI Express at `0x78`, then NVIDIA's
//! vendor-specific capability at `0xb4`. On a physical GPU that capability
//! is 20 bytes without a signature; on a vGPU (the description's `vgpu`)
//! it is NVIDIA's vGPU capability: `VF`, then the host driver record
//! (type 0, 22 bytes: version and branch, 10 NUL-padded bytes each).

use crate::desc::GpuDesc;

/// The header's length.
pub const HEADER_LEN: usize = 256;
/// Where NVIDIA's vendor-specific capability sits.
pub const VENDOR_CAP: usize = 0xb4;

/// The configuration header of `g`.
pub fn header(g: &GpuDesc) -> Vec<u8> {
    let mut c = vec![0u8; HEADER_LEN];
    let mut put16 = |at: usize, v: u16| c[at..at + 2].copy_from_slice(&v.to_le_bytes());
    put16(0x00, hostlib::pci::NVIDIA_VENDOR);
    put16(0x02, g.device_id.0);
    // Memory space, bus master, legacy interrupts off.
    put16(0x04, 0x0406);
    // Status: a capability list follows.
    put16(0x06, 0x0010);
    put16(0x2c, hostlib::pci::NVIDIA_VENDOR);
    put16(0x2e, g.subsystem_id.map_or(0, |s| s.0));
    c[0x08] = 0xa1;
    c[0x0a] = g.pci_class.0 as u8;
    c[0x0b] = (g.pci_class.0 >> 8) as u8;
    c[0x34] = 0x60;
    c[0x3d] = 0x01;
    // Power management (version 3), MSI (64-bit), PCI Express (endpoint).
    c[0x60..0x64].copy_from_slice(&[0x01, 0x68, 0x03, 0x00]);
    c[0x68..0x6c].copy_from_slice(&[0x05, 0x78, 0x80, 0x00]);
    c[0x78..0x7c].copy_from_slice(&[0x10, VENDOR_CAP as u8, 0x02, 0x00]);
    let vendor: Vec<u8> = match &g.vgpu {
        None => {
            let mut v = vec![0x09, 0x00, 0x14, 0x01];
            v.resize(0x14, 0);
            v
        }
        Some(vgpu) => {
            let mut v = vec![0x09, 0x00, 27, b'V', b'F', 0x00, 22];
            for field in [&vgpu.host_driver_version, &vgpu.host_driver_branch] {
                let mut f = field.as_bytes().to_vec();
                f.resize(10, 0);
                v.extend(f);
            }
            v
        }
    };
    c[VENDOR_CAP..VENDOR_CAP + vendor.len()].copy_from_slice(&vendor);
    c
}
