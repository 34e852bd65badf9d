//! A GPU's PCI configuration space (`hostlib::vgpu`), as sysfs's `config`
//! gives it, read for NVIDIA's vGPU capability. Never a panic; every
//! vendor-specific capability found starts with its ID and lies in the
//! 256-byte header; a vGPU's host driver version and branch are 1 to 10
//! printable characters; what follows the header changes nothing.
#![no_main]

use hostlib::vgpu::{self, CAP_VENDOR_SPECIFIC, CONFIG_HEADER_LEN, VgpuState};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let state = vgpu::state(data);
    let header = data.len().min(CONFIG_HEADER_LEN);
    for cap in vgpu::vendor_capabilities(data) {
        assert_eq!(cap[0], CAP_VENDOR_SPECIFIC);
        let start = cap.as_ptr() as usize - data.as_ptr() as usize;
        assert!(start + cap.len() <= header, "{start} + {}", cap.len());
    }
    if let VgpuState::Guest {
        host_driver_version,
        host_driver_branch,
    } = &state
    {
        for f in [host_driver_version, host_driver_branch]
            .into_iter()
            .flatten()
        {
            assert!((1..=10).contains(&f.len()), "{f:?}");
            assert!(f.bytes().all(|b| b.is_ascii_graphic()), "{f:?}");
        }
    }
    if data.len() > CONFIG_HEADER_LEN {
        assert_eq!(vgpu::state(&data[..CONFIG_HEADER_LEN]), state);
    }
});
