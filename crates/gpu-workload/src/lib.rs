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

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use gpu_agent_proto::cri::v1 as cri;
use gpu_agent_proto::cri::v1::image_service_client::ImageServiceClient;
use gpu_agent_proto::cri::v1::runtime_service_client::RuntimeServiceClient;
use hostlib::HostError;
use tonic::transport::Channel;

mod check;
mod sandbox;

pub use check::{
    DEFAULT_LOG_ROOT, DEFAULT_TIMEOUT, LABEL, LABEL_VALUE, LINE_PREFIX, POD_NAMESPACE,
    WorkloadCheck, WorkloadError, WorkloadReport,
};

pub use sandbox::log_lines;
use sandbox::{Run, dial};

/// Numbers the checks of this process (sandbox names must be unique).
static CHECKS: AtomicU64 = AtomicU64::new(0);

impl WorkloadCheck<'_> {
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
            paths: self.expect_paths.clone(),
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
