//! The checkpoint of the node's claims: one JSON file under the state
//! directory, written atomically, tied to the boot it was written in; what
//! each claim's state is (preparing / prepared), its devices and its spec.

use std::collections::BTreeMap;

use gpu_model::cdi::Spec;
use hostlib::HostRoot;
use serde::{Deserialize, Serialize};

use super::error::StateError;
use super::interval::TimeSliceRecord;
use super::sharing::MpsSettings;
use crate::claim::{ClaimRef, PreparedDevice};

/// The checkpoint's file name in the state directory.
pub const CHECKPOINT_FILE: &str = "checkpoint.json";
/// Where the kernel says which boot this is.
pub const BOOT_ID_PATH: &str = "/proc/sys/kernel/random/boot_id";
/// The format written; another is read as corrupt.
pub const CHECKPOINT_VERSION: u32 = 1;

/// The whole checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Checkpoint {
    pub version: u32,
    /// The boot it was written in: claims of another boot are not prepared.
    pub boot_id: String,
    /// By claim UID.
    pub claims: BTreeMap<String, Entry>,
    /// The claims with time-slicing on full GPUs, by claim UID: recorded
    /// before their GPUs' time slice is set, dropped once it is set back
    /// (a record without its claim is a prepare cut short, undone at start).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub time_slices: BTreeMap<String, TimeSliceRecord>,
}

/// How far a claim's prepare got.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum EntryState {
    /// Begun, not answered: rolled back on start and by unprepare.
    Preparing,
    /// The spec is written and the kubelet was (or is being) answered.
    Prepared,
}

/// One claim.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Entry {
    pub namespace: String,
    pub name: String,
    pub state: EntryState,
    pub devices: Vec<EntryDevice>,
    /// The claim's CDI spec as written, to write it again after a restart.
    pub spec: Spec,
    /// Rebuilt from a spec file after the checkpoint was corrupt: request
    /// names and pools are not known until the allocation is seen again.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub recovered: bool,
    /// The claim's GPUs are shared through an MPS control daemon with these
    /// settings: started before its spec is written, started again on
    /// start-up, stopped by unprepare.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mps: Option<MpsSettings>,
}

/// One device of a claim, as answered to the kubelet.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EntryDevice {
    pub request_names: Vec<String>,
    pub pool: String,
    pub device: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share_id: Option<String>,
    pub cdi_device_ids: Vec<String>,
}

impl Checkpoint {
    pub fn empty(boot_id: &str) -> Self {
        Checkpoint {
            version: CHECKPOINT_VERSION,
            boot_id: boot_id.to_string(),
            claims: BTreeMap::new(),
            time_slices: BTreeMap::new(),
        }
    }
}

impl Entry {
    /// The claim this entry is about.
    pub fn claim_ref(&self, uid: &str) -> ClaimRef {
        ClaimRef {
            namespace: self.namespace.clone(),
            uid: uid.to_string(),
            name: self.name.clone(),
        }
    }

    /// The answer to the kubelet.
    pub fn prepared_devices(&self) -> Vec<PreparedDevice> {
        self.devices
            .iter()
            .map(|d| PreparedDevice {
                request_names: d.request_names.clone(),
                pool_name: d.pool.clone(),
                device_name: d.device.clone(),
                cdi_device_ids: d.cdi_device_ids.clone(),
                share_id: d.share_id.clone(),
            })
            .collect()
    }
}

/// The checkpoint's host path in `state_dir`.
pub fn checkpoint_path(state_dir: &str) -> String {
    format!("{}/{CHECKPOINT_FILE}", state_dir.trim_end_matches('/'))
}

/// This boot's ID.
pub fn read_boot_id(host: &HostRoot) -> Result<String, StateError> {
    host.read_to_string(BOOT_ID_PATH)
        .map(|s| s.trim().to_string())
        .map_err(|source| StateError::BootId {
            path: BOOT_ID_PATH,
            source,
        })
}

/// What was found at the checkpoint's path.
#[derive(Debug)]
pub enum Loaded {
    Missing,
    Found(Checkpoint),
    /// There, but not a checkpoint this version can read: why.
    Corrupt(String),
}

