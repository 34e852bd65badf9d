//! What systemd hears from the running agent (`Type=notify`): READY=1 once
//! the host is ready, STATUS= with one line that changes as the stages do,
//! RELOADING=1 around a SIGHUP, STOPPING=1, and watchdog pings from the
//! supervisor's main loop. Outside systemd (no `NOTIFY_SOCKET`) every call
//! is a no-op, and without `WatchdogSec=` nothing is pinged: an idle agent
//! still does nothing.

use std::time::Duration;

use sd_notify::NotifyState;

use crate::stages::{self, Stage, StageState, StageStatus};
use crate::state::AgentState;

/// The longest STATUS= line we send (systemctl shows it on one line).
const STATUS_MAX: usize = 200;

/// The service manager's side of the agent.
#[derive(Debug, Default)]
pub struct Systemd {
    ready_sent: bool,
    status: String,
    watchdog: Option<Duration>,
    /// systemd gave us a `NOTIFY_SOCKET`: there is someone to tell.
    listening: bool,
}

impl Systemd {
    /// Reads `NOTIFY_SOCKET` and `WATCHDOG_USEC` (set by systemd for a
    /// `Type=notify` unit, the latter when it has `WatchdogSec=`).
    pub fn from_env() -> Self {
        Systemd {
            watchdog: sd_notify::watchdog_enabled(),
            listening: std::env::var_os("NOTIFY_SOCKET").is_some_and(|s| !s.is_empty()),
            ..Systemd::default()
        }
    }

    /// How often the main loop pings: half the watchdog's timeout, as
    /// sd_watchdog_enabled(3) advises; `None` when there is no watchdog.
    pub fn ping_every(&self) -> Option<Duration> {
        self.watchdog
            .map(|d| (d / 2).max(Duration::from_millis(100)))
    }

    pub fn ping(&self) {
        send(&[NotifyState::Watchdog]);
    }

    /// Tells systemd what the state now says: READY=1 the first time the
    /// host is ready (and again after a reload), STATUS= when the line changed.
    pub fn update(&mut self, st: &AgentState) {
        let line = status_line(st);
        let ready_now = !self.ready_sent && stages::host_ready(&st.stages);
        if !ready_now && line == self.status {
            return;
        }
        let mut msg = vec![NotifyState::Status(&line)];
        if ready_now {
            msg.push(NotifyState::Ready);
        }
        // Said only where systemd listens and heard it (outside systemd
        // there is nobody to tell).
        if send(&msg) && ready_now && self.listening {
            tracing::info!(status = %line, "told systemd the agent is ready");
        }
        self.ready_sent |= ready_now;
        self.status = line;
    }

    /// A SIGHUP's reconcile begins; [`Systemd::update`] sends READY=1 again
    /// when it is done and the host is ready.
    pub fn reloading(&mut self) {
        send(&[NotifyState::Reloading, NotifyState::Status("reloading")]);
        self.ready_sent = false;
        self.status.clear();
    }

    pub fn stopping(&self) {
        send(&[NotifyState::Stopping, NotifyState::Status("stopping")]);
    }
}

/// Sends `msg` to systemd (nothing without `NOTIFY_SOCKET`); false when
/// it could not be sent.
fn send(msg: &[NotifyState<'_>]) -> bool {
    match sd_notify::notify(msg) {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(error = %e, "cannot notify systemd (NOTIFY_SOCKET)");
            false
        }
    }
}

/// One line for `systemctl status`: ready, or the first stage that holds
/// the agent back and why.
pub fn status_line(st: &AgentState) -> String {
    let gpus = match &st.inventory {
        Some(inv) if inv.gpus.is_empty() => "no GPUs".to_string(),
        Some(inv) => format!("{} GPU(s): {}", inv.gpus.len(), inv.models_summary()),
        None => "GPUs not discovered".to_string(),
    };
    let line = if st.ready {
        format!("ready: {gpus}; every enabled stage validated")
    } else if let Some(s) = st
        .stages
        .iter()
        .find(|s| !stages::ready(std::slice::from_ref(s)))
    {
        let head = if stages::host_ready(&st.stages) {
            format!("host ready ({gpus}); waiting for")
        } else {
            "not ready:".to_string()
        };
        format!("{head} {}: {}", s.stage.name(), why(s))
    } else {
        format!("host ready ({gpus}); waiting for the workload check")
    };
    shorten(line)
}

