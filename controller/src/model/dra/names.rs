//! Spellings the API and NVIDIA's driver fix: device and slice names,
//! versions as semver, PCI addresses, and Quantities in the API server's
//! canonical form (so what is read back equals what was written).

use sha2::{Digest, Sha256};

/// The DRA driver's name, NVIDIA's: the slices' `spec.driver`, the domain of
/// the unqualified attribute names.
pub const DRIVER: &str = "gpu.nvidia.com";

/// Longest DNS label (a device name).
pub const MAX_LABEL: usize = 63;
/// Longest DNS subdomain (a slice name).
pub const MAX_SUBDOMAIN: usize = 253;
/// Longest string or version attribute.
pub const MAX_ATTRIBUTE: usize = 64;

/// Device names come from where the agent's DRA plugin takes them too, so
/// the slices and the prepared claims name a device alike.
pub use gpu_agent_proto::dra_names::{
    gpu_device_name as gpu_name, mig_device_name as mig_name, normalize_profile as profile_label,
};

/// Whether `s` is a DNS label (RFC 1123): what a device name must be.
pub fn is_dns_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= MAX_LABEL
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

/// `major[.minor[.patch]]` of plain numbers as semver 2.0.0, the way
/// Masterminds semver reads it: leading zeros dropped, missing parts 0
/// (`580.95.05` → `580.95.5`, `9.0` → `9.0.0`). `None` for anything else.
pub fn semver(v: &str) -> Option<String> {
    let parts: Vec<&str> = v.trim().split('.').collect();
    if parts.is_empty() || parts.len() > 3 {
        return None;
    }
    let mut nums = [0u64; 3];
    for (n, p) in nums.iter_mut().zip(&parts) {
        if p.is_empty() || !p.bytes().all(|c| c.is_ascii_digit()) {
            return None;
        }
        *n = p.parse().ok()?;
    }
    let s = format!("{}.{}.{}", nums[0], nums[1], nums[2]);
    (s.len() <= MAX_ATTRIBUTE).then_some(s)
}

/// NVML's CUDA driver version integer as NVIDIA's driver spells it before
/// the semver parse: `<v/1000>.<(v%1000)/10>` (13000 → `13.0`).
pub fn cuda_version(v: u32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// A PCI address as `resource.kubernetes.io/pciBusID` wants it:
/// `dddd:bb:dd.f`, lowercase, a 4-digit domain (NVML's
/// `00000000:3B:00.0` → `0000:3b:00.0`). `None` when it is not one.
pub fn pci_bus_id(addr: &str) -> Option<String> {
    let lower = addr.trim().to_ascii_lowercase();
    let (domain, rest) = lower.split_once(':')?;
    let domain = u32::from_str_radix(domain, 16).ok()?;
    if domain > 0xffff {
        return None;
    }
    let out = format!("{domain:04x}:{rest}");
    let b = out.as_bytes();
    let hex = |i: usize| b[i].is_ascii_hexdigit();
    let ok = b.len() == 12
        && (0..4).all(hex)
        && b[4] == b':'
        && hex(5)
        && hex(6)
        && b[7] == b':'
        && hex(8)
        && hex(9)
        && b[10] == b'.'
        && hex(11);
    ok.then_some(out)
}

/// Bytes as the API server's canonical binary-SI Quantity: the largest
/// suffix that divides exactly (`85520809984` → `81559Mi`), below 1 Ki a
/// plain number.
pub fn binary_si(bytes: u64) -> String {
    const SUFFIXES: [&str; 6] = ["Ki", "Mi", "Gi", "Ti", "Pi", "Ei"];
    let mut v = bytes;
    let mut suffix = "";
    for s in SUFFIXES {
        if v == 0 || !v.is_multiple_of(1024) {
            break;
        }
        v /= 1024;
        suffix = s;
    }
    format!("{v}{suffix}")
}

/// A count as the API server's canonical decimal-SI Quantity (`16`,
/// `2k` for 2000).
pub fn decimal_si(n: u64) -> String {
    const SUFFIXES: [&str; 6] = ["k", "M", "G", "T", "P", "E"];
    let mut v = n;
    let mut suffix = "";
    for s in SUFFIXES {
        if v == 0 || !v.is_multiple_of(1000) {
            break;
        }
        v /= 1000;
        suffix = s;
    }
    format!("{v}{suffix}")
}

/// The name of the node's slice number `index`:
/// `<node>-gpu.nvidia.com-<index>`, fixed so that an unchanged node gives
/// the same objects. A node name too long for that is cut and marked with
/// a hash of the whole name, so names of different nodes stay apart.
pub fn slice_name(node: &str, index: usize) -> String {
    let suffix = format!("-{}-{index}", DRIVER);
    if node.len() + suffix.len() <= MAX_SUBDOMAIN {
        return format!("{node}{suffix}");
    }
    let hash = Sha256::digest(node.as_bytes());
    let tag: String = hash[..4].iter().map(|b| format!("{b:02x}")).collect();
    let keep = MAX_SUBDOMAIN - suffix.len() - tag.len() - 1;
    let cut: String = node
        .char_indices()
        .take_while(|(i, c)| i + c.len_utf8() <= keep)
        .map(|(_, c)| c)
        .collect();
    // A DNS subdomain's parts end in [a-z0-9].
    format!("{}-{tag}{suffix}", cut.trim_end_matches(['-', '.']))
}
