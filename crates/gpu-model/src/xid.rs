//! What an XID means, in code: for each XID an operator is likely to meet,
//! a short name, one sentence on what happened, who is usually at fault,
//! what to do, and how the health policy treats it by default.
//!
//! Sources: NVIDIA's public XID documentation ("XID Errors" and the Xid
//! catalog in the GPU deployment and management docs, which gives an
//! immediate and an investigatory action per XID for Ampere and later), the
//! constant names in NVIDIA's open kernel modules (`nverror.h`), and the
//! default ignore list of NVIDIA's Kubernetes device plugin. The sentences
//! here are ours; check NVIDIA's catalog for your driver branch when in
//! doubt, because several XIDs (NVLink 144–150, 154) carry sub-codes in the
//! message whose meaning changes between driver branches.
//!
//! Default severities follow the device plugin: everything it treats as
//! critical is [`Severity::Unhealthy`], its ignore list
//! ([`DEVICE_PLUGIN_IGNORED`]: 13, 31, 43, 45, 68, 109) never is. We depart
//! from the plugin in one direction only, and only where NVIDIA's own catalog
//! says the event needs no immediate action (its "IGNORE" bucket): 63 (a row
//! remap was recorded; it takes effect at the next reset and the GPU keeps
//! working), 92 (corrected single-bit errors above a rate), 121 (a corrected
//! chip-to-chip link error), 147 and 148 (NVLink units whose catalog entries
//! only list ignore-level outcomes). These are [`Severity::Log`] here:
//! logged as warnings, the GPU stays schedulable. One tension is kept on
//! purpose: NVIDIA's catalog asks for a GPU reset after 109 (context switch
//! timeout) while the device plugin ignores it; the health policy follows
//! the plugin (the GPU stays healthy) and the advice still says reset.
//! XIDs not in this catalogue are treated as critical, like the plugin does.

use serde::Serialize;
use serde::ser::SerializeStruct;

/// XIDs NVIDIA's device plugin ignores by default: application-level
/// errors that say nothing about the GPU's health.
pub const DEVICE_PLUGIN_IGNORED: &[u64] = &[13, 31, 43, 45, 68, 109];

/// Who is usually at fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Cause {
    /// The program running on the GPU (bad address, bad kernel, killed job).
    Application,
    /// The board, its memory, its links or the PCIe path to it.
    Hardware,
    /// The driver or the GPU's own firmware (GSP, PMU).
    Driver,
    /// Any of the above; the message and the XIDs around it tell which.
    Mixed,
}

impl Cause {
    /// A few words for a person.
    pub fn text(self) -> &'static str {
        match self {
            Cause::Application => "usually the application",
            Cause::Hardware => "hardware",
            Cause::Driver => "driver or GPU firmware",
            Cause::Mixed => "application, driver or hardware",
        }
    }
}

/// What an operator should do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Action {
    /// Nothing now; watch whether it keeps happening.
    None,
    /// The event is a consequence: look at the XID before it.
    SeePreviousXid,
    /// The job failed; restart it.
    RestartJob,
    /// No hurry: reset the GPU when it is idle.
    ResetWhenIdle,
    /// Stop the GPU's jobs and reset the GPU.
    ResetGpu,
    /// The node as a whole needs a reboot.
    DrainAndReboot,
    /// The board is failing: reset now, replace it if it recurs.
    ReplaceBoard,
    /// An NVLink / NVSwitch fabric problem.
    CheckNvlink,
    /// The driver says what to do, in the message.
    FollowRecoveryAction,
}

impl Action {
    /// One line for a person.
    pub fn text(self) -> &'static str {
        match self {
            Action::None => "no action now; watch whether it recurs",
            Action::SeePreviousXid => {
                "look at the XID logged just before it on this GPU; this one follows from it"
            }
            Action::RestartJob => "restart the job; if it keeps failing, debug the application",
            Action::ResetWhenIdle => "reset the GPU the next time it is idle",
            Action::ResetGpu => "stop the GPU's jobs and reset the GPU; reboot if the reset fails",
            Action::DrainAndReboot => "drain and reboot the node",
            Action::ReplaceBoard => {
                "drain the GPU and reset it; if it happens again, have the board replaced"
            }
            Action::CheckNvlink => {
                "drain the GPU, check its NVLink links and the fabric, then reset the GPU"
            }
            Action::FollowRecoveryAction => {
                "do what the recovery action in the message asks (none, reset, drain or reboot)"
            }
        }
    }
}

