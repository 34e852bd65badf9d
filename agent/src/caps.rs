//! Linux capabilities: the ones each stage uses ([`GRANTS`], one table),
//! the trimming `run` does at start ([`restrict`]) and the set held after
//! it ([`HeldCaps`]), which stages check so that a stage missing one is
//! shown as blocked, naming it, instead of failing later with EPERM.
//!
//! At start (`gpu-agent run`, after the policy is read, before any stage
//! runs and before any other thread exists: capabilities belong to a
//! thread, and threads started later inherit them) the agent keeps only
//! what the stages the policy enables use, and drops every other capability
//! from the bounding set (while CAP_SETPCAP is still held; CAP_SETPCAP
//! itself last), then from the inheritable, permitted and effective sets,
//! and clears the ambient set. Programs the agent starts (`chroot …
//! systemctl`, the MPS control daemon through `host-exec`) get no more than
//! that: a root exec's capabilities are its bounding set.
//!
//! A dropped capability cannot be had back. A reload (SIGHUP, a changed
//! policy file, the cluster's policy) that turns on a stage whose
//! capability was dropped shows that stage `blocked`, saying the capability
//! was dropped at start because the stage was off, and that a restart of
//! gpu-agent enables it. A reload never drops more either (the worker
//! threads started after the trim hold their own copies): a restart trims
//! to the new policy.
//!
//! Where the capabilities cannot be read or changed (not root, a test, a
//! development machine), `run` logs why and goes on with what it holds.

use std::collections::{BTreeMap, BTreeSet};

use caps::CapSet;
pub use caps::Capability;
use serde::{Deserialize, Serialize};

use crate::policy::{Policy, ReloadMode};
use crate::stages::Stage;

/// What decides whether a use of a capability is needed.
#[derive(Clone, Copy, Debug)]
pub struct Setting<'a> {
    pub policy: &'a Policy,
    /// The host root is `/` (the unit), not a mounted host (a DaemonSet's
    /// `/host`): nothing is run through `chroot`.
    pub host_is_system: bool,
    /// The policy the cluster may send (a use it wants is kept too).
    pub cluster: ClusterPolicy<'a>,
}

/// What is known of the cluster's policy at start, when a controller is
/// configured: the agent will run that policy, so the capabilities it
/// keeps must serve it too (they cannot be had back without a restart).
#[derive(Clone, Copy, Debug)]
pub enum ClusterPolicy<'a> {
    /// No controller: the agent runs its own policy only.
    NoController,
    /// The last policy the controller sent, remembered across restarts.
    Remembered(&'a Policy),
    /// A controller is configured and has sent no policy yet: what any
    /// policy may ask for is kept (the next start, with the policy
    /// remembered, keeps only what it asks).
    Unknown,
}

/// Where the agent remembers the last policy the controller sent (a host
/// path; `gpu-agent uninstall` removes it with the rest of the directory).
pub const CLUSTER_POLICY_MEMORY: &str = "/var/lib/gpu-agent/cluster-policy.yaml";

/// A policy with every stage and every optional use on: what a cluster
/// may ask for.
fn widest_policy() -> Policy {
    let mut p = Policy::default();
    p.driver.enabled = true;
    p.toolkit.enabled = true;
    p.toolkit.reload = ReloadMode::Restart;
    p.cdi.enabled = true;
    p.validator.enabled = true;
    p.device_plugin.enabled = true;
    p.dcgm_exporter.enabled = true;
    p.gfd.enabled = true;
    p.mig_manager.enabled = true;
    p.mig_manager.reboot = true;
    p.health.kernel_log = true;
    p.dra.enabled = true;
    p
}

/// Whether `u` is wanted under `policy` alone.
fn wanted_by(u: &Use, policy: &Policy, host_is_system: bool) -> bool {
    let s = Setting {
        policy,
        host_is_system,
        cluster: ClusterPolicy::NoController,
    };
    u.stage.disabled_by(policy).is_none() && (u.unless)(&s).is_none()
}

