//! What a workload check is (the device, the image, the expectations), what
//! it reports and why it fails: plain data and constants, below the CRI
//! conversation (`sandbox.rs`) and the run (`lib.rs`).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use gpu_model::cdi;
use hostlib::{HostError, HostRoot};

/// Where the checks' log directories go on the host (one per check,
/// removed after it).
pub const DEFAULT_LOG_ROOT: &str = "/run/gpu-agent/workload";

/// How long a whole check may take by default, an image pull included.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

/// The pod namespace of the check's sandboxes.
pub const POD_NAMESPACE: &str = "gpu-agent";

/// The label every sandbox and container of the check carries
/// (with [`LABEL_VALUE`]).
pub const LABEL: &str = "app.kubernetes.io/managed-by";
pub const LABEL_VALUE: &str = "gpu-agent";

/// The prefix of every line the check's script prints.
pub const LINE_PREFIX: &str = "gpu-agent-check: ";

/// Time allowed to each cleanup call, and to a call that creates something
/// (sandbox, container) to answer after the check's deadline, so that what it
/// created can still be removed.
pub(crate) const CLEANUP_GRACE: Duration = Duration::from_secs(15);

/// First and longest sleep between two `ContainerStatus` polls.
pub(crate) const POLL_FIRST: Duration = Duration::from_millis(10);
pub(crate) const POLL_MAX: Duration = Duration::from_millis(200);

/// The container's script; the checks are its arguments (`node:<path>`,
/// `env:<NAME>=<value>`). Variable names carry a prefix the expectations may
/// not use ([`WorkloadCheck::run`] refuses such names).
pub(crate) const SCRIPT: &str = r#"_gpu_agent_failed=0
for _gpu_agent_check in "$@"; do
  case "$_gpu_agent_check" in
  node:*)
    _gpu_agent_path=${_gpu_agent_check#node:}
    if [ -c "$_gpu_agent_path" ]; then
      :
    elif [ -e "$_gpu_agent_path" ]; then
      printf 'gpu-agent-check: %s is not a character device\n' "$_gpu_agent_path"
      _gpu_agent_failed=1
    else
      printf 'gpu-agent-check: %s is missing\n' "$_gpu_agent_path"
      _gpu_agent_failed=1
    fi
    ;;
  path:*)
    _gpu_agent_path=${_gpu_agent_check#path:}
    if [ ! -e "$_gpu_agent_path" ]; then
      printf 'gpu-agent-check: %s is missing\n' "$_gpu_agent_path"
      _gpu_agent_failed=1
    fi
    ;;
  env:*)
    _gpu_agent_kv=${_gpu_agent_check#env:}
    _gpu_agent_name=${_gpu_agent_kv%%=*}
    _gpu_agent_want=${_gpu_agent_kv#*=}
    eval "_gpu_agent_set=\${$_gpu_agent_name+set} _gpu_agent_got=\${$_gpu_agent_name-}"
    if [ -z "$_gpu_agent_set" ]; then
      printf 'gpu-agent-check: %s is not set (want %s)\n' "$_gpu_agent_name" "$_gpu_agent_want"
      _gpu_agent_failed=1
    elif [ "$_gpu_agent_got" != "$_gpu_agent_want" ]; then
      printf 'gpu-agent-check: %s is %s, want %s\n' "$_gpu_agent_name" "$_gpu_agent_got" "$_gpu_agent_want"
      _gpu_agent_failed=1
    fi
    ;;
  esac
done
if [ "$_gpu_agent_failed" = 0 ]; then
  printf 'gpu-agent-check: ok\n'
fi
exit "$_gpu_agent_failed"
"#;

/// Why a workload check did not pass. Each variant names the socket, image
/// or CDI device it is about.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    /// An expectation the script cannot check (not an absolute path, not a
    /// shell variable name).
    #[error("workload check for {cdi_device}: {what}")]
    Invalid { cdi_device: String, what: String },
    /// Nothing answers on the socket.
    #[error("cannot reach the container runtime at {socket}: {source}")]
    Unreachable {
        socket: PathBuf,
        #[source]
        source: tonic::transport::Error,
    },
    /// The image is not on the node and could not be pulled.
    #[error("image {image} could not be had through {socket}: {message}")]
    ImageUnavailable {
        socket: PathBuf,
        image: String,
        message: String,
    },
    /// The runtime refused the pod sandbox.
    #[error("the runtime at {socket} refused the pod sandbox {sandbox}: {message}")]
    SandboxRefused {
        socket: PathBuf,
        sandbox: String,
        message: String,
    },
    /// The runtime refused to create or start the container (a CDI device it
    /// cannot resolve ends here, in the runtime's own words).
    #[error(
        "the runtime at {socket} refused to {action} the container ({image}, {cdi_device}): {message}"
    )]
    ContainerRefused {
        socket: PathBuf,
        image: String,
        cdi_device: String,
        action: &'static str,
        message: String,
    },
    /// The container ran and found something missing or different.
    #[error("in a container with {cdi_device} ({image}): {} (exit code {exit_code})", .lines.join("; "))]
    ChecksFailed {
        image: String,
        cdi_device: String,
        exit_code: i32,
        lines: Vec<String>,
    },
    /// The container was killed or removed from outside before it finished:
    /// no verdict on the GPU.
    #[error(
        "the check's container with {cdi_device} was stopped from outside before it finished: {reason}"
    )]
    Interrupted { cdi_device: String, reason: String },
    /// The check did not finish in time.
    #[error(
        "the workload check with {cdi_device} through {socket} did not finish in {after:?} (at: {stage})"
    )]
    TimedOut {
        socket: PathBuf,
        cdi_device: String,
        stage: &'static str,
        after: Duration,
    },
    /// The log directory could not be made or read.
    #[error("workload check log directory: {0}")]
    LogDir(#[from] HostError),
}

