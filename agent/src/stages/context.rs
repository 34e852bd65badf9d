//! What a pass reads ([`Context`]) and what the running agent's passes last
//! said in the log ([`LogMemory`]): below every stage.

use hostlib::HostRoot;
use hostlib::Syscalls;
use hostlib::command::CommandRunner;

use super::stage::Stage;
use super::status::StageState;
use crate::backend::GpuBackend;
use crate::caps::HeldCaps;
use crate::inventory::Inventory;
use crate::policy::Policy;

/// Everything a pass reads.
#[derive(Debug)]
pub struct Context<'a> {
    pub policy: &'a Policy,
    pub caps: &'a HeldCaps,
    /// Where sysfs and /proc are read (the host root, or a simulated tree).
    pub sys: &'a HostRoot,
    pub backend: &'a dyn GpuBackend,
    /// The host whose files the agent changes.
    pub host: &'a HostRoot,
    /// How to run host commands when stages may change the host; `None`:
    /// look only (`status`), change nothing.
    pub apply: Option<&'a dyn CommandRunner>,
    /// The privileged calls stages make on the host.
    pub syscalls: &'a dyn Syscalls,
    /// The node is simulated (`--simulate`, the demo): the driver and
    /// device-node stages plan against the simulated tree and make no
    /// system calls.
    pub simulated: bool,
    /// Stops the device plugin's advertising before a driver upgrade;
    /// `None`: nothing is advertised yet.
    pub drain: Option<&'a dyn crate::driver::Drain>,
    /// `run`'s first pass: the stages the kubelet's registration does not
    /// need ([`AFTER_REGISTRATION`]) are left for [`run_deferred`], so the
    /// kubelet hears from us sooner.
    pub serve_first: bool,
    /// What stages changed on the host during this pass (drained per stage).
    pub changes: ChangeLog,
    /// Why a MIG layout change must not be applied this pass (the
    /// supervisor found its GPUs still in use).
    pub mig_hold: Option<String>,
    /// Driver upgrades under the cluster's rollout (the controller's
    /// go-ahead), and where this pass found the node.
    pub upgrade: crate::driver::UpgradeGate,
    /// What earlier passes of this process said in the log (the running
    /// agent's): a pass then logs at INFO only what changed. `None`: a
    /// one-shot pass (`status`, `run --once`, the demo) says everything.
    pub logged: Option<&'a LogMemory>,
}

/// What the running agent's passes last said in the log, so that a pass
/// that changes nothing says nothing above DEBUG (docs/operations.md): a
/// stage's state is logged when it changes, or when the stage changed the
/// host; its words when they change, except from those of a pass that
/// changed the host to those of one that found it as left ("wrote X" to "X
/// is up to date"); a GPU when it is found or no longer found; a warning of
/// discovery when it is new.
#[derive(Debug, Default)]
pub struct LogMemory(std::sync::Mutex<Said>);

#[derive(Debug, Default)]
struct Said {
    /// Each stage's last state and detail, and whether that pass changed the host.
    stages: std::collections::HashMap<Stage, (StageState, String, bool)>,
    /// The GPUs last found (bus id, then what was said of each); `None`
    /// before the first discovery.
    gpus: Option<std::collections::BTreeMap<String, GpuSaid>>,
    /// Discovery's warnings of the last pass.
    warnings: std::collections::BTreeSet<String>,
    /// Other conditions by name ([`LogMemory::news`]), while they hold.
    conditions: std::collections::HashMap<String, String>,
}

/// What the log says of a GPU found: a UUID NVML gives later, or another
/// model, is news.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuSaid {
    pub id: String,
    pub model: String,
}

impl LogMemory {
    /// Whether `stage` coming to `state` with `detail` is news (and
    /// remembers it); `changed_host`: this pass of the stage changed the host.
    pub fn stage_is_news(
        &self,
        stage: Stage,
        state: StageState,
        detail: &str,
        changed_host: bool,
    ) -> bool {
        let mut said = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let news = match said.stages.get(&stage) {
            None => true,
            Some((was, _, _)) if *was != state => true,
            Some(_) if changed_host => true,
            Some((_, words, _)) if words == detail => false,
            // Its words change: news, unless they went from a change made
            // to finding it made.
            Some((_, _, was_change)) => !was_change,
        };
        said.stages
            .insert(stage, (state, detail.to_string(), changed_host));
        news
    }

    /// The GPUs found now, by bus id: those not found (or said otherwise)
    /// before, and those no longer found.
    pub fn gpus_found(
        &self,
        now: std::collections::BTreeMap<String, GpuSaid>,
    ) -> (Vec<String>, Vec<(String, GpuSaid)>) {
        let mut said = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let before = said.gpus.take().unwrap_or_default();
        let new = now
            .iter()
            .filter(|(bus, what)| before.get(*bus) != Some(what))
            .map(|(bus, _)| bus.clone())
            .collect();
        let gone = before
            .into_iter()
            .filter(|(bus, _)| !now.contains_key(bus))
            .collect();
        said.gpus = Some(now);
        (new, gone)
    }

    /// Whether the condition `key` changed since it was last told: `now` is
    /// what it says now (`None`: it no longer holds). A condition that
    /// holds pass after pass in the same words is said once.
    pub fn news(&self, key: &str, now: Option<&str>) -> bool {
        let mut said = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let before = match now {
            Some(text) => said.conditions.insert(key.to_string(), text.to_string()),
            None => said.conditions.remove(key),
        };
        before.as_deref() != now
    }

    /// Of discovery's warnings now, those the last pass did not have.
    pub fn new_warnings<'w>(&self, now: &'w [String]) -> Vec<&'w String> {
        let mut said = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let new = now.iter().filter(|w| !said.warnings.contains(*w)).collect();
        said.warnings = now.iter().cloned().collect();
        new
    }
}

/// Host changes a stage made, in words (`wrote /var/run/cdi/nvidia.yaml`).
pub type ChangeLog = std::cell::RefCell<Vec<String>>;

impl Context<'_> {
    /// Whether the condition `key` (`None`: it no longer holds) is news to
    /// the running agent ([`LogMemory::news`]); always, without one.
    pub fn news(&self, key: &str, now: Option<&str>) -> bool {
        self.logged.is_none_or(|m| m.news(key, now))
    }

    /// Records a change made to the host.
    pub fn changed(&self, what: impl Into<String>) {
        let what = what.into();
        tracing::info!(changed = %what, "host changed");
        self.changes.borrow_mut().push(what);
    }
}

/// Why GPUs the node has cannot be used yet: the backend does not describe them.
pub(crate) fn undescribed(inv: &Inventory, what: &str) -> String {
    format!(
        "{} GPU(s) on the node, none can be {what} until {} describes them: {}",
        inv.gpus.len(),
        inv.backend.name,
        inv.backend.error.as_deref().unwrap_or("no UUIDs reported")
    )
}
