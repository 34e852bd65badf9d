//! The MPS control daemons of DRA claims ([`DraMps`]): gpu-dra's
//! [`MpsPort`] served by an [`MpsDaemons`] of their own (not the device
//! plugin's), one daemon per claim, run by one async task that takes start
//! and stop requests over a channel. Per claim `<uid>` the daemon's
//! resource is `dra-claim-<uid>` under the MPS root (default
//! `/run/nvidia/mps`): pipe, log and shm directories of its own, the
//! claim's devices visible to it by UUID (a MIG device's own, as NVIDIA's
//! driver does), its full GPUs in EXCLUSIVE_PROCESS while it runs (a MIG
//! device's compute mode is its parent GPU's, shared with the GPU's other
//! MIG devices: left alone); the limits are the claim's `mpsConfig` only
//! (nothing derived from replicas), `multiUser` starts it with `-M` on
//! GPUs of compute capability 7.0 or newer. A daemon that exits is
//! started again with backoff; each claim's phase is in `status`. The
//! directories outlive an agent restart (running containers have them
//! mounted) and go when the claim is unprepared.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpu_dra::claims::{MpsDirs, MpsGpu, MpsPort, MpsSettings};
use hostlib::HostRoot;
use hostlib::process::Spawner;
use tokio::sync::{Notify, mpsc};
use tokio::time::Instant;

use super::mps::{MpsDaemons, Phase};
use crate::backend::{BackendError, BackendSnapshot, ComputeMode, GpuBackend};
use crate::plugin::mps::{DaemonGpu, DaemonPlan, ExplicitLimits};

/// The log field of these daemons.
pub const TASK: &str = "dra-mps";
/// How long a start waits for the daemon to serve (the kubelet gives a
/// prepare 45 s), and how long the port's caller waits for the answer.
const START_WAIT: Duration = Duration::from_secs(38);
const ANSWER_WAIT: Duration = Duration::from_secs(40);
/// Restarts of a daemon that exited: 1 s, doubling, at most a minute.
const BACKOFF_FIRST: Duration = Duration::from_secs(1);
const BACKOFF_MAX: Duration = Duration::from_secs(60);
/// How often the phases are looked at while a daemon is starting.
const PHASE_POLL: Duration = Duration::from_millis(100);

/// The compute capability `multiUser` needs (Volta), as NVIDIA's driver.
const MULTI_USER_CAPABILITY: (u32, u32) = (7, 0);

/// The resource name (and directory under the MPS root) of claim `uid`.
pub fn resource_of(uid: &str) -> String {
    format!("dra-claim-{uid}")
}

/// What the supervisor keeps between runs of the DRA plugin: the node's
/// backend once shared (the view's box then passes every call on to it),
/// and the daemons while the plugin restarts (a restart of the plugin
/// must not end the daemons its claims' running containers use).
#[derive(Debug, Default)]
pub struct Kept {
    pub backend: Option<Arc<dyn GpuBackend>>,
    pub daemons: Option<DraMps>,
}

/// What the daemons run with.
pub struct DraMpsSetup {
    pub host: HostRoot,
    /// Runs the host's `nvidia-cuda-mps-control` (through `host-exec`).
    pub spawner: Arc<dyn Spawner>,
    /// Sets the compute modes.
    pub backend: Arc<dyn GpuBackend>,
    /// The MPS root on the host.
    pub root: String,
    /// Capabilities the daemons need that this process lacks: every start
    /// fails naming them.
    pub missing_caps: Vec<String>,
}

impl std::fmt::Debug for DraMpsSetup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DraMpsSetup")
            .field("root", &self.root)
            .field("backend", &self.backend)
            .field("missing_caps", &self.missing_caps)
            .finish_non_exhaustive()
    }
}

type Reply<T> = std::sync::mpsc::SyncSender<Result<T, String>>;

enum Request {
    Start {
        uid: String,
        gpus: Vec<MpsGpu>,
        settings: MpsSettings,
        reply: Reply<MpsDirs>,
    },
    Stop {
        uid: String,
        reply: Reply<()>,
    },
    Shutdown {
        done: tokio::sync::oneshot::Sender<()>,
    },
}

