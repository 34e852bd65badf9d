//! The validator's workload check (`spec.validator.workload`): one
//! short-lived container, run through the node's CRI runtime with one GPU
//! injected by CDI, that looks from inside at what the GPU's CDI device
//! promised: its device nodes are character devices and its environment
//! variables have their values.
//!
//! The way through the runtime is the kubelet's, minus the kubelet:
//! `ImageStatus` (and `PullImage` when the image is absent), `RunPodSandbox`
//! on the node's network (no CNI needed), `CreateContainer` naming the CDI
//! device, `StartContainer`, `ContainerStatus` polled until the container
//! exits, then the container's log read back from a directory gpu-agent
//! passed as the sandbox's log directory. Whatever happened, the container
//! and the sandbox are removed and the log directory deleted.
//!
//! The container runs `/bin/sh -c <script> gpu-agent-check <checks…>`: the
//! script is fixed and the expectations are its arguments (nothing of them is
//! spliced into shell text), so any image with a POSIX `sh` will do. It
//! prints one `gpu-agent-check: …` line per failure and exits 1, or prints
//! `gpu-agent-check: ok` and exits 0.
//!
//! What a runtime says when it refuses comes through as it said it
//! (containerd: `CDI device injection failed: unresolvable CDI devices
//! nvidia.com/gpu=0`). [`cannot_run_reason`] tells beforehand, in one line,
//! why a node cannot run the check at all (no CRI socket, a runtime that is
//! not ready, containerd older than 1.7 or with CDI off).
//!
//! On a Kubernetes node the kubelet may stop pod sandboxes it did not
//! create (the Kubernetes documentation warns of it for `crictl runp`); the
//! check takes about half a second, but one cut short that way ends in
//! [`WorkloadError::Interrupted`], not in a verdict on the GPU.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use gpu_agent_proto::cri::v1 as cri;
use gpu_agent_proto::cri::v1::image_service_client::ImageServiceClient;
use gpu_agent_proto::cri::v1::runtime_service_client::RuntimeServiceClient;
use hostlib::{HostError, HostRoot};
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint};

use gpu_model::cdi;

mod sandbox;

pub use sandbox::log_lines;
use sandbox::{Run, dial};

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
const CLEANUP_GRACE: Duration = Duration::from_secs(15);

/// First and longest sleep between two `ContainerStatus` polls.
const POLL_FIRST: Duration = Duration::from_millis(10);
const POLL_MAX: Duration = Duration::from_millis(200);

/// The container's script; the checks are its arguments (`node:<path>`,
/// `env:<NAME>=<value>`). Variable names carry a prefix the expectations may
/// not use ([`WorkloadCheck::run`] refuses such names).
const SCRIPT: &str = r#"_gpu_agent_failed=0
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
        format!(
            "{} in a container ({}): {} device node(s) and {} environment variable(s) as expected ({} ms)",
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
    /// The whole check's limit, an image pull included.
    pub timeout: Duration,
    /// Host directory under which the check's log directory is made.
    pub log_root: String,
    /// The runtime handler (RuntimeClass handler); empty: the default.
    pub runtime_handler: String,
}

