//! The driver on the host: where the modules come from (an installed
//! bundle or a module directory), which flavour, loading them with the
//! policy's parameters, device nodes, the host-driver mode, and upgrades
//! that roll back on failure.

use std::time::{Duration, Instant};

use hostlib::driver::DriverState;
use hostlib::{HostError, HostRoot, Syscalls};
use kmod::bundle::{self, BundleError, Flavour};
use kmod::devnodes::{self, NodeError};
use kmod::modules::{self, Holder, LoadOutcome, ModuleError, ModuleSpec};

pub mod spec;

use gpu_model::inventory::Inventory;

use crate::spec::{DriverSpec, OnParamMismatch};

/// Errors of the driver stage and the `driver` commands.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    #[error(transparent)]
    Module(#[from] ModuleError),
    #[error(transparent)]
    Nodes(#[from] NodeError),
    #[error(transparent)]
    Bundle(#[from] BundleError),
    #[error(transparent)]
    Host(#[from] HostError),
    #[error(transparent)]
    State(#[from] hostlib::driver::DriverError),
    /// The host-files lock (driver installs and upgrades take it).
    #[error(transparent)]
    Lock(#[from] hostlib::managed::ManagedError),
    #[error(
        "no NVIDIA driver is loaded and there is nothing to load: set spec.driver.bundle (or install one: gpu-agent driver install), spec.driver.moduleDir, or spec.driver.enabled: false to use the host's driver"
    )]
    NothingToLoad,
    #[error("{0}")]
    Flavour(String),
    #[error("validation failed: {0}")]
    Validate(String),
    #[error(
        "{} process(es) still use the GPUs after {waited} s: {}; stop them (or raise spec.driver.upgradeTimeoutSeconds); nothing was changed",
        .holders.len(), holders_list(.holders)
    )]
    Busy { holders: Vec<Holder>, waited: u64 },
    #[error("upgrade to {to} failed: {why}; {rolled_back}")]
    Upgrade {
        to: String,
        why: String,
        rolled_back: String,
    },
}

fn holders_list(h: &[Holder]) -> String {
    h.iter()
        .map(|h| format!("{} (pid {}, {})", h.command, h.pid, h.device))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The running kernel's release (`/proc/sys/kernel/osrelease`).
pub fn running_kernel(sys: &HostRoot) -> Result<String, DriverError> {
    Ok(sys
        .read_to_string("/proc/sys/kernel/osrelease")?
        .trim()
        .to_string())
}

/// The module flavour to load, and why.
pub fn choose_flavour(
    spec: &DriverSpec,
    inv: Option<&Inventory>,
    available: &[Flavour],
) -> Result<(Flavour, String), DriverError> {
    let (flavour, why) = match spec.use_open_kernel_modules {
        Some(true) => (
            Flavour::Open,
            "spec.driver.useOpenKernelModules".to_string(),
        ),
        Some(false) => (
            Flavour::Proprietary,
            "spec.driver.useOpenKernelModules: false".to_string(),
        ),
        None => {
            // Open modules need Turing (compute capability 7.5) or newer.
            // Before the driver is loaded NVML cannot tell the compute
            // capability; PCI device IDs from 0x1e00 on are Turing and later.
            let older: Vec<String> = inv
                .map(|i| i.gpus.as_slice())
                .unwrap_or_default()
                .iter()
                .filter(|g| match (&g.compute_capability, &g.pci) {
                    (Some(cc), _) => (cc.major, cc.minor) < (7, 5),
                    (None, Some(pci)) => pci.device < 0x1e00,
                    (None, None) => false,
                })
                .map(|g| g.bus_id.to_string())
                .collect();
            if older.is_empty() {
                (
                    Flavour::Open,
                    "every GPU is Turing or newer (compute capability >= 7.5)".to_string(),
                )
            } else {
                (
                    Flavour::Proprietary,
                    format!("GPU(s) older than Turing: {}", older.join(", ")),
                )
            }
        }
    };
    if !available.contains(&flavour) {
        let have: Vec<&str> = available.iter().map(|f| f.name()).collect();
        return Err(DriverError::Flavour(format!(
            "the {} modules are needed ({why}), the bundle carries only {}",
            flavour.name(),
            have.join(", ")
        )));
    }
    Ok((flavour, why))
}

/// What to load, from where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadPlan {
    /// Host directory of the `.ko` files.
    pub dir: String,
    /// The installed bundle it comes from, and its driver version.
    pub bundle: Option<(String, String)>,
    pub specs: Vec<ModuleSpec>,
    /// Why this flavour (empty for a module directory).
    pub why: String,
}

/// The modules to load: from `spec.driver.moduleDir`, else from the
/// installed bundle `name` (default: `current`) for the running kernel.
pub fn plan_load(
    host: &HostRoot,
    d: &DriverSpec,
    inv: Option<&Inventory>,
    kernel: &str,
    name: Option<&str>,
) -> Result<LoadPlan, DriverError> {
    let params = d.module_params();
    if let (Some(dir), None) = (&d.module_dir, name) {
        return Ok(LoadPlan {
            specs: modules::plan(dir, d.drm, d.peermem, &params),
            dir: dir.clone(),
            bundle: None,
            why: String::new(),
        });
    }
    let name = match name {
        Some(n) => n.to_string(),
        None => bundle::current(host)?.ok_or(DriverError::NothingToLoad)?,
    };
    let manifest = bundle::read_installed(host, &name)?;
    let (flavour, why) = choose_flavour(d, inv, &manifest.flavours)?;
    let dir = bundle::module_dir(&name, kernel, flavour);
    Ok(LoadPlan {
        specs: modules::plan(&dir, d.drm, d.peermem, &params),
        dir,
        bundle: Some((name, manifest.driver_version)),
        why: format!("{} modules: {why}", flavour.name()),
    })
}

/// Every module gpu-agent may load, in load order.
pub fn all_modules() -> Vec<String> {
    modules::LOAD_ORDER
        .iter()
        .map(|(m, _)| m.to_string())
        .collect()
}

/// Loads the plan's modules; a parameter mismatch is an error or, by
/// policy, an unload and a fresh load.
pub fn load(
    host: &HostRoot,
    sys: &dyn Syscalls,
    plan: &LoadPlan,
    on_mismatch: OnParamMismatch,
) -> Result<Vec<LoadOutcome>, DriverError> {
    match modules::load(host, sys, &plan.specs) {
        Err(ModuleError::ParamMismatch { module, param, .. })
            if on_mismatch == OnParamMismatch::Reload =>
        {
            tracing::warn!(stage = "driver", module = %module, param = %param, "loaded with other parameters; reloading (spec.driver.onParamMismatch: reload)");
            modules::unload(host, sys, &all_modules())?;
            Ok(modules::load(host, sys, &plan.specs)?)
        }
        other => Ok(other?),
    }
}

/// The MIG access capabilities of existing MIG devices, as
/// `/proc/driver/nvidia-caps/mig-minors` numbers them.
fn mig_access_caps(sys: &HostRoot, inv: Option<&Inventory>) -> Result<Vec<u32>, DriverError> {
    let Some(inv) = inv else {
        return Ok(Vec::new());
    };
    if inv.gpus.iter().all(|g| g.mig_devices.is_empty()) {
        return Ok(Vec::new());
    }
    let Some(minors) = hostlib::driver::read_mig_minors(sys)? else {
        return Ok(Vec::new());
    };
    let mut caps = Vec::new();
    for g in &inv.gpus {
        let Some(minor) = g.minor else { continue };
        for m in &g.mig_devices {
            if let Ok(pair) = gpu_model::cdi::mig_access_minors(&minors, minor, m) {
                caps.extend(pair);
            }
        }
    }
    Ok(caps)
}

/// The device nodes the loaded driver needs (driver state read from `sys`).
pub fn plan_nodes(
    sys: &HostRoot,
    inv: Option<&Inventory>,
) -> Result<Vec<devnodes::Node>, DriverError> {
    let state = DriverState::read(sys);
    let extra = mig_access_caps(sys, inv)?;
    Ok(devnodes::plan(sys, &state, &extra)?)
}

/// `created 3, replaced 1, 12 already right`.
pub fn nodes_summary(out: &[devnodes::Outcome]) -> String {
    let count = |f: fn(&devnodes::Outcome) -> bool| out.iter().filter(|o| f(o)).count();
    let created = count(|o| matches!(o, devnodes::Outcome::Created(_)));
    let replaced = count(|o| matches!(o, devnodes::Outcome::Replaced { .. }));
    let right = count(|o| matches!(o, devnodes::Outcome::Unchanged(_)));
    let admin = count(|o| matches!(o, devnodes::Outcome::LeftToAdmin { .. }));
    let mut parts = Vec::new();
    if created > 0 {
        parts.push(format!("created {created}"));
    }
    if replaced > 0 {
        parts.push(format!("replaced {replaced} wrong"));
    }
    parts.push(format!("{right} already right"));
    if admin > 0 {
        parts.push(format!(
            "{admin} left to the administrator (the driver says not to make or change them)"
        ));
    }
    format!("{} device node(s): {}", out.len(), parts.join(", "))
}

/// The loaded driver's version, checked against `expected`; and, when
/// given, a second opinion (NVML) that must answer with the same version.
pub fn validate(
    sys: &HostRoot,
    expected: Option<&str>,
    nvml: Option<&dyn Fn() -> Result<String, String>>,
) -> Result<String, DriverError> {
    let state = DriverState::read(sys);
    if !state.is_loaded() {
        return Err(DriverError::Validate(
            "the nvidia module is not loaded".into(),
        ));
    }
    let Some(version) = state.version else {
        return Err(DriverError::Validate(
            "/proc/driver/nvidia/version is missing".into(),
        ));
    };
    if let Some(want) = expected
        && want != version
    {
        return Err(DriverError::Validate(format!(
            "the loaded driver says {version}, the bundle is {want}"
        )));
    }
    if let Some(ask) = nvml {
        match ask() {
            Ok(v) if v == version => {}
            Ok(v) => {
                return Err(DriverError::Validate(format!(
                    "NVML reports driver {v}, the kernel module {version}"
                )));
            }
            Err(e) => return Err(DriverError::Validate(format!("NVML does not answer: {e}"))),
        }
    }
    Ok(version)
}

/// Where a node stands in a driver upgrade the cluster rolls out, as the
/// report tells gpu-controller (NVIDIA's state names, as far as the agent
/// takes part: `upgrade-required`, `upgrade-done`, `upgrade-failed`).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct UpgradeStatus {
    pub state: String,
    /// The version the policy asks for.
    pub driver_version: String,
    pub detail: String,
}

