//! Errors configuring a container runtime, each naming the file and line or
//! what is missing on the host.

use hostlib::command::CommandError;
use hostlib::managed::ManagedError;

/// Errors configuring a runtime. Each names the file (and line) or says
/// plainly what is missing on the host.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(transparent)]
    Host(hostlib::HostError),
    #[error("{path}:{line}:{column}: not valid TOML: {message}")]
    Parse {
        path: String,
        line: usize,
        column: usize,
        message: String,
    },
    #[error("{path}:{line}:{column}: {key}: {message}")]
    Invalid {
        path: String,
        line: usize,
        column: usize,
        key: String,
        message: String,
    },
    #[error("{0}")]
    NoInjection(String),
    #[error(transparent)]
    Managed(#[from] ManagedError),
    #[error("reloading {runtime}: {source}")]
    Reload {
        runtime: String,
        #[source]
        source: CommandError,
    },
    #[error("{0}")]
    ReloadMode(String),
}
