//! The running agent (`gpu-agent run`): one supervisor that runs the stages,
//! then keeps reconciling — every `spec.reconcileIntervalSeconds`, when the
//! policy file changes (inotify; a ConfigMap's `..data` swap included), on
//! SIGHUP — and runs the long-lived front ends as tasks: the device plugin
//! and the health monitor (NVML events, the kernel log). One inventory is
//! published on a watch channel; the front ends subscribe to it, none
//! re-discovers. A task that fails is logged, shown in `status` and started
//! again with backoff; the others go on. SIGTERM/SIGINT: every task stops,
//! sockets are removed, the state is written.
//!
//! Passes run on the thread that called [`run`]; the tasks run on one
//! runtime worker, so the device plugin serves while a pass runs.

mod controller;
mod core;
mod dra;
pub mod dra_mps;
mod dra_task;
pub mod dra_timeslice;
mod exporter;
mod health;
mod health_task;
mod mig_change;
mod mps;
#[cfg(test)]
mod mps_fake;
mod mps_task;
pub mod notify;
mod options;
mod plugin;
mod plugin_task;
mod policy_watch;
mod readiness;
mod reconcile;
mod reload;
mod report;
mod restarts;
mod run_loop;
mod tasks;
mod workload_check;

pub use health::RunningHealth;
pub use options::{Options, SupervisorError};
pub use plugin::RunningPlugin;
pub use readiness::{DRIVER_READY, PLUGIN_READY, TOOLKIT_READY, VALIDATIONS_DIR};
pub use reconcile::same_node;
pub use run_loop::run;

/// One supervised task, for `status` (the state file's type).
pub use crate::state::TaskStatus;