/// How the health policy treats the XID unless configured otherwise.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Severity {
    /// Noted at info level; the GPU stays healthy.
    Ignore,
    /// Logged as a warning; the GPU stays healthy.
    Log,
    /// The GPU is taken out of scheduling.
    Unhealthy,
}

/// One catalogue entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct XidInfo {
    pub xid: u64,
    /// NVIDIA's constant name (`nverror.h`).
    pub mnemonic: &'static str,
    /// A short name.
    pub name: &'static str,
    /// What happened, in one sentence.
    pub meaning: &'static str,
    pub cause: Cause,
    pub action: Action,
    pub severity: Severity,
}

impl XidInfo {
    /// One line for a person: "XID 79: GPU has fallen off the bus —
    /// hardware; drain and reboot the node".
    pub fn advice(&self) -> String {
        format!(
            "XID {}: {} — {}; {}",
            self.xid,
            self.name,
            self.cause.text(),
            self.action.text()
        )
    }
}

impl Serialize for XidInfo {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut st = s.serialize_struct("XidInfo", 9)?;
        st.serialize_field("xid", &self.xid)?;
        st.serialize_field("mnemonic", self.mnemonic)?;
        st.serialize_field("name", self.name)?;
        st.serialize_field("meaning", self.meaning)?;
        st.serialize_field("cause", &self.cause)?;
        st.serialize_field("action", &self.action)?;
        st.serialize_field("action_text", self.action.text())?;
        st.serialize_field("severity", &self.severity)?;
        st.serialize_field("advice", &self.advice())?;
        st.end()
    }
}

const fn entry(
    xid: u64,
    mnemonic: &'static str,
    name: &'static str,
    meaning: &'static str,
    cause: Cause,
    action: Action,
    severity: Severity,
) -> XidInfo {
    XidInfo {
        xid,
        mnemonic,
        name,
        meaning,
        cause,
        action,
        severity,
    }
}

use Action as A;
use Cause as C;
use Severity as S;