/// Numbers the checks of this process (sandbox names must be unique).
static CHECKS: AtomicU64 = AtomicU64::new(0);

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
            timeout: DEFAULT_TIMEOUT,
            log_root: DEFAULT_LOG_ROOT.into(),
            runtime_handler: String::new(),
        }
    }

    /// Expects what `spec` promises for the device named by `cdi_device`:
    /// the device's and the spec's device nodes and environment variables.
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
    fn checks(&self) -> Result<Vec<String>, WorkloadError> {
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

    /// Runs the check. The sandbox and container are removed and the log
    /// directory deleted whatever the outcome.
    pub async fn run(&self) -> Result<WorkloadReport, WorkloadError> {
        let started = Instant::now();
        let deadline = started + self.timeout;
        let checks = self.checks()?;
        let n = CHECKS.fetch_add(1, Ordering::Relaxed);
        let name = format!("gpu-agent-validate-{}-{n}", std::process::id());
        tracing::info!(stage = "validate", socket = %self.socket.display(), image = %self.image, device = %self.cdi_device, sandbox = %name, "workload check: starting");

        let channel = dial(&self.socket)
            .await
            .map_err(|source| WorkloadError::Unreachable {
                socket: self.socket.clone(),
                source,
            })?;
        let mut rt = RuntimeServiceClient::new(channel.clone());
        let mut images = ImageServiceClient::new(channel);

        let pulled = self.ensure_image(&mut images, deadline).await?;
        let image_time = started.elapsed();

        // The log directory: a host path the runtime writes and we read.
        let log_dir = format!("{}/{name}", self.log_root.trim_end_matches('/'));
        let local_log_dir = self.host.resolve(&log_dir)?;
        std::fs::create_dir_all(&local_log_dir).map_err(|e| HostError::io(&local_log_dir, e))?;

        let mut run = Run {
            check: self,
            rt: &mut rt,
            deadline,
            sandbox_name: name.clone(),
            sandbox_id: None,
            container_id: None,
            log_dir: log_dir.clone(),
        };
        let outcome = run.sandbox_and_container(&checks).await;
        let cleanup_started = Instant::now();
        let cleanup_warnings = run.cleanup().await;
        if let Err(e) = std::fs::remove_dir_all(&local_log_dir) {
            tracing::warn!(stage = "validate", path = %local_log_dir.display(), error = %e, "cannot remove the workload check's log directory");
        }
        let cleanup_time = cleanup_started.elapsed();
        for w in &cleanup_warnings {
            tracing::warn!(stage = "validate", sandbox = %name, "{w}");
        }

        let ran = match outcome {
            Ok(ran) => ran,
            Err(e) => {
                tracing::warn!(stage = "validate", socket = %self.socket.display(), device = %self.cdi_device, error = %e, "workload check failed");
                return Err(e);
            }
        };
        let report = WorkloadReport {
            socket: self.socket.clone(),
            image: self.image.clone(),
            cdi_device: self.cdi_device.clone(),
            sandbox: name,
            nodes: self.expect_nodes.clone(),
            env: self.expect_env.clone(),
            pulled,
            output: ran.output,
            image_time,
            sandbox_time: ran.sandbox_time,
            container_time: ran.container_time,
            cleanup_time,
            elapsed: started.elapsed(),
            cleanup_warnings,
        };
        tracing::info!(stage = "validate", socket = %self.socket.display(), device = %self.cdi_device, "workload check passed: {}", report.summary());
        Ok(report)
    }

    /// Pulls the image unless the runtime has it. True when it pulled.
    async fn ensure_image(
        &self,
        images: &mut ImageServiceClient<Channel>,
        deadline: Instant,
    ) -> Result<bool, WorkloadError> {
        let spec = cri::ImageSpec {
            image: self.image.clone(),
            ..Default::default()
        };
        let unavailable = |message: String| WorkloadError::ImageUnavailable {
            socket: self.socket.clone(),
            image: self.image.clone(),
            message,
        };
        let status = self
            .bounded(
                deadline,
                "ImageStatus",
                images.image_status(cri::ImageStatusRequest {
                    image: Some(spec.clone()),
                    verbose: false,
                }),
            )
            .await?
            .map_err(|s| unavailable(format!("ImageStatus: {}", s.message())))?;
        if status.into_inner().image.is_some() {
            return Ok(false);
        }
        tracing::info!(stage = "validate", socket = %self.socket.display(), image = %self.image, "workload check: pulling the image");
        self.bounded(
            deadline,
            "PullImage",
            images.pull_image(cri::PullImageRequest {
                image: Some(spec),
                sandbox_config: None,
            }),
        )
        .await?
        .map_err(|s| unavailable(s.message().to_string()))?;
        Ok(true)
    }

    /// `fut`, or [`WorkloadError::TimedOut`] at `deadline`.
    async fn bounded<T>(
        &self,
        deadline: Instant,
        stage: &'static str,
        fut: impl std::future::Future<Output = T>,
    ) -> Result<T, WorkloadError> {
        tokio::time::timeout_at(deadline.into(), fut)
            .await
            .map_err(|_| self.timed_out(stage))
    }

    fn timed_out(&self, stage: &'static str) -> WorkloadError {
        WorkloadError::TimedOut {
            socket: self.socket.clone(),
            cdi_device: self.cdi_device.clone(),
            stage,
            after: self.timeout,
        }
    }
}

