//! The ClusterPolicy's `spec.driver.upgradePolicy` (the GPU Operator's
//! keys and defaults), read into an [`UpgradePolicy`]: how many nodes may
//! upgrade at once, how many may be out of service, which pods a node waits
//! for, evicts or drains. Pure: no API calls.

use std::time::Duration;

use serde_json::Value;

/// How long a node's agent has, by default, from the go-ahead to report
/// the new driver validated (it withdraws its GPUs, waits for their
/// processes, unloads, switches, loads and validates).
pub const VALIDATION_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// A count of nodes, or a percentage of them (`maxUnavailable`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Amount {
    Count(u32),
    Percent(u32),
}

impl Amount {
    /// Of `total` nodes: a percentage rounds up.
    pub fn of(self, total: usize) -> usize {
        match self {
            Amount::Count(n) => n as usize,
            Amount::Percent(p) => (total * p as usize).div_ceil(100),
        }
    }
}

/// How long a step may take (`None`: no limit, the API's `0`).
fn limit(seconds: u64) -> Option<Duration> {
    (seconds > 0).then(|| Duration::from_secs(seconds))
}

/// Which pods a step removes, and what it may do to them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Removal {
    /// Evict pods no controller runs (they are not recreated).
    pub force: bool,
    /// Evict pods with `emptyDir` volumes (their data is lost).
    pub delete_empty_dir: bool,
    pub timeout: Option<Duration>,
    /// A label selector (`drain.podSelector`), empty: every pod.
    pub selector: String,
}

/// `spec.driver.upgradePolicy` of the ClusterPolicy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UpgradePolicy {
    pub auto_upgrade: bool,
    /// Nodes upgrading at once; 0: no limit.
    pub max_parallel: u32,
    pub max_unavailable: Amount,
    /// `waitForCompletion`: pods to wait for, and how long.
    pub wait_selector: String,
    pub wait_timeout: Option<Duration>,
    /// `gpuPodDeletion`.
    pub pod_deletion: Removal,
    /// `drain`, when enabled.
    pub drain: Option<Removal>,
    /// How long `validation-required` may last (the agent's switch and
    /// validation) before the node is `upgrade-failed`; not a key of the
    /// ClusterPolicy: gpu-controller's `--upgrade-validation-timeout-seconds`.
    pub validation_timeout: Option<Duration>,
}

impl Default for UpgradePolicy {
    /// The GPU Operator's defaults.
    fn default() -> Self {
        UpgradePolicy {
            auto_upgrade: true,
            max_parallel: 1,
            max_unavailable: Amount::Percent(25),
            wait_selector: String::new(),
            wait_timeout: None,
            pod_deletion: Removal {
                force: false,
                delete_empty_dir: false,
                timeout: limit(300),
                selector: String::new(),
            },
            drain: None,
            validation_timeout: Some(VALIDATION_TIMEOUT),
        }
    }
}

/// A key of `spec.driver.upgradePolicy` that cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("spec.driver.upgradePolicy{key}: {why}")]
pub struct PolicyError {
    /// The key under `upgradePolicy`, with its leading dot.
    pub key: String,
    pub why: String,
}

