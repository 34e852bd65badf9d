//! The check's conversation with the CRI runtime: dialing its socket, the
//! sandbox and the container, waiting for the container to exit, reading its
//! log, and the cleanup.

use std::path::Path;
use std::time::{Duration, Instant};

use gpu_agent_proto::cri::v1 as cri;
use gpu_agent_proto::cri::v1::runtime_service_client::RuntimeServiceClient;
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint};

use crate::check::{
    CLEANUP_GRACE, LABEL, LABEL_VALUE, LINE_PREFIX, POD_NAMESPACE, POLL_FIRST, POLL_MAX, SCRIPT,
    WorkloadCheck, WorkloadError,
};

/// What a finished container gave.
pub(super) struct Ran {
    pub(super) output: Vec<String>,
    pub(super) sandbox_time: Duration,
    pub(super) container_time: Duration,
}

/// One check's sandbox and container, remembered for the cleanup.
pub(super) struct Run<'c, 'a> {
    pub(super) check: &'c WorkloadCheck<'a>,
    pub(super) rt: &'c mut RuntimeServiceClient<Channel>,
    pub(super) deadline: Instant,
    pub(super) sandbox_name: String,
    pub(super) sandbox_id: Option<String>,
    pub(super) container_id: Option<String>,
    pub(super) log_dir: String,
}

const LOG_FILE: &str = "check.log";