fn why(s: &StageStatus) -> &str {
    match (&s.validation, s.state) {
        (Some(v), StageState::Done) if !v.ok => &v.detail,
        (None, StageState::Done) if s.stage != Stage::Discover => "not validated yet",
        _ if s.detail.is_empty() => s.state.label(),
        _ => &s.detail,
    }
}

fn shorten(mut line: String) -> String {
    if line.len() > STATUS_MAX {
        let mut cut = STATUS_MAX - 1;
        while !line.is_char_boundary(cut) {
            cut -= 1;
        }
        line.truncate(cut);
        line.push('…');
    }
    line.replace('\n', " ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stages::Validation;

    fn stage(stage: Stage, state: StageState, ok: Option<bool>, detail: &str) -> StageStatus {
        StageStatus {
            stage,
            state,
            detail: detail.into(),
            needs: Vec::new(),
            missing: Vec::new(),
            changed: Vec::new(),
            repairs: 0,
            last_repair: None,
            validation: ok.map(|ok| Validation {
                ok,
                detail: format!("validation of {}", stage.name()),
                since: 0,
            }),
        }
    }

    fn state(stages: Vec<StageStatus>) -> AgentState {
        let mut st = AgentState::new(
            &hostlib::HostRoot::new(std::env::temp_dir()).unwrap(),
            0,
            Vec::new(),
        );
        st.ready = stages::ready(&stages);
        st.stages = stages;
        st
    }

    #[test]
    fn the_line_names_the_stage_that_holds_the_agent_back() {
        let st = state(vec![
            stage(Stage::Discover, StageState::Done, None, "1 GPU"),
            stage(
                Stage::Runtime,
                StageState::Failed,
                None,
                "/etc/containerd/config.toml: line 3: bad TOML",
            ),
            stage(Stage::Plugin, StageState::Done, Some(false), ""),
        ]);
        assert_eq!(
            status_line(&st),
            "not ready: runtime: /etc/containerd/config.toml: line 3: bad TOML"
        );
        assert!(!stages::host_ready(&st.stages));
    }

    #[test]
    fn the_kubelet_does_not_hold_back_the_host() {
        let st = state(vec![
            stage(Stage::Discover, StageState::Done, None, "1 GPU"),
            stage(Stage::Runtime, StageState::Done, Some(true), ""),
            stage(Stage::Plugin, StageState::Done, Some(false), ""),
        ]);
        assert!(stages::host_ready(&st.stages));
        assert!(!st.ready);
        assert_eq!(
            status_line(&st),
            "host ready (GPUs not discovered); waiting for plugin: validation of plugin"
        );
    }

    #[test]
    fn ready_says_so_and_long_lines_are_cut() {
        let st = state(vec![
            stage(Stage::Discover, StageState::Done, None, "1 GPU"),
            stage(Stage::Plugin, StageState::Done, Some(true), ""),
        ]);
        assert_eq!(
            status_line(&st),
            "ready: GPUs not discovered; every enabled stage validated"
        );
        let long = shorten("é".repeat(300));
        assert!(long.len() <= STATUS_MAX + '…'.len_utf8(), "{}", long.len());
        assert!(long.ends_with('…'));
    }

    #[test]
    fn outside_systemd_nothing_is_sent_and_nothing_pings() {
        // No NOTIFY_SOCKET / WATCHDOG_USEC in the test's environment.
        let mut sd = Systemd::from_env();
        assert_eq!(sd.ping_every(), None);
        sd.update(&state(Vec::new()));
        assert!(sd.ready_sent);
    }
}