/// The claims' daemons, served by a task of their own.
pub struct DraMps {
    tx: mpsc::UnboundedSender<Request>,
    phases: Arc<Mutex<BTreeMap<String, String>>>,
    task: Option<tokio::task::JoinHandle<()>>,
    missing_caps: Vec<String>,
}

impl std::fmt::Debug for DraMps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DraMps")
            .field("phases", &self.phases())
            .field("missing_caps", &self.missing_caps)
            .finish_non_exhaustive()
    }
}

/// gpu-dra's side: blocking calls, answered by the task.
struct Port {
    tx: mpsc::UnboundedSender<Request>,
}

impl MpsPort for Port {
    fn start(
        &self,
        claim_uid: &str,
        gpus: &[MpsGpu],
        settings: &MpsSettings,
    ) -> Result<MpsDirs, String> {
        let (reply, answer) = std::sync::mpsc::sync_channel(1);
        self.ask(
            Request::Start {
                uid: claim_uid.to_string(),
                gpus: gpus.to_vec(),
                settings: settings.clone(),
                reply,
            },
            answer,
        )
    }

    fn stop(&self, claim_uid: &str) -> Result<(), String> {
        let (reply, answer) = std::sync::mpsc::sync_channel(1);
        self.ask(
            Request::Stop {
                uid: claim_uid.to_string(),
                reply,
            },
            answer,
        )
    }
}

impl Port {
    fn ask<T>(
        &self,
        request: Request,
        answer: std::sync::mpsc::Receiver<Result<T, String>>,
    ) -> Result<T, String> {
        self.tx
            .send(request)
            .map_err(|_| "the DRA plugin's MPS task has stopped".to_string())?;
        match answer.recv_timeout(ANSWER_WAIT) {
            Ok(r) => r,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Err(format!(
                "the DRA plugin's MPS task did not answer within {ANSWER_WAIT:?}"
            )),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                Err("the DRA plugin's MPS task has stopped".into())
            }
        }
    }
}