impl UpgradePolicy {
    /// Reads it from a ClusterPolicy's `spec` (absent keys take the GPU
    /// Operator's defaults). Keys the operator has and gpu-agent does not
    /// use are left alone; a wrong type or value is an error naming it.
    pub fn from_spec(spec: &Value) -> Result<UpgradePolicy, PolicyError> {
        let mut p = UpgradePolicy::default();
        let Some(u) = spec.pointer("/driver/upgradePolicy") else {
            return Ok(p);
        };
        let err = |key: &str, why: &str| PolicyError {
            key: format!(".{key}"),
            why: why.into(),
        };
        if !u.is_object() {
            return Err(PolicyError {
                key: String::new(),
                why: "expected a mapping".into(),
            });
        }
        let bool_at = |key: &str, default: bool| -> Result<bool, PolicyError> {
            match u.pointer(&format!("/{}", key.replace('.', "/"))) {
                None | Some(Value::Null) => Ok(default),
                Some(Value::Bool(b)) => Ok(*b),
                Some(_) => Err(err(key, "expected true or false")),
            }
        };
        let uint_at = |key: &str, default: u64| -> Result<u64, PolicyError> {
            match u.pointer(&format!("/{}", key.replace('.', "/"))) {
                None | Some(Value::Null) => Ok(default),
                Some(v) => v
                    .as_u64()
                    .ok_or_else(|| err(key, "expected a whole number, 0 or more")),
            }
        };
        let str_at = |key: &str| -> Result<String, PolicyError> {
            match u.pointer(&format!("/{}", key.replace('.', "/"))) {
                None | Some(Value::Null) => Ok(String::new()),
                Some(Value::String(s)) => Ok(s.clone()),
                Some(_) => Err(err(key, "expected a label selector (a string)")),
            }
        };
        p.auto_upgrade = bool_at("autoUpgrade", true)?;
        p.max_parallel = u32::try_from(uint_at("maxParallelUpgrades", 1)?)
            .map_err(|_| err("maxParallelUpgrades", "too large"))?;
        p.max_unavailable = match u.get("maxUnavailable") {
            None | Some(Value::Null) => Amount::Percent(25),
            Some(Value::Number(n)) => Amount::Count(
                n.as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| err("maxUnavailable", "expected a count or a percentage"))?,
            ),
            Some(Value::String(s)) => {
                let bad = || {
                    err(
                        "maxUnavailable",
                        &format!("{s:?} is not a count or a percentage like 25%"),
                    )
                };
                match s.strip_suffix('%') {
                    Some(p) => {
                        Amount::Percent(p.parse().ok().filter(|p| *p <= 100).ok_or_else(bad)?)
                    }
                    None => Amount::Count(s.parse().map_err(|_| bad())?),
                }
            }
            Some(_) => return Err(err("maxUnavailable", "expected a count or a percentage")),
        };
        p.wait_selector = str_at("waitForCompletion.podSelector")?;
        p.wait_timeout = limit(uint_at("waitForCompletion.timeoutSeconds", 0)?);
        p.pod_deletion = Removal {
            force: bool_at("gpuPodDeletion.force", false)?,
            delete_empty_dir: bool_at("gpuPodDeletion.deleteEmptyDir", false)?,
            timeout: limit(uint_at("gpuPodDeletion.timeoutSeconds", 300)?),
            selector: String::new(),
        };
        p.drain = if bool_at("drain.enable", false)? {
            Some(Removal {
                force: bool_at("drain.force", false)?,
                delete_empty_dir: bool_at("drain.deleteEmptyDir", false)?,
                timeout: limit(uint_at("drain.timeoutSeconds", 300)?),
                selector: str_at("drain.podSelector")?,
            })
        } else {
            None
        };
        Ok(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_operators_keys_and_defaults() {
        assert_eq!(
            UpgradePolicy::from_spec(&json!({})).unwrap(),
            UpgradePolicy::default()
        );
        let p = UpgradePolicy::from_spec(&json!({"driver": {"upgradePolicy": {
            "autoUpgrade": true, "maxParallelUpgrades": 0, "maxUnavailable": "50%",
            "waitForCompletion": {"timeoutSeconds": 0, "podSelector": "app=train"},
            "gpuPodDeletion": {"force": true, "timeoutSeconds": 60, "deleteEmptyDir": true},
            "drain": {"enable": true, "force": false, "podSelector": "", "timeoutSeconds": 0, "deleteEmptyDir": false},
        }}}))
        .unwrap();
        assert_eq!(p.max_parallel, 0);
        assert_eq!(p.max_unavailable, Amount::Percent(50));
        assert_eq!(p.wait_selector, "app=train");
        assert_eq!(p.wait_timeout, None);
        assert_eq!(p.pod_deletion.timeout, Some(Duration::from_secs(60)));
        assert!(p.pod_deletion.force && p.pod_deletion.delete_empty_dir);
        assert_eq!(p.drain.as_ref().unwrap().timeout, None);
        let e = UpgradePolicy::from_spec(
            &json!({"driver": {"upgradePolicy": {"maxUnavailable": "lots"}}}),
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "spec.driver.upgradePolicy.maxUnavailable: \"lots\" is not a count or a percentage like 25%"
        );
        let e = UpgradePolicy::from_spec(
            &json!({"driver": {"upgradePolicy": {"drain": {"enable": "yes"}}}}),
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "spec.driver.upgradePolicy.drain.enable: expected true or false"
        );
    }

    #[test]
    fn amounts_of_nodes() {
        assert_eq!(Amount::Percent(25).of(10), 3);
        assert_eq!(Amount::Percent(25).of(1), 1);
        assert_eq!(Amount::Percent(0).of(10), 0);
        assert_eq!(Amount::Count(2).of(10), 2);
    }
}
