//! The MPS control daemons, one per MPS-shared resource (what each is
//! started with and told: `plugin/mps.rs`). For each: its directories are
//! made, its GPUs put in EXCLUSIVE_PROCESS compute mode, a daemon a
//! previous agent left on its pipe directory told to `quit`, then the
//! host's `nvidia-cuda-mps-control -f` started (in the foreground, so that
//! the agent waits on its exit: `-d` would fork and leave nothing to wait
//! on) in a mount namespace whose `/dev/shm` is the resource's shm
//! directory. Once it answers `get_default_active_thread_percentage` it is
//! told each client's thread share and each GPU's pinned-memory limit;
//! then nothing runs until it exits. A daemon that exits is a failure of
//! the supervisor's task `mps` (in `status`), started again with its
//! backoff. When the agent stops, or a resource is no longer MPS-shared,
//! the daemon is told `quit` and its GPUs go back to DEFAULT.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use hostlib::HostRoot;
use hostlib::process::{Child, Launch, Spawner};
use tokio::sync::{mpsc, oneshot, watch};

use crate::backend::{ComputeMode, GpuBackend};
use crate::caps::Capability;
use crate::plugin::mps::{CONTROL_PROGRAM, DaemonPlan, HEALTH_COMMAND};

/// The task's name in `status`.
pub const TASK: &str = "mps";
/// What `host-exec` needs to run a daemon: a mount namespace of its own
/// (for its `/dev/shm`) and `chroot` into the host root.
pub const NEEDS: &[Capability] = &[Capability::CAP_SYS_ADMIN, Capability::CAP_SYS_CHROOT];

/// Modes of the directories: the pipe directory is where clients (any
/// user, in any container) reach the daemon's sockets, so others may
/// enter and read it, not write; the logs are the daemon's alone; the
/// shared memory is everyone's, like `/dev/shm` (sticky).
const ROOT_MODE: u32 = 0o755;
const PIPE_MODE: u32 = 0o755;
const LOG_MODE: u32 = 0o700;
const SHM_MODE: u32 = 0o1777;

/// How long the daemon and its control client are given.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    /// A started daemon must answer within this.
    pub answer_within: Duration,
    /// One control command (the client connects, sends, reads the answer).
    pub command: Duration,
    /// After `quit`, the daemon must exit within this, or it is killed.
    pub quit_within: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            answer_within: Duration::from_secs(30),
            command: Duration::from_secs(10),
            quit_within: Duration::from_secs(5),
        }
    }
}

/// Where a daemon is in its life.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Phase {
    Starting,
    /// It answered and took its limits.
    Serving,
    /// It stopped (the reason, when it failed).
    Ended(Option<String>),
}

/// One run of one daemon.
struct Run {
    generation: u64,
    stop: Option<oneshot::Sender<()>>,
    phase: watch::Receiver<Phase>,
    task: tokio::task::JoinHandle<()>,
}

struct Daemon {
    plan: DaemonPlan,
    run: Option<Run>,
}

/// A run's end: (resource, generation, why it failed).
type Ended = (String, u64, Result<(), String>);

/// The MPS daemons of the node.
pub struct MpsDaemons {
    host: HostRoot,
    spawner: Arc<dyn Spawner>,
    timing: Timing,
    daemons: BTreeMap<String, Daemon>,
    next_generation: u64,
    ended_tx: mpsc::UnboundedSender<Ended>,
    ended_rx: mpsc::UnboundedReceiver<Ended>,
    /// Capabilities of [`NEEDS`] this process lacks, by name.
    missing_caps: Vec<String>,
}