impl DraMps {
    /// Starts the task (on the current runtime); `changed` hears of every
    /// change of a daemon's phase.
    pub fn start(setup: DraMpsSetup, changed: Option<Arc<Notify>>) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let phases = Arc::new(Mutex::new(BTreeMap::new()));
        let missing_caps = setup.missing_caps.clone();
        let daemons = MpsDaemons::new(setup.host.clone(), setup.spawner.clone())
            .with_missing_caps(setup.missing_caps.clone());
        let task = Task {
            daemons,
            host: setup.host,
            backend: setup.backend,
            root: setup.root,
            plans: BTreeMap::new(),
            failed: BTreeMap::new(),
            attempts: BTreeMap::new(),
            restart_at: None,
            starting: false,
            phases: phases.clone(),
            changed,
        };
        DraMps {
            tx,
            phases,
            task: Some(tokio::spawn(task.run(rx))),
            missing_caps,
        }
    }

    /// What gpu-dra's claims start and stop daemons through.
    pub fn port(&self) -> Arc<dyn MpsPort> {
        Arc::new(Port {
            tx: self.tx.clone(),
        })
    }

    /// Each claim's daemon, by claim UID: `starting`, `serving`, or
    /// `failed: …` (with when it starts again).
    pub fn phases(&self) -> BTreeMap<String, String> {
        self.phases
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Why claims asking for MPS fail on this node, if they all do.
    pub fn unavailable(&self) -> Option<String> {
        (!self.missing_caps.is_empty()).then(|| {
            format!(
                "claims with MPS sharing fail: the MPS control daemon needs {}",
                self.missing_caps.join(", ")
            )
        })
    }

    /// Tells every daemon to quit and puts their GPUs back to DEFAULT.
    pub async fn stop(mut self) {
        let (done, wait) = tokio::sync::oneshot::channel();
        if self.tx.send(Request::Shutdown { done }).is_ok() {
            let _ = wait.await;
        }
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

impl Drop for DraMps {
    fn drop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

struct Task {
    daemons: MpsDaemons,
    host: HostRoot,
    backend: Arc<dyn GpuBackend>,
    root: String,
    /// By claim UID.
    plans: BTreeMap<String, DaemonPlan>,
    /// Claims whose daemon exited, and why, until it runs again.
    failed: BTreeMap<String, String>,
    /// Restarts since the claim's daemon was asked for.
    attempts: BTreeMap<String, u32>,
    restart_at: Option<Instant>,
    /// A daemon is starting (its phase is looked at until it is not).
    starting: bool,
    phases: Arc<Mutex<BTreeMap<String, String>>>,
    changed: Option<Arc<Notify>>,
}

impl Task {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Request>) {
        loop {
            let restart_at = self.restart_at;
            tokio::select! {
                req = rx.recv() => match req {
                    Some(Request::Start { uid, gpus, settings, reply }) => {
                        let r = self.start(&uid, &gpus, &settings).await;
                        // `status` says so before the claim is answered.
                        self.publish();
                        let _ = reply.try_send(r);
                    }
                    Some(Request::Stop { uid, reply }) => {
                        self.stop(&uid).await;
                        self.publish();
                        let _ = reply.try_send(Ok(()));
                    }
                    Some(Request::Shutdown { done }) => {
                        self.daemons.stop_all(self.backend.as_ref()).await;
                        let _ = done.send(());
                        return;
                    }
                    None => {
                        self.daemons.stop_all(self.backend.as_ref()).await;
                        return;
                    }
                },
                (resource, why) = self.daemons.ended() => {
                    let uid = resource.strip_prefix("dra-claim-").unwrap_or(&resource).to_string();
                    let n = self.attempts.entry(uid.clone()).or_insert(0);
                    let delay = BACKOFF_FIRST
                        .saturating_mul(2u32.saturating_pow(*n))
                        .min(BACKOFF_MAX);
                    *n = n.saturating_add(1);
                    tracing::info!(task = TASK, claim = %uid, after = ?delay, "the claim's MPS control daemon starts again");
                    self.failed.insert(uid, format!("{why}; starting again in {delay:?}"));
                    let at = Instant::now() + delay;
                    self.restart_at = Some(self.restart_at.map_or(at, |r| r.min(at)));
                }
                // A daemon started again says it serves on its own run's
                // channel: looked at while one is starting.
                _ = tokio::time::sleep(PHASE_POLL), if self.starting => {}
                _ = tokio::time::sleep_until(restart_at.unwrap_or_else(Instant::now)), if restart_at.is_some() => {
                    self.restart_at = None;
                    self.failed.clear();
                    self.daemons.start_missing(self.backend.as_ref());
                }
            }
            self.publish();
        }
    }

    /// The plan of claim `uid`'s daemon: `gpus` (GPUs and MIG devices) by
    /// their own UUIDs, device ordinals in that order.
    fn plan(
        &self,
        uid: &str,
        gpus: &[MpsGpu],
        settings: &MpsSettings,
    ) -> Result<DaemonPlan, String> {
        if settings.multi_user {
            self.check_multi_user(gpus)?;
        }
        let uuids: Vec<&str> = gpus.iter().map(|g| g.uuid.as_str()).collect();
        let resource = resource_of(uid);
        Ok(DaemonPlan {
            shm: Some(format!(
                "{}/{resource}/shm",
                self.root.trim_end_matches('/')
            )),
            resource,
            root: self.root.clone(),
            gpus: gpus
                .iter()
                .enumerate()
                .map(|(ordinal, g)| DaemonGpu {
                    uuid: g.uuid.clone(),
                    // The device minor: DRA names GPUs by it.
                    index: g.minor,
                    ordinal: ordinal as u32,
                    memory_mib: None,
                    // Its compute mode is its parent GPU's: not changed.
                    mig: g.is_mig(),
                })
                .collect(),
            replicas: 1,
            explicit: Some(ExplicitLimits {
                thread_percentage: settings.default_active_thread_percentage,
                pinned_mib: settings.pinned_limits(&uuids)?,
            }),
            multi_user: settings.multi_user,
        })
    }

    /// `multiUser` needs compute capability 7.0 (Volta) or newer on every
    /// GPU of the claim (a MIG device's parent's), as the backend reports
    /// it; `Err` names each GPU that lacks it.
    fn check_multi_user(&self, gpus: &[MpsGpu]) -> Result<(), String> {
        let snap = self.backend.snapshot().map_err(|e| {
            format!("mpsConfig.multiUser needs the GPUs' compute capability, which the backend did not give: {e}")
        })?;
        let (major, minor) = MULTI_USER_CAPABILITY;
        let mut short: Vec<String> = Vec::new();
        let mut seen: Vec<&str> = Vec::new();
        for g in gpus {
            if seen.contains(&g.gpu_uuid.as_str()) {
                continue;
            }
            seen.push(&g.gpu_uuid);
            let cc = snap
                .gpus
                .iter()
                .find(|b| b.uuid == g.gpu_uuid)
                .and_then(|b| b.compute_capability);
            match cc {
                Some(cc) if (cc.major, cc.minor) >= (major, minor) => {}
                Some(cc) => short.push(format!(
                    "GPU gpu-{} ({}) has compute capability {cc}",
                    g.minor, g.gpu_uuid
                )),
                None => short.push(format!(
                    "GPU gpu-{} ({}) has no known compute capability",
                    g.minor, g.gpu_uuid
                )),
            }
        }
        if short.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "mpsConfig.multiUser needs compute capability {major}.{minor} (Volta) or newer on every GPU of the claim: {}",
                short.join("; ")
            ))
        }
    }

    fn phase(&self, resource: &str) -> Option<Option<Phase>> {
        self.daemons
            .phases()
            .into_iter()
            .find(|(r, _)| r == resource)
            .map(|(_, p)| p)
    }

    async fn start(
        &mut self,
        uid: &str,
        gpus: &[MpsGpu],
        settings: &MpsSettings,
    ) -> Result<MpsDirs, String> {
        let plan = self.plan(uid, gpus, settings)?;
        let resource = plan.resource.clone();
        let dirs = MpsDirs {
            pipe_dir: plan.pipe_dir(),
            shm_dir: plan.shm_dir(),
        };
        if self.plans.get(uid) == Some(&plan) && self.phase(&resource) == Some(Some(Phase::Serving))
        {
            return Ok(dirs);
        }
        let claim_dir = format!("{}/{resource}", self.root.trim_end_matches('/'));
        let new_dirs = !self.host.exists(&claim_dir);
        self.plans.insert(uid.to_string(), plan);
        self.failed.remove(uid);
        self.attempts.remove(uid);
        let all: Vec<DaemonPlan> = self.plans.values().cloned().collect();
        self.daemons.update(all, self.backend.as_ref()).await;
        self.publish();
        let deadline = Instant::now() + START_WAIT;
        let why = loop {
            match self.phase(&resource) {
                Some(Some(Phase::Serving)) => return Ok(dirs),
                Some(Some(Phase::Starting)) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Some(Some(Phase::Starting)) => {
                    break format!("it did not serve within {START_WAIT:?}");
                }
                Some(Some(Phase::Ended(why))) => {
                    break why.unwrap_or_else(|| "it stopped".into());
                }
                Some(None) | None => break "it stopped".to_string(),
            }
        };
        // Nothing left running, its GPUs back to DEFAULT.
        self.plans.remove(uid);
        let all: Vec<DaemonPlan> = self.plans.values().cloned().collect();
        self.daemons.update(all, self.backend.as_ref()).await;
        if new_dirs {
            self.remove_dirs(uid);
        }
        Err(why)
    }

    async fn stop(&mut self, uid: &str) {
        self.failed.remove(uid);
        self.attempts.remove(uid);
        if self.plans.remove(uid).is_some() {
            let all: Vec<DaemonPlan> = self.plans.values().cloned().collect();
            self.daemons.update(all, self.backend.as_ref()).await;
            tracing::info!(task = TASK, claim = %uid, "the claim's MPS control daemon stopped");
        }
        self.remove_dirs(uid);
    }

    /// The claim's directories (no container has them any more).
    fn remove_dirs(&self, uid: &str) {
        let dir = format!("{}/{}", self.root.trim_end_matches('/'), resource_of(uid));
        // Through the host root's descriptors: links inside are removed,
        // never followed.
        match self.host.remove_all(&dir) {
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(task = TASK, claim = %uid, path = %dir, error = %e, "cannot remove the claim's MPS directories")
            }
        }
    }

    fn publish(&mut self) {
        self.starting = self
            .daemons
            .phases()
            .iter()
            .any(|(_, p)| *p == Some(Phase::Starting));
        let mut now: BTreeMap<String, String> = BTreeMap::new();
        for (resource, phase) in self.daemons.phases() {
            let uid = resource
                .strip_prefix("dra-claim-")
                .unwrap_or(&resource)
                .to_string();
            let words = match phase {
                Some(Phase::Starting) => "starting".to_string(),
                Some(Phase::Serving) => "serving".to_string(),
                Some(Phase::Ended(Some(why))) => format!("failed: {why}"),
                Some(Phase::Ended(None)) => "stopped".to_string(),
                None => format!(
                    "failed: {}",
                    self.failed
                        .get(&uid)
                        .map_or("waiting to start again", |w| w)
                ),
            };
            now.insert(uid, words);
        }
        let mut p = self.phases.lock().unwrap_or_else(|e| e.into_inner());
        if *p != now {
            *p = now;
            if let Some(c) = &self.changed {
                c.notify_one();
            }
        }
    }
}

