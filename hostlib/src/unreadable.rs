//! A host file, or one line of it, that could not be read: what discovery
//! reports (naming file and line) while it reads everything else.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::root::{HostError, HostRoot};

/// A host file, or one line of it, that could not be read. What it would
/// have told is missing; everything else was still read.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unreadable {
    /// The file, as resolved under the host root (`/host/proc/modules`).
    pub path: PathBuf,
    /// The 1-based line, where one line was the trouble.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub line: Option<usize>,
    pub message: String,
}

impl std::fmt::Display for Unreadable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.line {
            Some(n) => write!(f, "{}: line {n}: {}", self.path.display(), self.message),
            None => write!(f, "{}: {}", self.path.display(), self.message),
        }
    }
}

impl Unreadable {
    /// The lines of `host_path` a parser could not read.
    pub fn lines(
        root: &HostRoot,
        host_path: &str,
        bad: Vec<crate::procfiles::BadLine>,
    ) -> impl Iterator<Item = Unreadable> {
        let path = resolved(root, host_path);
        bad.into_iter().map(move |b| Unreadable {
            path: path.clone(),
            line: Some(b.line),
            message: b.message,
        })
    }

    /// A read error (the error already names the file).
    pub fn from_host_error(root: &HostRoot, host_path: &str, e: &HostError) -> Self {
        let message = match e {
            HostError::Io { source, .. } => source.to_string(),
            other => other.to_string(),
        };
        Unreadable {
            path: resolved(root, host_path),
            line: None,
            message,
        }
    }
}

/// `host_path` as resolved under the host root, or as given where it cannot be.
fn resolved(root: &HostRoot, p: &str) -> PathBuf {
    root.resolve(p).unwrap_or_else(|_| p.into())
}