/// Driver upgrades under a cluster's rollout. When the policy is the
/// cluster's (sent by gpu-controller), a new driver is not loaded on the
/// agent's own: the node reports `upgrade-required` and waits for the
/// controller's go-ahead for that version, which comes once the node is
/// cordoned and its GPU pods are gone (a few nodes at a time). A policy
/// file on a node of its own upgrades at once, as before.
#[derive(Debug, Default)]
pub struct UpgradeGate {
    /// The policy is the cluster's: upgrades wait for the go-ahead.
    pub gated: bool,
    /// The version the controller said to upgrade to now.
    pub go_ahead: Option<String>,
    /// An upgrade to this version failed (and was rolled back): why. It is
    /// not tried again until the controller says so anew.
    pub failed: Option<(String, String)>,
    /// What this pass found, for the report.
    pub out: std::cell::RefCell<Option<UpgradeStatus>>,
}

impl UpgradeGate {
    /// Whether the driver may move to `version` now.
    pub fn may_upgrade(&self, version: &str) -> bool {
        !self.gated || self.go_ahead.as_deref() == Some(version)
    }

    /// Records where the node stands (only under a cluster's rollout).
    pub fn say(&self, state: &str, version: &str, detail: impl Into<String>) {
        if self.gated {
            *self.out.borrow_mut() = Some(UpgradeStatus {
                state: state.into(),
                driver_version: version.into(),
                detail: detail.into(),
            });
        }
    }

