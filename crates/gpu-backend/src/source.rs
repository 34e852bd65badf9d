//! Where discovery reads from: the host (sysfs and /proc under the host
//! root, NVML), or a simulated node (a node description written out as a
//! sysfs/procfs tree in a private temp dir, and the simulated backend), so
//! the same discovery code reads both.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use hostlib::HostRoot;
use simnode::{DescError, NodeDescription};

use crate::nvml::{self, NvmlBackend};
use crate::sim::SimulatedBackend;
use crate::{BackendError, BackendSnapshot, GpuBackend};

/// Where libnvidia-ml usually is on a host, for a root other than `/`
/// (in a DaemonSet the loader's own search cannot see the host's libraries).
const HOST_LIB_DIRS: &[&str] = &[
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib64",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib",
    "/run/nvidia/driver/usr/lib/x86_64-linux-gnu",
    "/run/nvidia/driver/usr/lib64",
];

/// The sysfs/proc root and the backend one pass reads.
#[derive(Debug)]
pub struct NodeView {
    pub sys: HostRoot,
    pub backend: Box<dyn GpuBackend>,
    /// The node description's name when simulated.
    pub simulated: Option<String>,
    /// NVML being opened in the background ([`NodeView::host_opening_later`]).
    opening: Option<Arc<Opening>>,
    _sandbox: Option<tempfile::TempDir>,
}

/// The node view could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error(transparent)]
    Description(#[from] DescError),
    #[error("cannot write the simulated node's sysfs: {0}")]
    Sandbox(#[source] std::io::Error),
    #[error(transparent)]
    Host(#[from] hostlib::HostError),
}

/// A backend that could not be opened; every snapshot says why.
#[derive(Debug)]
struct Unavailable {
    name: &'static str,
    reason: String,
}

impl GpuBackend for Unavailable {
    fn name(&self) -> &'static str {
        self.name
    }

    fn snapshot(&self) -> Result<BackendSnapshot, BackendError> {
        Err(BackendError::Unavailable(self.reason.clone()))
    }
}

/// The NVML library to load: the one asked for, else the host's (when the
/// host root is not `/`), else the loader's default.
pub fn nvml_lib_path(host: &HostRoot, asked: Option<&Path>) -> Option<PathBuf> {
    if let Some(p) = asked {
        return Some(p.to_path_buf());
    }
    if host.is_system() {
        return None;
    }
    HOST_LIB_DIRS
        .iter()
        .filter_map(|d| host.resolve(format!("{d}/{}", nvml::DEFAULT_LIB)).ok())
        .find(|p| p.exists())
}

/// NVML from `lib`, or a backend that says why it cannot be had.
fn open_nvml(lib: Option<&Path>) -> Box<dyn GpuBackend> {
    match NvmlBackend::open(lib) {
        Ok(b) => Box::new(b),
        Err(e) => {
            tracing::info!(error = %e, "NVML is not available");
            Box::new(Unavailable {
                name: "nvml",
                reason: e.to_string(),
            })
        }
    }
}

/// NVML opened on a thread of its own while the agent sets itself up
/// (`nvmlInit` took 10.7 ms on a real H100, 71.5 ms after a cold boot: the
/// longest step before the kubelet can hear from us). The first call that
/// needs NVML waits for it; a view whose opening was never started opens it
/// then. Every [`GpuBackend`] method is passed on (a new one must be too).
#[derive(Debug)]
struct Opening {
    lib: Option<PathBuf>,
    thread: Mutex<Option<std::thread::JoinHandle<Box<dyn GpuBackend>>>>,
    opened: OnceLock<Box<dyn GpuBackend>>,
}

impl Opening {
    /// Starts opening NVML on a thread (once).
    fn start(&self) {
        let mut thread = self.thread.lock().unwrap_or_else(|p| p.into_inner());
        if thread.is_some() || self.opened.get().is_some() {
            return;
        }
        let lib = self.lib.clone();
        match std::thread::Builder::new()
            .name("nvml-init".into())
            .spawn(move || open_nvml(lib.as_deref()))
        {
            Ok(t) => *thread = Some(t),
            // Opened on first use instead.
            Err(e) => tracing::debug!(error = %e, "cannot start a thread to open NVML"),
        }
    }

    /// The opened backend (waiting for the opening thread, if any).
    fn get(&self) -> &dyn GpuBackend {
        self.opened
            .get_or_init(|| {
                let thread = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
                match thread.map(std::thread::JoinHandle::join) {
                    Some(Ok(b)) => b,
                    Some(Err(_)) => Box::new(Unavailable {
                        name: "nvml",
                        reason: "opening NVML panicked".into(),
                    }),
                    None => open_nvml(self.lib.as_deref()),
                }
            })
            .as_ref()
    }
}

/// The view's backend while NVML opens: the [`Opening`] it shares with the
/// view (a local type, as the backend trait is the model's).
#[derive(Debug)]
struct SharedOpening(Arc<Opening>);

impl GpuBackend for SharedOpening {
    fn sampler(&self) -> Result<Box<dyn crate::Sampler>, BackendError> {
        self.0.get().sampler()
    }
    fn mig_control(&self) -> Option<&dyn gpu_model::mig::MigControl> {
        self.0.get().mig_control()
    }
    fn name(&self) -> &'static str {
        "nvml"
    }
    fn snapshot(&self) -> Result<BackendSnapshot, BackendError> {
        self.0.get().snapshot()
    }
    fn watch_health(&self, events: crate::HealthSender) -> Result<(), BackendError> {
        self.0.get().watch_health(events)
    }
    fn set_compute_mode(&self, uuid: &str, mode: crate::ComputeMode) -> Result<(), BackendError> {
        self.0.get().set_compute_mode(uuid, mode)
    }
    fn compute_mode(&self, uuid: &str) -> Result<crate::ComputeMode, BackendError> {
        self.0.get().compute_mode(uuid)
    }
}

