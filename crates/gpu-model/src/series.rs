//! The agent's own series (`gpu_agent_…`): what the supervisor, the stages,
//! the device plugin and health record as they go, read by the exporter at
//! each scrape. Recording is a lock and a map update: nothing runs for it.

use std::collections::BTreeMap;
use std::sync::{LazyLock, Mutex};
use std::time::Duration;

/// What the exporter shows about the agent itself.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AgentSeries {
    /// Stage → its state's label (`done`, `failed`, ...).
    pub stages: Vec<(String, String)>,
    /// Stage → repairs since start.
    pub repairs: Vec<(String, u64)>,
    /// Resource → registrations with the kubelet.
    pub registrations: Vec<(String, u64)>,
    /// Resource → containers given devices.
    pub allocations: BTreeMap<String, u64>,
    /// XID → health events.
    pub xid_events: BTreeMap<u64, u64>,
    /// GPU UUID → its last XID.
    pub last_xid: BTreeMap<String, u64>,
    /// Passes (first and reconciles) and the last one's duration.
    pub passes: u64,
    pub last_pass_seconds: Option<f64>,
    /// The last validation's duration.
    pub last_validation_seconds: Option<f64>,
}

static SERIES: LazyLock<Mutex<AgentSeries>> = LazyLock::new(Mutex::default);

fn with(f: impl FnOnce(&mut AgentSeries)) {
    f(&mut SERIES.lock().unwrap_or_else(|p| p.into_inner()));
}

/// A copy of the series now.
pub fn snapshot() -> AgentSeries {
    SERIES.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

/// A pass of the stages took `d`.
pub fn pass_took(d: Duration) {
    with(|s| {
        s.passes += 1;
        s.last_pass_seconds = Some(d.as_secs_f64());
    });
}

/// The validate stage took `d`.
pub fn validation_took(d: Duration) {
    with(|s| s.last_validation_seconds = Some(d.as_secs_f64()));
}

/// GPU `uuid` raised XID `xid` (one event, after deduplication).
pub fn xid(uuid: &str, xid: u64) {
    with(|s| {
        *s.xid_events.entry(xid).or_default() += 1;
        s.last_xid.insert(uuid.to_string(), xid);
    });
}

/// A container was given devices of `resource`.
pub fn allocated(resource: &str) {
    with(|s| *s.allocations.entry(resource.to_string()).or_default() += 1);
}

/// Stage states (stage → state label), repairs (stage → count) and
/// registrations (resource → count), as the agent's state has them now.
pub fn set_status(
    stages: Vec<(String, String)>,
    repairs: Vec<(String, u64)>,
    registrations: Vec<(String, u64)>,
) {
    with(|s| {
        s.stages = stages;
        s.repairs = repairs;
        s.registrations = registrations;
    });
}
