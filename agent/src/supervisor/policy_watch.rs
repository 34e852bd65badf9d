//! Sees the policy file change (inotify), however it is changed: written in
//! place, replaced by an editor's rename, or — in a Kubernetes ConfigMap
//! volume — by the kubelet swapping the `..data` symlink (the file itself,
//! `policy.yaml -> ..data/policy.yaml`, never changes). The directory is
//! watched, not the file, so a replaced file is still seen; when the path
//! is a symbolic link elsewhere, the target's directory is watched too.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use inotify::{Inotify, WatchMask};
use tokio_stream::StreamExt;

/// A watch on the policy file's directory (and its target's).
pub struct PolicyWatch {
    events: inotify::EventStream<[u8; 4096]>,
    /// Names in the watched directories that concern the policy.
    names: Vec<OsString>,
}

impl std::fmt::Debug for PolicyWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicyWatch")
            .field("names", &self.names)
            .finish()
    }
}

/// The policy file cannot be watched.
#[derive(Debug, thiserror::Error)]
#[error("{path}: cannot watch the policy file's directory: {source}")]
pub struct WatchError {
    path: PathBuf,
    #[source]
    source: std::io::Error,
}

impl PolicyWatch {
    pub fn new(path: &Path) -> Result<Self, WatchError> {
        let dir_of = |p: &Path| match p.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let err = |path: &Path| {
            let path = path.to_path_buf();
            move |source| WatchError { path, source }
        };
        let dir = dir_of(path);
        let inotify = Inotify::init().map_err(err(&dir))?;
        let mask = WatchMask::CREATE
            | WatchMask::CLOSE_WRITE
            | WatchMask::MOVED_TO
            | WatchMask::MOVED_FROM
            | WatchMask::DELETE;
        let mut names: Vec<OsString> = path.file_name().map(|n| n.to_owned()).into_iter().collect();
        inotify.watches().add(&dir, mask).map_err(err(&dir))?;
        // A symbolic link to a file elsewhere: edits there count too.
        if let Ok(target) = std::fs::canonicalize(path) {
            let tdir = dir_of(&target);
            let inside_data = target.components().any(|c| {
                c.as_os_str()
                    .to_str()
                    .is_some_and(|s| s.starts_with("..") && s.len() > 2)
            });
            if tdir != dir && !inside_data {
                inotify.watches().add(&tdir, mask).map_err(err(&tdir))?;
                names.extend(target.file_name().map(|n| n.to_owned()));
            }
        }
        let events = inotify.into_event_stream([0u8; 4096]).map_err(err(&dir))?;
        Ok(PolicyWatch { events, names })
    }

    /// Waits for the next event in the watched directories; true when it
    /// may concern the policy (its name, or a ConfigMap's `..data` swap).
    pub async fn next(&mut self) -> bool {
        loop {
            match self.events.next().await {
                Some(Ok(ev)) => {
                    let Some(name) = ev.name else { continue };
                    let is_data = name.to_str().is_some_and(|n| n.starts_with(".."));
                    if is_data || self.names.contains(&name) {
                        return true;
                    }
                }
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "policy watch failed; policy changes are seen on SIGHUP only");
                    return std::future::pending().await;
                }
                None => return std::future::pending().await,
            }
        }
    }
}
