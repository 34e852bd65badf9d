//! The errors of bundles and unpacked drivers; each names the bundle, the
//! entry or the installed directory.

use std::io;
use std::path::PathBuf;

use hostlib::HostError;

use super::limits::MAX_EXPANSION;
use super::paths::MANIFEST;

/// Errors; each names the bundle, the entry or the installed directory.
#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    #[error("{bundle}: {source}")]
    Read {
        bundle: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "{bundle}: sha256 is {actual}, expected {expected} (from {from}); nothing was unpacked"
    )]
    Checksum {
        bundle: PathBuf,
        expected: String,
        actual: String,
        from: String,
    },
    #[error(
        "{bundle}: no sha256 to check it against: give one (--sha256, spec.driver.bundleSha256) or put `<sha256>  <name>` in {sidecar}"
    )]
    NoChecksum { bundle: PathBuf, sidecar: PathBuf },
    #[error("{sidecar}: {message}")]
    Sidecar { sidecar: PathBuf, message: String },
    #[error("{bundle}: manifest {MANIFEST}: {message}")]
    Manifest { bundle: PathBuf, message: String },
    #[error("{bundle}: entry {entry:?}: {message}; nothing was installed")]
    Entry {
        bundle: PathBuf,
        entry: String,
        message: String,
    },
    #[error(
        "{bundle}: built for kernel(s) {}, the running kernel is {running}; nothing was installed",
        .kernels.join(", ")
    )]
    Kernel {
        bundle: PathBuf,
        kernels: Vec<String>,
        running: String,
    },
    #[error(
        "{bundle}: unpacks to more than {limit} bytes ({MAX_EXPANSION} times its size): refused as a gzip bomb; nothing was installed"
    )]
    TooLarge { bundle: PathBuf, limit: u64 },
    #[error("{dir}: {message}")]
    Installed { dir: String, message: String },
    #[error("{path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    Host(#[from] HostError),
}
