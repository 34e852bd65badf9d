//! What health tells the rest of the agent: the unhealthy GPUs (the device
//! plugin's view) and each event that was not ignored (the report's).

use std::collections::BTreeMap;

/// What the device plugin needs: the unhealthy GPUs (UUID → why). A GPU
/// not named is healthy.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HealthView {
    pub unhealthy: BTreeMap<String, String>,
}

impl HealthView {
    pub fn healthy(&self, uuid: &str) -> bool {
        !self.unhealthy.contains_key(uuid)
    }
}

/// A health event that was not ignored, as the report to the controller
/// tells it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventRecord {
    pub uuid: String,
    pub xid: Option<u64>,
    /// What happened, in words.
    pub reason: String,
    /// The XID catalogue's advice, if any.
    pub advice: Option<String>,
    /// Whether it made the GPU unhealthy (else it was only logged).
    pub unhealthy: bool,
    /// Unix milliseconds.
    pub at_unix_ms: u64,
}