impl Run<'_, '_> {
    fn sandbox_config(&self) -> cri::PodSandboxConfig {
        let c = self.check;
        cri::PodSandboxConfig {
            metadata: Some(cri::PodSandboxMetadata {
                name: self.sandbox_name.clone(),
                // Unique across restarts too: a sandbox left by an earlier
                // agent with the same PID keeps its name reserved.
                uid: format!(
                    "{}-{}",
                    self.sandbox_name,
                    std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_nanos())
                ),
                namespace: POD_NAMESPACE.into(),
                attempt: 0,
            }),
            hostname: String::new(),
            log_directory: self.log_dir.clone(),
            labels: labels(),
            annotations: [("gpu-agent/cdi-device".to_string(), c.cdi_device.clone())].into(),
            linux: Some(cri::LinuxPodSandboxConfig {
                cgroup_parent: String::new(),
                security_context: Some(cri::LinuxSandboxSecurityContext {
                    namespace_options: Some(cri::NamespaceOption {
                        network: cri::NamespaceMode::Node as i32,
                        pid: cri::NamespaceMode::Container as i32,
                        ipc: cri::NamespaceMode::Pod as i32,
                    }),
                }),
            }),
        }
    }

    pub(super) async fn sandbox_and_container(
        &mut self,
        checks: &[String],
    ) -> Result<Ran, WorkloadError> {
        let c = self.check;
        let started = Instant::now();
        let sandbox_config = self.sandbox_config();
        // A call that creates something may answer after the deadline: what
        // it made is then removed before the timeout is reported.
        let created = tokio::time::timeout_at(
            (self.deadline + CLEANUP_GRACE).into(),
            self.rt.run_pod_sandbox(cri::RunPodSandboxRequest {
                config: Some(sandbox_config.clone()),
                runtime_handler: c.runtime_handler.clone(),
            }),
        )
        .await
        .map_err(|_| c.timed_out("RunPodSandbox"))?
        .map_err(|s| WorkloadError::SandboxRefused {
            socket: c.socket.clone(),
            sandbox: self.sandbox_name.clone(),
            message: s.message().to_string(),
        })?;
        self.sandbox_id = Some(created.into_inner().pod_sandbox_id);
        if Instant::now() > self.deadline {
            return Err(c.timed_out("RunPodSandbox"));
        }
        let sandbox_time = started.elapsed();

        let started = Instant::now();
        let refused = |action: &'static str, s: tonic::Status| WorkloadError::ContainerRefused {
            socket: c.socket.clone(),
            image: c.image.clone(),
            cdi_device: c.cdi_device.clone(),
            action,
            message: s.message().to_string(),
        };
        let mut command = vec![
            "/bin/sh".to_string(),
            "-c".into(),
            SCRIPT.into(),
            "gpu-agent-check".into(),
        ];
        command.extend(checks.iter().cloned());
        let config = cri::ContainerConfig {
            metadata: Some(cri::ContainerMetadata {
                name: "gpu-check".into(),
                attempt: 0,
            }),
            image: Some(cri::ImageSpec {
                image: c.image.clone(),
                ..Default::default()
            }),
            command,
            labels: labels(),
            log_path: LOG_FILE.into(),
            cdi_devices: vec![cri::CdiDevice {
                name: c.cdi_device.clone(),
            }],
            ..Default::default()
        };
        let created = tokio::time::timeout_at(
            (self.deadline + CLEANUP_GRACE).into(),
            self.rt.create_container(cri::CreateContainerRequest {
                pod_sandbox_id: self.sandbox_id.clone().unwrap_or_default(),
                config: Some(config),
                sandbox_config: Some(sandbox_config),
            }),
        )
        .await
        .map_err(|_| c.timed_out("CreateContainer"))?
        .map_err(|s| refused("create", s))?;
        let id = created.into_inner().container_id;
        self.container_id = Some(id.clone());
        c.bounded(
            self.deadline,
            "StartContainer",
            self.rt.start_container(cri::StartContainerRequest {
                container_id: id.clone(),
            }),
        )
        .await?
        .map_err(|s| refused("start", s))?;

        let status = self.wait_exited(&id).await?;
        let container_time = started.elapsed();
        let log = c
            .host
            .read_optional(format!("{}/{LOG_FILE}", self.log_dir))?
            .unwrap_or_default();
        let output = log_lines(&log);
        let failures: Vec<String> = output
            .iter()
            .filter_map(|l| l.strip_prefix(LINE_PREFIX))
            .filter(|l| *l != "ok")
            .map(str::to_string)
            .collect();
        match status.exit_code {
            0 if output.iter().any(|l| l == "gpu-agent-check: ok") => Ok(Ran {
                output,
                sandbox_time,
                container_time,
            }),
            // Killed (SIGKILL, SIGTERM) without a word from the script:
            // stopped from outside.
            137 | 143 if failures.is_empty() => Err(WorkloadError::Interrupted {
                cdi_device: c.cdi_device.clone(),
                reason: format!(
                    "exit code {}, {} {}",
                    status.exit_code, status.reason, status.message
                )
                .trim()
                .to_string(),
            }),
            code => Err(WorkloadError::ChecksFailed {
                image: c.image.clone(),
                cdi_device: c.cdi_device.clone(),
                exit_code: code,
                lines: if failures.is_empty() {
                    // Not our script's words (no sh in the image, ...):
                    // whatever the container and the runtime said.
                    let mut l = output.clone();
                    if !status.message.is_empty() {
                        l.push(status.message.clone());
                    }
                    if l.is_empty() {
                        l.push(format!("no output ({})", status.reason));
                    }
                    l
                } else {
                    failures
                },
            }),
        }
    }

    /// Polls `ContainerStatus` (short sleeps, growing to [`POLL_MAX`]) until
    /// the container has exited or the deadline passes.
    async fn wait_exited(&mut self, id: &str) -> Result<cri::ContainerStatus, WorkloadError> {
        let c = self.check;
        let mut sleep = POLL_FIRST;
        loop {
            let answer = c
                .bounded(
                    self.deadline,
                    "ContainerStatus",
                    self.rt.container_status(cri::ContainerStatusRequest {
                        container_id: id.to_string(),
                        verbose: false,
                    }),
                )
                .await?;
            let status = match answer {
                Ok(r) => r.into_inner().status,
                Err(s) if s.code() == tonic::Code::NotFound => {
                    return Err(WorkloadError::Interrupted {
                        cdi_device: c.cdi_device.clone(),
                        reason: format!("the container is gone: {}", s.message()),
                    });
                }
                Err(s) => {
                    return Err(WorkloadError::ContainerRefused {
                        socket: c.socket.clone(),
                        image: c.image.clone(),
                        cdi_device: c.cdi_device.clone(),
                        action: "report on",
                        message: s.message().to_string(),
                    });
                }
            };
            if let Some(st) = status
                && st.state == cri::ContainerState::ContainerExited as i32
            {
                return Ok(st);
            }
            if Instant::now() + sleep > self.deadline {
                return Err(c.timed_out("waiting for the container to exit"));
            }
            tokio::time::sleep(sleep).await;
            sleep = (sleep * 2).min(POLL_MAX);
        }
    }

    /// Removes the container, stops and removes the sandbox; each call has
    /// [`CLEANUP_GRACE`]. Returns what failed.
    pub(super) async fn cleanup(&mut self) -> Vec<String> {
        let mut warnings = Vec::new();
        let socket = self.check.socket.display().to_string();
        if let Some(id) = self.container_id.take() {
            let r = tokio::time::timeout(
                CLEANUP_GRACE,
                self.rt.remove_container(cri::RemoveContainerRequest {
                    container_id: id.clone(),
                }),
            )
            .await;
            if let Some(why) = failed(r) {
                warnings.push(format!("{socket}: RemoveContainer {id}: {why}"));
            }
        }
        if let Some(id) = self.sandbox_id.take() {
            let r = tokio::time::timeout(
                CLEANUP_GRACE,
                self.rt.stop_pod_sandbox(cri::StopPodSandboxRequest {
                    pod_sandbox_id: id.clone(),
                }),
            )
            .await;
            if let Some(why) = failed(r) {
                warnings.push(format!("{socket}: StopPodSandbox {id}: {why}"));
            }
            let r = tokio::time::timeout(
                CLEANUP_GRACE,
                self.rt.remove_pod_sandbox(cri::RemovePodSandboxRequest {
                    pod_sandbox_id: id.clone(),
                }),
            )
            .await;
            if let Some(why) = failed(r) {
                warnings.push(format!("{socket}: RemovePodSandbox {id}: {why}"));
            }
        }
        warnings
    }
}