/// Sorted by XID (a test checks it; [`lookup`] relies on it).
static CATALOGUE: &[XidInfo] = &[
    entry(
        13,
        "ROBUST_CHANNEL_GR_EXCEPTION",
        "graphics engine exception",
        "A kernel running on the GPU faulted (an out-of-range access, an illegal instruction) and its work was stopped.",
        C::Application,
        A::RestartJob,
        S::Log,
    ),
    entry(
        31,
        "ROBUST_CHANNEL_FIFO_ERROR_MMU_ERR_FLT",
        "GPU memory page fault",
        "The GPU's MMU caught an access to an address the process has not mapped, almost always a bug in the program.",
        C::Application,
        A::RestartJob,
        S::Log,
    ),
    entry(
        32,
        "ROBUST_CHANNEL_PBDMA_ERROR",
        "corrupted push buffer stream",
        "The command stream the GPU fetched was invalid, from a program bug, a driver fault, or data damaged on the PCIe path.",
        C::Mixed,
        A::RestartJob,
        S::Unhealthy,
    ),
    entry(
        43,
        "ROBUST_CHANNEL_RESETCHANNEL_VERIF_ERROR",
        "GPU stopped processing",
        "The driver stopped a channel after its process hit a fault; other processes on the GPU are not affected.",
        C::Application,
        A::RestartJob,
        S::Log,
    ),
    entry(
        45,
        "ROBUST_CHANNEL_PREEMPTIVE_REMOVAL",
        "preemptive channel cleanup",
        "The driver tore down a process's channels because the process ended or an earlier error forced it.",
        C::Mixed,
        A::SeePreviousXid,
        S::Ignore,
    ),
    entry(
        48,
        "ROBUST_CHANNEL_GPU_ECC_DBE",
        "double-bit ECC error",
        "GPU memory returned data with an error ECC could detect but not correct.",
        C::Hardware,
        A::ResetGpu,
        S::Unhealthy,
    ),
    entry(
        61,
        "PMU_BREAKPOINT",
        "internal micro-controller breakpoint",
        "The GPU's power-management micro-controller hit a breakpoint or raised a warning.",
        C::Mixed,
        A::ResetGpu,
        S::Unhealthy,
    ),
    entry(
        62,
        "PMU_HALT_ERROR",
        "internal micro-controller halt",
        "The GPU's power-management micro-controller stopped running.",
        C::Mixed,
        A::ResetGpu,
        S::Unhealthy,
    ),
    entry(
        63,
        "INFOROM_PAGE_RETIREMENT_EVENT",
        "memory row remap or page retirement recorded",
        "After a memory error the GPU recorded a page to retire or a row to remap; it takes effect at the next GPU reset.",
        C::Hardware,
        A::ResetWhenIdle,
        S::Log,
    ),
    entry(
        64,
        "INFOROM_PAGE_RETIREMENT_FAILURE",
        "memory row remap or page retirement failed",
        "The GPU could not record the retirement or remap of failing memory, so the bad memory stays in use.",
        C::Hardware,
        A::ReplaceBoard,
        S::Unhealthy,
    ),
    entry(
        68,
        "ROBUST_CHANNEL_NVDEC0_ERROR",
        "video decoder exception",
        "The NVDEC video decoder faulted on the stream it was given.",
        C::Application,
        A::RestartJob,
        S::Log,
    ),
    entry(
        69,
        "ROBUST_CHANNEL_GR_CLASS_ERROR",
        "graphics engine class error",
        "The graphics engine received a method it does not accept, from a program, driver or hardware fault.",
        C::Mixed,
        A::RestartJob,
        S::Unhealthy,
    ),
    entry(
        74,
        "NVLINK_ERROR",
        "NVLink error",
        "An NVLink connection to a peer GPU or NVSwitch reported an error; the registers in the message tell how serious.",
        C::Hardware,
        A::CheckNvlink,
        S::Unhealthy,
    ),
    entry(
        79,
        "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS",
        "GPU has fallen off the bus",
        "The GPU stopped answering on PCIe and the driver can no longer reach it.",
        C::Hardware,
        A::DrainAndReboot,
        S::Unhealthy,
    ),
    entry(
        92,
        "EXCESSIVE_SBE_INTERRUPTS",
        "high single-bit ECC error rate",
        "Corrected single-bit memory errors arrived faster than a threshold; data is intact, but a rising rate predicts failure.",
        C::Hardware,
        A::None,
        S::Log,
    ),
    entry(
        94,
        "ROBUST_CHANNEL_CONTAINED_ERROR",
        "contained memory error",
        "An uncorrectable memory error was confined to the processes that used the memory; they were stopped, the rest run on.",
        C::Hardware,
        A::RestartJob,
        S::Unhealthy,
    ),
    entry(
        95,
        "ROBUST_CHANNEL_UNCONTAINED_ERROR",
        "uncontained memory error",
        "An uncorrectable memory error could not be confined, so every process on the GPU is affected.",
        C::Hardware,
        A::ResetGpu,
        S::Unhealthy,
    ),
    entry(
        109,
        "ROBUST_CHANNEL_CTXSW_TIMEOUT_ERROR",
        "context switch timeout",
        "The GPU did not switch away from a context in time, often a kernel that will not yield.",
        C::Mixed,
        A::ResetGpu,
        S::Log,
    ),
    entry(
        110,
        "SEC_FAULT_ERROR",
        "security fault",
        "The GPU's security engine reported a fault.",
        C::Mixed,
        A::ResetGpu,
        S::Unhealthy,
    ),
    entry(
        119,
        "GSP_RPC_TIMEOUT",
        "GSP RPC timeout",
        "The GPU System Processor firmware did not answer a driver request in time.",
        C::Driver,
        A::ResetGpu,
        S::Unhealthy,
    ),
    entry(
        120,
        "GSP_ERROR",
        "GSP error",
        "The GPU System Processor firmware reported an internal error.",
        C::Driver,
        A::ResetGpu,
        S::Unhealthy,
    ),
    entry(
        121,
        "C2C_ERROR",
        "chip-to-chip link corrected error",
        "The NVLink-C2C link between the GPU and its Grace CPU corrected a transmission error.",
        C::Hardware,
        A::None,
        S::Log,
    ),
    entry(
        136,
        "ALI_TRAINING_FAIL",
        "NVLink training failure",
        "An NVLink link failed to train (come up) during initialisation.",
        C::Hardware,
        A::CheckNvlink,
        S::Unhealthy,
    ),
    entry(
        140,
        "UNRECOVERABLE_ECC_ERROR_ESCAPE",
        "uncorrectable ECC error escaped containment",
        "An uncorrectable memory error reached a consumer before it could be contained.",
        C::Hardware,
        A::ResetGpu,
        S::Unhealthy,
    ),
    entry(
        143,
        "GPU_INIT_ERROR",
        "GPU initialisation error",
        "The driver failed to bring the GPU up.",
        C::Mixed,
        A::ResetGpu,
        S::Unhealthy,
    ),
    entry(
        144,
        "NVLINK_SAW_ERROR",
        "NVLink SAW unit error",
        "An NVLink error from the link's SAW unit; the message says fatal or non-fatal and carries the error status.",
        C::Hardware,
        A::CheckNvlink,
        S::Unhealthy,
    ),
    entry(
        145,
        "NVLINK_RLW_ERROR",
        "NVLink RLW unit error",
        "An NVLink error from the link's RLW unit; the message says fatal or non-fatal and carries the error status.",
        C::Hardware,
        A::CheckNvlink,
        S::Unhealthy,
    ),
    entry(
        146,
        "NVLINK_TLW_ERROR",
        "NVLink TLW unit error",
        "An NVLink error from the link's TLW unit; the message says fatal or non-fatal and carries the error status.",
        C::Hardware,
        A::CheckNvlink,
        S::Unhealthy,
    ),
    entry(
        147,
        "NVLINK_TREX_ERROR",
        "NVLink TREX unit error",
        "An NVLink event from the link's TREX unit; NVIDIA's catalog lists no action for it.",
        C::Hardware,
        A::None,
        S::Log,
    ),
    entry(
        148,
        "NVLINK_NVLPW_CTRL_ERROR",
        "NVLink power-control error",
        "An NVLink event from the link's NVLPW control unit; NVIDIA's catalog lists no action for it.",
        C::Hardware,
        A::None,
        S::Log,
    ),
    entry(
        149,
        "NVLINK_NETIR_ERROR",
        "NVLink network interface error",
        "An NVLink error from the link's NETIR unit (link down, fabric events); the message says fatal or non-fatal.",
        C::Hardware,
        A::CheckNvlink,
        S::Unhealthy,
    ),
    entry(
        150,
        "NVLINK_MSE_ERROR",
        "NVLink management engine error",
        "The NVLink management firmware (MSE) reported a fault or degraded state.",
        C::Hardware,
        A::CheckNvlink,
        S::Unhealthy,
    ),
    entry(
        154,
        "GPU_RECOVERY_ACTION_CHANGED",
        "GPU recovery action changed",
        "The driver changed the action it needs to recover the GPU (none, reset, drain, reboot) after another XID.",
        C::Driver,
        A::FollowRecoveryAction,
        S::Unhealthy,
    ),
];

