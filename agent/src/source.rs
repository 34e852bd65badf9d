//! Where discovery reads from: the host (sysfs and /proc under the host
//! root, NVML), or a simulated node (a node description written out as a
//! sysfs/procfs tree in a private temp dir, and the simulated backend), so
//! the same discovery code reads both.

use std::path::{Path, PathBuf};

use hostlib::HostRoot;
use simnode::{DescError, NodeDescription};

use crate::backend::nvml::{self, NvmlBackend};
use crate::backend::sim::SimulatedBackend;
use crate::backend::{BackendError, BackendSnapshot, GpuBackend};

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

impl NodeView {
    /// The real host: sysfs under `host`, NVML from `nvml_lib`.
    pub fn host(host: &HostRoot, nvml_lib: Option<&Path>) -> Self {
        let lib = nvml_lib_path(host, nvml_lib);
        let backend: Box<dyn GpuBackend> = match NvmlBackend::open(lib.as_deref()) {
            Ok(b) => Box::new(b),
            Err(e) => {
                tracing::info!(error = %e, "NVML is not available");
                Box::new(Unavailable {
                    name: "nvml",
                    reason: e.to_string(),
                })
            }
        };
        NodeView {
            sys: host.clone(),
            backend,
            simulated: None,
            _sandbox: None,
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
            backend: Box::new(SimulatedBackend::new(desc)),
            _sandbox: Some(dir),
        })
    }
}
