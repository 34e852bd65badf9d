//! Linux capabilities the agent holds, read once at start. Each stage names
//! the ones it needs; a stage missing one is shown as blocked, naming it,
//! instead of failing later with EPERM.

use std::collections::BTreeSet;

pub use caps::Capability;

/// The effective capabilities of this process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldCaps {
    held: BTreeSet<String>,
}

impl HeldCaps {
    /// Reads the effective set of this thread. If it cannot be read, none are
    /// assumed held (and the reason is logged), so stages say "blocked"
    /// rather than fail later.
    pub fn read() -> Self {
        match caps::read(None, caps::CapSet::Effective) {
            Ok(set) => HeldCaps {
                held: set.into_iter().map(|c| c.to_string()).collect(),
            },
            Err(e) => {
                tracing::warn!(error = %e, "cannot read capabilities; assuming none are held");
                HeldCaps {
                    held: BTreeSet::new(),
                }
            }
        }
    }

    /// A fixed set, for tests and for showing what a stage would need.
    pub fn from_caps(caps: &[Capability]) -> Self {
        HeldCaps {
            held: caps.iter().map(|c| c.to_string()).collect(),
        }
    }

    /// True when `cap` is held.
    pub fn has(&self, cap: Capability) -> bool {
        self.held.contains(&cap.to_string())
    }

    /// The ones of `needed` that are not held, by name (`CAP_SYS_MODULE`).
    pub fn missing(&self, needed: &[Capability]) -> Vec<String> {
        needed
            .iter()
            .filter(|c| !self.has(**c))
            .map(|c| c.to_string())
            .collect()
    }

    /// Every held capability's name.
    pub fn names(&self) -> Vec<String> {
        self.held.iter().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_names_the_capability() {
        let held = HeldCaps::from_caps(&[Capability::CAP_MKNOD]);
        assert!(held.has(Capability::CAP_MKNOD));
        assert_eq!(
            held.missing(&[Capability::CAP_MKNOD, Capability::CAP_SYS_MODULE]),
            vec!["CAP_SYS_MODULE".to_string()]
        );
    }

    #[test]
    fn reads_this_process() {
        // Whatever this process holds, reading works and names look right.
        let held = HeldCaps::read();
        assert!(held.names().iter().all(|n| n.starts_with("CAP_")));
    }
}
