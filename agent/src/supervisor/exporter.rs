//! The metrics exporter as a supervised task: started when its stage
//! planned it, restarted when the policy changes it, and whether its series
//! carry pod labels.

use tokio::sync::watch;

use super::core::Supervisor;
use super::readiness::keep_since;
use super::tasks::METRICS;
use crate::metrics::server::{ExporterConfig, PodLabels};
use crate::plugin::manager;
use crate::stages::{Stage, StageState, Validation};
use crate::state::{self, AgentState};

impl Supervisor {
    /// Starts the metrics exporter when its stage planned it.
    pub(super) fn start_metrics(&mut self) {
        if self.metrics.is_some() {
            return;
        }
        let Some(inv) = self.inventory.as_ref() else {
            return;
        };
        let planned = self.st.stages.iter().any(|s| {
            s.stage == Stage::Metrics && matches!(s.state, StageState::Ready | StageState::Failed)
        }) && self.opts.policy.dcgm_exporter.enabled;
        if !planned {
            return;
        }
        let fail = |st: &mut AgentState, why: String| {
            if let Some(s) = st.stages.iter_mut().find(|s| s.stage == Stage::Metrics) {
                s.state = StageState::Failed;
                s.detail = why;
            }
        };
        let cfg = match ExporterConfig::from_spec(&self.opts.policy.dcgm_exporter) {
            Ok(c) => c,
            Err(e) => return fail(&mut self.st, e.to_string()),
        };
        let no_gpu = self
            .st
            .inventory
            .as_ref()
            .is_some_and(|i| i.gpus.is_empty());
        let sampler = match self.opts.view.backend.sampler() {
            Ok(s) => s,
            // A node without a GPU has nothing to sample: the agent's own
            // series are still served, and the stage is not failed.
            Err(_) if no_gpu => Box::new(crate::backend::NoGpuSampler),
            Err(e) => return fail(&mut self.st, format!("cannot sample the GPUs: {e}")),
        };
        let listener = match crate::metrics::server::bind(&cfg) {
            Ok(l) => l,
            Err(e) => {
                // Started again with backoff (the port may be freed).
                self.task_started(METRICS);
                return self.task_ended(METRICS, Err(e));
            }
        };
        let bound = listener.local_addr().unwrap_or(cfg.listen);
        // Through the host root: /var/lib/kubelet may be a link on the host.
        let pod_socket_path = self.opts.policy.host_paths.pod_resources_socket();
        let pod_socket = match self.opts.host.resolve(&pod_socket_path) {
            Ok(p) => p,
            Err(e) => {
                return fail(
                    &mut self.st,
                    format!("the kubelet's pod-resources socket: {e}"),
                );
            }
        };
        let (pod_labels, pod_labels_rx) = watch::channel(PodLabels::Unknown);
        self.pod_labels = Some((pod_socket_path, pod_labels_rx));
        self.metrics = Some(tokio::spawn(crate::metrics::server::run(
            cfg.clone(),
            listener,
            inv.subscribe(),
            sampler,
            pod_socket,
            pod_labels,
            self.changed.clone(),
        )));
        self.metrics_detail = format!(
            "serving {} field(s) on http://{bound}/metrics, sampled every {} ms while scraped",
            cfg.fields.fields.len(),
            cfg.interval.as_millis()
        );
        if let Some(s) = self
            .st
            .stages
            .iter_mut()
            .find(|s| s.stage == Stage::Metrics)
        {
            s.state = StageState::Done;
            s.detail = self.metrics_detail.clone();
        }
        self.metrics_config = Some(cfg);
        self.task_started(METRICS);
    }

    /// The metrics stage says whether the series carry pod labels, and why
    /// not: in its detail, and as its validation where a kubelet is there
    /// to be asked (a node without one has no pods to name).
    pub(super) fn refresh_pod_labels(&mut self) {
        let Some((socket, rx)) = &self.pod_labels else {
            return;
        };
        if self.metrics.is_none() {
            return;
        }
        let kubelet_here = self
            .opts
            .host
            .resolve(format!(
                "{}/{}",
                self.opts.policy.host_paths.device_plugin_dir(),
                manager::KUBELET_SOCKET
            ))
            .is_ok_and(|p| p.exists());
        let (ok, words) = match &*rx.borrow() {
            PodLabels::Unknown => return,
            PodLabels::Attributed => (
                true,
                format!("pod labels from the kubelet's pod-resources API ({socket})"),
            ),
            PodLabels::Missing(why) if kubelet_here => (
                false,
                format!(
                    "no pod labels: {why}. The kubelet serves its pod-resources API under its --root-dir: set spec.hostPaths.kubeletRootDir if that is not {} (kubelets before 1.28 serve it only with the KubeletPodResources feature gate)",
                    self.opts.policy.host_paths.kubelet_root_dir
                ),
            ),
            PodLabels::Missing(why) => (
                true,
                format!("no pod labels: no kubelet on this node ({why})"),
            ),
        };
        let now = state::now();
        let detail = format!("{}; {words}", self.metrics_detail);
        if let Some(s) = self
            .st
            .stages
            .iter_mut()
            .find(|s| s.stage == Stage::Metrics && s.state == StageState::Done)
        {
            s.detail = detail;
            let v = Validation {
                ok,
                detail: words,
                since: now,
            };
            s.validation = keep_since(s.validation.take(), Some(v));
        }
    }

    /// After a reconcile: the exporter follows the policy (off, or started
    /// again on a new address, counters file or interval).
    pub(super) fn reconcile_metrics(&mut self) {
        let want = self
            .opts
            .policy
            .dcgm_exporter
            .enabled
            .then(|| ExporterConfig::from_spec(&self.opts.policy.dcgm_exporter).ok())
            .flatten();
        let pod_socket = self.opts.policy.host_paths.pod_resources_socket();
        let pod_socket_changed = self
            .pod_labels
            .as_ref()
            .is_some_and(|(s, _)| *s != pod_socket);
        if self.metrics.is_some() && (want != self.metrics_config || pod_socket_changed) {
            if let Some(m) = self.metrics.take() {
                m.abort();
            }
            tracing::info!(
                stage = "metrics",
                "the exporter's policy changed; starting it again"
            );
            let t = self.tasks.entry(METRICS).or_default();
            t.started = None;
            self.metrics_config = None;
            // The stage kept the running exporter's word (done): planned
            // again, or the exporter would not start (a new counters file
            // stopped it for good).
            if let Some(s) = self
                .st
                .stages
                .iter_mut()
                .find(|s| s.stage == Stage::Metrics && s.state == StageState::Done)
            {
                s.state = StageState::Ready;
            }
        }
        let waiting = self
            .tasks
            .get(METRICS)
            .is_some_and(|t| t.restart_at.is_some());
        if self.metrics.is_none() && !waiting {
            self.start_metrics();
        } else if self.metrics.is_some()
            && let Some(s) = self
                .st
                .stages
                .iter_mut()
                .find(|s| s.stage == Stage::Metrics)
        {
            // The pass planned it again; the running exporter's word stands.
            s.state = StageState::Done;
            s.detail = self.metrics_detail.clone();
        }
    }
}