impl std::fmt::Debug for MpsDaemons {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpsDaemons")
            .field("daemons", &self.daemons.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// `nvidia-cuda-mps-control -f` for `plan` (`-f -M` in multi-user mode).
pub fn daemon_launch(plan: &DaemonPlan) -> Launch {
    let mut args = vec!["-f".to_string()];
    if plan.multi_user {
        args.push("-M".into());
    }
    Launch {
        program: CONTROL_PROGRAM.into(),
        args,
        env: plan.env(),
        shm: Some(plan.shm_dir()),
    }
}

/// `nvidia-cuda-mps-control` as a client of `plan`'s daemon (commands on stdin).
pub fn client_launch(plan: &DaemonPlan) -> Launch {
    Launch {
        program: CONTROL_PROGRAM.into(),
        args: Vec::new(),
        env: plan.env(),
        shm: None,
    }
}

impl MpsDaemons {
    pub fn new(host: HostRoot, spawner: Arc<dyn Spawner>) -> Self {
        let (ended_tx, ended_rx) = mpsc::unbounded_channel();
        MpsDaemons {
            host,
            spawner,
            timing: Timing::default(),
            daemons: BTreeMap::new(),
            next_generation: 1,
            ended_tx,
            ended_rx,
            missing_caps: Vec::new(),
        }
    }

    /// The capabilities of [`NEEDS`] this process lacks: every run fails
    /// at once, naming them.
    pub fn with_missing_caps(mut self, missing: Vec<String>) -> Self {
        self.missing_caps = missing;
        self
    }

    #[cfg(test)]
    pub fn with_timing(mut self, timing: Timing) -> Self {
        self.timing = timing;
        self
    }

    /// True when there is no MPS-shared resource.
    pub fn is_empty(&self) -> bool {
        self.daemons.is_empty()
    }

    /// Each daemon's resource and phase (`None`: waiting to start again).
    pub fn phases(&self) -> Vec<(String, Option<Phase>)> {
        self.daemons
            .iter()
            .map(|(name, d)| {
                (
                    name.clone(),
                    d.run.as_ref().map(|r| r.phase.borrow().clone()),
                )
            })
            .collect()
    }

    /// Follows `plans`: daemons of resources no longer MPS-shared, or
    /// shared otherwise, are stopped (their GPUs back to DEFAULT); new
    /// ones are started. Returns whether any was started.
    pub async fn update(&mut self, plans: Vec<DaemonPlan>, backend: &dyn GpuBackend) -> bool {
        let wanted: BTreeMap<String, DaemonPlan> =
            plans.into_iter().map(|p| (p.resource.clone(), p)).collect();
        let stale: Vec<String> = self
            .daemons
            .iter()
            .filter(|(name, d)| wanted.get(*name) != Some(&d.plan))
            .map(|(name, _)| name.clone())
            .collect();
        for name in stale {
            if let Some(d) = self.daemons.remove(&name) {
                tracing::info!(task = TASK, resource = %name, "the MPS sharing of this resource changed; stopping its daemon");
                self.stop_one(d, backend).await;
            }
        }
        for (name, plan) in wanted {
            self.daemons
                .entry(name)
                .or_insert(Daemon { plan, run: None });
        }
        self.start_missing(backend)
    }

    /// Starts every daemon that is not running; returns whether any was.
    pub fn start_missing(&mut self, backend: &dyn GpuBackend) -> bool {
        let names: Vec<String> = self
            .daemons
            .iter()
            .filter(|(_, d)| d.run.is_none())
            .map(|(n, _)| n.clone())
            .collect();
        for name in &names {
            let generation = self.next_generation;
            self.next_generation += 1;
            let plan = self.daemons[name].plan.clone();
            let run = self.start(plan, generation, backend);
            if let Some(d) = self.daemons.get_mut(name) {
                d.run = Some(run);
            }
        }
        !names.is_empty()
    }

    /// One run: what can be done here at once (directories, compute
    /// modes), then a task for the rest. A failure here ends the run.
    fn start(&self, plan: DaemonPlan, generation: u64, backend: &dyn GpuBackend) -> Run {
        let (phase_tx, phase) = watch::channel(Phase::Starting);
        let (stop, stopped) = oneshot::channel();
        let ended = self.ended_tx.clone();
        let resource = plan.resource.clone();
        let prepared = self
            .can_run()
            .and_then(|()| prepare_dirs(&self.host, &plan))
            .and_then(|()| set_modes(backend, &plan, ComputeMode::ExclusiveProcess));
        let spawner = self.spawner.clone();
        let timing = self.timing;
        let task = tokio::spawn(async move {
            let outcome = match prepared {
                Ok(()) => supervise(&plan, spawner.as_ref(), timing, &phase_tx, stopped).await,
                Err(e) => Err(e),
            };
            if let Err(e) = &outcome {
                tracing::error!(task = TASK, resource = %resource, error = %e, "MPS control daemon failed");
            }
            phase_tx.send_replace(Phase::Ended(outcome.clone().err()));
            let _ = ended.send((resource, generation, outcome));
        });
        Run {
            generation,
            stop: Some(stop),
            phase,
            task,
        }
    }

    /// Why no daemon can run here, if none can.
    fn can_run(&self) -> Result<(), String> {
        if !self.missing_caps.is_empty() {
            return Err(format!(
                "the MPS control daemon needs {} (a mount namespace for its /dev/shm, chroot into the host root)",
                self.missing_caps.join(", ")
            ));
        }
        if !self.host.exists(CONTROL_PROGRAM) {
            return Err(format!(
                "the host has no {CONTROL_PROGRAM} (the NVIDIA driver's MPS control program)"
            ));
        }
        Ok(())
    }

    /// Resolves when a daemon's run fails: its resource and why. The
    /// daemon is then not running until [`MpsDaemons::start_missing`].
    pub async fn ended(&mut self) -> (String, String) {
        loop {
            let Some((resource, generation, outcome)) = self.ended_rx.recv().await else {
                return std::future::pending().await;
            };
            let Some(d) = self.daemons.get_mut(&resource) else {
                continue;
            };
            if d.run.as_ref().map(|r| r.generation) != Some(generation) {
                continue;
            }
            d.run = None;
            if let Err(e) = outcome {
                return (resource, e);
            }
        }
    }

    /// Waits until every running daemon serves or has ended (at most the
    /// time a daemon is given to answer, and a little).
    pub async fn wait_started(&self) {
        let mut phases: Vec<watch::Receiver<Phase>> = self
            .daemons
            .values()
            .filter_map(|d| d.run.as_ref().map(|r| r.phase.clone()))
            .collect();
        let all = async {
            for p in &mut phases {
                let _ = p.wait_for(|p| *p != Phase::Starting).await;
            }
        };
        let limit = self.timing.answer_within + self.timing.command * 2;
        if tokio::time::timeout(limit, all).await.is_err() {
            tracing::warn!(
                task = TASK,
                "MPS control daemons still starting; the device plugin serves meanwhile"
            );
        }
    }

    /// Tells every daemon to quit (the agent stops); their GPUs go back to
    /// DEFAULT.
    pub async fn stop_all(&mut self, backend: &dyn GpuBackend) {
        let all = std::mem::take(&mut self.daemons);
        for (_, d) in all {
            self.stop_one(d, backend).await;
        }
    }

    async fn stop_one(&self, mut d: Daemon, backend: &dyn GpuBackend) {
        if let Some(mut run) = d.run.take() {
            if let Some(stop) = run.stop.take() {
                let _ = stop.send(());
            }
            let _ = (&mut run.task).await;
        }
        if let Err(e) = set_modes(backend, &d.plan, ComputeMode::Default) {
            tracing::warn!(task = TASK, resource = %d.plan.resource, error = %e, "cannot put the GPUs back in DEFAULT compute mode");
        }
    }
}

/// The daemon's directories, under the host root, with their modes.
fn prepare_dirs(host: &HostRoot, plan: &DaemonPlan) -> Result<(), String> {
    let make = |path: &str, mode: u32| -> Result<(), String> {
        let real = host.resolve(path).map_err(|e| e.to_string())?;
        std::fs::create_dir_all(&real).map_err(|e| format!("{}: {e}", real.display()))?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&real, std::fs::Permissions::from_mode(mode))
            .map_err(|e| format!("{}: {e}", real.display()))
    };
    make(&plan.root, ROOT_MODE)?;
    // `nvidia.com/gpu` is two levels: both may be entered by clients.
    let mut dir = plan.root.trim_end_matches('/').to_string();
    for part in plan.resource.split('/') {
        dir = format!("{dir}/{part}");
        make(&dir, ROOT_MODE)?;
    }
    make(&plan.pipe_dir(), PIPE_MODE)?;
    make(&plan.log_dir(), LOG_MODE)?;
    make(&plan.shm_dir(), SHM_MODE)
}

/// Puts the plan's GPUs in `mode`, changing only those in another one.
/// MIG devices are left alone, neither set nor reset: a MIG device's
/// compute mode is its parent GPU's, shared with the GPU's other MIG
/// devices (other claims' among them), as NVIDIA's DRA driver does.
fn set_modes(backend: &dyn GpuBackend, plan: &DaemonPlan, mode: ComputeMode) -> Result<(), String> {
    for g in plan.gpus.iter().filter(|g| !g.mig) {
        if backend.compute_mode(&g.uuid).is_ok_and(|m| m == mode) {
            continue;
        }
        backend
            .set_compute_mode(&g.uuid, mode)
            .map_err(|e| format!("compute mode {mode} on GPU {} ({}): {e}", g.index, g.uuid))?;
    }
    Ok(())
}

/// One command to the daemon, through the control client.
async fn ask(
    spawner: &dyn Spawner,
    plan: &DaemonPlan,
    timing: Timing,
    command: &str,
) -> Result<String, String> {
    let client = client_launch(plan);
    let input = format!("{command}\n");
    match tokio::time::timeout(timing.command, spawner.output(&client, &input)).await {
        Ok(Ok(out)) => Ok(out),
        Ok(Err(e)) => Err(e.message),
        Err(_) => Err(format!("no answer within {:?}", timing.command)),
    }
}

/// Starts the daemon, waits until it answers, gives it its limits, then
/// waits for its exit (a failure) or the stop signal (it is told `quit`).
async fn supervise(
    plan: &DaemonPlan,
    spawner: &dyn Spawner,
    timing: Timing,
    phase: &watch::Sender<Phase>,
    mut stopped: oneshot::Receiver<()>,
) -> Result<(), String> {
    let resource = plan.resource.as_str();
    // A daemon left on this pipe directory (by an agent that died) would
    // answer in place of ours.
    if ask(spawner, plan, timing, "quit").await.is_ok() {
        tracing::warn!(
            task = TASK,
            resource,
            "told a daemon left on the pipe directory to quit"
        );
    }
    let mut child = spawner
        .spawn(&daemon_launch(plan))
        .map_err(|e| e.to_string())?;
    tracing::info!(task = TASK, resource, pid = child.id(), gpus = %plan.summary(), "MPS control daemon started");
    let deadline = tokio::time::Instant::now() + timing.answer_within;
    let mut delay = Duration::from_millis(10);
    loop {
        tokio::select! {
            exit = child.wait() => {
                let exit = exit.map_or_else(|e| e.to_string(), |x| x.to_string());
                return Err(format!("the MPS control daemon for {resource} exited before it answered ({exit})"));
            }
            _ = &mut stopped => return quit(plan, spawner, timing, child.as_mut()).await,
            answer = ask(spawner, plan, timing, HEALTH_COMMAND) => match answer {
                Ok(_) => break,
                Err(e) if tokio::time::Instant::now() >= deadline => {
                    kill(child.as_mut()).await;
                    return Err(format!(
                        "the MPS control daemon for {resource} did not answer within {:?}: {e}",
                        timing.answer_within
                    ));
                }
                Err(_) => {
                    // Starting: its socket is not there yet.
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_millis(500));
                }
            },
        }
    }
    for command in plan.setup_commands() {
        if let Err(e) = ask(spawner, plan, timing, &command).await {
            kill(child.as_mut()).await;
            return Err(format!(
                "the MPS control daemon for {resource} refused `{command}`: {e}"
            ));
        }
    }
    phase.send_replace(Phase::Serving);
    tracing::info!(
        task = TASK,
        resource,
        thread_percentage = plan.thread_percentage(),
        "MPS control daemon serves"
    );
    tokio::select! {
        exit = child.wait() => {
            let exit = exit.map_or_else(|e| e.to_string(), |x| x.to_string());
            Err(format!("the MPS control daemon for {resource} exited ({exit})"))
        }
        _ = &mut stopped => quit(plan, spawner, timing, child.as_mut()).await,
    }
}

