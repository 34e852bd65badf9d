//! What `gpu-agent run` was asked for ([`Options`]) and why it could not run
//! ([`SupervisorError`]).

use std::path::PathBuf;

use hostlib::HostRoot;

use crate::caps::HeldCaps;
use crate::policy::Policy;
use crate::source::NodeView;
use crate::state;

/// What `gpu-agent run` was asked for.
#[derive(Debug)]
pub struct Options {
    pub host: HostRoot,
    /// The policy file (in this process's filesystem: a ConfigMap volume in
    /// a DaemonSet), read again when it changes; `None`: the defaults.
    pub policy_path: Option<PathBuf>,
    pub policy: Policy,
    pub view: NodeView,
    pub caps: HeldCaps,
    /// Stamp the state file every this many seconds (0: never).
    pub heartbeat: u64,
    /// Run the stages once and exit.
    pub once: bool,
    /// Report to the cluster controller (`None`: the agent works alone).
    pub report: Option<crate::report::ReportConfig>,
}

/// The agent could not run.
#[derive(Debug, thiserror::Error)]
pub enum SupervisorError {
    #[error(transparent)]
    Lock(#[from] state::LockError),
    #[error("cannot start the async runtime: {0}")]
    Runtime(#[source] std::io::Error),
    #[error("cannot handle signals: {0}")]
    Signals(#[source] std::io::Error),
}