/// What a CRI runtime says about itself: enough to tell whether it can run
/// the check.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RuntimeFacts {
    /// `containerd`, `cri-o`, ...
    pub name: String,
    pub version: String,
    /// Conditions that are false (type: reason message).
    pub not_ready: Vec<String>,
    /// containerd's `enableCDI` from its verbose status; `None` where the
    /// runtime does not report it (CRI-O has CDI always on and reports no
    /// such key; containerd 1.6 has no CDI).
    pub cdi_enabled: Option<bool>,
}

/// Asks the runtime at `socket` for its name, version, conditions and
/// configuration.
pub async fn runtime_facts(socket: &Path) -> Result<RuntimeFacts, String> {
    if !socket.exists() {
        return Err(format!(
            "no CRI socket at {}: no container runtime serves CRI there",
            socket.display()
        ));
    }
    let channel = dial(socket).await.map_err(|e| {
        format!(
            "cannot reach the container runtime at {}: {e}",
            socket.display()
        )
    })?;
    let mut rt = RuntimeServiceClient::new(channel);
    let limit = gpu_grpc::DIAL_TIMEOUT;
    let version = tokio::time::timeout(limit, rt.version(cri::VersionRequest::default()))
        .await
        .map_err(|_| {
            format!(
                "{}: no answer to CRI Version in {limit:?}",
                socket.display()
            )
        })?
        .map_err(|s| {
            format!(
                "{} does not answer CRI runtime.v1 Version: {}",
                socket.display(),
                s.message()
            )
        })?
        .into_inner();
    let status = tokio::time::timeout(limit, rt.status(cri::StatusRequest { verbose: true }))
        .await
        .map_err(|_| format!("{}: no answer to CRI Status in {limit:?}", socket.display()))?
        .map_err(|s| format!("{}: CRI Status: {}", socket.display(), s.message()))?
        .into_inner();
    let not_ready = status
        .status
        .map(|s| {
            s.conditions
                .into_iter()
                .filter(|c| !c.status)
                .map(|c| {
                    format!("{}: {} {}", c.r#type, c.reason, c.message)
                        .trim()
                        .to_string()
                })
                .collect()
        })
        .unwrap_or_default();
    let cdi_enabled = status
        .info
        .get("config")
        .and_then(|c| serde_json::from_str::<serde_json::Value>(c).ok())
        .and_then(|c| c.get("enableCDI").and_then(serde_json::Value::as_bool));
    Ok(RuntimeFacts {
        name: version.runtime_name,
        version: version.runtime_version,
        not_ready,
        cdi_enabled,
    })
}

/// Why a runtime that says these `facts` cannot run the check, in one line;
/// `None` when nothing stands in the way.
pub fn reason_from_facts(facts: &RuntimeFacts) -> Option<String> {
    if let Some(c) = facts
        .not_ready
        .iter()
        .find(|c| c.starts_with("RuntimeReady"))
    {
        return Some(format!(
            "{} {} is not ready ({c})",
            facts.name, facts.version
        ));
    }
    if facts.name == "containerd" {
        let v = facts.version.trim_start_matches('v');
        let mut parts = v.split(['.', '-', '+', '~']).map(|p| p.parse::<u32>().ok());
        if let (Some(Some(major)), Some(Some(minor))) = (parts.next(), parts.next())
            && (major, minor) < (1, 7)
        {
            return Some(format!(
                "containerd {} cannot inject CDI devices named through the CRI (CDI came in containerd 1.7)",
                facts.version
            ));
        }
        if facts.cdi_enabled == Some(false) {
            return Some(format!(
                "containerd {} has CDI off (enable_cdi = false in its CRI plugin's config)",
                facts.version
            ));
        }
    }
    None
}

/// Why the runtime at `socket` cannot run the check, in one line, or `None`
/// when it can (as far as it tells).
pub async fn cannot_run_reason(socket: &Path) -> Option<String> {
    match runtime_facts(socket).await {
        Ok(facts) => reason_from_facts(&facts),
        Err(why) => Some(why),
    }
}

#[cfg(test)]
mod tests;