/// What a passed check looked at, and how long each part took.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkloadReport {
    pub socket: PathBuf,
    pub image: String,
    pub cdi_device: String,
    /// The sandbox's name (`gpu-agent-validate-<pid>-<n>`).
    pub sandbox: String,
    /// Device nodes found to be character devices.
    pub nodes: Vec<String>,
    /// Paths found (the spec's mounts: the driver's files).
    pub paths: Vec<String>,
    /// Environment variables found with their values.
    pub env: Vec<(String, String)>,
    /// True when the image had to be pulled.
    pub pulled: bool,
    /// The container's output.
    pub output: Vec<String>,
    /// Image status (and pull), sandbox, container (create to exit), cleanup.
    pub image_time: Duration,
    pub sandbox_time: Duration,
    pub container_time: Duration,
    pub cleanup_time: Duration,
    /// The whole check.
    pub elapsed: Duration,
    /// Cleanup calls that failed (the check's verdict stands).
    pub cleanup_warnings: Vec<String>,
}

impl WorkloadReport {
    /// One line for logs and `gpu-agent status`.
    pub fn summary(&self) -> String {
        let paths = if self.paths.is_empty() {
            String::new()
        } else {
            format!(", {} driver file(s)", self.paths.len())
        };
        format!(
            "{} in a container ({}): {} device node(s){paths} and {} environment variable(s) as expected ({} ms)",
            self.cdi_device,
            self.image,
            self.nodes.len(),
            self.env.len(),
            self.elapsed.as_millis()
        )
    }
}

/// One workload check: what to run, where, and what to expect inside.
#[derive(Clone, Debug)]
pub struct WorkloadCheck<'a> {
    /// The host, for the log directory (a host path the runtime writes).
    pub host: &'a HostRoot,
    /// The CRI socket, already resolved under the host root.
    pub socket: PathBuf,
    /// The image the container runs; it needs `/bin/sh`.
    pub image: String,
    /// The fully qualified CDI device (`nvidia.com/gpu=0`).
    pub cdi_device: String,
    /// Paths that must be character devices in the container.
    pub expect_nodes: Vec<String>,
    /// Environment variables that must have these values.
    pub expect_env: Vec<(String, String)>,
    /// Paths that must exist in the container (the spec's mounts: the
    /// driver's libraries and programs).
    pub expect_paths: Vec<String>,
    /// The whole check's limit, an image pull included.
    pub timeout: Duration,
    /// Host directory under which the check's log directory is made.
    pub log_root: String,
    /// The runtime handler (RuntimeClass handler); empty: the default.
    pub runtime_handler: String,
}

