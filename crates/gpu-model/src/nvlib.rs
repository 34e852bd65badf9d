//! NVML's brand and architecture codes, spelled as NVIDIA's DRA driver
//! publishes them in a ResourceSlice (its `brand` and `architecture`
//! attributes, `device.attributes['gpu.nvidia.com'].brand` in CEL).
//!
//! The driver (kubernetes-sigs/dra-driver-nvidia-gpu,
//! `cmd/gpu-kubelet-plugin/nvlib.go`, v0.4.1) takes both strings from
//! go-nvlib's `GetBrandAsString` and `GetArchitectureAsString`
//! (NVIDIA/go-nvlib `pkg/nvlib/device/device.go`), whose tables are copied
//! here: `NVML_BRAND_NVIDIA` is `Nvidia` (not nvidia-smi's `NVIDIA`, nor
//! DCGM's: see [`crate::backend::dcgm_brand`]), `NVML_DEVICE_ARCH_ADA` is
//! `Ada Lovelace` (not nvml-wrapper's `Ada`). A code go-nvlib does not
//! know is an error there (the driver then publishes no device); here it
//! is `None`, and the attribute is left out.

/// go-nvlib's name for NVML's `nvmlBrandType_t` code.
pub fn brand_name(code: u32) -> Option<&'static str> {
    Some(match code {
        0 => "Unknown",
        1 => "Quadro",
        2 => "Tesla",
        3 => "NVS",
        4 => "Grid",
        5 => "GeForce",
        6 => "Titan",
        7 => "NvidiaVApps",
        8 => "NvidiaVPC",
        9 => "NvidiaVCS",
        10 => "NvidiaVWS",
        // NVML_BRAND_NVIDIA_CLOUD_GAMING, and the deprecated
        // NVML_BRAND_NVIDIA_VGAMING that has the same value.
        11 => "NvidiaCloudGaming",
        12 => "QuadroRTX",
        13 => "NvidiaRTX",
        14 => "Nvidia",
        15 => "GeForceRTX",
        16 => "TitanRTX",
        _ => return None,
    })
}

/// `NVML_DEVICE_ARCH_UNKNOWN`.
pub const ARCH_UNKNOWN: u32 = 0xffff_ffff;

/// go-nvlib's name for NVML's `nvmlDeviceArchitecture_t` code.
pub fn architecture_name(code: u32) -> Option<&'static str> {
    Some(match code {
        2 => "Kepler",
        3 => "Maxwell",
        4 => "Pascal",
        5 => "Volta",
        6 => "Turing",
        7 => "Ampere",
        8 => "Ada Lovelace",
        9 => "Hopper",
        10 => "Blackwell",
        // NVML_DEVICE_ARCH_T23X (Jetson Orin).
        11 => "Orin",
        ARCH_UNKNOWN => "Unknown",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn brands_as_nvidias_dra_driver_spells_them() {
        // What NVML answers on an H100 (nvidia-smi: "NVIDIA") and a T4
        // (nvidia-smi: "Tesla").
        assert_eq!(brand_name(14), Some("Nvidia"));
        assert_eq!(brand_name(2), Some("Tesla"));
        assert_eq!(brand_name(13), Some("NvidiaRTX"));
        assert_eq!(brand_name(11), Some("NvidiaCloudGaming"));
        assert_eq!(brand_name(0), Some("Unknown"));
        // NVML_BRAND_COUNT and beyond: go-nvlib has no name.
        assert_eq!(brand_name(17), None);
        assert_eq!(brand_name(18), None);
    }

    #[test]
    fn architectures_as_nvidias_dra_driver_spells_them() {
        assert_eq!(architecture_name(9), Some("Hopper"));
        assert_eq!(architecture_name(7), Some("Ampere"));
        assert_eq!(architecture_name(6), Some("Turing"));
        assert_eq!(architecture_name(8), Some("Ada Lovelace"));
        assert_eq!(architecture_name(10), Some("Blackwell"));
        assert_eq!(architecture_name(11), Some("Orin"));
        assert_eq!(architecture_name(ARCH_UNKNOWN), Some("Unknown"));
        assert_eq!(architecture_name(1), None);
        assert_eq!(architecture_name(12), None);
    }
}
