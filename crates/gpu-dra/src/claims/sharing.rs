//! MPS sharing of a claim's GPUs, as NVIDIA's DRA driver does it
//! (`cmd/gpu-kubelet-plugin/sharing.go`): one control daemon per claim, with
//! a pipe directory and a shared-memory directory of its own, and the
//! claim's CDI devices pointing the containers at them. What the claim asks
//! for is its `mpsConfig` ([`MpsSettings`], read strictly by
//! [`parse_mps_config`]); who runs the daemon is the [`MpsPort`] the agent
//! hands to [`NodeClaims`](super::NodeClaims).

use std::collections::BTreeMap;

use gpu_model::cdi::{ContainerEdits, Mount};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Where a claim's containers find the daemon's pipe directory (NVIDIA's).
pub const CONTAINER_PIPE_DIR: &str = "/tmp/nvidia-mps";
/// Where a claim's containers get the daemon's shared memory.
pub const CONTAINER_SHM_DIR: &str = "/dev/shm";
/// The options of both mounts, as NVIDIA's driver writes them.
pub const MOUNT_OPTIONS: &[&str] = &["rw", "nosuid", "nodev", "bind"];

const MPS_FIELDS: &[&str] = &[
    "defaultActiveThreadPercentage",
    "defaultPinnedDeviceMemoryLimit",
    "defaultPerDevicePinnedMemoryLimit",
    "multiUser",
];

/// A claim's `mpsConfig`, checked: limits in MiB.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MpsSettings {
    /// Each client's share of the GPU's threads, 1..=100.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_active_thread_percentage: Option<u32>,
    /// The pinned-memory limit of every GPU of the claim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_pinned_device_memory_limit_mib: Option<u64>,
    /// Per GPU, by its index among the claim's GPUs (`"0"`) or its UUID, as
    /// written: overrides the default. Checked against the claim's GPUs by
    /// [`MpsSettings::pinned_limits`].
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub per_device_pinned_memory_limit_mib: BTreeMap<String, u64>,
    /// `multiUser`: the daemon takes clients of any user (`-M`); needs
    /// compute capability 7.0 (Volta) or newer on every GPU of the claim.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub multi_user: bool,
}

/// One device of a claim's daemon: a full GPU or a MIG device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MpsGpu {
    /// The device's UUID (a MIG device's own): what the daemon sees.
    pub uuid: String,
    /// `/dev/nvidia<minor>` (the parent GPU's, for a MIG device).
    pub minor: u32,
    /// The GPU's UUID: the parent's for a MIG device, `uuid` for a GPU.
    pub gpu_uuid: String,
}

impl MpsGpu {
    /// A MIG device (its compute mode is its parent GPU's).
    pub fn is_mig(&self) -> bool {
        self.uuid != self.gpu_uuid
    }
}

/// Where a started daemon's directories are (host paths, the host's own).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MpsDirs {
    pub pipe_dir: String,
    pub shm_dir: String,
}

/// Who runs the claims' MPS control daemons (the agent). Both calls block
/// (prepare runs on a blocking thread) and answer within the kubelet's 45 s.
pub trait MpsPort: Send + Sync {
    /// Starts claim `claim_uid`'s daemon for `gpus` (GPUs and MIG
    /// devices, in that order: the daemon's device 0, 1, …) with
    /// `settings` (refused in words when the GPUs cannot have them), and returns once it
    /// serves with its limits set; `Err` says why it does not (nothing is
    /// left running then). Starting a claim's daemon that runs already
    /// answers at once.
    fn start(
        &self,
        claim_uid: &str,
        gpus: &[MpsGpu],
        settings: &MpsSettings,
    ) -> Result<MpsDirs, String>;

    /// Tells claim `claim_uid`'s daemon to quit and puts its GPUs back in
    /// the DEFAULT compute mode; `Ok` when it has none.
    fn stop(&self, claim_uid: &str) -> Result<(), String>;
}