    /// The upgrade is held: `upgrade-required`, or `upgrade-failed` when
    /// the last try at this version failed. Returns the stage's words.
    pub fn hold(&self, have: &str, want: &str) -> String {
        match &self.failed {
            Some((v, why)) if v == want => {
                self.say("upgrade-failed", want, why.clone());
                format!(
                    "driver {have} loaded; the upgrade to {want} failed ({why}); gpu-controller holds the node cordoned"
                )
            }
            _ => {
                self.say("upgrade-required", want, format!("driver {have} loaded"));
                format!(
                    "driver {have} loaded; {want} wanted: waiting for gpu-controller's go-ahead (the cluster rolls upgrades out a few nodes at a time)"
                )
            }
        }
    }
}

/// What the running agent keeps of the cluster's rollout between passes:
/// whether the controller has spoken, its go-ahead, and a failed try.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rollout {
    /// A controller is configured: driver changes wait for its first word.
    pub controller: bool,
    /// The controller has said what it wants.
    pub heard: bool,
    /// The version the controller said to upgrade to now, until tried.
    pub go_ahead: Option<String>,
    /// The last try failed: (version, why). Not tried again until the
    /// controller gives the go-ahead anew.
    pub failed: Option<(String, String)>,
}

/// What the controller's word means for the agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Heard {
    /// The controller's first word since the agent started.
    pub first: bool,
    /// A new go-ahead: the GPUs are withdrawn before the pass upgrades.
    pub go_ahead: bool,
}