/// Whether `u` is wanted under `setting`: by the agent's own policy, or by
/// the cluster's.
fn use_wanted(u: &Use, setting: &Setting<'_>) -> bool {
    wanted_by(u, setting.policy, setting.host_is_system)
        || match setting.cluster {
            ClusterPolicy::NoController => false,
            ClusterPolicy::Remembered(p) => wanted_by(u, p, setting.host_is_system),
            ClusterPolicy::Unknown => wanted_by(u, &widest_policy(), setting.host_is_system),
        }
}

/// One stage's use of a capability.
#[derive(Clone, Copy, Debug)]
pub struct Use {
    pub stage: Stage,
    /// What the stage does with it, the system calls named.
    pub why: &'static str,
    /// Beyond the stage being enabled: `Some(reason)` when this setting
    /// asks nothing of the stage that needs the capability.
    pub unless: fn(&Setting<'_>) -> Option<&'static str>,
}

/// A capability and every use of it.
#[derive(Clone, Copy, Debug)]
pub struct Grant {
    pub cap: Capability,
    pub uses: &'static [Use],
}

fn always(_: &Setting<'_>) -> Option<&'static str> {
    None
}

fn driver_managed(s: &Setting<'_>) -> Option<&'static str> {
    (!s.policy.driver.enabled).then_some("spec.driver.enabled is false: the host's driver is used")
}

fn kernel_log(s: &Setting<'_>) -> Option<&'static str> {
    (!s.policy.health.kernel_log).then_some("spec.health.kernelLog is false")
}

fn chroot_restart(s: &Setting<'_>) -> Option<&'static str> {
    if s.host_is_system {
        Some("the host root is /: the runtime is restarted without chroot")
    } else if s.policy.toolkit.reload != ReloadMode::Restart {
        Some("spec.toolkit.reload is not restart")
    } else {
        None
    }
}

fn chroot_reboot(s: &Setting<'_>) -> Option<&'static str> {
    if s.host_is_system {
        Some("the host root is /: the node is rebooted without chroot")
    } else if !s.policy.mig_manager.reboot {
        Some("spec.migManager.reboot is false")
    } else {
        None
    }
}

fn chroot_mps(s: &Setting<'_>) -> Option<&'static str> {
    s.host_is_system
        .then_some("the host root is /: MPS control daemons run without chroot")
}

/// DRA claims with MPS sharing run a control daemon each (the claims'
/// CDI specs are the cdi stage's work: their uses are listed under it).
fn dra_mps(s: &Setting<'_>) -> Option<&'static str> {
    (!s.policy.dra.enabled).then_some("spec.dra.enabled is false")
}

fn chroot_dra_mps(s: &Setting<'_>) -> Option<&'static str> {
    dra_mps(s).or_else(|| chroot_mps(s))
}

/// The stages that write host files (runtime configs, CDI specs, labels,
/// validation files, the kubelet's plugin directory, module settings).
macro_rules! host_files {
    ($why:expr) => {
        &[
            Use {
                stage: Stage::Driver,
                why: $why,
                unless: always,
            },
            Use {
                stage: Stage::Runtime,
                why: $why,
                unless: always,
            },
            Use {
                stage: Stage::Cdi,
                why: $why,
                unless: always,
            },
            Use {
                stage: Stage::Validate,
                why: $why,
                unless: always,
            },
            Use {
                stage: Stage::Plugin,
                why: $why,
                unless: always,
            },
            Use {
                stage: Stage::Labels,
                why: $why,
                unless: always,
            },
        ]
    };
}

const HOLDERS: &str = "find the processes holding /dev/nvidia* (/proc/PID/fd of every user) before a driver upgrade or a MIG change";

/// Every capability a stage uses, and what for. A capability no enabled
/// stage uses is dropped at start; one not in this table is always
/// dropped. [`Stage::needs`] (what a stage is blocked without) must be
/// within its uses here (a unit test checks it).
pub const GRANTS: &[Grant] = &[
    Grant {
        cap: Capability::CAP_SYS_MODULE,
        uses: &[Use {
            stage: Stage::Driver,
            why: "load and unload the NVIDIA kernel modules (finit_module, delete_module)",
            unless: driver_managed,
        }],
    },
    Grant {
        cap: Capability::CAP_MKNOD,
        uses: &[Use {
            stage: Stage::Devnodes,
            why: "make /dev/nvidia*, /dev/nvidia-uvm* and the MIG capability nodes (mknod)",
            unless: always,
        }],
    },
    Grant {
        cap: Capability::CAP_SYS_ADMIN,
        uses: &[
            Use {
                stage: Stage::Mig,
                why: "change MIG modes and instances (NVML's privileged calls)",
                unless: always,
            },
            Use {
                stage: Stage::Plugin,
                why: "give an MPS control daemon a mount namespace with its own /dev/shm (unshare, mount)",
                unless: always,
            },
            Use {
                stage: Stage::Cdi,
                why: "give a DRA claim's MPS control daemon a mount namespace with its own /dev/shm (unshare, mount); set a claim's GPU time slice (nvidia-smi compute-policy, a privileged NVML call)",
                unless: dra_mps,
            },
            Use {
                stage: Stage::Metrics,
                why: "sample the profiling fields through NVML's GPM (the driver keeps GPU profiling to CAP_SYS_ADMIN unless NVreg_RestrictProfilingToAdminUsers=0)",
                unless: always,
            },
            Use {
                stage: Stage::Labels,
                why: "read each GPU's PCI configuration space whole (sysfs gives a reader without it the first 64 bytes), where an NVIDIA vGPU shows itself (nvidia.com/vgpu.present)",
                unless: always,
            },
        ],
    },
    Grant {
        cap: Capability::CAP_SYS_CHROOT,
        uses: &[
            Use {
                stage: Stage::Runtime,
                why: "restart the container runtime through the host's systemctl (chroot into the host root)",
                unless: chroot_restart,
            },
            Use {
                stage: Stage::Mig,
                why: "reboot through the host's systemctl (chroot into the host root)",
                unless: chroot_reboot,
            },
            Use {
                stage: Stage::Plugin,
                why: "run the host's MPS control daemon (chroot into the host root)",
                unless: chroot_mps,
            },
            Use {
                stage: Stage::Cdi,
                why: "run the host's MPS control daemon and nvidia-smi (a time slice) for a DRA claim (chroot into the host root)",
                unless: chroot_dra_mps,
            },
        ],
    },
    Grant {
        cap: Capability::CAP_SETUID,
        uses: &[
            Use {
                stage: Stage::Plugin,
                why: "let an MPS control daemon start each client's MPS server as that client's user (the daemon runs as root and starts servers with the client's uid)",
                unless: always,
            },
            Use {
                stage: Stage::Cdi,
                why: "let a DRA claim's MPS control daemon start each client's MPS server as that client's user",
                unless: dra_mps,
            },
        ],
    },
    Grant {
        cap: Capability::CAP_SETGID,
        uses: &[
            Use {
                stage: Stage::Plugin,
                why: "let an MPS control daemon start each client's MPS server with that client's groups",
                unless: always,
            },
            Use {
                stage: Stage::Cdi,
                why: "let a DRA claim's MPS control daemon start each client's MPS server with that client's groups",
                unless: dra_mps,
            },
        ],
    },
    Grant {
        cap: Capability::CAP_SYSLOG,
        uses: &[Use {
            stage: Stage::Health,
            why: "read XIDs from /dev/kmsg where kernel.dmesg_restrict is 1",
            unless: kernel_log,
        }],
    },
    Grant {
        cap: Capability::CAP_SYS_PTRACE,
        uses: &[
            Use {
                stage: Stage::Driver,
                why: HOLDERS,
                unless: driver_managed,
            },
            Use {
                stage: Stage::Mig,
                why: HOLDERS,
                unless: always,
            },
        ],
    },
    Grant {
        cap: Capability::CAP_DAC_READ_SEARCH,
        uses: &[
            Use {
                stage: Stage::Driver,
                why: HOLDERS,
                unless: driver_managed,
            },
            Use {
                stage: Stage::Mig,
                why: HOLDERS,
                unless: always,
            },
        ],
    },
    Grant {
        cap: Capability::CAP_DAC_OVERRIDE,
        uses: host_files!("write host files and directories of other owners (/etc, /var/lib)"),
    },
    Grant {
        cap: Capability::CAP_CHOWN,
        uses: host_files!("give a rewritten host file back to its owner (chown)"),
    },
    Grant {
        cap: Capability::CAP_FOWNER,
        uses: host_files!("keep the mode of a rewritten host file of another owner (chmod)"),
    },
];

/// A capability the agent holds, and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldCap {
    /// `CAP_SYS_MODULE`.
    pub name: String,
    /// The enabled stages that use it (none: no stage does, and it could
    /// not be dropped).
    pub stages: Vec<String>,
    /// What they do with it (`driver: load …; mig: …`).
    pub why: String,
}

/// A capability a stage could use, dropped at start because the stage was
/// off.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DroppedCap {
    pub name: String,
    /// `driver was disabled (spec.driver.enabled is false: …)`.
    pub because: String,
}

/// What `run` holds and dropped, for the state file and `status`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Privileges {
    /// The effective set after the trim, each with its reason.
    pub held: Vec<HeldCap>,
    /// Capabilities of the table dropped because their stages are off
    /// (the others no stage uses are not listed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dropped: Vec<DroppedCap>,
    /// How many capabilities were dropped in all (from the bounding set,
    /// or from the effective set where the bounding set could not be
    /// changed).
    #[serde(default)]
    pub dropped_count: usize,
    /// The bounding set after the trim (what programs the agent starts
    /// can have at most); `None` when it could not be read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bounding: Option<Vec<String>>,
    /// Why the trim was not done, or not in full.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
    /// What the capabilities kept follow beside the agent's own policy
    /// (the cluster's, when a controller is configured).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<String>,
}

/// The capabilities the enabled stages use under `setting`: each with the
/// uses that want it.
pub fn wanted(setting: &Setting<'_>) -> Vec<(Capability, Vec<&'static Use>)> {
    GRANTS
        .iter()
        .filter_map(|g| {
            let uses: Vec<&'static Use> =
                g.uses.iter().filter(|u| use_wanted(u, setting)).collect();
            (!uses.is_empty()).then_some((g.cap, uses))
        })
        .collect()
}

/// Why a capability of [`GRANTS`] is not wanted under `setting`: each
/// use's stage and why it is off; `None` when it is wanted or not in the
/// table.
fn why_not_wanted(cap: Capability, setting: &Setting<'_>) -> Option<String> {
    let grant = GRANTS.iter().find(|g| g.cap == cap)?;
    if grant.uses.iter().any(|u| use_wanted(u, setting)) {
        return None;
    }
    let mut reasons: Vec<String> = Vec::new();
    for u in grant.uses {
        let line = match u.stage.disabled_by(setting.policy) {
            Some(off) => format!("{} was disabled ({off})", u.stage.name()),
            // A policy switch turned this use off; a fact of the host
            // (the host root is `/`) means the stage never needs it.
            None => match (u.unless)(setting)? {
                // DRA is no stage: its uses sit under the cdi stage.
                off if off.starts_with("spec.dra.") => format!("dra was disabled ({off})"),
                off if off.starts_with("spec.") => {
                    format!("{} was disabled ({off})", u.stage.name())
                }
                off => format!("{} does not need it ({off})", u.stage.name()),
            },
        };
        if !reasons.contains(&line) {
            reasons.push(line);
        }
    }
    if let ClusterPolicy::Remembered(_) = setting.cluster {
        reasons.push("the cluster's last policy does not use it either".into());
    }
    Some(reasons.join(" and "))
}

fn held_cap(cap: Capability, uses: &[&'static Use]) -> HeldCap {
    let mut stages: Vec<String> = Vec::new();
    let mut why: Vec<String> = Vec::new();
    for u in uses {
        if !stages.iter().any(|s| s == u.stage.name()) {
            stages.push(u.stage.name().to_string());
        }
        if !why.iter().any(|w| w == u.why) {
            why.push(u.why.to_string());
        }
    }
    HeldCap {
        name: cap.to_string(),
        stages,
        why: why.join("; "),
    }
}

/// Describes `held` under `setting` (what `status` shows when it inspects
/// the host, and what [`restrict`] records).
pub fn describe(held: &HeldCaps, setting: &Setting<'_>) -> Vec<HeldCap> {
    let wanted = wanted(setting);
    let mut out: Vec<HeldCap> = Vec::new();
    for c in held.caps() {
        out.push(match wanted.iter().find(|(w, _)| *w == c) {
            Some((_, uses)) => held_cap(c, uses),
            None => HeldCap {
                name: c.to_string(),
                stages: Vec::new(),
                why: "no enabled stage uses it".into(),
            },
        });
    }
    out
}

/// Trims this thread's capabilities to what the enabled stages use (see
/// the module docs). Call it before any other thread is started. Never
/// fails: what could not be done is logged and noted.
pub fn restrict(setting: &Setting<'_>) -> (HeldCaps, Privileges) {
    let wanted = wanted(setting);
    let keep: caps::CapsHashSet = wanted.iter().map(|(c, _)| *c).collect();
    let mut notes: Vec<String> = Vec::new();
    let mut dropped_count = 0usize;

    // 1. The bounding set, while CAP_SETPCAP is held; CAP_SETPCAP last.
    let effective = caps::read(None, CapSet::Effective);
    let has_setpcap = effective
        .as_ref()
        .is_ok_and(|e| e.contains(&Capability::CAP_SETPCAP));
    match caps::read(None, CapSet::Bounding) {
        Ok(bounding) if has_setpcap => {
            let mut order: Vec<Capability> = bounding
                .iter()
                .copied()
                .filter(|c| !keep.contains(c) && *c != Capability::CAP_SETPCAP)
                .collect();
            order.sort_by_key(|c| c.index());
            if bounding.contains(&Capability::CAP_SETPCAP)
                && !keep.contains(&Capability::CAP_SETPCAP)
            {
                order.push(Capability::CAP_SETPCAP);
            }
            for c in order {
                match caps::drop(None, CapSet::Bounding, c) {
                    Ok(()) => dropped_count += 1,
                    Err(e) => notes.push(format!("cannot drop {c} from the bounding set: {e}")),
                }
            }
        }
        Ok(bounding) => {
            let extra = bounding.iter().filter(|c| !keep.contains(c)).count();
            if extra > 0 {
                notes.push(format!(
                    "the bounding set keeps {extra} capabilities no enabled stage uses: without CAP_SETPCAP it cannot be trimmed (programs the agent starts may get them)"
                ));
            }
        }
        Err(e) => notes.push(format!("cannot read the bounding set: {e}")),
    }

    // 2. Ambient, inheritable, then effective and permitted.
    if let Err(e) = caps::clear(None, CapSet::Ambient) {
        notes.push(format!("cannot clear the ambient set: {e}"));
    }
    for (set, name) in [
        (CapSet::Inheritable, "inheritable"),
        (CapSet::Effective, "effective"),
        (CapSet::Permitted, "permitted"),
    ] {
        match caps::read(None, set) {
            Ok(now) => {
                let trimmed: caps::CapsHashSet = now.intersection(&keep).copied().collect();
                if trimmed.len() != now.len() {
                    if name == "permitted" && dropped_count == 0 {
                        dropped_count = now.len() - trimmed.len();
                    }
                    if let Err(e) = caps::set(None, set, &trimmed) {
                        notes.push(format!("cannot trim the {name} set: {e}"));
                    }
                }
            }
            Err(e) => notes.push(format!("cannot read the {name} set: {e}")),
        }
    }

    let held = HeldCaps::read();
    let bounding = caps::read(None, CapSet::Bounding).ok().map(|b| {
        let mut v: Vec<String> = b.iter().map(|c| c.to_string()).collect();
        v.sort();
        v
    });
    let mut dropped = Vec::new();
    for g in GRANTS {
        if !held.has(g.cap)
            && let Some(because) = why_not_wanted(g.cap, setting)
        {
            dropped.push(DroppedCap {
                name: g.cap.to_string(),
                because,
            });
        }
    }
    let held = held.with_dropped(
        dropped
            .iter()
            .map(|d| (d.name.clone(), d.because.clone()))
            .collect(),
    );
    for n in &notes {
        tracing::warn!(note = %n, "capabilities not trimmed in full");
    }
    let privileges = Privileges {
        held: describe(&held, setting),
        dropped,
        dropped_count,
        bounding,
        notes,
        cluster: match setting.cluster {
            ClusterPolicy::NoController => None,
            ClusterPolicy::Remembered(_) => Some(format!(
                "kept for the agent's policy and the cluster's last policy (remembered in {CLUSTER_POLICY_MEMORY})"
            )),
            ClusterPolicy::Unknown => Some(format!(
                "a controller is configured and has sent no policy yet ({CLUSTER_POLICY_MEMORY} holds none): what any policy may ask for is kept; the next start keeps only what the cluster's policy asks"
            )),
        },
    };
    tracing::info!(
        held = %held.names().join(","),
        dropped = dropped_count,
        "capabilities trimmed to the enabled stages"
    );
    (held, privileges)
}

/// The effective capabilities of this process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldCaps {
    held: BTreeSet<String>,
    /// Capabilities dropped at start because their stages were off, with
    /// why (see [`restrict`]).
    dropped: BTreeMap<String, String>,
}

impl HeldCaps {
    /// Reads the effective set of this thread. If it cannot be read, none are
    /// assumed held (and the reason is logged), so stages say "blocked"
    /// rather than fail later.
    pub fn read() -> Self {
        match caps::read(None, CapSet::Effective) {
            Ok(set) => HeldCaps {
                held: set.into_iter().map(|c| c.to_string()).collect(),
                dropped: BTreeMap::new(),
            },
            Err(e) => {
                tracing::warn!(error = %e, "cannot read capabilities; assuming none are held");
                HeldCaps {
                    held: BTreeSet::new(),
                    dropped: BTreeMap::new(),
                }
            }
        }
    }

    /// A fixed set, for tests and for showing what a stage would need.
    pub fn from_caps(caps: &[Capability]) -> Self {
        HeldCaps {
            held: caps.iter().map(|c| c.to_string()).collect(),
            dropped: BTreeMap::new(),
        }
    }

    /// The same, remembering why each of `dropped` (by name) was dropped.
    pub fn with_dropped(mut self, dropped: BTreeMap<String, String>) -> Self {
        self.dropped = dropped;
        self
    }

    /// True when `cap` is held.
    pub fn has(&self, cap: Capability) -> bool {
        self.held.contains(&cap.to_string())
    }

    /// The held capabilities, as the library names them.
    fn caps(&self) -> Vec<Capability> {
        let mut v: Vec<Capability> = caps::all().into_iter().filter(|c| self.has(*c)).collect();
        v.sort_by_key(|c| c.to_string());
        v
    }

    /// The ones of `needed` that are not held, by name (`CAP_SYS_MODULE`).
    pub fn missing(&self, needed: &[Capability]) -> Vec<String> {
        needed
            .iter()
            .filter(|c| !self.has(**c))
            .map(|c| c.to_string())
            .collect()
    }

    /// Why a stage missing `missing` is blocked: a capability dropped at
    /// start says so and that a restart brings it back; any other is
    /// simply missing.
    pub fn blocked_detail(&self, missing: &[String]) -> String {
        let mut parts: Vec<String> = Vec::new();
        let plain: Vec<&str> = missing
            .iter()
            .filter(|m| !self.dropped.contains_key(*m))
            .map(String::as_str)
            .collect();
        if !plain.is_empty() {
            parts.push(format!("missing {}", plain.join(", ")));
        }
        for m in missing {
            if let Some(because) = self.dropped.get(m) {
                parts.push(format!(
                    "capability {m} was dropped at start because {because}; restart gpu-agent to enable it"
                ));
            }
        }
        parts.join("; ")
    }

    /// Every held capability's name.
    pub fn names(&self) -> Vec<String> {
        self.held.iter().cloned().collect()
    }
}

#[cfg(test)]
mod tests;
