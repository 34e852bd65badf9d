//! The stages themselves: their names, what each is for, the privileges each
//! needs, their order and what turns each off. Below the privileges
//! (`caps`) and the pass that runs them (`stages`), which both read it.

use ::caps::Capability;
use serde::{Deserialize, Serialize};

use crate::policy::Policy;

/// Every stage, in the order the agent runs them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Stage {
    Discover,
    Driver,
    Devnodes,
    Runtime,
    Cdi,
    Validate,
    Plugin,
    Health,
    Labels,
    Metrics,
    Mig,
}

impl Stage {
    pub const ALL: [Stage; 11] = [
        Stage::Discover,
        Stage::Driver,
        // Before the nodes, the CDI spec and the device plugin: they
        // describe the MIG devices the layout makes.
        Stage::Mig,
        Stage::Devnodes,
        Stage::Runtime,
        Stage::Cdi,
        Stage::Validate,
        Stage::Plugin,
        Stage::Health,
        Stage::Labels,
        Stage::Metrics,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Stage::Discover => "discover",
            Stage::Driver => "driver",
            Stage::Devnodes => "devnodes",
            Stage::Runtime => "runtime",
            Stage::Cdi => "cdi",
            Stage::Validate => "validate",
            Stage::Plugin => "plugin",
            Stage::Health => "health",
            Stage::Labels => "labels",
            Stage::Metrics => "metrics",
            Stage::Mig => "mig",
        }
    }

    /// What the stage does, in a few words.
    pub fn purpose(self) -> &'static str {
        match self {
            Stage::Discover => "find GPUs (sysfs, /proc, NVML)",
            Stage::Driver => "verify the driver bundle, load kernel modules",
            Stage::Devnodes => "create /dev/nvidia* and /dev/char links",
            Stage::Runtime => "configure containerd / CRI-O / Docker",
            Stage::Cdi => "write CDI specs for every GPU",
            Stage::Validate => "check every stage, write validation status",
            Stage::Plugin => "serve the kubelet device-plugin API",
            Stage::Health => "watch XIDs, ECC and temperature",
            Stage::Labels => "write GPU feature-discovery labels",
            Stage::Metrics => "export Prometheus metrics on :9400",
            Stage::Mig => "apply the MIG layout",
        }
    }

    /// Capabilities the stage's system calls need.
    pub fn needs(self) -> &'static [Capability] {
        match self {
            Stage::Discover
            | Stage::Validate
            | Stage::Plugin
            | Stage::Labels
            | Stage::Metrics
            | Stage::Cdi => &[],
            Stage::Driver => &[Capability::CAP_SYS_MODULE],
            Stage::Devnodes => &[Capability::CAP_MKNOD],
            // Writing /etc as root; a reload runs the host's systemctl.
            Stage::Runtime => &[],
            // NVML events need no capability; the kernel log needs
            // CAP_SYSLOG only where kernel.dmesg_restrict is 1, and without
            // it health goes on from NVML (the reader says why it is off).
            Stage::Health => &[],
            // MIG reconfiguration through NVML is a privileged operation.
            Stage::Mig => &[Capability::CAP_SYS_ADMIN],
        }
    }

    /// [`Stage::needs`] for this policy and node: the host-driver mode
    /// loads no module, and a simulated node gets no system calls.
    pub fn needs_under(self, policy: &Policy, simulated: bool) -> &'static [Capability] {
        match self {
            Stage::Driver if simulated || !policy.driver.enabled => &[],
            Stage::Devnodes if simulated => &[],
            Stage::Mig if simulated || policy.mig_manager.selected_layout().is_none() => &[],
            other => other.needs(),
        }
    }

    /// Earlier stages this one waits on.
    pub fn after(self) -> &'static [Stage] {
        match self {
            Stage::Discover => &[],
            Stage::Driver => &[Stage::Discover],
            Stage::Devnodes => &[Stage::Driver],
            Stage::Runtime => &[Stage::Discover],
            Stage::Cdi => &[Stage::Devnodes],
            // Validation checks what is done and says what is not; it does
            // not hold the front ends back (a CDI file gone missing must not
            // take the GPUs' capacity away): it takes readiness away.
            Stage::Validate | Stage::Plugin | Stage::Labels | Stage::Metrics | Stage::Health => {
                &[Stage::Discover]
            }
            Stage::Mig => &[Stage::Driver],
        }
    }

    /// `Some(reason)` when the policy turns the stage off.
    pub fn disabled_by(self, p: &Policy) -> Option<&'static str> {
        match self {
            Stage::Runtime if !p.toolkit.enabled => Some("spec.toolkit.enabled is false"),
            Stage::Cdi if !p.cdi.enabled => Some("spec.cdi.enabled is false"),
            Stage::Validate if !p.validator.enabled => Some("spec.validator.enabled is false"),
            Stage::Plugin if !p.device_plugin.enabled => Some("spec.devicePlugin.enabled is false"),
            Stage::Health if !p.device_plugin.enabled && !p.dcgm_exporter.enabled => {
                Some("both spec.devicePlugin and spec.dcgmExporter are disabled")
            }
            Stage::Labels if !p.gfd.enabled => Some("spec.gfd.enabled is false"),
            Stage::Metrics if !p.dcgm_exporter.enabled => {
                Some("spec.dcgmExporter.enabled is false")
            }
            Stage::Mig if !p.mig_manager.enabled => Some("spec.migManager.enabled is false"),
            _ => None,
        }
    }

    /// Built and running for real.
    pub fn implemented(self) -> bool {
        matches!(
            self,
            Stage::Discover
                | Stage::Driver
                | Stage::Devnodes
                | Stage::Runtime
                | Stage::Cdi
                | Stage::Validate
                | Stage::Plugin
                | Stage::Health
                | Stage::Metrics
                | Stage::Labels
                | Stage::Mig
        )
    }
}