impl NodeView {
    /// The real host: sysfs under `host`, NVML from `nvml_lib`.
    pub fn host(host: &HostRoot, nvml_lib: Option<&Path>) -> Self {
        let lib = nvml_lib_path(host, nvml_lib);
        NodeView {
            sys: host.clone(),
            backend: open_nvml(lib.as_deref()),
            simulated: None,
            opening: None,
            _sandbox: None,
        }
    }

    /// [`NodeView::host`] with NVML opened later: on a thread of its own
    /// from [`NodeView::start_opening`] (`run` calls it once it has trimmed
    /// its capabilities, which a thread started earlier would keep), or by
    /// the first call that needs it.
    pub fn host_opening_later(host: &HostRoot, nvml_lib: Option<&Path>) -> Self {
        let opening = Arc::new(Opening {
            lib: nvml_lib_path(host, nvml_lib),
            thread: Mutex::new(None),
            opened: OnceLock::new(),
        });
        NodeView {
            sys: host.clone(),
            backend: Box::new(SharedOpening(opening.clone())),
            simulated: None,
            opening: Some(opening),
            _sandbox: None,
        }
    }

    /// Starts opening NVML in the background, for a view made by
    /// [`NodeView::host_opening_later`] (else nothing).
    pub fn start_opening(&self) {
        if let Some(o) = &self.opening {
            o.start();
        }
    }

    /// A simulated node from a description (file path or built-in name),
    /// written to a private temp dir that lives as long as the view.
    pub fn simulated(name_or_path: &str) -> Result<Self, SourceError> {
        let desc = NodeDescription::load(name_or_path)?;
        let dir = tempfile::Builder::new()
            .prefix("gpu-agent-sim-")
            .tempdir()
            .map_err(SourceError::Sandbox)?;
        desc.materialize(dir.path()).map_err(SourceError::Sandbox)?;
        let sys = HostRoot::new(dir.path())?;
        Ok(NodeView {
            sys,
            simulated: Some(desc.name.clone()),
            opening: None,
            backend: Box::new(SimulatedBackend::new(desc)),
            _sandbox: Some(dir),
        })
    }
}
