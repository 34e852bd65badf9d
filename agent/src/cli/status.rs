//! `gpu-agent status`: the running agent's report, or an inspection of the
//! host when none answers, and `status --ready`.

use std::process::ExitCode;

use gpu_agent::caps::HeldCaps;
use gpu_agent::plugin::manager::ResourceStatus;
use gpu_agent::policy::Policy;
use gpu_agent::source::NodeView;
use gpu_agent::stages::{self, Context, StageStatus};
use gpu_agent::state::{self, AgentState, Liveness};
use gpu_agent::{Inventory, render};
use hostlib::HostRoot;
use serde::Serialize;

use super::args::{Cli, Output};
use super::{Failure, host_root, load_policy, node_view, print_json};

/// Exit code of `status` when no running agent answered (none, stopped,
/// crashed, starting or hung): what it printed is an inspection of the
/// host. LSB's "program is not running", as `systemctl status` exits for a
/// unit that is not active.
const EXIT_NOT_RUNNING: u8 = 3;

/// The pass context of this process: `apply` changes the host (`run`),
/// without it stages only look (`status`).
fn context<'a>(
    policy: &'a Policy,
    caps: &'a HeldCaps,
    view: &'a NodeView,
    host: &'a HostRoot,
    apply: bool,
) -> Context<'a> {
    Context {
        policy,
        caps,
        sys: &view.sys,
        backend: view.backend.as_ref(),
        host,
        apply: apply
            .then_some(&hostlib::command::SystemRunner as &dyn hostlib::command::CommandRunner),
        syscalls: &hostlib::LinuxSyscalls,
        simulated: view.simulated.is_some(),
        drain: None,
        serve_first: false,
        changes: Default::default(),
        mig_hold: None,
        upgrade: Default::default(),
        logged: None,
    }
}

/// What `status` shows, in either output form.
#[derive(Debug, Serialize)]
pub(crate) struct StatusReport {
    /// `running-agent` or `host-inspection`.
    source: &'static str,
    /// Why the host was inspected, or which agent answered.
    note: String,
    held_caps: Vec<String>,
    /// Held capabilities with their reasons, what was dropped (running agent only).
    #[serde(skip_serializing_if = "Option::is_none")]
    privileges: Option<gpu_agent::caps::Privileges>,
    stages: Vec<StageStatus>,
    inventory: Option<Inventory>,
    /// The device plugin's resources (running agent only).
    plugin: Vec<ResourceStatus>,
    /// Every enabled stage validated (running agent only).
    #[serde(skip_serializing_if = "Option::is_none")]
    ready: Option<bool>,
    /// Running agent only.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    health: Vec<gpu_agent::health::GpuHealth>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tasks: Vec<gpu_agent::supervisor::TaskStatus>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reconcile_interval_secs: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    policy_error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    mig: Option<gpu_agent::mig::MigStatus>,
    /// The report stream to gpu-controller (running agent only; none when
    /// the agent works on its own).
    #[serde(skip_serializing_if = "Option::is_none")]
    controller: Option<gpu_agent::report::ControllerLink>,
    /// The running policy is the cluster's ClusterPolicy, less these keys.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    policy_from_cluster: bool,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    policy_ignored: Vec<String>,
    /// The DRA kubelet plugin (running agent with `spec.dra.enabled` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    dra: Option<gpu_agent::state::DraStatus>,
}

impl StatusReport {
    /// The report of a running agent, from its state file.
    pub(crate) fn from_agent(st: AgentState, age_secs: u64) -> Self {
        StatusReport {
            source: "running-agent",
            note: format!(
                "from the running agent (pid {}, version {}, updated {age_secs} s ago{})",
                st.pid,
                st.version,
                st.simulated
                    .as_deref()
                    .map(|s| format!(", simulating {s}"))
                    .unwrap_or_default()
            ),
            held_caps: st.held_caps,
            privileges: st.privileges,
            stages: st.stages,
            inventory: st.inventory,
            plugin: st.plugin,
            ready: Some(st.ready),
            health: st.health,
            tasks: st.tasks,
            reconcile_interval_secs: Some(st.reconcile_interval_secs),
            policy_error: st.policy_error,
            mig: st.mig,
            controller: st.controller,
            policy_from_cluster: st.policy_from_cluster,
            policy_ignored: st.policy_ignored,
            dra: st.dra,
        }
    }
}

