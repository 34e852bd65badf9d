//! The cluster's policy: the GPU Operator's `ClusterPolicy` (`nvidia.com/v1`,
//! cluster-scoped), which users keep when they move to gpu-agent. The
//! controller follows it (a watch) and sends it to every agent, which runs
//! it instead of its policy file, leaving out (and naming) the keys it does
//! not use. Clusters without the operator get the CRD from
//! `packaging/crds/`. With several ClusterPolicies, the one named by
//! `--cluster-policy` is used.

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::StreamExt;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::watcher::{self, Event};

use crate::fleet::Fleet;

/// The ClusterPolicy resource.
pub fn resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("nvidia.com", "v1", "ClusterPolicy"),
        "clusterpolicies",
    )
}

/// The policy text an agent is sent: the object as JSON (a YAML subset),
/// with only what a policy reads.
pub fn policy_text(obj: &DynamicObject) -> String {
    serde_json::json!({
        "apiVersion": "nvidia.com/v1",
        "kind": "ClusterPolicy",
        "metadata": { "name": obj.metadata.name },
        "spec": obj.data.get("spec").cloned().unwrap_or(serde_json::json!({})),
    })
    .to_string()
}

/// Follows the ClusterPolicies until the stream ends (the watcher retries
/// with backoff; a cluster without the CRD is said once a retry).
pub async fn run(client: kube::Client, fleet: Arc<Fleet>, name: String) {
    let api: Api<DynamicObject> = Api::all_with(client, &resource());
    let mut stream = std::pin::pin!(kube::runtime::WatchStreamExt::default_backoff(
        watcher::watcher(api, watcher::Config::default())
    ));
    let mut all: BTreeMap<String, DynamicObject> = BTreeMap::new();
    let mut init: BTreeMap<String, DynamicObject> = BTreeMap::new();
    while let Some(ev) = stream.next().await {
        match ev {
            Ok(Event::Apply(o)) => {
                all.insert(o.metadata.name.clone().unwrap_or_default(), o);
            }
            Ok(Event::Delete(o)) => {
                all.remove(&o.metadata.name.clone().unwrap_or_default());
            }
            Ok(Event::Init) => init.clear(),
            Ok(Event::InitApply(o)) => {
                init.insert(o.metadata.name.clone().unwrap_or_default(), o);
            }
            Ok(Event::InitDone) => all = std::mem::take(&mut init),
            Err(e) => {
                tracing::warn!(error = %e, "cannot watch ClusterPolicies (nvidia.com/v1); agents keep their own policy");
                continue;
            }
        }
        let chosen = all
            .get(&name)
            .or_else(|| (all.len() == 1).then(|| all.values().next()).flatten());
        if all.len() > 1 && !all.contains_key(&name) {
            tracing::warn!(wanted = %name, found = all.len(), "several ClusterPolicies and none is the one named: agents keep their own policy");
        }
        fleet.set_policy(
            chosen.map(|o| (o.metadata.name.clone().unwrap_or_default(), policy_text(o))),
        );
    }
}
