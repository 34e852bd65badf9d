//! Start-up: the checkpoint read and reconciled with the boot and the spec
//! files present, and what was found and done kept as [`Recovery`] for the
//! agent's `status`.

use std::collections::BTreeMap;

use hostlib::HostRoot;
use serde::Serialize;

use super::cdi;
use super::checkpoint::{self, Checkpoint, Entry, EntryDevice, EntryState, Loaded};
use super::error::StateError;
use super::options::Options;

/// What start-up found at the checkpoint's path.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(
    rename_all = "camelCase",
    rename_all_fields = "camelCase",
    tag = "found"
)]
pub enum Found {
    /// No checkpoint: a first start (or a state directory wiped).
    #[default]
    None,
    /// This boot's checkpoint, with this many claims.
    Loaded { claims: usize },
    /// A checkpoint of another boot: its claims were dropped, since the
    /// kubelet prepares every claim again after a reboot.
    OtherBoot {
        boot_id: String,
        dropped: Vec<String>,
    },
    /// A checkpoint that could not be read: set aside, and the claims
    /// rebuilt from the transient spec files present.
    Corrupt {
        why: String,
        set_aside: String,
        rebuilt: Vec<String>,
    },
}

/// What start-up found and did, for `status`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Recovery {
    pub checkpoint: Found,
    /// Claims whose prepare never finished: spec removed, entry dropped.
    pub rolled_back: Vec<String>,
    /// Prepared claims whose spec was written again from the checkpoint.
    pub rewritten: Vec<String>,
    /// Spec files of claims the checkpoint does not hold, removed.
    pub removed: Vec<String>,
    /// What could not be done (each names its file or claim).
    pub problems: Vec<String>,
    /// Prepared claims whose MPS control daemon was started again.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mps_restarted: Vec<String>,
}

impl Recovery {
    /// One line for logs and `status`.
    pub fn summary(&self) -> String {
        let mut s = match &self.checkpoint {
            Found::None => "no checkpoint (first start)".to_string(),
            Found::Loaded { claims } => format!("checkpoint loaded: {claims} claim(s)"),
            Found::OtherBoot { boot_id, dropped } => format!(
                "checkpoint of another boot ({boot_id}) dropped with {} claim(s): the kubelet prepares them again",
                dropped.len()
            ),
            Found::Corrupt {
                why,
                set_aside,
                rebuilt,
            } => format!(
                "checkpoint corrupt ({why}): set aside as {set_aside}, {} claim(s) rebuilt from the CDI specs",
                rebuilt.len()
            ),
        };
        for (what, list) in [
            ("rolled back", &self.rolled_back),
            ("specs rewritten", &self.rewritten),
            ("stray specs removed", &self.removed),
            ("MPS daemons started again", &self.mps_restarted),
            ("problems", &self.problems),
        ] {
            if !list.is_empty() {
                s.push_str(&format!("; {what}: {}", list.join(", ")));
            }
        }
        s
    }
}

