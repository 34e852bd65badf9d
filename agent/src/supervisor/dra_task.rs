//! How the supervisor starts, follows and stops the DRA kubelet plugin
//! ([`RunningDra`]) as the policy's `spec.dra` says, and what `status` and
//! the report show of it.

use super::core::Supervisor;
use std::sync::Arc;

use super::dra::{DraSetting, DraSharing, RunningDra, TASK};
use super::dra_mps::{DraMps, DraMpsSetup, SharedBackend};
use crate::inventory::Inventory;
use crate::state::DraStatus;
use gpu_agent_proto::report::v1 as pb;

impl Supervisor {
    /// DRA's GPUs of the node now (`spec.dra.gpus`), as an inventory of
    /// their own, and the selectors that name none.
    fn dra_inventory(&self) -> Option<(Inventory, Vec<String>)> {
        let inv = self.st.inventory.as_ref()?;
        let (gpus, unmatched) = gpu_dra::spec::dra_gpus(&self.opts.policy.dra, inv);
        Some((gpu_dra::spec::split(inv, &gpus, true), unmatched))
    }

    fn dra_setting(&self) -> DraSetting {
        let node = match &self.opts.report {
            Some(r) => r.node_name.clone(),
            None => crate::report::node_name(),
        };
        DraSetting::of(&self.opts.policy, &node)
    }

    /// After a pass: the plugin runs while `spec.dra.enabled` (and there is
    /// an inventory), is started again on new settings, and hears of the
    /// node's devices when they change.
    pub(super) async fn reconcile_dra(&mut self) {
        if !self.opts.policy.dra.enabled {
            if let Some(d) = self.dra.take() {
                tracing::info!(
                    task = TASK,
                    "DRA is turned off by the policy; the plugin stops"
                );
                d.stop().await;
            }
            // Kept from a run that could not start again: they quit too.
            if let Some(m) = self.dra_mps.daemons.take() {
                m.stop().await;
            }
            self.tasks.remove(TASK);
            self.st.dra = None;
            return;
        }
        let Some((inv, _)) = self.dra_inventory() else {
            return;
        };
        let setting = self.dra_setting();
        if let Some(d) = &self.dra {
            if d.setting == setting {
                d.claims.set_inventory(&inv);
                return;
            }
            tracing::info!(
                task = TASK,
                "DRA settings changed; restarting the DRA plugin"
            );
            if let Some(d) = self.dra.take() {
                // The claims' daemons go on for the next run.
                self.dra_mps.daemons = d.stop_keeping_mps().await;
            }
        }
        self.start_dra();
    }

    /// Starts the plugin (a failure is the task's, restarted with backoff).
    pub(super) fn start_dra(&mut self) {
        if let Some(d) = self.dra.take() {
            // One that ended on its own is replaced; its sockets are gone,
            // its claims' daemons go on.
            self.dra_mps.daemons = d.into_mps();
        }
        if !self.opts.policy.dra.enabled {
            return;
        }
        let Some((inv, _)) = self.dra_inventory() else {
            return;
        };
        let setting = self.dra_setting();
        // No health monitor: every device's health is Unknown to the kubelet.
        let health = match &self.health {
            Some(h) => h.view(),
            None => tokio::sync::watch::channel(Default::default()).1,
        };
        let mps = match self.dra_mps.daemons.take() {
            Some(m) => Ok(m),
            None => self
                .dra_mps_setup()
                .map(|setup| DraMps::start(setup, Some(self.changed.clone()))),
        };
        let time_slice = self.dra_time_slice();
        match RunningDra::start(
            &self.opts.host,
            setting,
            &inv,
            self.dra_feed.clone(),
            health,
            self.changed.clone(),
            DraSharing {
                mps,
                time_slice,
                report_now: self.report_now.clone(),
            },
        ) {
            Ok(d) => {
                self.dra = Some(d);
                self.task_started(TASK);
            }
            Err((e, daemons)) => {
                self.dra_mps.daemons = daemons;
                self.task_ended(TASK, Err(e));
            }
        }
    }

    /// What DRA's MPS daemons run with: the node's backend (shared from now
    /// on), `host-exec` for the host's control program, the device
    /// plugin's MPS root; `Err` on a simulated node, which has no MPS.
    fn dra_mps_setup(&mut self) -> Result<DraMpsSetup, String> {
        if self.opts.view.simulated.is_some() {
            return Err(
                "a simulated node runs no MPS control daemon: claims with MPS sharing are refused"
                    .into(),
            );
        }
        let backend = self.shared_backend();
        let exe = std::env::current_exe().unwrap_or_else(|_| "/proc/self/exe".into());
        let needs = self.host_exec_needs();
        let root = self
            .plugin_plan
            .as_ref()
            .map(|p| p.settings.mps_root.clone())
            .unwrap_or_else(|| crate::plugin::resources::DEFAULT_MPS_ROOT.to_string());
        Ok(DraMpsSetup {
            host: self.opts.host.clone(),
            spawner: Arc::new(hostlib::process::HostSpawner::new(
                exe,
                self.opts.host.clone(),
            )),
            backend,
            root,
            missing_caps: self.opts.caps.missing(&needs),
        })
    }

