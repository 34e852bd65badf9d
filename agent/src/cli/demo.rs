//! `gpu-agent demo`: a simulated node in a sandbox host root, the agent's
//! stages run over it, and what came of it. Nothing outside a temp dir changes.

use std::io::Write;
use std::time::Instant;

use anyhow::Context as _;
use gpu_agent::backend::sim::SimulatedBackend;
use gpu_agent::caps::HeldCaps;
use gpu_agent::policy::Policy;
use gpu_agent::render;
use gpu_agent::stages::{self, Context, PluginPlan, StageState};
use gpu_agent::state::{self, AgentState};
use hostlib::HostRoot;
use simnode::NodeDescription;

use super::status::{StatusReport, status_text};
use gpu_agent::supervisor::{RunningHealth, RunningPlugin};

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
    // A containerd 2.x config for the runtime stage to edit; the sandbox has
    // no containerd to restart, so the demo's policy says not to.
    host.write_atomic(
        "/etc/containerd/config.toml",
        b"# the node's containerd config (simulated)\nversion = 3\n\n[plugins.\"io.containerd.cri.v1.runtime\".containerd]\n  default_runtime_name = \"runc\"\n",
        0o644,
    )?;
    let mut policy = Policy::default();
    policy.toolkit.reload = gpu_agent::policy::ReloadMode::None;
    let caps = HeldCaps::read();
    let backend = SimulatedBackend::new(desc.clone());
    let backend_for_plugin = backend.clone();
    let pass = stages::run_pass(&Context {
        policy: &policy,
        caps: &caps,
        sys: &host,
        backend: &backend,
        host: &host,
        apply: Some(&hostlib::command::RecordingRunner::new()),
        syscalls: &hostlib::LinuxSyscalls,
        simulated: true,
        drain: None,
        serve_first: false,
        changes: Default::default(),
        mig_hold: None,
        upgrade: Default::default(),
        logged: None,
    });
    if let Some(inv) = &pass.inventory {
        for line in render::inventory(inv).lines() {
            writeln!(out, "{}", format!("   {line}").trim_end())?;
        }
    }
    let mut st = AgentState::new(&host, 10, caps.names());
    st.simulated = Some(desc.name.clone());
    st.stages = pass.stages;
    st.inventory = pass.inventory;
    if let (Some(plan), Some(inv)) = (pass.plugin, st.inventory.clone()) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(serve_plugin(
            &host,
            plan,
            inv,
            &backend_for_plugin,
            &mut st,
            out,
        ))?;
    }
    st.write(&host)?;
    let written = host.resolve(state::STATE_FILE)?;
    writeln!(
        out,
        "\n5. Wrote the agent's state to {}; `gpu-agent status` reads it back:\n",
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
    let unbuilt = if unbuilt == 0 {
        String::new()
    } else {
        format!(", {unbuilt} not built yet (shown as such, never as done)")
    };
    writeln!(
        out,
        "\n{done} stage(s) done{unbuilt}. Took {:.2} s.",
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

/// Step 4: the device plugin registers with an in-process mock kubelet in the
/// sandbox, and the kubelet's side of one allocation is shown.
async fn serve_plugin(
    host: &HostRoot,
    plan: PluginPlan,
    inventory: gpu_agent::Inventory,
    backend: &SimulatedBackend,
    st: &mut AgentState,
    out: &mut dyn Write,
) -> anyhow::Result<()> {
    use gpu_agent::plugin::kubelet::{self, MockKubelet};
    use gpu_agent::plugin::manager::{self, KUBELET_SOCKET};
    use gpu_agent_proto::deviceplugin::v1beta1::device_plugin_client::DevicePluginClient;
    use gpu_agent_proto::deviceplugin::v1beta1::{AllocateRequest, ContainerAllocateRequest};

    let Some(first) = plan.resources.first().cloned() else {
        writeln!(
            out,
            "\n4. No devices to advertise: the device plugin has nothing to register."
        )?;
        return Ok(());
    };
    let dir = manager::plugin_dir(host, manager::DEVICE_PLUGIN_DIR)?;
    std::fs::create_dir_all(&dir)?;
    let mock =
        MockKubelet::start(&dir.join(KUBELET_SOCKET)).context("cannot start the mock kubelet")?;
    // The health monitor first: the plugin follows its view.
    let policy = Policy::default();
    let inventory = std::sync::Arc::new(inventory);
    let inventories = tokio::sync::watch::Sender::new(inventory.clone());
    let health_policy = tokio::sync::watch::Sender::new(policy.health.to_policy());
    let health = RunningHealth::start(
        backend,
        &policy,
        inventories.subscribe(),
        health_policy.subscribe(),
        Default::default(),
        tokio::sync::broadcast::Sender::new(1),
    )
    .ok();
    let plugin = RunningPlugin::start(
        host,
        manager::DEVICE_PLUGIN_DIR,
        plan,
        inventory,
        Default::default(),
        health.as_ref().map(|h| h.view()),
        None,
    )?;
    let registered = mock.wait_for(1, std::time::Duration::from_secs(5)).await;
    // Let the plugin record the kubelet's answer.
    for _ in 0..100 {
        plugin.refresh(st);
        if st.plugin.iter().all(|r| r.registered) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    writeln!(
        out,
        "\n4. Device plugin: served {} on {} and {} with a mock kubelet at {}.",
        first.name,
        dir.join(first.socket_name()).display(),
        if registered {
            "registered"
        } else {
            "could NOT register"
        },
        dir.join(KUBELET_SOCKET).display()
    )?;
    let id = first.devices[0].id.clone();
    let mut client =
        DevicePluginClient::new(kubelet::connect(&dir.join(first.socket_name())).await?);
    let resp = client
        .allocate(AllocateRequest {
            container_requests: vec![ContainerAllocateRequest {
                devices_ids: vec![id.clone()],
            }],
        })
        .await?
        .into_inner();
    writeln!(
        out,
        "   The kubelet allocates {id} to a container; the plugin answers:"
    )?;
    let c = &resp.container_responses[0];
    let mut envs: Vec<_> = c.envs.iter().collect();
    envs.sort();
    for (k, v) in envs {
        writeln!(out, "     env {k}={v}")?;
    }
    for d in &c.devices {
        writeln!(
            out,
            "     device {} (host {}, {})",
            d.container_path, d.host_path, d.permissions
        )?;
    }
    for d in &c.cdi_devices {
        writeln!(out, "     CDI device {}", d.name)?;
    }
    if let Some(h) = &health {
        health_demo(backend, &mut client, h, st, out).await?;
    }
    plugin.refresh(st);
    plugin.stop().await;
    if let Some(h) = health {
        h.stop();
    }
    mock.stop().await;
    Ok(())
}

/// The health monitor on the simulated backend: an injected XID 79 turns
/// GPU 3 unhealthy in the kubelet's ListAndWatch stream.
async fn health_demo(
    backend: &SimulatedBackend,
    client: &mut gpu_agent_proto::deviceplugin::v1beta1::device_plugin_client::DevicePluginClient<
        tonic::transport::Channel,
    >,
    health: &RunningHealth,
    st: &mut AgentState,
    out: &mut dyn Write,
) -> anyhow::Result<()> {
    use gpu_agent::backend::HealthEvent;
    use gpu_agent_proto::deviceplugin::v1beta1::Empty;
    use tokio_stream::StreamExt;

    let board = health.board();
    let mut stream = client.list_and_watch(Empty {}).await?.into_inner();
    let _ = stream.next().await;
    let uuid = st
        .inventory
        .as_ref()
        .and_then(|inv| inv.gpus.get(3))
        .and_then(|g| g.uuid.clone())
        .context("the simulated node has no GPU 3")?;
    backend.inject(HealthEvent::Xid {
        uuid: uuid.clone(),
        xid: 79,
    });
    let update = tokio::time::timeout(std::time::Duration::from_secs(5), stream.next())
        .await
        .context("no ListAndWatch update after the injected XID")?
        .context("the ListAndWatch stream ended")??;
    let sick: Vec<&str> = update
        .devices
        .iter()
        .filter(|d| d.health == "Unhealthy")
        .map(|d| d.id.as_str())
        .collect();
    writeln!(
        out,
        "   Health: injected XID 79 (GPU fallen off the bus) on {uuid}; the kubelet's ListAndWatch stream now reports unhealthy: {}",
        sick.join(", ")
    )?;
    st.health = board.lock().unwrap().clone();
    gpu_agent::stages::apply_health_status(&mut st.stages, &st.health);
    Ok(())
}