/// Reads the checkpoint and reconciles it: another boot's is dropped, a
/// corrupt one set aside and rebuilt from the specs present, unfinished
/// prepares rolled back (NVIDIA #840), the specs of prepared claims written
/// again (the kubelet does not prepare running pods' claims again), stray
/// specs removed; then the result is saved for this boot.
pub fn recover(
    host: &HostRoot,
    opts: &Options,
    boot_id: &str,
) -> Result<(Checkpoint, Recovery), StateError> {
    let path = checkpoint::checkpoint_path(&opts.state_dir);
    let mut rec = Recovery::default();
    let mut ckpt = Checkpoint::empty(boot_id);
    match checkpoint::load(host, &path)? {
        Loaded::Missing => {}
        Loaded::Found(c) if c.boot_id == boot_id => {
            rec.checkpoint = Found::Loaded {
                claims: c.claims.len(),
            };
            ckpt = c;
        }
        Loaded::Found(c) => {
            tracing::info!(
                boot_id = %c.boot_id,
                claims = c.claims.len(),
                "the DRA checkpoint is of another boot: dropped, the kubelet prepares its claims again"
            );
            rec.checkpoint = Found::OtherBoot {
                boot_id: c.boot_id,
                dropped: c.claims.into_keys().collect(),
            };
        }
        Loaded::Corrupt(why) => {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            let aside = checkpoint::set_aside(host, &path, now)?;
            ckpt.claims = rebuild(host, opts, &mut rec.problems)?;
            tracing::warn!(
                path = %path, set_aside = %aside, error = %why, rebuilt = ckpt.claims.len(),
                "the DRA checkpoint was corrupt: set aside and rebuilt from the CDI specs"
            );
            rec.checkpoint = Found::Corrupt {
                why,
                set_aside: aside,
                rebuilt: ckpt.claims.keys().cloned().collect(),
            };
        }
    }
    let unfinished: Vec<String> = ckpt
        .claims
        .iter()
        .filter(|(_, e)| e.state == EntryState::Preparing)
        .map(|(u, _)| u.clone())
        .collect();
    for uid in unfinished {
        let spec = cdi::spec_path(&opts.cdi_dir, &uid);
        match host.remove_file(&spec) {
            Ok(_) => {
                ckpt.claims.remove(&uid);
                tracing::info!(claim = %uid, "unfinished prepare rolled back");
                rec.rolled_back.push(uid);
            }
            Err(e) => rec.problems.push(format!("rolling back claim {uid}: {e}")),
        }
    }
    for (uid, e) in ckpt
        .claims
        .iter()
        .filter(|(_, e)| e.state == EntryState::Prepared)
    {
        let spec = cdi::spec_path(&opts.cdi_dir, uid);
        let yaml = cdi::to_yaml(&e.spec);
        if host.read_optional(&spec).ok().flatten().as_deref() == Some(yaml.as_str()) {
            continue;
        }
        match host.write_atomic(&spec, yaml.as_bytes(), 0o644) {
            Ok(_) => rec.rewritten.push(uid.clone()),
            Err(err) => rec.problems.push(format!("writing {spec}: {err}")),
        }
    }
    for (uid, name) in spec_files(host, &opts.cdi_dir)? {
        if ckpt.claims.contains_key(&uid) {
            continue;
        }
        let spec = format!("{}/{name}", opts.cdi_dir.trim_end_matches('/'));
        match host.remove_file(&spec) {
            Ok(_) => rec.removed.push(spec),
            Err(e) => rec.problems.push(format!("removing {spec}: {e}")),
        }
    }
    // A spec's temp file whose writer was killed before its rename (an
    // agent is alone on its host, so no writer of one is alive now): the
    // claim's prepare was rolled back or the spec written again above.
    for name in host.read_dir_names(&opts.cdi_dir).unwrap_or_default() {
        if !is_stale_spec_temp(&name) {
            continue;
        }
        let temp = format!("{}/{name}", opts.cdi_dir.trim_end_matches('/'));
        match host.remove_file(&temp) {
            Ok(_) => rec.removed.push(temp),
            Err(e) => rec.problems.push(format!("removing {temp}: {e}")),
        }
    }
    ckpt.boot_id = boot_id.to_string();
    checkpoint::save(host, &path, &ckpt)?;
    tracing::info!(summary = %rec.summary(), "DRA claims recovered");
    Ok((ckpt, rec))
}

/// Whether `name` is the temp file of a claim's spec that an atomic write
/// left (`.<spec file>.gpu-agent-tmp.<pid>.<n>`).
fn is_stale_spec_temp(name: &str) -> bool {
    name.strip_prefix('.')
        .and_then(|n| n.split_once(".gpu-agent-tmp."))
        .is_some_and(|(spec, _)| cdi::uid_of_spec_file(spec).is_some())
}

