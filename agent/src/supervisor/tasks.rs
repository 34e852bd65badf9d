//! The supervised tasks' bookkeeping: when each started, why it ended, and
//! its restart with backoff.

use std::time::Duration;

use tokio::time::Instant;

/// The first restart of a failed task comes after this; each failure in a
/// row doubles it, up to [`MAX_BACKOFF`].
pub(super) const FIRST_BACKOFF: Duration = Duration::from_secs(1);

pub(super) const MAX_BACKOFF: Duration = Duration::from_secs(300);

/// A task that ran this long without failing starts its backoff afresh.
pub(super) const STABLE_AFTER: Duration = Duration::from_secs(600);

/// The kernel-log reader's task name in `status`.
pub(super) const KERNEL_LOG: &str = "kernel-log";

/// The metrics exporter's task name.
pub(super) const METRICS: &str = "metrics";

/// The report stream's task name.
pub(super) const REPORT: &str = "report";

#[derive(Default)]
pub(super) struct TaskControl {
    pub(super) restarts: u32,
    pub(super) backoff: Option<Duration>,
    pub(super) started: Option<Instant>,
    pub(super) restart_at: Option<Instant>,
    /// The same, in Unix seconds, for `status` (fixed when the restart is
    /// planned: the state file does not change while the task waits).
    pub(super) restart_unix: Option<u64>,
    pub(super) last_error: Option<String>,
}
