//! What a removal step sees of a pod: whether it uses GPUs, whether a
//! drain takes it, whether it may be evicted, and the eviction itself.

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::policy::v1::Eviction;
use kube::api::{Api, PostParams};

use crate::model::upgrade_policy::Removal;

/// A pod as a step sees it.
pub(super) struct PodInfo {
    pub(super) namespace: String,
    pub(super) name: String,
    /// Its deletion began (evicted, deleted): when, and the grace period
    /// it was given.
    pub(super) terminating: Option<(String, Option<i64>)>,
    /// Why it may not be evicted, if so.
    pub(super) refused: Option<String>,
}

impl PodInfo {
    /// `ns/name`, or `ns/name (terminating since T, grace period N s)`.
    pub(super) fn said(&self) -> String {
        match &self.terminating {
            None => format!("{}/{}", self.namespace, self.name),
            Some((since, grace)) => format!(
                "{}/{} (terminating since {since}{})",
                self.namespace,
                self.name,
                grace.map_or(String::new(), |g| format!(", grace period {g} s"))
            ),
        }
    }
}

/// What keeps a removal step waiting, in words: the pods still running
/// and those still terminating, apart.
pub(super) fn left(pods: &[PodInfo]) -> String {
    let running: Vec<String> = pods
        .iter()
        .filter(|p| p.terminating.is_none())
        .map(PodInfo::said)
        .collect();
    let terminating: Vec<String> = pods
        .iter()
        .filter(|p| p.terminating.is_some())
        .map(PodInfo::said)
        .collect();
    let mut parts = Vec::new();
    if !running.is_empty() {
        parts.push(format!("{} still running", running.join(", ")));
    }
    if !terminating.is_empty() {
        parts.push(format!("{} still terminating", terminating.join(", ")));
    }
    parts.join("; ")
}

/// Posts a `policy/v1` Eviction for the pod, so its disruption budgets
/// hold. (kube's `Api::evict` sends a body without apiVersion and kind and
/// with a snake-case `delete_options`, which strict validation refuses.)
pub(super) async fn evict(api: &Api<Pod>, namespace: &str, name: &str) -> Result<(), kube::Error> {
    let body = Eviction {
        metadata: kube::core::ObjectMeta {
            name: Some(name.into()),
            namespace: Some(namespace.into()),
            ..Default::default()
        },
        delete_options: None,
    };
    api.create_subresource::<_, serde_json::Value>("eviction", name, &PostParams::default(), &body)
        .await
        .map(|_| ())
}

pub(super) fn names(pods: &[Pod]) -> String {
    pods.iter()
        .map(|p| {
            format!(
                "{}/{}",
                p.metadata.namespace.as_deref().unwrap_or(""),
                p.metadata.name.as_deref().unwrap_or("")
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Whether a pod asks for any `nvidia.com/` resource (whole GPUs, shared
/// replicas, MIG devices).
pub fn uses_gpus(p: &Pod) -> bool {
    let Some(spec) = &p.spec else { return false };
    spec.containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .filter_map(|c| c.resources.as_ref())
        .flat_map(|r| r.limits.iter().flatten().chain(r.requests.iter().flatten()))
        .any(|(k, _)| k.starts_with("nvidia.com/"))
}

fn owner_kind(p: &Pod) -> Option<&str> {
    p.metadata
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true))
        .map(|o| o.kind.as_str())
}

/// Whether a drain removes the pod: not a DaemonSet's (it would come back
/// at once) nor a static pod (the kubelet's own).
pub(super) fn drained(p: &Pod) -> bool {
    let mirror = p
        .metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key("kubernetes.io/config.mirror"));
    !mirror && owner_kind(p) != Some("DaemonSet")
}

pub(super) fn info(p: &Pod, rules: &Removal) -> PodInfo {
    let empty_dir = p
        .spec
        .as_ref()
        .and_then(|s| s.volumes.as_ref())
        .is_some_and(|v| v.iter().any(|v| v.empty_dir.is_some()));
    let refused = if owner_kind(p).is_none() && !rules.force {
        Some(
            "no controller runs it, so it would not come back (force: true evicts it anyway)"
                .to_string(),
        )
    } else if empty_dir && !rules.delete_empty_dir {
        Some("its emptyDir data would be lost (deleteEmptyDir: true evicts it anyway)".to_string())
    } else {
        None
    };
    PodInfo {
        namespace: p.metadata.namespace.clone().unwrap_or_default(),
        name: p.metadata.name.clone().unwrap_or_default(),
        terminating: p
            .metadata
            .deletion_timestamp
            .as_ref()
            .map(|t| (t.0.to_string(), p.metadata.deletion_grace_period_seconds)),
        refused,
    }
}
