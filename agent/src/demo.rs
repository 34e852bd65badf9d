//! `gpu-agent demo`: a simulated node in a sandbox host root, the agent's
//! stages run over it, and what came of it. Nothing outside a temp dir changes.

use std::io::Write;
use std::time::Instant;

use anyhow::Context as _;
use gpu_agent::backend::sim::SimulatedBackend;
use gpu_agent::caps::HeldCaps;
use gpu_agent::policy::Policy;
use gpu_agent::render;
use gpu_agent::stages::{self, Context, StageState};
use gpu_agent::state::{self, AgentState};
use hostlib::HostRoot;
use simnode::NodeDescription;

use crate::{StatusReport, status_text};

pub fn run(node: &str, keep: bool, out: &mut dyn Write) -> anyhow::Result<()> {
    let t0 = Instant::now();
    let desc = NodeDescription::load(node)?;
    let sandbox = tempfile::Builder::new()
        .prefix("gpu-agent-demo-")
        .tempdir()
        .context("cannot make the sandbox directory")?;
    let host = HostRoot::new(sandbox.path())?;
    writeln!(
        out,
        "gpu-agent demo: a simulated \"{}\" node in a sandbox\n",
        desc.name
    )?;
    writeln!(out, "1. Sandbox host root: {}", host.path().display())?;
    desc.materialize(host.path()).with_context(|| {
        format!(
            "cannot write the simulated node under {}",
            host.path().display()
        )
    })?;
    writeln!(
        out,
        "2. Wrote what the node's kernel would show: /sys/bus/pci/devices ({} GPU(s), {} NVSwitch(es)), /proc/driver/nvidia/version, /proc/modules, /proc/devices",
        desc.gpus.len(),
        desc.nvswitches.len()
    )?;
    writeln!(
        out,
        "3. Ran the agent's stages (default policy), reading that sysfs and /proc and a simulated NVML:\n"
    )?;
    let policy = Policy::default();
    let caps = HeldCaps::read();
    let backend = SimulatedBackend::new(desc.clone());
    let pass = stages::run_pass(&Context {
        policy: &policy,
        caps: &caps,
        sys: &host,
        backend: &backend,
    });
    if let Some(inv) = &pass.inventory {
        for line in render::inventory(inv).lines() {
            writeln!(out, "{}", format!("   {line}").trim_end())?;
        }
    }
    let now = state::now();
    let st = AgentState {
        format: state::FORMAT,
        pid: std::process::id(),
        version: env!("CARGO_PKG_VERSION").into(),
        started_at: now,
        updated_at: now,
        stopped_at: None,
        heartbeat_secs: 10,
        host_root: host.path().display().to_string(),
        policy: None,
        simulated: Some(desc.name.clone()),
        held_caps: caps.names(),
        stages: pass.stages,
        inventory: pass.inventory,
    };
    st.write(&host)?;
    let written = host.resolve(state::STATE_FILE)?;
    writeln!(
        out,
        "\n4. Wrote the agent's state to {}; `gpu-agent status` reads it back:\n",
        written.display()
    )?;
    let read_back = AgentState::read(&host)?.context("the state file just written is missing")?;
    for line in status_text(&StatusReport::from_agent(read_back, 0)).lines() {
        writeln!(out, "{}", format!("   {line}").trim_end())?;
    }
    let done = st
        .stages
        .iter()
        .filter(|s| s.state == StageState::Done)
        .count();
    let unbuilt = st
        .stages
        .iter()
        .filter(|s| s.state == StageState::NotImplemented)
        .count();
    writeln!(
        out,
        "\n{done} stage(s) done, {unbuilt} not built yet (shown as such, never as done). Took {:.2} s.",
        t0.elapsed().as_secs_f64()
    )?;
    if keep {
        let path = sandbox.keep();
        writeln!(
            out,
            "Kept the sandbox: try `gpu-agent --host-root {} status` or `... inventory`.",
            path.display()
        )?;
    } else {
        writeln!(
            out,
            "Removed the sandbox (use --keep to look around in it)."
        )?;
    }
    Ok(())
}