impl Rollout {
    /// The gate for a pass; `cluster_policy`: the running policy is the
    /// cluster's.
    pub fn gate(&self, cluster_policy: bool) -> UpgradeGate {
        UpgradeGate {
            gated: cluster_policy || (self.controller && !self.heard),
            go_ahead: self.go_ahead.clone(),
            failed: self.failed.clone(),
            out: Default::default(),
        }
    }

    /// The controller's go-ahead as its latest Desired says (`None`: none).
    pub fn hear(&mut self, go_ahead: Option<String>) -> Heard {
        let first = !self.heard;
        self.heard = true;
        let new = go_ahead.is_some() && go_ahead != self.go_ahead;
        if go_ahead != self.go_ahead {
            self.go_ahead = go_ahead;
        }
        if new {
            self.failed = None;
        }
        Heard {
            first,
            go_ahead: new,
        }
    }

    /// What a pass found: a failed try spends its go-ahead and is
    /// remembered; a done one forgets the failure.
    pub fn took(&mut self, out: Option<&UpgradeStatus>) {
        let Some(u) = out else { return };
        match u.state.as_str() {
            "upgrade-failed" => {
                if self.go_ahead.as_deref() == Some(u.driver_version.as_str()) {
                    self.go_ahead = None;
                }
                self.failed = Some((u.driver_version.clone(), u.detail.clone()));
            }
            "upgrade-done" => self.failed = None,
            _ => {}
        }
    }
}

/// Stops the device plugin from advertising GPUs (resources to 0) for an
/// upgrade; advertising resumes with the next pass's resources.
pub trait Drain: std::fmt::Debug {
    /// Stops advertising; returns what was done, for the log.
    fn stop_advertising(&self) -> String;
}

/// Nothing is advertised by this process (the `driver` commands, the
/// first pass before the device plugin starts).
#[derive(Debug)]
pub struct NothingAdvertised;

impl Drain for NothingAdvertised {
    fn stop_advertising(&self) -> String {
        "nothing advertised by this process".into()
    }
}

/// Waits until no process has `/dev/nvidia*` open, or `timeout`.
pub fn wait_for_holders(host: &HostRoot, timeout: Duration) -> Result<(), DriverError> {
    let start = Instant::now();
    loop {
        let holders = modules::device_holders(host);
        if holders.is_empty() {
            return Ok(());
        }
        if start.elapsed() >= timeout {
            return Err(DriverError::Busy {
                holders,
                waited: timeout.as_secs(),
            });
        }
        tracing::info!(stage = "driver", holders = %holders_list(&holders), "waiting for processes using the GPUs to exit");
        std::thread::sleep(Duration::from_millis(500).min(timeout));
    }
}