/// `status --ready`: the running agent's own word, one line.
pub(crate) fn status_ready(cli: &Cli) -> Result<ExitCode, Failure> {
    let host = host_root(cli)?;
    let not = |why: String| {
        println!("not ready: {why}");
        Ok(ExitCode::from(1))
    };
    let st = match AgentState::read(&host) {
        Ok(Some(st)) => st,
        Ok(None) => {
            return not(format!(
                "no running agent ({} does not exist)",
                host.resolve(state::STATE_FILE)?.display()
            ));
        }
        Err(e) => return not(e.to_string()),
    };
    match st.liveness(state::now(), state::agent_running(&host)) {
        Liveness::Live { .. } => {}
        Liveness::Starting { pid } => return not(format!("the agent (pid {pid}) is starting")),
        Liveness::Hung { age_secs } => {
            return not(format!(
                "the agent (pid {}) has not stamped its state for {age_secs} s: it hangs",
                st.pid
            ));
        }
        Liveness::Stale { .. } | Liveness::Stopped { .. } => {
            return not(format!("the agent (pid {}) is not running", st.pid));
        }
    }
    let line = gpu_agent::supervisor::notify::status_line(&st);
    println!("{line}");
    Ok(if st.ready {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

pub(crate) fn status(cli: &Cli, output: Output) -> Result<ExitCode, Failure> {
    let host = host_root(cli)?;
    let now = state::now();
    let note = match AgentState::read(&host) {
        Ok(Some(st)) => match st.liveness(now, state::agent_running(&host)) {
            Liveness::Starting { pid } => format!(
                "an agent (pid {pid}) is starting and has not written its state yet; inspecting the host"
            ),
            Liveness::Live { age_secs } => {
                return print_status(&StatusReport::from_agent(st, age_secs), output);
            }
            Liveness::Hung { age_secs } => format!(
                "the agent (pid {}) holds its lock but has not stamped its state for {age_secs} s (heartbeat {} s): it hangs; inspecting the host",
                st.pid, st.heartbeat_secs
            ),
            Liveness::Stale { age_secs } => format!(
                "the agent (pid {}) is not running and did not say it stopped (killed or crashed; state {age_secs} s old); inspecting the host",
                st.pid
            ),
            Liveness::Stopped { age_secs } => {
                format!(
                    "the agent (pid {}) stopped {age_secs} s ago; inspecting the host",
                    st.pid
                )
            }
        },
        Ok(None) => format!(
            "no running agent ({} does not exist); inspecting the host",
            host.resolve(state::STATE_FILE)?.display()
        ),
        Err(e) => format!("{e}; inspecting the host"),
    };
    let policy = load_policy(cli.policy.as_deref())?;
    let caps = HeldCaps::read();
    let view = node_view(cli, &host)?;
    // Inspecting: stages plan but change nothing (`apply: None`).
    let pass = stages::run_pass(&context(&policy, &caps, &view, &host, false));
    let report = StatusReport {
        source: "host-inspection",
        note,
        held_caps: caps.names(),
        privileges: None,
        stages: pass.stages,
        inventory: pass.inventory,
        plugin: Vec::new(),
        ready: None,
        health: Vec::new(),
        tasks: Vec::new(),
        reconcile_interval_secs: None,
        policy_error: None,
        mig: pass.mig,
        controller: None,
        policy_from_cluster: false,
        policy_ignored: Vec::new(),
        dra: None,
    };
    print_status(&report, output)
}

/// Prints the report; exits 0 when it is the running agent's, 3 when no
/// running agent answered and the host was inspected instead.
fn print_status(report: &StatusReport, output: Output) -> Result<ExitCode, Failure> {
    match output {
        Output::Json => print_json(report)?,
        Output::Table => print!("{}", status_text(report)),
    }
    Ok(if report.source == "running-agent" {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(EXIT_NOT_RUNNING)
    })
}

pub(crate) fn status_text(report: &StatusReport) -> String {
    let mut out = format!("gpu-agent status: {}\n", report.note);
    if let Some(inv) = &report.inventory {
        out.push_str(&format!(
            "node: {} · {} GPU(s){}\n",
            render::node_line(inv),
            inv.gpus.len(),
            if inv.gpus.is_empty() {
                String::new()
            } else {
                format!(": {}", inv.models_summary())
            }
        ));
    }
    if let Some(ready) = report.ready {
        let reconcile = match report.reconcile_interval_secs {
            Some(0) | None => "reconciles on policy changes and SIGHUP".to_string(),
            Some(s) => format!("reconciles every {s} s, on policy changes and SIGHUP"),
        };
        out.push_str(&format!(
            "ready: {} · {reconcile}\n",
            if ready {
                "yes (every enabled stage validated)"
            } else {
                "no (not every enabled stage is validated)"
            }
        ));
    }
    if report.policy_from_cluster {
        out.push_str("policy: the cluster's ClusterPolicy, from gpu-controller (the policy file is not used)\n");
        if !report.policy_ignored.is_empty() {
            out.push_str(&format!(
                "policy: ClusterPolicy keys gpu-agent does not use (left out): {}\n",
                report.policy_ignored.join(", ")
            ));
        }
    }
    if let Some(e) = &report.policy_error {
        out.push_str(&format!("policy: not applied: {e}\n"));
    }
    match (&report.controller, report.ready) {
        (Some(link), _) => {
            out.push_str(&format!("controller: {}\n", link.summary()));
            if let Some(d) = &link.desired {
                out.push_str(&format!("controller asks: {d}\n"));
            }
        }
        (None, Some(_)) => out.push_str(
            "controller: none configured; the agent works on its own (`run --controller URL` reports to gpu-controller)\n",
        ),
        (None, None) => {}
    }
    if let Some(m) = &report.mig {
        out.push_str(&format!(
            "mig: layout {:?}: {} ({})\n",
            m.layout,
            m.state.as_str(),
            m.detail
        ));
    }
    out.push('\n');
    out.push_str(&render::stages(&report.stages));
    if !report.plugin.is_empty() {
        out.push('\n');
        out.push_str(&render::plugin_resources(&report.plugin));
    }
    if let Some(d) = &report.dra {
        out.push('\n');
        out.push_str(&render::dra(d));
    }
    if let Some(p) = &report.privileges {
        out.push('\n');
        out.push_str(&render::privileges(p));
    }
    if report.health.iter().any(|g| !g.healthy || g.events > 0) {
        out.push('\n');
        out.push_str(&render::health(&report.health, report.inventory.as_ref()));
    }
    if !report.tasks.is_empty() {
        out.push('\n');
        out.push_str(&render::tasks(&report.tasks));
    }
    if let Some(inv) = &report.inventory {
        for w in &inv.warnings {
            out.push_str(&format!("warning: {w}\n"));
        }
    }
    out
}
