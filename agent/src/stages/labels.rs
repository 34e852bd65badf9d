//! The `labels` stage: GPU feature discovery's labels ([`crate::labels`])
//! in NFD's local feature file, written (atomically, restorable) only when
//! they differ from what the file holds.

use std::io::Read;

use hostlib::{HostError, HostRoot};

use super::context::Context;
use super::status::StageState;
use crate::inventory::Inventory;
use crate::labels::{FEATURES_FILE, LabelWarning, Labels, LabelsError};

/// The feature file's mode (GFD writes it 0644: NFD's worker reads it).
const FILE_MODE: u32 = 0o644;

/// The file's bytes, `None` when it does not exist.
fn current(host: &HostRoot, path: &str) -> Result<Option<Vec<u8>>, HostError> {
    let mut f = match host.open(path) {
        Ok(f) => f,
        Err(e) if e.is_not_found() => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut bytes = Vec::new();
    f.read_to_end(&mut bytes)
        .map_err(|e| HostError::io(path, e))?;
    Ok(Some(bytes))
}

/// What the file should hold, and how many labels that is.
fn wanted(ctx: &Context<'_>, inv: &Inventory) -> Result<(Labels, String), LabelsError> {
    let (labels, warnings) =
        crate::labels::node_labels_noted(inv, &ctx.policy.device_plugin, ctx.policy.mig.strategy)?;
    let text = crate::labels::render(&labels);
    tell(ctx, &warnings);
    Ok((labels, text))
}

/// Logs each of the labels' warnings once while it holds (WARN), and
/// forgets those that no longer do, so one that comes back is said again.
fn tell(ctx: &Context<'_>, warnings: &[LabelWarning]) {
    for what in LabelWarning::KINDS {
        let now: Vec<&LabelWarning> = warnings.iter().filter(|w| w.kind() == *what).collect();
        let words = (!now.is_empty()).then(|| {
            now.iter()
                .map(|w| w.to_string())
                .collect::<Vec<_>>()
                .join("; ")
        });
        if ctx.news(&format!("labels:{what}"), words.as_deref()) {
            now.iter().for_each(|w| w.log());
        }
    }
}

/// Up to date when the file holds exactly the labels; no label and no
/// file is up to date too (nothing to write).
fn up_to_date(now: Option<&[u8]>, text: &str) -> bool {
    match now {
        Some(bytes) => bytes == text.as_bytes(),
        None => text.is_empty(),
    }
}

pub(super) fn labels_stage(ctx: &Context<'_>, inv: &Inventory) -> (StageState, String) {
    let (labels, text) = match wanted(ctx, inv) {
        Ok(w) => w,
        Err(e @ LabelsError::Undescribed { .. }) => {
            // The file keeps what it says until NVML answers again.
            return (StageState::Waiting, e.to_string());
        }
        Err(e) => return (StageState::Failed, e.to_string()),
    };
    let n = labels.len();
    let now = match current(ctx.host, FEATURES_FILE) {
        Ok(b) => b,
        Err(e) => return (StageState::Failed, e.to_string()),
    };
    if up_to_date(now.as_deref(), &text) {
        let detail = if n == 0 {
            "no GPU: no labels to write".to_string()
        } else {
            format!("{n} label(s) in {FEATURES_FILE} (unchanged)")
        };
        return (StageState::Done, detail);
    }
    if ctx.apply.is_none() {
        return (
            StageState::Ready,
            format!("would write {n} label(s) to {FEATURES_FILE}"),
        );
    }
    let written = hostlib::managed::ManagedFiles::lock(ctx.host, ctx.syscalls, true)
        .and_then(|files| files.write(FEATURES_FILE, text.as_bytes(), FILE_MODE));
    match written {
        Ok(true) => {
            tracing::info!(
                stage = "labels",
                file = FEATURES_FILE,
                labels = n,
                "wrote labels"
            );
            ctx.changed(format!("wrote {FEATURES_FILE}"));
            (
                StageState::Done,
                format!("wrote {n} label(s) to {FEATURES_FILE}"),
            )
        }
        // Changed back between the look and the lock.
        Ok(false) => (
            StageState::Done,
            format!("{n} label(s) in {FEATURES_FILE} (unchanged)"),
        ),
        Err(e) => (StageState::Failed, e.to_string()),
    }
}

/// Validation: the feature file holds exactly this node's labels.
pub(super) fn validate(ctx: &Context<'_>, inv: &Inventory) -> Result<String, String> {
    let (labels, text) = wanted(ctx, inv).map_err(|e| e.to_string())?;
    let now = current(ctx.host, FEATURES_FILE).map_err(|e| e.to_string())?;
    if up_to_date(now.as_deref(), &text) {
        Ok(if labels.is_empty() {
            "no GPU: no labels".into()
        } else {
            format!("{FEATURES_FILE} holds the node's {} label(s)", labels.len())
        })
    } else if now.is_none() {
        Err(format!("{FEATURES_FILE} is missing"))
    } else {
        Err(format!(
            "{FEATURES_FILE} does not hold the node's {} label(s)",
            labels.len()
        ))
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;
    use crate::caps::HeldCaps;
    use crate::policy::Policy;
    use crate::test_support::sim_node;

    struct Fixture {
        _sys_dir: tempfile::TempDir,
        _host_dir: tempfile::TempDir,
        sys: HostRoot,
        host: HostRoot,
        backend: crate::backend::sim::SimulatedBackend,
        caps: HeldCaps,
        runner: hostlib::command::RecordingRunner,
        syscalls: hostlib::RecordingSyscalls,
        policy: Policy,
    }

    impl Fixture {
        fn new(node: &str) -> Self {
            let (sys_dir, sys, backend) = sim_node(node);
            let host_dir = tempfile::tempdir().unwrap();
            Fixture {
                host: HostRoot::new(host_dir.path()).unwrap(),
                _sys_dir: sys_dir,
                _host_dir: host_dir,
                sys,
                backend,
                caps: HeldCaps::from_caps(&[]),
                runner: hostlib::command::RecordingRunner::new(),
                syscalls: hostlib::RecordingSyscalls::new(),
                policy: Policy::default(),
            }
        }

        fn ctx(&self, apply: bool) -> Context<'_> {
            Context {
                policy: &self.policy,
                caps: &self.caps,
                sys: &self.sys,
                backend: &self.backend,
                host: &self.host,
                apply: apply.then_some(&self.runner as &dyn hostlib::command::CommandRunner),
                syscalls: &self.syscalls,
                simulated: true,
                drain: None,
                serve_first: false,
                changes: Default::default(),
                mig_hold: None,
                upgrade: Default::default(),
                logged: None,
            }
        }

        fn inventory(&self) -> Inventory {
            crate::inventory::discover(&self.sys, &self.backend)
        }

        fn file(&self) -> Option<String> {
            self.host.read_optional(FEATURES_FILE).unwrap()
        }
    }

    #[test]
    fn writes_once_then_leaves_an_unchanged_file_alone() {
        let f = Fixture::new("h100-sxm-8");
        let inv = f.inventory();
        let want = crate::labels::render(
            &crate::labels::node_labels(&inv, &f.policy.device_plugin, f.policy.mig.strategy)
                .unwrap(),
        );
        let n = want.lines().count();
        assert_eq!(n, 27);

        // Inspecting (`status`): says what it would write, writes nothing.
        let look = f.ctx(false);
        assert_eq!(
            labels_stage(&look, &inv),
            (
                StageState::Ready,
                format!("would write {n} label(s) to {FEATURES_FILE}")
            )
        );
        assert!(look.changes.borrow().is_empty());
        assert_eq!(f.file(), None);

        let ctx = f.ctx(true);
        assert_eq!(
            labels_stage(&ctx, &inv),
            (
                StageState::Done,
                format!("wrote {n} label(s) to {FEATURES_FILE}")
            )
        );
        assert_eq!(*ctx.changes.borrow(), [format!("wrote {FEATURES_FILE}")]);
        assert_eq!(f.file().as_deref(), Some(want.as_str()));
        let real = f.host.resolve(FEATURES_FILE).unwrap();
        let meta = std::fs::metadata(&real).unwrap();
        assert_eq!(meta.permissions().mode() & 0o7777, 0o644);
        let mtime = meta.modified().unwrap();
        assert_eq!(
            validate(&ctx, &inv),
            Ok(format!("{FEATURES_FILE} holds the node's {n} label(s)"))
        );

        // A reconcile of the unchanged node: no write, no change recorded.
        let again = f.ctx(true);
        assert_eq!(
            labels_stage(&again, &inv),
            (
                StageState::Done,
                format!("{n} label(s) in {FEATURES_FILE} (unchanged)")
            )
        );
        assert!(again.changes.borrow().is_empty());
        assert_eq!(std::fs::metadata(&real).unwrap().modified().unwrap(), mtime);

        // Drift: the file edited by hand is put back, and counted.
        f.host
            .write_atomic(FEATURES_FILE, b"nvidia.com/gpu.count=1\n", 0o644)
            .unwrap();
        assert_eq!(
            validate(&again, &inv),
            Err(format!(
                "{FEATURES_FILE} does not hold the node's {n} label(s)"
            ))
        );
        let repair = f.ctx(true);
        assert_eq!(labels_stage(&repair, &inv).0, StageState::Done);
        assert_eq!(repair.changes.borrow().len(), 1);
        assert_eq!(f.file().as_deref(), Some(want.as_str()));

        // Restore (uninstall) removes the file: it did not exist before.
        let files = hostlib::managed::ManagedFiles::lock(&f.host, &f.syscalls, false).unwrap();
        files.restore().unwrap();
        assert_eq!(f.file(), None);
        assert_eq!(
            validate(&again, &inv),
            Err(format!("{FEATURES_FILE} is missing"))
        );
    }

    #[test]
    fn no_gpu_writes_nothing() {
        let f = Fixture::new("no-gpu");
        let inv = f.inventory();
        let ctx = f.ctx(true);
        assert_eq!(
            labels_stage(&ctx, &inv),
            (StageState::Done, "no GPU: no labels to write".to_string())
        );
        assert!(ctx.changes.borrow().is_empty());
        assert_eq!(f.file(), None);
        assert_eq!(validate(&ctx, &inv), Ok("no GPU: no labels".to_string()));
    }

    #[test]
    fn undescribed_gpus_wait_and_keep_the_file() {
        let f = Fixture::new("t4-4");
        let mut inv = f.inventory();
        for g in &mut inv.gpus {
            g.uuid = None;
            g.index = None;
        }
        inv.backend.error = Some("NVML: driver not loaded".into());
        f.host
            .write_atomic(FEATURES_FILE, b"nvidia.com/gpu.count=4\n", 0o644)
            .unwrap();
        let ctx = f.ctx(true);
        let (state, detail) = labels_stage(&ctx, &inv);
        assert_eq!(state, StageState::Waiting);
        assert!(detail.contains("NVML: driver not loaded"), "{detail}");
        assert_eq!(f.file().as_deref(), Some("nvidia.com/gpu.count=4\n"));
    }

    #[test]
    fn a_bad_device_plugin_config_fails_the_stage() {
        let mut f = Fixture::new("t4-4");
        f.policy = Policy::from_yaml(
            "spec:\n  devicePlugin:\n    config:\n      file: /nonexistent/dp.yaml\n",
            "p",
        )
        .unwrap();
        let inv = f.inventory();
        let (state, detail) = labels_stage(&f.ctx(true), &inv);
        assert_eq!(state, StageState::Failed);
        assert!(
            detail.starts_with("/nonexistent/dp.yaml: cannot read"),
            "{detail}"
        );
        assert_eq!(f.file(), None);
    }
}