/// The node's backend shared with the DRA MPS task: the supervisor's view
/// keeps one of these in place of the box it had, every call passed on.
#[derive(Debug)]
pub struct SharedBackend(pub Arc<dyn GpuBackend>);

impl GpuBackend for SharedBackend {
    fn sampler(&self) -> Result<Box<dyn crate::backend::Sampler>, BackendError> {
        self.0.sampler()
    }
    fn mig_control(&self) -> Option<&dyn gpu_model::mig::MigControl> {
        self.0.mig_control()
    }
    fn name(&self) -> &'static str {
        self.0.name()
    }
    fn snapshot(&self) -> Result<BackendSnapshot, BackendError> {
        self.0.snapshot()
    }
    fn watch_health(&self, events: crate::backend::HealthSender) -> Result<(), BackendError> {
        self.0.watch_health(events)
    }
    fn set_compute_mode(&self, uuid: &str, mode: ComputeMode) -> Result<(), BackendError> {
        self.0.set_compute_mode(uuid, mode)
    }
    fn compute_mode(&self, uuid: &str) -> Result<ComputeMode, BackendError> {
        self.0.compute_mode(uuid)
    }
}

#[cfg(test)]
mod tests {

    use hostlib::process::{Exit, FakeSpawner};

    use super::*;
    use crate::backend::sim::SimulatedBackend;