/// Reads the checkpoint at `path`.
pub fn load(host: &HostRoot, path: &str) -> Result<Loaded, StateError> {
    let text = match host.read_optional(path) {
        Ok(Some(t)) => t,
        Ok(None) => return Ok(Loaded::Missing),
        // Bytes that are not UTF-8 are a corrupt file, not an unreadable one.
        Err(hostlib::HostError::Io { source, .. })
            if source.kind() == std::io::ErrorKind::InvalidData =>
        {
            return Ok(Loaded::Corrupt(source.to_string()));
        }
        Err(source) => {
            return Err(StateError::ReadCheckpoint {
                path: path.to_string(),
                source,
            });
        }
    };
    match serde_json::from_str::<Checkpoint>(&text) {
        Ok(c) if c.version == CHECKPOINT_VERSION => Ok(Loaded::Found(c)),
        Ok(c) => Ok(Loaded::Corrupt(format!(
            "version {}, not {CHECKPOINT_VERSION}",
            c.version
        ))),
        Err(e) => Ok(Loaded::Corrupt(e.to_string())),
    }
}

/// Writes `c` to `path` atomically (temp file, fsync, rename, fsync of the
/// directory), readable by root only.
pub fn save(host: &HostRoot, path: &str, c: &Checkpoint) -> Result<(), StateError> {
    let mut text = serde_json::to_string_pretty(c).expect("a checkpoint always serialises");
    text.push('\n');
    host.write_atomic(path, text.as_bytes(), 0o600)
        .map(|_| ())
        .map_err(|source| StateError::WriteCheckpoint {
            path: path.to_string(),
            source,
        })
}

/// Renames the corrupt checkpoint at `path` to `<path>.corrupt-<unix_time>`
/// beside it; returns that host path.
pub fn set_aside(host: &HostRoot, path: &str, unix_time: u64) -> Result<String, StateError> {
    let aside = format!("{path}.corrupt-{unix_time}");
    let fail = |source| StateError::SetAside {
        path: path.to_string(),
        aside: aside.clone(),
        source,
    };
    let (dir, name) = path.rsplit_once('/').unwrap_or(("", path));
    let dir = host
        .dir(if dir.is_empty() { "/" } else { dir }, false)
        .map_err(|e| match e {
            hostlib::HostError::Io { source, .. } => fail(source),
            other => fail(std::io::Error::other(other.to_string())),
        })?;
    let aside_name = format!("{name}.corrupt-{unix_time}");
    dir.rename(name, &aside_name).map_err(fail)?;
    Ok(aside)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host() -> (tempfile::TempDir, HostRoot) {
        let dir = tempfile::tempdir().unwrap();
        let host = HostRoot::new(dir.path()).unwrap();
        (dir, host)
    }

    #[test]
    fn saved_then_loaded_and_private() {
        use std::os::unix::fs::PermissionsExt;
        let (_d, host) = host();
        let path = checkpoint_path("/var/lib/gpu-agent/dra/");
        assert!(matches!(load(&host, &path).unwrap(), Loaded::Missing));
        let c = Checkpoint::empty("boot-1");
        save(&host, &path, &c).unwrap();
        assert!(matches!(load(&host, &path).unwrap(), Loaded::Found(x) if x == c));
        let mode = std::fs::metadata(host.resolve(&path).unwrap())
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }

    #[test]
    fn another_version_bad_json_and_bad_bytes_are_corrupt() {
        let (_d, host) = host();
        let path = "/state/checkpoint.json";
        for bytes in [
            &br#"{"version":2,"bootId":"b","claims":{}}"#[..],
            b"{\"version\":1,",
            b"\xff\xfe\x00",
            br#"{"version":1,"bootId":"b","claims":{},"extra":1}"#,
        ] {
            host.write_atomic(path, bytes, 0o600).unwrap();
            assert!(
                matches!(load(&host, path).unwrap(), Loaded::Corrupt(_)),
                "{}",
                String::from_utf8_lossy(bytes)
            );
        }
        let aside = set_aside(&host, path, 1_700_000_000).unwrap();
        assert_eq!(aside, "/state/checkpoint.json.corrupt-1700000000");
        assert!(host.exists(&aside));
        assert!(!host.exists(path));
    }

    #[test]
    fn the_boot_id_is_read_trimmed() {
        let (_d, host) = host();
        assert!(
            read_boot_id(&host)
                .unwrap_err()
                .to_string()
                .contains(BOOT_ID_PATH)
        );
        host.write_atomic(BOOT_ID_PATH, b"abc-123\n", 0o444)
            .unwrap();
        assert_eq!(read_boot_id(&host).unwrap(), "abc-123");
    }
}