/// Tells the daemon to quit and waits for it to exit (killed if it does not).
async fn quit(
    plan: &DaemonPlan,
    spawner: &dyn Spawner,
    timing: Timing,
    child: &mut dyn Child,
) -> Result<(), String> {
    let resource = plan.resource.as_str();
    if let Err(e) = ask(spawner, plan, timing, "quit").await {
        tracing::warn!(task = TASK, resource, error = %e, "the MPS control daemon did not take `quit`");
    }
    match tokio::time::timeout(timing.quit_within, child.wait()).await {
        Ok(exit) => {
            tracing::info!(
                task = TASK,
                resource,
                exit = exit.ok().map(|e| e.to_string()),
                "MPS control daemon quit"
            );
        }
        Err(_) => {
            tracing::warn!(
                task = TASK,
                resource,
                "the MPS control daemon did not quit; killing it"
            );
            kill(child).await;
        }
    }
    Ok(())
}

async fn kill(child: &mut dyn Child) {
    if let Err(e) = child.kill() {
        tracing::warn!(task = TASK, error = %e, "cannot kill the MPS control daemon");
        return;
    }
    let _ = child.wait().await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::sim::SimulatedBackend;
    use crate::plugin::config::{MigStrategy, PluginConfig};
    use crate::plugin::resources::{PluginSettings, build};
    use crate::test_support::inventory_of;
    use hostlib::process::{Exit, FakeSpawner};
    use std::os::unix::fs::PermissionsExt;

    fn plans(yaml: &str) -> Vec<DaemonPlan> {
        let c = PluginConfig::from_yaml(yaml, "c").unwrap();
        let s = PluginSettings {
            mig_strategy: MigStrategy::Single,
            mps: c.sharing.mps,
            ..PluginSettings::default()
        };
        let inv = inventory_of("t4-4");
        crate::plugin::mps::plans(&s, &build(&inv, &s).unwrap(), &inv)
    }

    const TWO_RESOURCES: &str = "version: v1\nsharing:\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, devices: [0, 1], replicas: 4, rename: gpu.quarter}\n    - {name: nvidia.com/gpu, devices: [3], replicas: 2, rename: gpu.half}\n";

    use super::super::mps_fake::fake_mps;

    fn fixture() -> (tempfile::TempDir, HostRoot, SimulatedBackend) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("usr/bin")).unwrap();
        std::fs::write(dir.path().join("usr/bin/nvidia-cuda-mps-control"), "").unwrap();
        let host = HostRoot::new(dir.path()).unwrap();
        let backend = SimulatedBackend::new(simnode::NodeDescription::load("t4-4").unwrap());
        (dir, host, backend)
    }

    fn fast() -> Timing {
        Timing {
            answer_within: Duration::from_secs(2),
            command: Duration::from_secs(1),
            quit_within: Duration::from_millis(200),
        }
    }

    fn mode(dir: &tempfile::TempDir, p: &str) -> u32 {
        std::fs::metadata(dir.path().join(p))
            .unwrap()
            .permissions()
            .mode()
            & 0o7777
    }

    #[tokio::test]
    async fn starts_configures_and_quits_each_daemon() {
        let (dir, host, backend) = fixture();
        let f = fake_mps();
        let mut d = MpsDaemons::new(host, f.clone()).with_timing(fast());
        let ps = plans(TWO_RESOURCES);
        assert!(d.update(ps.clone(), &backend).await);
        d.wait_started().await;
        assert_eq!(
            d.phases(),
            [
                ("nvidia.com/gpu.half".to_string(), Some(Phase::Serving)),
                ("nvidia.com/gpu.quarter".to_string(), Some(Phase::Serving)),
            ]
        );
        // Directories and their modes.
        assert_eq!(mode(&dir, "run/nvidia/mps"), 0o755);
        assert_eq!(mode(&dir, "run/nvidia/mps/nvidia.com"), 0o755);
        assert_eq!(
            mode(&dir, "run/nvidia/mps/nvidia.com/gpu.quarter/pipe"),
            0o755
        );
        assert_eq!(
            mode(&dir, "run/nvidia/mps/nvidia.com/gpu.quarter/log"),
            0o700
        );
        assert_eq!(mode(&dir, "run/nvidia/mps/shm"), 0o1777);
        // The daemons: in the foreground, their env, the shm directory.
        let spawned = f.spawned();
        assert_eq!(spawned.len(), 2);
        assert_eq!(spawned[0], daemon_launch(&ps[0]));
        assert_eq!(spawned[1], daemon_launch(&ps[1]));
        assert_eq!(spawned[1].args, ["-f"]);
        assert_eq!(spawned[1].shm.as_deref(), Some("/run/nvidia/mps/shm"));
        assert_eq!(
            spawned[1].env["CUDA_VISIBLE_DEVICES"],
            "GPU-5f0cf4a3-6a1c-5c37-a7a5-5e54ae0c9a40,GPU-5f0cf4a3-6a1c-5c37-a7a5-5e54ae0c9a41"
        );
        // Compute modes: the shared GPUs only.
        let m = |i: usize| backend.compute_mode(&backend.node().gpus[i].uuid).unwrap();
        assert_eq!(
            [m(0), m(1), m(2), m(3)],
            [
                ComputeMode::ExclusiveProcess,
                ComputeMode::ExclusiveProcess,
                ComputeMode::Default,
                ComputeMode::ExclusiveProcess
            ]
        );
        // What the quarter daemon was told, in order (T4: 15360 MiB).
        let told: Vec<String> = f
            .ran()
            .into_iter()
            .filter(|(l, _)| l.env["CUDA_MPS_PIPE_DIRECTORY"].ends_with("/gpu.quarter/pipe"))
            .map(|(_, i)| i)
            .collect();
        assert_eq!(
            told,
            [
                "quit\n",
                "get_default_active_thread_percentage\n",
                "set_default_active_thread_percentage 25\n",
                "set_default_device_pinned_mem_limit 0 3840M\n",
                "set_default_device_pinned_mem_limit 1 3840M\n",
            ]
        );
        // Stop: each told to quit, GPUs back to DEFAULT.
        d.stop_all(&backend).await;
        assert_eq!(f.running(), 0);
        assert_eq!(f.inputs().iter().filter(|i| *i == "quit\n").count(), 4);
        assert!((0..4).all(|i| m(i) == ComputeMode::Default));
    }

    #[tokio::test]
    async fn a_daemon_that_exits_is_reported_and_started_again() {
        let (_dir, host, backend) = fixture();
        let f = fake_mps();
        let mut d = MpsDaemons::new(host, f.clone()).with_timing(fast());
        d.update(plans(TWO_RESOURCES), &backend).await;
        d.wait_started().await;
        assert!(f.exit(
            1,
            Exit {
                code: None,
                signal: Some(9)
            }
        ));
        let (resource, why) = d.ended().await;
        assert_eq!(resource, "nvidia.com/gpu.quarter");
        assert_eq!(
            why,
            "the MPS control daemon for nvidia.com/gpu.quarter exited (killed by SIGKILL)"
        );
        assert_eq!(d.phases()[1].1, None);
        // The supervisor starts it again after its backoff; the other one
        // was left alone.
        assert!(d.start_missing(&backend));
        d.wait_started().await;
        assert_eq!(f.spawned().len(), 3);
        assert_eq!(f.running(), 2);
        assert!(d.phases().iter().all(|(_, p)| *p == Some(Phase::Serving)));
        d.stop_all(&backend).await;
    }

    #[tokio::test]
    async fn a_changed_plan_restarts_only_its_daemon_and_a_removed_one_quits() {
        let (_dir, host, backend) = fixture();
        let f = fake_mps();
        let mut d = MpsDaemons::new(host, f.clone()).with_timing(fast());
        d.update(plans(TWO_RESOURCES), &backend).await;
        d.wait_started().await;
        // Unchanged: nothing happens.
        assert!(!d.update(plans(TWO_RESOURCES), &backend).await);
        assert_eq!(f.spawned().len(), 2);
        // GPU 3 in 4 replicas now, and nvidia.com/gpu gone from MPS.
        let next = plans(
            "version: v1\nsharing:\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, devices: [3], replicas: 4, rename: gpu.half}\n",
        );
        assert!(d.update(next, &backend).await);
        d.wait_started().await;
        assert_eq!(f.spawned().len(), 3);
        assert_eq!(f.running(), 1);
        let uuid0 = backend.node().gpus[0].uuid.clone();
        assert_eq!(backend.compute_mode(&uuid0).unwrap(), ComputeMode::Default);
        let half: Vec<String> = f
            .ran()
            .into_iter()
            .filter(|(l, i)| {
                l.env["CUDA_MPS_PIPE_DIRECTORY"].ends_with("/gpu.half/pipe")
                    && i.starts_with("set_default_active")
            })
            .map(|(_, i)| i)
            .collect();
        assert_eq!(
            half,
            [
                "set_default_active_thread_percentage 50\n",
                "set_default_active_thread_percentage 25\n"
            ]
        );
        // Nothing shared with MPS any more: nothing runs.
        assert!(!d.update(Vec::new(), &backend).await);
        assert!(d.is_empty());
        assert_eq!(f.running(), 0);
    }

    #[tokio::test]
    async fn a_daemon_that_never_answers_or_refuses_a_limit_fails_the_run() {
        let (_dir, host, backend) = fixture();
        let f = Arc::new(FakeSpawner::new());
        f.respond(|_, _| Err("Cannot find MPS control daemon process".into()));
        let mut d = MpsDaemons::new(host.clone(), f.clone()).with_timing(Timing {
            answer_within: Duration::from_millis(100),
            ..fast()
        });
        d.update(plans(TWO_RESOURCES), &backend).await;
        let (_, why) = d.ended().await;
        assert!(why.contains("did not answer within 100ms"), "{why}");
        assert!(
            why.ends_with("Cannot find MPS control daemon process"),
            "{why}"
        );
        d.stop_all(&backend).await;

        let f = Arc::new(FakeSpawner::new());
        f.respond(|_, input| {
            if input.starts_with("set_default_device_pinned_mem_limit") {
                Err("unknown command".into())
            } else {
                Ok(String::new())
            }
        });
        let mut d = MpsDaemons::new(host, f.clone()).with_timing(fast());
        d.update(plans(TWO_RESOURCES), &backend).await;
        let (_, why) = d.ended().await;
        assert!(
            why.contains("refused `set_default_device_pinned_mem_limit 0 ")
                && why.ends_with("M`: unknown command"),
            "{why}"
        );
        d.stop_all(&backend).await;
        assert_eq!(f.running(), 0, "the refused daemon is killed");
    }

    #[tokio::test]
    async fn no_control_program_or_no_capabilities_is_said_in_words() {
        let (dir, host, backend) = fixture();
        let f = fake_mps();
        let mut d = MpsDaemons::new(host.clone(), f.clone())
            .with_timing(fast())
            .with_missing_caps(vec!["CAP_SYS_CHROOT".into()]);
        d.update(plans(TWO_RESOURCES), &backend).await;
        let (_, why) = d.ended().await;
        assert_eq!(
            why,
            "the MPS control daemon needs CAP_SYS_CHROOT (a mount namespace for its /dev/shm, chroot into the host root)"
        );
        d.stop_all(&backend).await;
        std::fs::remove_file(dir.path().join("usr/bin/nvidia-cuda-mps-control")).unwrap();
        let mut d = MpsDaemons::new(host, f.clone()).with_timing(fast());
        d.update(plans(TWO_RESOURCES), &backend).await;
        let (_, why) = d.ended().await;
        assert_eq!(
            why,
            "the host has no /usr/bin/nvidia-cuda-mps-control (the NVIDIA driver's MPS control program)"
        );
        d.stop_all(&backend).await;
        // Nothing was started, no GPU left in EXCLUSIVE_PROCESS.
        assert!(f.spawned().is_empty());
        let uuid = backend.node().gpus[0].uuid.clone();
        assert_eq!(backend.compute_mode(&uuid).unwrap(), ComputeMode::Default);
    }
}