    const U1: &str = "dab5ab50-d59a-42a6-af16-cfd4628c0f7a";
    const U2: &str = "0c7e1d7a-2f4b-4b83-9d0b-5b1f2a3c4d5e";

    use super::super::mps_fake::fake_mps;

    struct Fixture {
        dir: tempfile::TempDir,
        spawner: Arc<FakeSpawner>,
        backend: Arc<SimulatedBackend>,
        mps: DraMps,
    }

    fn fixture() -> Fixture {
        let backend = Arc::new(SimulatedBackend::new(
            simnode::NodeDescription::load("t4-4").unwrap(),
        ));
        let (dir, spawner, mps) = daemons_on(backend.clone());
        Fixture {
            dir,
            spawner,
            backend,
            mps,
        }
    }

    /// Claims' daemons on `backend`, with the fake control program.
    fn daemons_on(backend: Arc<dyn GpuBackend>) -> (tempfile::TempDir, Arc<FakeSpawner>, DraMps) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("usr/bin")).unwrap();
        std::fs::write(dir.path().join("usr/bin/nvidia-cuda-mps-control"), "").unwrap();
        let host = HostRoot::new(dir.path()).unwrap();
        let spawner = fake_mps();
        let mps = DraMps::start(
            DraMpsSetup {
                host,
                spawner: spawner.clone(),
                backend,
                root: "/run/nvidia/mps".into(),
                missing_caps: Vec::new(),
            },
            None,
        );
        (dir, spawner, mps)
    }

    /// The simulated node's backend, recording every compute-mode change.
    #[derive(Debug)]
    struct Recording {
        sim: SimulatedBackend,
        set: Mutex<Vec<(String, ComputeMode)>>,
    }

    impl GpuBackend for Recording {
        fn sampler(&self) -> Result<Box<dyn crate::backend::Sampler>, BackendError> {
            self.sim.sampler()
        }
        fn mig_control(&self) -> Option<&dyn gpu_model::mig::MigControl> {
            None
        }
        fn name(&self) -> &'static str {
            "recording"
        }
        fn snapshot(&self) -> Result<BackendSnapshot, BackendError> {
            self.sim.snapshot()
        }
        fn watch_health(&self, events: crate::backend::HealthSender) -> Result<(), BackendError> {
            self.sim.watch_health(events)
        }
        fn set_compute_mode(&self, uuid: &str, mode: ComputeMode) -> Result<(), BackendError> {
            self.set.lock().unwrap().push((uuid.to_string(), mode));
            self.sim.set_compute_mode(uuid, mode)
        }
        fn compute_mode(&self, uuid: &str) -> Result<ComputeMode, BackendError> {
            self.sim.compute_mode(uuid)
        }
    }

    /// `h100-mig-2` with GPU 1's MIG mode off (a full GPU) and GPU 0 (MIG
    /// devices `MIG-…400`, `MIG-…401`, …) at compute capability `cc0`.
    fn mig_node(cc0: &str) -> Arc<Recording> {
        let mut desc = simnode::NodeDescription::load("h100-mig-2").unwrap();
        desc.gpus[1].mig.enabled = false;
        desc.gpus[1].mig.devices.clear();
        desc.gpus[0].compute_capability = cc0.into();
        Arc::new(Recording {
            sim: SimulatedBackend::new(desc),
            set: Mutex::new(Vec::new()),
        })
    }

    fn mig_gpu(b: &Recording, dev: usize) -> MpsGpu {
        let g = &b.sim.node().gpus[0];
        MpsGpu {
            uuid: g.mig.devices[dev].uuid.clone(),
            minor: 0,
            gpu_uuid: g.uuid.clone(),
        }
    }

    fn full_gpu(b: &Recording) -> MpsGpu {
        let uuid = b.sim.node().gpus[1].uuid.clone();
        MpsGpu {
            uuid: uuid.clone(),
            minor: 1,
            gpu_uuid: uuid,
        }
    }

    fn gpus(b: &SimulatedBackend, which: &[usize]) -> Vec<MpsGpu> {
        which
            .iter()
            .map(|&i| MpsGpu {
                uuid: b.node().gpus[i].uuid.clone(),
                minor: i as u32,
                gpu_uuid: b.node().gpus[i].uuid.clone(),
            })
            .collect()
    }

    /// The port's blocking call, off the async threads.
    async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        tokio::task::spawn_blocking(f).await.unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn claims_get_daemons_of_their_own_and_lose_them_at_stop() {
        let f = fixture();
        let port = f.mps.port();
        let (p, g) = (port.clone(), gpus(&f.backend, &[1, 2]));
        let settings = MpsSettings {
            default_active_thread_percentage: Some(30),
            default_pinned_device_memory_limit_mib: Some(1024),
            ..Default::default()
        };
        let s = settings.clone();
        let dirs = blocking(move || p.start(U1, &g, &s)).await.unwrap();
        assert_eq!(
            dirs,
            MpsDirs {
                pipe_dir: format!("/run/nvidia/mps/dra-claim-{U1}/pipe"),
                shm_dir: format!("/run/nvidia/mps/dra-claim-{U1}/shm"),
            }
        );
        assert!(f.dir.path().join(&dirs.pipe_dir[1..]).is_dir());
        let launch = &f.spawner.spawned()[0];
        assert_eq!(launch.shm.as_deref(), Some(dirs.shm_dir.as_str()));
        let g = gpus(&f.backend, &[1, 2]);
        assert_eq!(
            launch.env["CUDA_VISIBLE_DEVICES"],
            format!("{},{}", g[0].uuid, g[1].uuid)
        );
        let told: Vec<String> = f.spawner.ran().into_iter().map(|(_, i)| i).collect();
        assert_eq!(
            told,
            [
                "quit\n",
                "get_default_active_thread_percentage\n",
                "set_default_active_thread_percentage 30\n",
                "set_default_device_pinned_mem_limit 0 1024M\n",
                "set_default_device_pinned_mem_limit 1 1024M\n",
            ]
        );
        let mode = |i: usize| {
            f.backend
                .compute_mode(&f.backend.node().gpus[i].uuid)
                .unwrap()
        };
        assert_eq!(
            [mode(0), mode(1), mode(2)],
            [
                ComputeMode::Default,
                ComputeMode::ExclusiveProcess,
                ComputeMode::ExclusiveProcess
            ]
        );
        assert_eq!(f.mps.phases()[U1], "serving");
        // Asked again (a repeat, a restart of the plugin): nothing new.
        let (p, g, s) = (port.clone(), gpus(&f.backend, &[1, 2]), settings.clone());
        assert_eq!(blocking(move || p.start(U1, &g, &s)).await.unwrap(), dirs);
        assert_eq!(f.spawner.spawned().len(), 1);
        // A second claim: a daemon of its own.
        let (p, g) = (port.clone(), gpus(&f.backend, &[3]));
        blocking(move || p.start(U2, &g, &MpsSettings::default()))
            .await
            .unwrap();
        assert_eq!(f.spawner.running(), 2);
        // Stop: quit, DEFAULT, directories gone; the other one runs on.
        let p = port.clone();
        blocking(move || p.stop(U1)).await.unwrap();
        assert_eq!(f.spawner.running(), 1);
        assert_eq!([mode(1), mode(2)], [ComputeMode::Default; 2]);
        assert!(
            !f.dir
                .path()
                .join(format!("run/nvidia/mps/dra-claim-{U1}"))
                .exists()
        );
        assert_eq!(f.mps.phases().keys().collect::<Vec<_>>(), [U2]);
        // The agent stops: every daemon quits.
        f.mps.stop().await;
        assert_eq!(f.spawner.running(), 0);
        assert_eq!(mode(3), ComputeMode::Default);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_start_leaves_nothing_and_an_exit_is_started_again() {
        let f = fixture();
        let port = f.mps.port();
        let (p, g) = (port.clone(), gpus(&f.backend, &[0]));
        let refused = MpsSettings {
            default_active_thread_percentage: Some(13),
            ..Default::default()
        };
        let err = blocking(move || p.start(U1, &g, &refused))
            .await
            .unwrap_err();
        assert!(
            err.contains("refused `set_default_active_thread_percentage 13`: refused"),
            "{err}"
        );
        assert_eq!(f.spawner.running(), 0);
        let uuid0 = f.backend.node().gpus[0].uuid.clone();
        assert_eq!(
            f.backend.compute_mode(&uuid0).unwrap(),
            ComputeMode::Default
        );
        assert!(
            !f.dir
                .path()
                .join(format!("run/nvidia/mps/dra-claim-{U1}"))
                .exists()
        );
        assert!(f.mps.phases().is_empty());
        // A key that names no GPU of the claim.
        let (p, g) = (port.clone(), gpus(&f.backend, &[0]));
        let bad = MpsSettings {
            per_device_pinned_memory_limit_mib: [("3".to_string(), 10)].into(),
            ..Default::default()
        };
        let err = blocking(move || p.start(U1, &g, &bad)).await.unwrap_err();
        assert!(err.contains("names \"3\""), "{err}");
        // One that serves, then exits: failed in the phases, started again.
        let (p, g) = (port.clone(), gpus(&f.backend, &[0]));
        blocking(move || p.start(U1, &g, &MpsSettings::default()))
            .await
            .unwrap();
        let n = f.spawner.spawned().len() - 1;
        assert!(f.spawner.exit(
            n,
            Exit {
                code: None,
                signal: Some(9)
            }
        ));
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let mut saw_failed = false;
        loop {
            let phase = f.mps.phases().get(U1).cloned().unwrap_or_default();
            saw_failed |= phase.starts_with("failed: ") && phase.contains("killed by SIGKILL");
            if saw_failed && phase == "serving" {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "{phase}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(f.spawner.running(), 1);
        f.mps.stop().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mig_devices_are_seen_by_their_uuids_and_their_compute_mode_left_alone() {
        let b = mig_node("9.0");
        let (_dir, spawner, mps) = daemons_on(b.clone());
        let port = mps.port();
        // Two MIG devices of GPU 0 and the full GPU 1: one daemon over all.
        let claim = vec![mig_gpu(&b, 1), full_gpu(&b), mig_gpu(&b, 0)];
        let settings = MpsSettings {
            multi_user: true,
            per_device_pinned_memory_limit_mib: BTreeMap::from([
                (claim[2].uuid.clone(), 2048),
                ("0".to_string(), 1024),
            ]),
            ..Default::default()
        };
        let (p, g, s) = (port.clone(), claim.clone(), settings.clone());
        blocking(move || p.start(U1, &g, &s)).await.unwrap();
        let launch = &spawner.spawned()[0];
        assert_eq!(launch.args, ["-f", "-M"]);
        let uuids: Vec<&str> = claim.iter().map(|g| g.uuid.as_str()).collect();
        assert_eq!(launch.env["CUDA_VISIBLE_DEVICES"], uuids.join(","));
        assert!(uuids[0].starts_with("MIG-") && uuids[2].starts_with("MIG-"));
        // Limits by the daemon's device ordinals (its visible devices' order).
        let told: Vec<String> = spawner.ran().into_iter().map(|(_, i)| i).collect();
        assert_eq!(
            told,
            [
                "quit\n",
                "get_default_active_thread_percentage\n",
                "set_default_device_pinned_mem_limit 0 1024M\n",
                "set_default_device_pinned_mem_limit 2 2048M\n",
            ]
        );
        // Only the full GPU's mode is changed, and back at stop.
        let full = claim[1].uuid.clone();
        assert_eq!(
            *b.set.lock().unwrap(),
            [(full.clone(), ComputeMode::ExclusiveProcess)]
        );
        let p = port.clone();
        blocking(move || p.stop(U1)).await.unwrap();
        assert_eq!(
            *b.set.lock().unwrap(),
            [
                (full.clone(), ComputeMode::ExclusiveProcess),
                (full, ComputeMode::Default)
            ]
        );
        assert_eq!(spawner.running(), 0);
        mps.stop().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn multi_user_is_refused_naming_a_gpu_older_than_volta() {
        let b = mig_node("6.0");
        let (_dir, spawner, mps) = daemons_on(b.clone());
        let port = mps.port();
        let claim = vec![full_gpu(&b), mig_gpu(&b, 0), mig_gpu(&b, 1)];
        let multi = MpsSettings {
            multi_user: true,
            ..Default::default()
        };
        let (p, g, s) = (port.clone(), claim.clone(), multi.clone());
        let err = blocking(move || p.start(U1, &g, &s)).await.unwrap_err();
        let parent = &claim[1].gpu_uuid;
        assert_eq!(
            err,
            format!(
                "mpsConfig.multiUser needs compute capability 7.0 (Volta) or newer on every GPU of the claim: GPU gpu-0 ({parent}) has compute capability 6.0"
            )
        );
        assert!(spawner.spawned().is_empty());
        assert!(b.set.lock().unwrap().is_empty());
        assert!(mps.phases().is_empty());
        // The same GPUs without multiUser: started, without -M.
        let (p, g) = (port.clone(), claim.clone());
        blocking(move || p.start(U1, &g, &MpsSettings::default()))
            .await
            .unwrap();
        assert_eq!(spawner.spawned()[0].args, ["-f"]);
        // The full GPU alone (9.0) takes multiUser.
        let (p, g) = (port.clone(), vec![full_gpu(&b)]);
        blocking(move || p.start(U2, &g, &multi)).await.unwrap();
        assert_eq!(spawner.spawned()[1].args, ["-f", "-M"]);
        mps.stop().await;
    }

    #[tokio::test]
    async fn missing_capabilities_are_said_in_words() {
        let dir = tempfile::tempdir().unwrap();
        let mps = DraMps::start(
            DraMpsSetup {
                host: HostRoot::new(dir.path()).unwrap(),
                spawner: Arc::new(FakeSpawner::new()),
                backend: Arc::new(SimulatedBackend::new(
                    simnode::NodeDescription::load("t4-4").unwrap(),
                )),
                root: "/run/nvidia/mps".into(),
                missing_caps: vec!["CAP_SYS_ADMIN".into()],
            },
            None,
        );
        assert_eq!(
            mps.unavailable().as_deref(),
            Some("claims with MPS sharing fail: the MPS control daemon needs CAP_SYS_ADMIN")
        );
        mps.stop().await;
    }
}
