//! When each supervised task started, why it ended, and its restart with
//! backoff ([`TaskControl`]).

use super::core::Supervisor;
use super::mps;
use super::tasks::{FIRST_BACKOFF, KERNEL_LOG, MAX_BACKOFF, METRICS, REPORT, STABLE_AFTER};
use crate::stages::{Stage, StageState};
use crate::state;
use tokio::time::Instant;

impl Supervisor {
    pub(super) fn task_started(&mut self, name: &'static str) {
        let t = self.tasks.entry(name).or_default();
        t.started = Some(Instant::now());
        t.restart_at = None;
    }

    /// A task stopped on its own: logged, shown, started again with backoff.
    pub(super) fn task_ended(&mut self, name: &'static str, outcome: Result<(), String>) {
        let t = self.tasks.entry(name).or_default();
        let error = match outcome {
            Ok(()) => "stopped on its own".to_string(),
            Err(e) => e,
        };
        let stable = t.started.is_some_and(|s| s.elapsed() >= STABLE_AFTER);
        let backoff = match (t.backoff, stable) {
            (Some(b), false) => (b * 2).min(MAX_BACKOFF),
            _ => FIRST_BACKOFF,
        };
        t.backoff = Some(backoff);
        t.restart_at = Some(Instant::now() + backoff);
        t.restart_unix = Some(state::now() + backoff.as_secs());
        t.last_error = Some(error.clone());
        t.started = None;
        tracing::error!(task = name, error = %error, restart_in = ?backoff, "task failed; starting it again");
        if name == METRICS
            && let Some(s) = self
                .st
                .stages
                .iter_mut()
                .find(|s| s.stage == Stage::Metrics)
        {
            s.state = StageState::Failed;
            s.detail = format!("the metrics exporter stopped ({error}); restarting in {backoff:?}");
        }
        if name == super::dra::TASK {
            self.dra = None;
        }
        if name == "plugin" {
            self.plugin = None;
            if let Some(s) = self.st.stages.iter_mut().find(|s| s.stage == Stage::Plugin) {
                s.state = StageState::Failed;
                s.detail =
                    format!("the device plugin stopped ({error}); restarting in {backoff:?}");
                s.validation = None;
            }
        }
    }

    pub(super) fn restart_due_tasks(&mut self) {
        let now = Instant::now();
        let due: Vec<&'static str> = self
            .tasks
            .iter()
            .filter(|(_, t)| t.restart_at.is_some_and(|at| at <= now))
            .map(|(n, _)| *n)
            .collect();
        for name in due {
            if let Some(t) = self.tasks.get_mut(name) {
                t.restart_at = None;
                t.restarts += 1;
            }
            tracing::info!(task = name, "starting the task again");
            match name {
                "plugin" => self.start_plugin(),
                KERNEL_LOG => self.start_kernel_log(),
                METRICS => self.start_metrics(),
                REPORT => self.start_report(),
                mps::TASK => self.restart_mps(),
                super::dra::TASK => self.start_dra(),
                _ => {}
            }
        }
    }
}