impl MpsSettings {
    /// The pinned-memory limits by the device's place in `uuids` (the
    /// claim's GPUs and MIG devices in the daemon's order: its device
    /// ordinals): the default for each, then the per-device ones; `Err`
    /// names a key that is no device of the claim.
    pub fn pinned_limits(&self, uuids: &[&str]) -> Result<BTreeMap<u32, u64>, String> {
        let mut out: BTreeMap<u32, u64> = BTreeMap::new();
        if let Some(mib) = self.default_pinned_device_memory_limit_mib {
            out.extend((0..uuids.len() as u32).map(|i| (i, mib)));
        }
        for (key, mib) in &self.per_device_pinned_memory_limit_mib {
            let at = match uuids.iter().position(|u| u == key) {
                Some(i) => i,
                None => match key.parse::<usize>() {
                    Ok(i) if i < uuids.len() => i,
                    _ => {
                        return Err(format!(
                            "mpsConfig.defaultPerDevicePinnedMemoryLimit names {key:?}, which is neither the index (0..{}) nor the UUID of one of the claim's devices ({})",
                            uuids.len(),
                            uuids.join(", ")
                        ));
                    }
                },
            };
            out.insert(at as u32, *mib);
        }
        Ok(out)
    }
}

/// Reads `mpsConfig` of a `kind` configuration strictly: unknown fields,
/// a thread percentage outside 1..=100 and limits under 1 MiB are errors.
/// `multiUser` is taken as written (the GPUs' compute capability is
/// checked where the daemon starts).
pub fn parse_mps_config(kind: &str, v: Option<&Value>) -> Result<MpsSettings, String> {
    let mut out = MpsSettings::default();
    let obj = match v {
        None | Some(Value::Null) => return Ok(out),
        Some(Value::Object(o)) => o,
        Some(_) => return Err(format!("{kind}.sharing.mpsConfig is not an object")),
    };
    let at = |f: &str| format!("{kind}.sharing.mpsConfig.{f}");
    if let Some(unknown) = obj.keys().find(|k| !MPS_FIELDS.contains(&k.as_str())) {
        return Err(format!(
            "unknown field {unknown:?} in {kind}.sharing.mpsConfig"
        ));
    }
    match obj.get("defaultActiveThreadPercentage") {
        None | Some(Value::Null) => {}
        Some(p) => match p.as_u64() {
            Some(n @ 1..=100) => out.default_active_thread_percentage = Some(n as u32),
            _ => {
                return Err(format!(
                    "{} is {p}, not a whole percentage from 1 to 100",
                    at("defaultActiveThreadPercentage")
                ));
            }
        },
    }
    match obj.get("defaultPinnedDeviceMemoryLimit") {
        None | Some(Value::Null) => {}
        Some(q) => {
            out.default_pinned_device_memory_limit_mib = Some(
                limit_mib(q)
                    .map_err(|why| format!("{}: {why}", at("defaultPinnedDeviceMemoryLimit")))?,
            );
        }
    }
    match obj.get("defaultPerDevicePinnedMemoryLimit") {
        None | Some(Value::Null) => {}
        Some(Value::Object(m)) => {
            for (key, q) in m {
                let mib = limit_mib(q).map_err(|why| {
                    format!(
                        "{}[{key:?}]: {why}",
                        at("defaultPerDevicePinnedMemoryLimit")
                    )
                })?;
                out.per_device_pinned_memory_limit_mib
                    .insert(key.clone(), mib);
            }
        }
        Some(_) => {
            return Err(format!(
                "{} is not a map of device to quantity",
                at("defaultPerDevicePinnedMemoryLimit")
            ));
        }
    }
    match obj.get("multiUser") {
        None | Some(Value::Null) => {}
        Some(Value::Bool(b)) => out.multi_user = *b,
        Some(other) => return Err(format!("{} is {other}, not a boolean", at("multiUser"))),
    }
    Ok(out)
}

/// A limit in MiB, rounded down as NVIDIA's driver does; at least 1.
fn limit_mib(q: &Value) -> Result<u64, String> {
    let text = match q {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        other => return Err(format!("{other} is not a quantity")),
    };
    let bytes = quantity_bytes(&text)?;
    let mib = bytes / (1024 * 1024);
    if mib == 0 {
        return Err(format!("{text} is under 1 MiB"));
    }
    u64::try_from(mib).map_err(|_| format!("{text} is too large"))
}