    /// The node's backend, shared (from the first call on) between the
    /// view and DRA's MPS daemons and time slices.
    fn shared_backend(&mut self) -> Arc<dyn crate::backend::GpuBackend> {
        match &self.dra_mps.backend {
            Some(b) => b.clone(),
            None => {
                let placeholder: Box<dyn crate::backend::GpuBackend> =
                    Box::new(SharedBackend(Arc::new(Unset)));
                let own = std::mem::replace(&mut self.opts.view.backend, placeholder);
                let shared: Arc<dyn crate::backend::GpuBackend> = Arc::from(own);
                self.opts.view.backend = Box::new(SharedBackend(shared.clone()));
                self.dra_mps.backend = Some(shared.clone());
                shared
            }
        }
    }

    /// What a host program run through `host-exec` for DRA needs (no
    /// chroot when the host root is `/`).
    fn host_exec_needs(&self) -> Vec<crate::caps::Capability> {
        super::mps::NEEDS
            .iter()
            .copied()
            .filter(|c| {
                !(self.opts.host.is_system() && *c == crate::caps::Capability::CAP_SYS_CHROOT)
            })
            .collect()
    }

    /// Who changes the time slices of DRA claims' GPUs: the host's
    /// `nvidia-smi` through `host-exec`; `Err` on a simulated node, which
    /// has no time slice to change.
    fn dra_time_slice(&mut self) -> Result<Arc<dyn gpu_dra::claims::TimeSlicePort>, String> {
        if self.opts.view.simulated.is_some() {
            return Err(
                "a simulated node has no GPU time slice to change: claims with time-slicing at an interval other than Default are refused"
                    .into(),
            );
        }
        let backend = self.shared_backend();
        let exe = std::env::current_exe().unwrap_or_else(|_| "/proc/self/exe".into());
        let needs = self.host_exec_needs();
        Ok(Arc::new(super::dra_timeslice::DraTimeSlice::new(
            Arc::new(hostlib::process::HostSpawner::new(
                exe,
                self.opts.host.clone(),
            )),
            backend,
            super::dra_timeslice::NVIDIA_SMI,
            self.opts.caps.missing(&needs),
        )))
    }

    /// The plugin's state for `status`, now.
    pub(super) fn refresh_dra(&mut self) {
        if !self.opts.policy.dra.enabled {
            self.st.dra = None;
            return;
        }
        let (gpus, unmatched) = match self.dra_inventory() {
            Some((inv, unmatched)) => (
                inv.gpus
                    .iter()
                    .map(|g| g.uuid.clone().unwrap_or_else(|| g.bus_id.to_string()))
                    .collect(),
                unmatched,
            ),
            None => (Vec::new(), Vec::new()),
        };
        self.st.dra = Some(match &self.dra {
            Some(d) => d.status(gpus, unmatched),
            None => DraStatus {
                registration: "not serving".into(),
                gpus,
                unmatched,
                error: Some(
                    self.tasks
                        .get(TASK)
                        .and_then(|t| t.last_error.clone())
                        .unwrap_or_else(|| "waiting for the first discovery".into()),
                ),
                ..Default::default()
            },
        });
    }
}

/// What the report tells the controller of the plugin.
pub(super) fn dra_report(st: Option<&DraStatus>) -> pb::DraState {
    let Some(d) = st else {
        return pb::DraState {
            error: "spec.dra.enabled is false".into(),
            ..Default::default()
        };
    };
    pb::DraState {
        registered: d.registered,
        gpu_uuids: d.gpus.clone(),
        prepared_claims: d
            .claims
            .iter()
            .filter(|c| c.state == "prepared")
            .map(|c| c.uid.clone())
            .collect(),
        error: match (&d.error, d.registered) {
            (Some(e), _) => e.clone(),
            (None, false) => d.registration.clone(),
            (None, true) => String::new(),
        },
    }
}

/// What the view's backend is for the instant it is moved into an `Arc`.
#[derive(Debug)]
struct Unset;

impl crate::backend::GpuBackend for Unset {
    fn name(&self) -> &'static str {
        "unset"
    }
    fn snapshot(&self) -> Result<crate::backend::BackendSnapshot, crate::backend::BackendError> {
        Err(crate::backend::BackendError::Unavailable(
            "the backend is being shared".into(),
        ))
    }
}
