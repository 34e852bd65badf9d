//! DRA device names, NVIDIA's convention (docs/dra-facts.md §6): what the
//! agent's kubelet plugin prepares and the controller's ResourceSlices
//! publish must be the same string, so both take it from here.

/// A full GPU's device name: `gpu-<minor>` (`/dev/nvidia<minor>`).
pub fn gpu_device_name(minor: u32) -> String {
    format!("gpu-{minor}")
}

/// A MIG profile as NVIDIA's driver puts it in device names: lowercased,
/// dots removed, any other character outside `[a-z0-9-]` made `-`, leading
/// and trailing `-` trimmed (`1g.10gb+me` → `1g10gb-me`).
pub fn normalize_profile(profile: &str) -> String {
    let s: String = profile
        .to_lowercase()
        .chars()
        .filter(|c| *c != '.')
        .map(|c| {
            if c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' {
                c
            } else {
                '-'
            }
        })
        .collect();
    s.trim_matches('-').to_string()
}

/// A MIG device's name:
/// `gpu-<parentMinor>-mig-<profile>-<giProfileID>-<placementStart>`.
pub fn mig_device_name(
    parent_minor: u32,
    profile: &str,
    gi_profile_id: u32,
    placement_start: u32,
) -> String {
    format!(
        "gpu-{parent_minor}-mig-{}-{gi_profile_id}-{placement_start}",
        normalize_profile(profile)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_as_nvidias_driver_makes_them() {
        assert_eq!(gpu_device_name(7), "gpu-7");
        assert_eq!(normalize_profile("1g.10gb"), "1g10gb");
        assert_eq!(normalize_profile("1g.10gb+me"), "1g10gb-me");
        assert_eq!(normalize_profile("1c.2g.20gb"), "1c2g20gb");
        assert_eq!(normalize_profile("+7G.80GB+"), "7g80gb");
        assert_eq!(
            mig_device_name(0, "1g.10gb", 19, 6),
            "gpu-0-mig-1g10gb-19-6"
        );
        assert_eq!(
            mig_device_name(3, "1g.10gb+me", 20, 0),
            "gpu-3-mig-1g10gb-me-20-0"
        );
    }
}
