//! What a claim's time-slicing asks for and who applies it, below the
//! checkpoint and the claims (a leaf: it uses neither): NVIDIA's
//! [`TimeSliceInterval`], the checkpoint's [`TimeSliceRecord`], and the
//! agent's [`TimeSlicePort`]. How prepare and unprepare use them:
//! [`super::timeslice`].

use serde::{Deserialize, Serialize};

/// NVIDIA's `TimeSliceInterval`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum TimeSliceInterval {
    /// The GPU's own: nothing is changed.
    #[default]
    Default,
    Short,
    Medium,
    Long,
}

impl TimeSliceInterval {
    /// Every interval, as NVIDIA's configuration spells them.
    pub const ALL: [TimeSliceInterval; 4] = [
        TimeSliceInterval::Default,
        TimeSliceInterval::Short,
        TimeSliceInterval::Medium,
        TimeSliceInterval::Long,
    ];

    /// The number `nvidia-smi compute-policy --set-timeslice` takes.
    pub fn int(self) -> u32 {
        match self {
            TimeSliceInterval::Default => 0,
            TimeSliceInterval::Short => 1,
            TimeSliceInterval::Medium => 2,
            TimeSliceInterval::Long => 3,
        }
    }

    /// Its name in a configuration.
    pub fn name(self) -> &'static str {
        match self {
            TimeSliceInterval::Default => "Default",
            TimeSliceInterval::Short => "Short",
            TimeSliceInterval::Medium => "Medium",
            TimeSliceInterval::Long => "Long",
        }
    }

    /// The interval a configuration names.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|i| i.name() == name)
    }
}

impl std::fmt::Display for TimeSliceInterval {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A claim with time-slicing, as the checkpoint records it: its interval
/// and its full GPUs (UUIDs). Written before the GPUs change.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TimeSliceRecord {
    pub interval: TimeSliceInterval,
    pub gpus: Vec<String>,
}

/// Who changes the GPUs' time slices (the agent). The call blocks (prepare
/// runs on a blocking thread) and answers within the kubelet's 45 s.
pub trait TimeSlicePort: Send + Sync {
    /// Puts each GPU (by UUID, in order) in the DEFAULT compute mode, then
    /// sets its time slice to `interval`; stops at the first GPU that
    /// fails, `Err` naming that GPU and what the command said.
    fn set_time_slice(&self, gpus: &[String], interval: TimeSliceInterval) -> Result<(), String>;
}