/// Every catalogued XID, sorted by number.
pub fn catalogue() -> &'static [XidInfo] {
    CATALOGUE
}

/// The entry for `xid`, if catalogued.
pub fn lookup(xid: u64) -> Option<&'static XidInfo> {
    CATALOGUE
        .binary_search_by_key(&xid, |e| e.xid)
        .ok()
        .and_then(|i| CATALOGUE.get(i))
}

/// The default severity of `xid`; an XID not in the catalogue is treated as
/// critical, as NVIDIA's device plugin does.
pub fn default_severity(xid: u64) -> Severity {
    lookup(xid).map_or(Severity::Unhealthy, |e| e.severity)
}

/// One line for a person, for any XID.
pub fn describe(xid: u64) -> String {
    match lookup(xid) {
        Some(e) => e.advice(),
        None => format!("XID {xid}: not in gpu-agent's catalogue; see NVIDIA's XID documentation"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_sorted_and_unique() {
        for pair in catalogue().windows(2) {
            assert!(
                pair[0].xid < pair[1].xid,
                "{} before {}",
                pair[0].xid,
                pair[1].xid
            );
        }
    }

    #[test]
    fn every_xid_operators_meet_is_catalogued() {
        let required = [
            13, 31, 32, 43, 45, 48, 61, 62, 63, 64, 68, 69, 74, 79, 92, 94, 95, 109, 119, 120, 121,
            140, 144, 145, 146, 147, 148, 149, 150, 154,
        ];
        let missing: Vec<u64> = required
            .iter()
            .copied()
            .filter(|x| lookup(*x).is_none())
            .collect();
        assert_eq!(missing, Vec::<u64>::new());
        for x in required {
            assert_eq!(lookup(x).map(|e| e.xid), Some(x));
        }
    }

    #[test]
    fn the_device_plugins_ignored_xids_never_make_a_gpu_unhealthy() {
        for &x in DEVICE_PLUGIN_IGNORED {
            let e = lookup(x).unwrap_or_else(|| panic!("XID {x} not catalogued"));
            assert_ne!(e.severity, Severity::Unhealthy, "XID {x}");
            assert_ne!(default_severity(x), Severity::Unhealthy, "XID {x}");
        }
    }

    #[test]
    fn departures_from_the_device_plugin_are_the_documented_ones() {
        // Everything else the plugin treats as critical stays critical.
        let healthy: Vec<u64> = catalogue()
            .iter()
            .filter(|e| e.severity != Severity::Unhealthy)
            .map(|e| e.xid)
            .filter(|x| !DEVICE_PLUGIN_IGNORED.contains(x))
            .collect();
        assert_eq!(healthy, [63, 92, 121, 147, 148]);
    }

    #[test]
    fn critical_hardware_xids_make_a_gpu_unhealthy() {
        for x in [48, 64, 74, 79, 95, 119, 140] {
            assert_eq!(default_severity(x), Severity::Unhealthy, "XID {x}");
        }
        // Unknown XIDs too, like the device plugin.
        assert_eq!(default_severity(999), Severity::Unhealthy);
    }

    #[test]
    fn every_entry_has_advice_text() {
        for e in catalogue() {
            assert!(!e.name.is_empty() && !e.meaning.is_empty() && !e.mnemonic.is_empty());
            assert!(e.meaning.ends_with('.'), "XID {}: {}", e.xid, e.meaning);
            let advice = e.advice();
            assert!(advice.starts_with(&format!("XID {}: ", e.xid)), "{advice}");
            assert!(advice.contains(e.action.text()), "{advice}");
            assert!(!e.action.text().is_empty() && !e.cause.text().is_empty());
        }
    }

    #[test]
    fn advice_reads_as_one_line() {
        assert_eq!(
            lookup(79).unwrap().advice(),
            "XID 79: GPU has fallen off the bus — hardware; drain and reboot the node"
        );
        assert_eq!(describe(79), lookup(79).unwrap().advice());
        assert_eq!(
            describe(999),
            "XID 999: not in gpu-agent's catalogue; see NVIDIA's XID documentation"
        );
        assert!(describe(13).contains("usually the application"));
    }

    #[test]
    fn entries_serialize_with_their_texts() {
        let v = serde_json::to_value(lookup(48).unwrap()).unwrap();
        assert_eq!(v["xid"], 48);
        assert_eq!(v["mnemonic"], "ROBUST_CHANNEL_GPU_ECC_DBE");
        assert_eq!(v["cause"], "hardware");
        assert_eq!(v["action"], "reset-gpu");
        assert_eq!(v["severity"], "unhealthy");
        assert_eq!(v["action_text"], Action::ResetGpu.text());
        assert_eq!(
            v["advice"],
            "XID 48: double-bit ECC error — hardware; stop the GPU's jobs and reset the GPU; reboot if the reset fails"
        );
    }
}
