//! Where the node's claims live (CDI directory, the node's spec, the state
//! directory) and how long prepare waits for an allocation: the parameters.

use std::time::Duration;

/// Where the node's claims live, and how long prepare waits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Options {
    /// The node's name: the pool every allocated device must be in.
    pub node_name: String,
    /// Where the claims' transient specs are written (a host path).
    pub cdi_dir: String,
    /// The node's own CDI spec that gpu-agent's cdi stage writes (a host path).
    pub node_spec: String,
    /// Where the checkpoint is kept (a host path).
    pub state_dir: String,
    /// How long prepare waits for a claim's allocation from the controller
    /// (the kubelet gives each call 45 s).
    pub allocation_wait: Duration,
}

/// `/var/run/cdi`, where the cdi stage writes by default.
pub const DEFAULT_CDI_DIR: &str = "/var/run/cdi";
/// The checkpoint's default directory.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/gpu-agent/dra";
/// Prepare's default wait for an allocation: within the kubelet's 45 s.
pub const DEFAULT_ALLOCATION_WAIT: Duration = Duration::from_secs(40);

impl Options {
    /// The defaults, for node `node_name`.
    pub fn new(node_name: impl Into<String>) -> Self {
        Options {
            node_name: node_name.into(),
            cdi_dir: DEFAULT_CDI_DIR.into(),
            node_spec: format!("{DEFAULT_CDI_DIR}/{}", super::cdi::NODE_SPEC_FILE),
            state_dir: DEFAULT_STATE_DIR.into(),
            allocation_wait: DEFAULT_ALLOCATION_WAIT,
        }
    }
}