/// A Kubernetes quantity (`10Gi`, `512M`, `1.5e9`, `1024`) in bytes,
/// rounded up as `Quantity.Value()` does. Negative quantities are refused.
pub fn quantity_bytes(text: &str) -> Result<u128, String> {
    let bad = |why: &str| format!("{text:?} is not a quantity ({why})");
    let s = text.trim();
    let s = s.strip_prefix('+').unwrap_or(s);
    if s.starts_with('-') {
        return Err(bad("negative"));
    }
    let end = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, suffix) = s.split_at(end);
    let (whole, frac) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() && frac.is_empty() {
        return Err(bad("no number"));
    }
    let digits = format!("{whole}{frac}");
    let digits = digits.trim_start_matches('0');
    if digits.len() > 30 {
        return Err(bad("too many digits"));
    }
    let mantissa: u128 = if digits.is_empty() {
        0
    } else {
        digits.parse().map_err(|_| bad("not a number"))?
    };
    // value = mantissa × 10^dec_exp × 2^bin_exp
    let mut dec_exp: i64 = -(frac.len() as i64);
    let mut bin_exp: u32 = 0;
    match suffix {
        "" => {}
        "Ki" => bin_exp = 10,
        "Mi" => bin_exp = 20,
        "Gi" => bin_exp = 30,
        "Ti" => bin_exp = 40,
        "Pi" => bin_exp = 50,
        "Ei" => bin_exp = 60,
        "n" => dec_exp -= 9,
        "u" => dec_exp -= 6,
        "m" => dec_exp -= 3,
        "k" => dec_exp += 3,
        "M" => dec_exp += 6,
        "G" => dec_exp += 9,
        "T" => dec_exp += 12,
        "P" => dec_exp += 15,
        "E" => dec_exp += 18,
        e if e.starts_with(['e', 'E']) => {
            let n: i64 = e[1..].parse().map_err(|_| bad("bad exponent"))?;
            if !(-30..=30).contains(&n) {
                return Err(bad("exponent out of range"));
            }
            dec_exp += n;
        }
        _ => return Err(bad("unknown suffix")),
    }
    let over = || bad("too large");
    let mut value = mantissa.checked_mul(1u128 << bin_exp).ok_or_else(over)?;
    if dec_exp >= 0 {
        let scale = 10u128.checked_pow(dec_exp as u32).ok_or_else(over)?;
        value = value.checked_mul(scale).ok_or_else(over)?;
    } else {
        let scale = 10u128
            .checked_pow((-dec_exp) as u32)
            .ok_or_else(|| bad("too small"))?;
        value = value.div_ceil(scale);
    }
    Ok(value)
}

/// The edits each of an MPS claim's CDI devices gets (NVIDIA's
/// `GetCDIContainerEdits`): the pipe directory in the environment and both
/// directories mounted.
pub fn container_edits(dirs: &MpsDirs) -> ContainerEdits {
    let opts: Vec<String> = MOUNT_OPTIONS.iter().map(|o| o.to_string()).collect();
    ContainerEdits {
        env: vec![format!("CUDA_MPS_PIPE_DIRECTORY={CONTAINER_PIPE_DIR}")],
        mounts: vec![
            Mount {
                host_path: dirs.shm_dir.clone(),
                container_path: CONTAINER_SHM_DIR.into(),
                options: opts.clone(),
            },
            Mount {
                host_path: dirs.pipe_dir.clone(),
                container_path: CONTAINER_PIPE_DIR.into(),
                options: opts,
            },
        ],
        ..Default::default()
    }
}