/// Why a cleanup call failed, if it did.
fn failed<T>(r: Result<Result<T, tonic::Status>, tokio::time::error::Elapsed>) -> Option<String> {
    match r {
        Ok(Ok(_)) => None,
        // Already gone is what we wanted.
        Ok(Err(s)) if s.code() == tonic::Code::NotFound => None,
        Ok(Err(s)) => Some(s.message().to_string()),
        Err(_) => Some(format!("no answer in {CLEANUP_GRACE:?}")),
    }
}

fn labels() -> std::collections::HashMap<String, String> {
    [
        (LABEL.to_string(), LABEL_VALUE.to_string()),
        ("gpu-agent/check".to_string(), "workload".to_string()),
    ]
    .into()
}

/// The text of a CRI container log (`<time> <stream> <F|P> <text>` per
/// line; `P` lines continue in the next), one string per logical line.
pub fn log_lines(log: &str) -> Vec<String> {
    let mut lines = Vec::new();
    let mut partial = String::new();
    for raw in log.lines() {
        let mut fields = raw.splitn(4, ' ');
        let (Some(_time), Some(_stream), Some(tag)) = (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let text = fields.next().unwrap_or("");
        partial.push_str(text);
        if tag != "P" {
            lines.push(std::mem::take(&mut partial));
        }
    }
    if !partial.is_empty() {
        lines.push(partial);
    }
    lines
}

/// A gRPC channel to the CRI socket. Unlike the kubelet dial, no per-call
/// timeout: an image pull may take minutes; the check bounds each call.
pub(super) async fn dial(path: &Path) -> Result<Channel, tonic::transport::Error> {
    let path = path.to_path_buf();
    // The URI is required by the API but unused: the connector dials the socket.
    Endpoint::from_static("http://[::1]:50051")
        .connect_timeout(gpu_grpc::DIAL_TIMEOUT)
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move { UnixStream::connect(path).await.map(TokioIo::new) }
        }))
        .await
}