/// The transient spec files in `cdi_dir`: (claim UID, file name). A
/// missing directory has none.
fn spec_files(host: &HostRoot, cdi_dir: &str) -> Result<Vec<(String, String)>, StateError> {
    let names = match host.read_dir_names(cdi_dir) {
        Ok(n) => n,
        Err(e) if e.is_not_found() => return Ok(Vec::new()),
        Err(source) => {
            return Err(StateError::ListSpecs {
                path: cdi_dir.to_string(),
                source,
            });
        }
    };
    Ok(names
        .into_iter()
        .filter_map(|n| cdi::uid_of_spec_file(&n).map(|u| (u.to_string(), n.clone())))
        .collect())
}

/// Entries rebuilt from the spec files present: prepared, their devices
/// from the specs' device names; request names and pools come back with
/// the allocation if the kubelet prepares the claim again. A spec that
/// cannot be read is a problem, and is removed as a stray.
fn rebuild(
    host: &HostRoot,
    opts: &Options,
    problems: &mut Vec<String>,
) -> Result<BTreeMap<String, Entry>, StateError> {
    let mut claims = BTreeMap::new();
    for (uid, name) in spec_files(host, &opts.cdi_dir)? {
        let path = format!("{}/{name}", opts.cdi_dir.trim_end_matches('/'));
        let spec = match host.read_to_string(&path) {
            Ok(text) => cdi::parse_claim_spec(&text),
            Err(e) => Err(e.to_string()),
        };
        let spec = match spec {
            Ok(s) => s,
            Err(why) => {
                problems.push(format!("{path} is not a claim's spec ({why}): removed"));
                continue;
            }
        };
        let devices = cdi::spec_device_names(&uid, &spec)
            .into_iter()
            .map(|device| EntryDevice {
                request_names: Vec::new(),
                pool: String::new(),
                cdi_device_ids: vec![cdi::cdi_device_id(&uid, &device)],
                device,
                share_id: None,
            })
            .collect();
        claims.insert(
            uid,
            Entry {
                namespace: String::new(),
                name: String::new(),
                state: EntryState::Prepared,
                devices,
                mps: cdi::mps_of_spec(&spec),
                spec,
                recovered: true,
            },
        );
    }
    Ok(claims)
}

/// This boot's claims with MPS whose prepare never finished, as the
/// checkpoint holds them before start-up rolls them back.
pub(crate) fn unfinished_mps(
    host: &HostRoot,
    opts: &Options,
    boot_id: &str,
) -> Vec<(String, Entry)> {
    let path = checkpoint::checkpoint_path(&opts.state_dir);
    match checkpoint::load(host, &path) {
        Ok(checkpoint::Loaded::Found(c)) if c.boot_id == boot_id => c
            .claims
            .into_iter()
            .filter(|(_, e)| e.state == EntryState::Preparing && e.mps.is_some())
            .collect(),
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests_support::Node;
    use super::*;

    #[test]
    fn a_killed_writers_temp_spec_is_removed_at_start() {
        let n = Node::new();
        let uid = "0e0b7f4c-aaaa-4bbb-8ccc-000000000001";
        let spec = cdi::spec_file_name(uid);
        let dir = n.opts.cdi_dir.trim_end_matches('/').to_string();
        let temp = format!("{dir}/.{spec}.gpu-agent-tmp.999999.0");
        let other = format!("{dir}/.other.json.gpu-agent-tmp.999999.0");
        n.write(&temp, "half a spec");
        n.write(&other, "not ours");
        let (_, rec) = recover(&n.host, &n.opts, "boot").unwrap();
        assert!(!n.exists(&temp), "{rec:?}");
        assert!(rec.removed.contains(&temp), "{rec:?}");
        assert!(n.exists(&other), "another writer's temp file is not ours");
        assert!(is_stale_spec_temp(&format!(".{spec}.gpu-agent-tmp.1.2")));
        assert!(!is_stale_spec_temp(&spec));
        assert!(!is_stale_spec_temp(
            ".k8s.gpu.nvidia.com-claim_a..b.yaml.gpu-agent-tmp.1.0"
        ));
    }
}
