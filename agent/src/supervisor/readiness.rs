//! What the agent says of itself: the tasks' live status copied into the
//! state, readiness, the state file and the agent's own series, and the GPU
//! Operator's validation files.

use hostlib::HostRoot;

use super::core::Supervisor;
use crate::stages::{self, Stage, StageState, Validation};
use crate::state::{AgentState, TaskStatus};

impl Supervisor {
    /// Copies the tasks' live status into the state.
    pub(super) fn refresh(&mut self) {
        if let Some(p) = &self.plugin {
            self.st.plugin = p.board.lock().unwrap().clone();
            for r in &mut self.st.plugin {
                r.registrations += self
                    .registrations_before
                    .get(&r.resource)
                    .copied()
                    .unwrap_or(0);
            }
            stages::apply_plugin_status(&mut self.st.stages, &self.st.plugin);
            let v = stages::plugin_validation(&self.st.plugin);
            if let Some(s) = self.st.stages.iter_mut().find(|s| s.stage == Stage::Plugin) {
                s.validation = keep_since(s.validation.take(), Some(v));
            }
        }
        if let Some(h) = &self.health {
            self.st.health = h.board.lock().unwrap().clone();
            stages::apply_health_status(&mut self.st.stages, &self.st.health);
        }
        self.refresh_pod_labels();
        self.refresh_dra();
        let tasks: Vec<TaskStatus> = self
            .tasks
            .iter()
            .map(|(name, t)| TaskStatus {
                name: name.to_string(),
                running: t.started.is_some(),
                restarts: t.restarts,
                last_error: t.last_error.clone(),
                restart_at: t.restart_at.and(t.restart_unix),
            })
            .collect();
        self.st.tasks = tasks;
        let workload_ok = !(self.opts.policy.validator.enabled
            && self.opts.policy.validator.workload)
            || self.st.workload.as_ref().is_some_and(|w| w.ok);
        self.st.ready = stages::ready(&self.st.stages) && workload_ok;
        let plugin_ok = self
            .st
            .stages
            .iter()
            .find(|s| s.stage == Stage::Plugin)
            .and_then(|s| s.validation.as_ref())
            .is_some_and(|v| v.ok);
        validation_file(&self.opts.host, PLUGIN_READY, plugin_ok.then_some(""));
    }

    /// Writes (or removes) the operator's validation files for the stages
    /// validated so far.
    pub(super) fn validation_files(&self) {
        let state = |stage: Stage| self.st.stages.iter().find(|s| s.stage == stage);
        // Validated: on, and its check passed.
        let checked = |stage: Stage| {
            state(stage).is_some_and(|s| {
                s.state != StageState::Disabled && s.validation.as_ref().is_some_and(|v| v.ok)
            })
        };
        let ok = |stage: Stage| {
            checked(stage) || state(stage).is_some_and(|s| s.state == StageState::Disabled)
        };
        // A file says something was validated: never when every stage it
        // stands for is off.
        let driver_ok = ok(Stage::Driver)
            && ok(Stage::Devnodes)
            && (checked(Stage::Driver) || checked(Stage::Devnodes));
        let driver_text = stages::driver_ready_text(&self.opts.host, &self.opts.policy);
        validation_file(
            &self.opts.host,
            DRIVER_READY,
            driver_ok.then_some(driver_text.as_str()),
        );
        // With the workload check asked for, the toolkit is ready when a
        // container got its GPU (as the operator's toolkit validation means).
        let workload_asked =
            self.opts.policy.validator.enabled && self.opts.policy.validator.workload;
        let workload_passed = self.st.workload.as_ref().is_some_and(|w| w.ok);
        let workload_ok = !workload_asked || workload_passed;
        let toolkit_ok = ok(Stage::Runtime)
            && ok(Stage::Cdi)
            && workload_ok
            && (checked(Stage::Runtime) || checked(Stage::Cdi) || workload_passed);
        validation_file(&self.opts.host, TOOLKIT_READY, toolkit_ok.then_some(""));
    }

    pub(super) fn sync_state(&mut self) {
        if self.st.stopped_at.is_none() {
            self.systemd.update(&self.st);
        }
        self.publish_report();
        record_series(&self.st);
        if let Err(e) = self.file.sync(&mut self.st, &self.opts.host) {
            tracing::warn!(error = %e, "cannot write the state file; `gpu-agent status` will not see this agent");
        }
    }
}

/// Stage states, repairs and registrations into the agent's own series
/// (`gpu_agent_…`), from the agent's state.
fn record_series(st: &AgentState) {
    crate::metrics::agent::set_status(
        st.stages
            .iter()
            .map(|x| (x.stage.name().to_string(), x.state.label().to_string()))
            .collect(),
        st.stages
            .iter()
            .map(|x| (x.stage.name().to_string(), x.repairs))
            .collect(),
        st.plugin
            .iter()
            .map(|r| (r.resource.clone(), r.registrations))
            .collect(),
    );
}

/// The GPU Operator's validation directory, and the files gpu-agent keeps there.
pub const VALIDATIONS_DIR: &str = "/run/nvidia/validations";
pub const DRIVER_READY: &str = "driver-ready";
pub const TOOLKIT_READY: &str = "toolkit-ready";
pub const PLUGIN_READY: &str = "plugin-ready";

/// Writes `content` to the validation file `name` when it differs, or
/// removes the file (`None`).
pub(super) fn validation_file(host: &HostRoot, name: &str, content: Option<&str>) {
    let path = format!("{VALIDATIONS_DIR}/{name}");
    let result = match content {
        Some(text) => match host.read_optional(&path) {
            Ok(Some(old)) if old == text => Ok(()),
            _ => host
                .write_atomic(&path, text.as_bytes(), 0o644)
                .map(|_| tracing::info!(stage = "validate", file = %path, "written")),
        },
        None => host
            .resolve_no_follow(&path)
            .and_then(|p| match std::fs::remove_file(&p) {
                Ok(()) => {
                    tracing::info!(stage = "validate", file = %path, "removed");
                    Ok(())
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(hostlib::HostError::io(p, e)),
            }),
    };
    if let Err(e) = result {
        tracing::warn!(stage = "validate", file = %path, error = %e, "cannot update the validation file");
    }
}

/// A validation result keeps its `since` while it says the same.
pub(super) fn keep_since(old: Option<Validation>, new: Option<Validation>) -> Option<Validation> {
    match (old, new) {
        (Some(o), Some(mut n)) if o.ok == n.ok && o.detail == n.detail => {
            n.since = o.since;
            Some(n)
        }
        (_, n) => n,
    }
}
