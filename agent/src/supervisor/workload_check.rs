//! `spec.validator.workload`: a short-lived container with one GPU, run
//! through the node's CRI runtime once the runtime and CDI validated.

use super::core::Supervisor;
use super::readiness::keep_since;
use crate::stages::{Stage, Validation};
use crate::state;

/// [`crate::stages::LogMemory::news`]'s name for a workload check that
/// fails.
const WORKLOAD_FAILED: &str = "workload check failed";

impl Supervisor {
    /// `spec.validator.workload`: a short-lived container with one GPU
    /// injected by CDI, through the node's CRI runtime (after the runtime
    /// and CDI validated). `due`: run it even if it ran before.
    pub(super) async fn workload_check(&mut self, due: bool) {
        let p = &self.opts.policy;
        if !p.validator.enabled || !p.validator.workload {
            self.st.workload = None;
            return;
        }
        if !due && self.st.workload.as_ref().is_some_and(|w| w.ok) {
            return;
        }
        let verdict = self.run_workload().await;
        let now = state::now();
        let v = match verdict {
            Ok(detail) => {
                self.logged.news(WORKLOAD_FAILED, None);
                tracing::info!(stage = "validate", "workload check passed: {detail}");
                Validation {
                    ok: true,
                    detail,
                    since: now,
                }
            }
            Err(detail) => {
                // Tried again at every reconcile; said when its words change.
                if self.logged.news(WORKLOAD_FAILED, Some(&detail)) {
                    tracing::error!(stage = "validate", "workload check failed: {detail}");
                } else {
                    tracing::debug!(stage = "validate", "workload check failed: {detail}");
                }
                Validation {
                    ok: false,
                    detail,
                    since: now,
                }
            }
        };
        self.st.workload = keep_since(self.st.workload.take(), Some(v));
        self.validation_files();
    }

    async fn run_workload(&self) -> Result<String, String> {
        use crate::policy::ContainerRuntime;
        let p = &self.opts.policy;
        if self.opts.view.simulated.is_some() {
            return Err("a simulated node cannot run a container with a GPU".into());
        }
        let validated = |stage: Stage| {
            self.st
                .stages
                .iter()
                .any(|s| s.stage == stage && s.validation.as_ref().is_some_and(|v| v.ok))
        };
        if !(validated(Stage::Runtime) && validated(Stage::Cdi)) {
            return Err("waits until the runtime and the CDI spec are validated".into());
        }
        let socket = match (&p.validator.cri_socket, p.operator.default_runtime) {
            (Some(s), _) => s.clone(),
            (None, ContainerRuntime::Containerd) => "/run/containerd/containerd.sock".into(),
            (None, ContainerRuntime::Crio) => "/var/run/crio/crio.sock".into(),
            (None, ContainerRuntime::Docker) => {
                return Err("this node's runtime is Docker, which has no CRI to run the check through (set spec.validator.criSocket to cri-dockerd's socket)".into());
            }
        };
        let resolved = self
            .opts
            .host
            .resolve(&socket)
            .map_err(|e| format!("the CRI socket {socket}: {e}"))?;
        if let Some(why) = crate::workload::cannot_run_reason(&resolved).await {
            return Err(format!("this node cannot run the check: {why}"));
        }
        let Some(inv) = &self.st.inventory else {
            return Err("no inventory".into());
        };
        let Some(index) = inv.gpus.iter().find_map(|g| g.index) else {
            return Err("no GPU NVML names by index".into());
        };
        let spec_path = crate::cdi::spec_path(&p.cdi.spec_dir);
        let spec: crate::cdi::Spec = self
            .opts
            .host
            .read_to_string(&spec_path)
            .map_err(|e| e.to_string())
            .and_then(|t| serde_json::from_str(&t).map_err(|e| format!("{spec_path}: {e}")))?;
        let device = format!("{}={index}", spec.kind);
        let mut check = crate::workload::WorkloadCheck::new(
            &self.opts.host,
            resolved,
            &p.validator.workload_image,
            &device,
        );
        if !check.expect_from_spec(&spec) {
            return Err(format!("{spec_path} has no device {device}"));
        }
        check
            .run()
            .await
            .map(|r| r.summary())
            .map_err(|e| e.to_string())
    }
}
