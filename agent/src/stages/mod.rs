//! The agent's ordered stages (ARCHITECTURE.md, "The data's way through one
//! node"). Each stage says what it needs (capabilities, earlier stages) and
//! whether the policy turns it on. A stage that is not built yet reports
//! `not implemented`, never `done`.

mod cdi;
mod context;
mod devnodes;
mod discover;
mod driver;
mod health;
mod labels;
mod metrics;
mod mig;
mod pass;
mod plugin;
mod runtime;
mod stage;
mod status;
mod validate;

pub use context::{ChangeLog, Context, GpuSaid, LogMemory};
pub use health::apply_health_status;
pub use pass::{AFTER_REGISTRATION, BEFORE_ALLOCATION, DEFERRED_DETAIL, run_deferred, run_pass};
pub use plugin::apply_plugin_status;
pub use stage::Stage;
pub use status::{Pass, PluginPlan, Repair, StageState, StageStatus, Validation};
pub use validate::{driver_ready_text, host_ready, plugin_validation, ready, revalidate};

#[cfg(test)]
mod tests;