impl<'a> WorkloadCheck<'a> {
    /// A check of `cdi_device` with no expectations yet, the default
    /// timeout, log root and runtime handler.
    pub fn new(host: &'a HostRoot, socket: PathBuf, image: &str, cdi_device: &str) -> Self {
        WorkloadCheck {
            host,
            socket,
            image: image.into(),
            cdi_device: cdi_device.into(),
            expect_nodes: Vec::new(),
            expect_env: Vec::new(),
            expect_paths: Vec::new(),
            timeout: DEFAULT_TIMEOUT,
            log_root: DEFAULT_LOG_ROOT.into(),
            runtime_handler: String::new(),
        }
    }

    /// Expects what `spec` promises for the device named by `cdi_device`:
    /// the device's and the spec's device nodes, mounts (the paths they
    /// put in the container) and environment variables.
    /// False (and nothing changed) when the spec is of another kind or has no
    /// such device.
    pub fn expect_from_spec(&mut self, spec: &cdi::Spec) -> bool {
        let Some((kind, name)) = self.cdi_device.split_once('=') else {
            return false;
        };
        if kind != spec.kind {
            return false;
        }
        let Some(device) = spec.devices.iter().find(|d| d.name == name) else {
            return false;
        };
        for edits in [&device.container_edits, &spec.container_edits] {
            for n in &edits.device_nodes {
                if !self.expect_nodes.contains(&n.path) {
                    self.expect_nodes.push(n.path.clone());
                }
            }
            for m in &edits.mounts {
                if !self.expect_paths.contains(&m.container_path) {
                    self.expect_paths.push(m.container_path.clone());
                }
            }
            for e in &edits.env {
                let (k, v) = e.split_once('=').unwrap_or((e.as_str(), ""));
                // The device's own value wins over the spec's (as in CDI).
                if !self.expect_env.iter().any(|(have, _)| have == k) {
                    self.expect_env.push((k.to_string(), v.to_string()));
                }
            }
        }
        true
    }

    /// The script's arguments, or why an expectation cannot be checked.
    pub(crate) fn checks(&self) -> Result<Vec<String>, WorkloadError> {
        let invalid = |what: String| WorkloadError::Invalid {
            cdi_device: self.cdi_device.clone(),
            what,
        };
        if !self.cdi_device.contains('=') || !self.cdi_device.contains('/') {
            return Err(invalid(format!(
                "{:?} is not a fully qualified CDI device name (vendor.com/class=name)",
                self.cdi_device
            )));
        }
        let mut args = Vec::new();
        for n in &self.expect_nodes {
            if !n.starts_with('/') {
                return Err(invalid(format!(
                    "device node {n:?} is not an absolute path"
                )));
            }
            args.push(format!("node:{n}"));
        }
        for p in &self.expect_paths {
            if !p.starts_with('/') {
                return Err(invalid(format!("path {p:?} is not an absolute path")));
            }
            args.push(format!("path:{p}"));
        }
        for (k, v) in &self.expect_env {
            let mut chars = k.chars();
            let ok = chars
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
                && !k.starts_with("_gpu_agent_");
            if !ok {
                return Err(invalid(format!(
                    "environment variable name {k:?} cannot be checked by sh"
                )));
            }
            args.push(format!("env:{k}={v}"));
        }
        Ok(args)
    }

    /// `fut`, or [`WorkloadError::TimedOut`] at `deadline`.
    pub(crate) async fn bounded<T>(
        &self,
        deadline: Instant,
        stage: &'static str,
        fut: impl std::future::Future<Output = T>,
    ) -> Result<T, WorkloadError> {
        tokio::time::timeout_at(deadline.into(), fut)
            .await
            .map_err(|_| self.timed_out(stage))
    }

    pub(crate) fn timed_out(&self, stage: &'static str) -> WorkloadError {
        WorkloadError::TimedOut {
            socket: self.socket.clone(),
            cdi_device: self.cdi_device.clone(),
            stage,
            after: self.timeout,
        }
    }
}