/// Adds `edits` to a device's edits (once: a repeat changes nothing).
pub fn add_edits(to: &mut ContainerEdits, edits: &ContainerEdits) {
    for e in &edits.env {
        if !to.env.contains(e) {
            to.env.push(e.clone());
        }
    }
    for m in &edits.mounts {
        if !to.mounts.contains(m) {
            to.mounts.push(m.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn quantities_in_bytes_as_kubernetes_reads_them() {
        for (q, bytes) in [
            ("10Gi", 10u128 << 30),
            ("512Mi", 512 << 20),
            ("1G", 1_000_000_000),
            ("1.5Gi", 3 << 29),
            ("1e9", 1_000_000_000),
            ("1024", 1024),
            ("0.5", 1),
            ("100m", 1),
        ] {
            assert_eq!(quantity_bytes(q), Ok(bytes), "{q}");
        }
        for q in ["", "-1Gi", "10GB", "Gi", "1e99", "1.2.3"] {
            assert!(quantity_bytes(q).is_err(), "{q}");
        }
    }

    #[test]
    fn mps_config_read_strictly() {
        let ok = parse_mps_config(
            "GpuConfig",
            Some(&json!({
                "defaultActiveThreadPercentage": 50,
                "defaultPinnedDeviceMemoryLimit": "10Gi",
                "defaultPerDevicePinnedMemoryLimit": {"0": "5Gi", "GPU-b": 2147483648u64},
                "multiUser": false,
            })),
        )
        .unwrap();
        assert_eq!(
            ok,
            MpsSettings {
                default_active_thread_percentage: Some(50),
                default_pinned_device_memory_limit_mib: Some(10240),
                per_device_pinned_memory_limit_mib: BTreeMap::from([
                    ("0".into(), 5120),
                    ("GPU-b".into(), 2048)
                ]),
                multi_user: false,
            }
        );
        let multi = parse_mps_config("MigDeviceConfig", Some(&json!({"multiUser": true})));
        assert_eq!(
            multi,
            Ok(MpsSettings {
                multi_user: true,
                ..Default::default()
            })
        );
        assert_eq!(
            parse_mps_config("GpuConfig", None),
            Ok(MpsSettings::default())
        );
        for (cfg, words) in [
            (
                json!({"threads": 5}),
                "unknown field \"threads\" in GpuConfig.sharing.mpsConfig",
            ),
            (
                json!({"defaultActiveThreadPercentage": 0}),
                "is 0, not a whole percentage from 1 to 100",
            ),
            (json!({"defaultActiveThreadPercentage": 101}), "is 101, not"),
            (
                json!({"defaultPinnedDeviceMemoryLimit": "512Ki"}),
                "defaultPinnedDeviceMemoryLimit: 512Ki is under 1 MiB",
            ),
            (
                json!({"defaultPinnedDeviceMemoryLimit": "ten"}),
                "\"ten\" is not a quantity",
            ),
            (
                json!({"defaultPerDevicePinnedMemoryLimit": {"0": "1Ki"}}),
                "defaultPerDevicePinnedMemoryLimit[\"0\"]: 1Ki is under 1 MiB",
            ),
            (
                json!({"multiUser": "yes"}),
                "multiUser is \"yes\", not a boolean",
            ),
            (json!("x"), "mpsConfig is not an object"),
        ] {
            let err = parse_mps_config("GpuConfig", Some(&cfg)).unwrap_err();
            assert!(err.contains(words), "{cfg}: {err}");
        }
    }

    #[test]
    fn per_device_limits_by_index_or_uuid_of_the_claims_gpus() {
        let s = MpsSettings {
            default_pinned_device_memory_limit_mib: Some(1000),
            per_device_pinned_memory_limit_mib: BTreeMap::from([
                ("1".into(), 500),
                ("GPU-c".into(), 700),
            ]),
            ..Default::default()
        };
        assert_eq!(
            s.pinned_limits(&["GPU-a", "GPU-b", "GPU-c"]),
            Ok(BTreeMap::from([(0, 1000), (1, 500), (2, 700)]))
        );
        let err = s.pinned_limits(&["GPU-a"]).unwrap_err();
        assert!(
            err.contains("names \"1\", which is neither the index (0..1) nor the UUID of one of the claim's devices (GPU-a)"),
            "{err}"
        );
        assert_eq!(
            MpsSettings::default().pinned_limits(&["GPU-a"]),
            Ok(BTreeMap::new())
        );
    }

    #[test]
    fn edits_are_nvidias_and_added_once() {
        let dirs = MpsDirs {
            pipe_dir: "/run/nvidia/mps/dra-claim-u/pipe".into(),
            shm_dir: "/run/nvidia/mps/dra-claim-u/shm".into(),
        };
        let e = container_edits(&dirs);
        assert_eq!(e.env, ["CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps"]);
        assert_eq!(e.mounts[0].container_path, "/dev/shm");
        assert_eq!(e.mounts[0].host_path, dirs.shm_dir);
        assert_eq!(e.mounts[1].container_path, "/tmp/nvidia-mps");
        assert_eq!(e.mounts[1].host_path, dirs.pipe_dir);
        assert_eq!(e.mounts[1].options, ["rw", "nosuid", "nodev", "bind"]);
        let mut to = ContainerEdits::default();
        add_edits(&mut to, &e);
        add_edits(&mut to, &e);
        assert_eq!(to, e);
    }
}