/// Everything an upgrade touches.
pub struct Upgrade<'a> {
    pub host: &'a HostRoot,
    pub sys: &'a dyn Syscalls,
    /// `spec.driver`.
    pub driver: &'a DriverSpec,
    pub inv: Option<&'a Inventory>,
    pub kernel: &'a str,
    pub drain: &'a dyn Drain,
    pub nvml: Option<&'a dyn Fn() -> Result<String, String>>,
}

impl std::fmt::Debug for Upgrade<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upgrade")
            .field("kernel", &self.kernel)
            .finish()
    }
}

impl Upgrade<'_> {
    /// Loads bundle `name` (switched to current), makes the nodes, validates.
    fn bring_up(&self, name: &str) -> Result<String, DriverError> {
        let plan = plan_load(self.host, self.driver, self.inv, self.kernel, Some(name))?;
        load(self.host, self.sys, &plan, self.driver.on_param_mismatch)?;
        let nodes = plan_nodes(self.host, self.inv)?;
        devnodes::ensure(self.host, self.sys, &nodes)?;
        let want = plan.bundle.as_ref().map(|(_, v)| v.as_str());
        validate(self.host, want, self.nvml)
    }

    /// Stops advertising, waits for GPU processes, unloads, switches to the
    /// installed bundle `to`, loads, recreates nodes, validates. On failure
    /// after the unload: unloads what was loaded, switches back, loads the
    /// previous driver. Returns a one-line report.
    pub fn run(&self, to: &str) -> Result<String, DriverError> {
        bundle::read_installed(self.host, to)?;
        let from = bundle::current(self.host)?;
        let from_previous = bundle::previous(self.host)?;
        let drained = self.drain.stop_advertising();
        tracing::info!(stage = "driver", to = %to, from = from.as_deref().unwrap_or("none"), drained = %drained, "upgrading the driver");
        wait_for_holders(
            self.host,
            Duration::from_secs(self.driver.upgrade_timeout_seconds),
        )?;
        modules::unload(self.host, self.sys, &all_modules())?;
        bundle::switch(self.host, to)?;
        match self.bring_up(to) {
            Ok(version) => {
                let pruned = bundle::prune(self.host).unwrap_or_default();
                let mut report = format!(
                    "upgraded to {to} (driver {version}); previous {} kept for rollback",
                    from.as_deref().unwrap_or("none")
                );
                if !pruned.is_empty() {
                    report.push_str(&format!("; removed {}", pruned.join(", ")));
                }
                Ok(report)
            }
            Err(e) => {
                let why = e.to_string();
                tracing::error!(stage = "driver", to = %to, error = %why, "upgrade failed; rolling back");
                let rolled_back = match &from {
                    None => {
                        let _ = modules::unload(self.host, self.sys, &all_modules());
                        "there was no previous driver to roll back to".to_string()
                    }
                    Some(old) => match self.roll_back(old, from_previous.as_deref()) {
                        Ok(v) => format!("rolled back to {old} (driver {v})"),
                        Err(e2) => format!("rolling back to {old} failed too: {e2}"),
                    },
                };
                Err(DriverError::Upgrade {
                    to: to.to_string(),
                    why,
                    rolled_back,
                })
            }
        }
    }

    /// Back to `old`, with `previous` as it was before the upgrade.
    fn roll_back(&self, old: &str, previous: Option<&str>) -> Result<String, DriverError> {
        modules::unload(self.host, self.sys, &all_modules())?;
        bundle::set_links(self.host, old, previous)?;
        self.bring_up(old)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rollout_waits_for_the_controller_and_spends_a_failed_go_ahead() {
        let status = |state: &str, detail: &str| UpgradeStatus {
            state: state.into(),
            driver_version: "560.35.03".into(),
            detail: detail.into(),
        };
        let mut r = Rollout {
            controller: true,
            ..Default::default()
        };
        // Before the controller's first word, nothing moves, whatever the policy.
        assert!(r.gate(false).gated);
        let h = r.hear(None);
        assert_eq!(
            h,
            Heard {
                first: true,
                go_ahead: false
            }
        );
        assert!(
            !r.gate(false).gated,
            "no ClusterPolicy: the node's own file rules"
        );
        let g = r.gate(true);
        assert!(g.gated && !g.may_upgrade("560.35.03"));
        // The go-ahead opens the gate for that version only.
        let h = r.hear(Some("560.35.03".into()));
        assert_eq!(
            h,
            Heard {
                first: false,
                go_ahead: true
            }
        );
        let g = r.gate(true);
        assert!(g.may_upgrade("560.35.03") && !g.may_upgrade("570.1.1"));
        // The same word again is not a new go-ahead.
        assert!(!r.hear(Some("560.35.03".into())).go_ahead);
        // A failed try spends it: the next pass holds, saying it failed.
        r.took(Some(&status("upgrade-failed", "nvidia.ko did not load")));
        let g = r.gate(true);
        assert!(!g.may_upgrade("560.35.03"));
        let said = g.hold("550.127.08", "560.35.03");
        assert!(said.contains("failed (nvidia.ko did not load)"), "{said}");
        assert_eq!(g.out.take().unwrap().state, "upgrade-failed");
        // The controller's retry is a new go-ahead, and the failure is forgotten.
        assert!(!r.hear(None).go_ahead);
        assert!(r.hear(Some("560.35.03".into())).go_ahead);
        assert_eq!(r.failed, None);
        r.took(Some(&status("upgrade-done", "")));
        assert_eq!(r.failed, None);
        // Without a controller nothing waits.
        assert!(!Rollout::default().gate(false).gated);
    }
    use gpu_backend::test_support::sim_node;
    use gpu_model::backend::ComputeCapability;

    fn inventory(node: &str) -> Inventory {
        let (_dir, sys, backend) = sim_node(node);
        gpu_backend::discover::discover(&sys, &backend)
    }

    #[test]
    fn flavour_follows_the_oldest_gpu_or_the_policy() {
        let both = [Flavour::Open, Flavour::Proprietary];
        let policy = DriverSpec::default();
        // T4 is Turing (7.5): open.
        let mut t4 = inventory("t4-4");
        let (f, why) = choose_flavour(&policy, Some(&t4), &both).unwrap();
        assert_eq!(f, Flavour::Open, "{why}");
        // One GPU older than Turing: proprietary, naming it.
        t4.gpus[2].compute_capability = Some(ComputeCapability { major: 7, minor: 0 });
        let bus = t4.gpus[2].bus_id.to_string();
        let (f, why) = choose_flavour(&policy, Some(&t4), &both).unwrap();
        assert_eq!(f, Flavour::Proprietary);
        assert_eq!(why, format!("GPU(s) older than Turing: {bus}"));
        // No compute capability (driver not loaded yet): the PCI device ID.
        for g in &mut t4.gpus {
            g.compute_capability = None;
        }
        let (f, _) = choose_flavour(&policy, Some(&t4), &both).unwrap();
        assert_eq!(f, Flavour::Open, "T4's device ID 0x1eb8 is Turing");
        t4.gpus[0].pci.as_mut().unwrap().device = 0x1db4; // V100
        let (f, _) = choose_flavour(&policy, Some(&t4), &both).unwrap();
        assert_eq!(f, Flavour::Proprietary);
        // The policy decides when it says; a flavour the bundle lacks is refused.
        let open = hostlib::strict::from_yaml::<DriverSpec>("{useOpenKernelModules: true}\n", "p")
            .unwrap();
        assert_eq!(
            choose_flavour(&open, Some(&t4), &both).unwrap().0,
            Flavour::Open
        );
        let err = choose_flavour(&policy, Some(&t4), &[Flavour::Open])
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            format!(
                "the proprietary modules are needed (GPU(s) older than Turing: {}), the bundle carries only open",
                t4.gpus[0].bus_id
            )
        );
    }
}
