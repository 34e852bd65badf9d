//! Where a claim's allocation comes from: the results the controller hands
//! the agent for each claim allocated to its node ([`ClaimAllocation`]), the
//! [`Allocations`] source prepare reads, and an in-memory one the feed fills.

use std::collections::BTreeMap;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Instant;

use serde::{Deserialize, Serialize};

/// One allocated device of a claim, as the claim's
/// `status.allocation.devices.results[]` names it (driver `gpu.nvidia.com`
/// only: the controller leaves out other drivers' results).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AllocatedDevice {
    /// The request (or `<request>/<subrequest>`) this device serves.
    pub request: String,
    /// The ResourceSlice pool: the node's name.
    pub pool: String,
    /// The device's name in the pool (`gpu-0`, a MIG device's name).
    pub device: String,
    /// Set when the device may be allocated to several claims at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share_id: Option<String>,
}

/// Where an opaque configuration came from (`…devices.config[].source`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ConfigSource {
    FromClass,
    FromClaim,
}

/// One opaque configuration for driver `gpu.nvidia.com`
/// (`…devices.config[]`), in the allocation's order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct OpaqueConfig {
    pub source: ConfigSource,
    /// The requests it applies to (empty: all of the claim's).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub requests: Vec<String>,
    /// `opaque.parameters`, as written (a `GpuConfig` or `MigDeviceConfig`).
    pub parameters: serde_json::Value,
}

/// A claim's allocation on this node, as the controller hands it over.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClaimAllocation {
    /// The claim's namespace and name (for messages; the UID is the key).
    pub namespace: String,
    pub name: String,
    pub devices: Vec<AllocatedDevice>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub configs: Vec<OpaqueConfig>,
}

/// The allocations of the claims allocated to this node, by claim UID.
pub trait Allocations: Send + Sync + 'static {
    /// Claim `uid`'s allocation, waiting until `deadline` for it to arrive;
    /// `None` when it has not by then.
    fn wait_for(&self, uid: &str, deadline: Instant) -> Option<ClaimAllocation>;
}

/// Called when a prepare waits for an allocation not handed over yet.
pub type OnMissing = Box<dyn Fn() + Send + Sync>;

/// Allocations held in memory: what the controller's feed last handed over.
#[derive(Default)]
pub struct MemoryAllocations {
    claims: Mutex<BTreeMap<String, ClaimAllocation>>,
    changed: Condvar,
    /// Asks the feed for the latest (the agent's report checks in at once).
    on_missing: Option<OnMissing>,
}

impl std::fmt::Debug for MemoryAllocations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryAllocations")
            .field("claims", &self.claims)
            .finish_non_exhaustive()
    }
}

impl MemoryAllocations {
    pub fn new() -> Self {
        Self::default()
    }

    /// `f` is called when a prepare finds its claim's allocation missing
    /// and waits for it: the feed is asked for the latest at once rather
    /// than at its next interval.
    pub fn when_missing(mut self, f: impl Fn() + Send + Sync + 'static) -> Self {
        self.on_missing = Some(Box::new(f));
        self
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, ClaimAllocation>> {
        self.claims.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds or replaces claim `uid`'s allocation and wakes its waiters.
    pub fn insert(&self, uid: impl Into<String>, allocation: ClaimAllocation) {
        self.lock().insert(uid.into(), allocation);
        self.changed.notify_all();
    }

    /// Forgets claim `uid` (deallocated, or deleted).
    pub fn remove(&self, uid: &str) -> Option<ClaimAllocation> {
        self.lock().remove(uid)
    }

    /// Replaces every allocation with `all` (a complete list from the feed).
    pub fn replace_all(&self, all: BTreeMap<String, ClaimAllocation>) {
        *self.lock() = all;
        self.changed.notify_all();
    }

    /// Claim `uid`'s allocation now, without waiting.
    pub fn get(&self, uid: &str) -> Option<ClaimAllocation> {
        self.lock().get(uid).cloned()
    }
}

impl Allocations for MemoryAllocations {
    fn wait_for(&self, uid: &str, deadline: Instant) -> Option<ClaimAllocation> {
        let mut claims = self.lock();
        let mut asked = false;
        loop {
            if let Some(a) = claims.get(uid) {
                return Some(a.clone());
            }
            if !asked && let Some(f) = &self.on_missing {
                asked = true;
                f();
            }
            let left = deadline.checked_duration_since(Instant::now())?;
            if left.is_zero() {
                return None;
            }
            claims = self
                .changed
                .wait_timeout(claims, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;

    fn alloc(device: &str) -> ClaimAllocation {
        ClaimAllocation {
            namespace: "ns".into(),
            name: "c".into(),
            devices: vec![AllocatedDevice {
                request: "gpu".into(),
                pool: "node-a".into(),
                device: device.into(),
                share_id: None,
            }],
            configs: Vec::new(),
        }
    }

    #[test]
    fn a_missing_allocation_asks_the_feed_once() {
        let asked = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let a = {
            let asked = asked.clone();
            MemoryAllocations::new().when_missing(move || {
                asked.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            })
        };
        a.insert("u1", alloc("gpu-0"));
        assert!(a.wait_for("u1", Instant::now()).is_some());
        assert_eq!(asked.load(std::sync::atomic::Ordering::Relaxed), 0);
        assert_eq!(
            a.wait_for("u2", Instant::now() + Duration::from_millis(30)),
            None
        );
        assert_eq!(asked.load(std::sync::atomic::Ordering::Relaxed), 1);
    }

    #[test]
    fn waits_until_the_allocation_arrives() {
        let a = Arc::new(MemoryAllocations::new());
        let feed = Arc::clone(&a);
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            feed.insert("u1", alloc("gpu-0"));
        });
        let started = Instant::now();
        let got = a.wait_for("u1", started + Duration::from_secs(10));
        t.join().unwrap();
        assert_eq!(got, Some(alloc("gpu-0")));
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn gives_up_at_the_deadline() {
        let a = MemoryAllocations::new();
        a.insert("other", alloc("gpu-1"));
        let started = Instant::now();
        assert_eq!(a.wait_for("u1", started + Duration::from_millis(80)), None);
        assert!(started.elapsed() >= Duration::from_millis(80));
        assert_eq!(a.wait_for("other", started), Some(alloc("gpu-1")));
    }

    #[test]
    fn replace_and_remove() {
        let a = MemoryAllocations::new();
        a.insert("u1", alloc("gpu-0"));
        a.replace_all(BTreeMap::from([("u2".to_string(), alloc("gpu-1"))]));
        assert_eq!(a.get("u1"), None);
        assert_eq!(a.remove("u2"), Some(alloc("gpu-1")));
        assert_eq!(a.get("u2"), None);
    }

    #[test]
    fn the_feed_format_is_strict_camel_case() {
        let json = r#"{"namespace":"ns","name":"c","devices":[{"request":"gpu","pool":"node-a","device":"gpu-0","shareId":"s1"}],
            "configs":[{"source":"FromClaim","requests":["gpu"],"parameters":{"kind":"GpuConfig"}}]}"#;
        let a: ClaimAllocation = serde_json::from_str(json).unwrap();
        assert_eq!(a.devices[0].share_id.as_deref(), Some("s1"));
        assert_eq!(a.configs[0].source, ConfigSource::FromClaim);
        let bad = r#"{"namespace":"ns","name":"c","devices":[{"request":"gpu","pool":"p","device":"gpu-0","driver":"x"}]}"#;
        assert!(serde_json::from_str::<ClaimAllocation>(bad).is_err());
    }
}
