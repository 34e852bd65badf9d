//! The cluster's policy: the GPU Operator's `ClusterPolicy` (`nvidia.com/v1`,
//! cluster-scoped), which users keep when they move to gpu-agent. The
//! controller follows it (a watch) and sends it to every agent, which runs
//! it instead of its policy file, leaving out (and naming) the keys it does
//! not use, with the contents of the ConfigMaps it names inlined
//! ([`crate::config_maps`]). Clusters without the operator get the CRD from
//! `packaging/crds/`. With several ClusterPolicies, the one named by
//! `--cluster-policy` is used.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::watcher::{self, Event};

use crate::fleet::Fleet;
use crate::model::policy_summary::{Part, PolicySummary, SummaryError, fleet_status};
use crate::shards::{ShardMap, shard_of};

/// The ClusterPolicy resource.
pub fn resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("nvidia.com", "v1", "ClusterPolicy"),
        "clusterpolicies",
    )
}

/// The nodes sharded over the replicas (`--shards`): the ClusterPolicy's
/// status counts every shard's.
#[derive(Debug)]
pub struct Sharded {
    /// The shards, as this replica knows them (the others' summaries in it).
    pub map: tokio::sync::watch::Receiver<ShardMap>,
    /// What this replica says of each shard it holds (encoded
    /// [`PolicySummary`]s), which `shards::run` carries in their Leases.
    pub own: tokio::sync::watch::Sender<BTreeMap<u32, String>>,
}

/// Keeps the running ClusterPolicy's `status` saying whether the agents
/// run it (`state: ready` / `notReady`, with a `Ready` condition naming the
/// ConfigMaps it names that are not used, the nodes that do not run it and
/// the keys gpu-agent does not use). Written by the leader only, at most
/// every 2 s, only when it changes.
///
/// Sharded, every replica summarises its own shards' nodes for its shard
/// Leases (`sharded.own`), and the leader merges those with the other
/// shards' summaries from the Leases ([`fleet_status`]): the status counts
/// the whole fleet, and names the shards it could not count. It is looked
/// at again when the shards or their summaries change too. No request is
/// added: the summaries ride on the Leases' renewals.
pub async fn status_loop(
    client: kube::Client,
    fleet: Arc<Fleet>,
    leader: tokio::sync::watch::Receiver<bool>,
    mut sharded: Option<Sharded>,
) {
    let api: Api<DynamicObject> = Api::all_with(client, &resource());
    let mut written: Option<(String, bool, String)> = None;
    let mut since = String::new();
    // The malformed summaries already said, by shard.
    let mut said: BTreeMap<u32, String> = BTreeMap::new();
    loop {
        let map_changed = async {
            match sharded.as_mut() {
                Some(s) => {
                    if s.map.changed().await.is_err() {
                        std::future::pending::<()>().await;
                    }
                }
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = fleet.policy_changed.notified() => {}
            _ = map_changed => {}
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        let now = match &mut sharded {
            None if !*leader.borrow() => continue,
            None => fleet.policy_status(),
            Some(s) => {
                let map = s.map.borrow_and_update().clone();
                let own = fleet.policy_summaries(&map.mine, |n| shard_of(n, map.count));
                let texts: BTreeMap<u32, String> = own
                    .iter()
                    .flat_map(|(_, o)| o.iter().map(|(k, s)| (*k, s.encode())))
                    .collect();
                s.own.send_if_modified(|cur| {
                    let changed = *cur != texts;
                    if changed {
                        *cur = texts;
                    }
                    changed
                });
                if !*leader.borrow() {
                    continue;
                }
                own.map(|(policy, own)| {
                    let parts = parts(&map, own, &policy.name, &mut said);
                    let (ready, message) = fleet_status(&policy, &parts);
                    (policy.name.clone(), ready, message)
                })
            }
        };
        let Some(now) = now else {
            continue;
        };
        if written.as_ref() == Some(&now) {
            continue;
        }
        let (name, ready, message) = &now;
        if written
            .as_ref()
            .is_none_or(|w| w.1 != *ready || w.0 != *name)
        {
            since = jiff::Timestamp::from_second(jiff::Timestamp::now().as_second())
                .map(|t| t.to_string())
                .unwrap_or_default();
        }
        let body = serde_json::json!({
            "status": {
                "state": if *ready { "ready" } else { "notReady" },
                "conditions": [{
                    "type": "Ready",
                    "status": if *ready { "True" } else { "False" },
                    // A ConfigMap it names that is not used is said first
                    // (Fleet::policy_status).
                    "reason": if *ready {
                        "AgentsRunIt"
                    } else if message.starts_with("ConfigMap ") {
                        "ConfigMapNotUsed"
                    } else {
                        "AgentsNotReady"
                    },
                    "message": message,
                    "lastTransitionTime": since,
                }],
            }
        });
        let params = kube::api::PatchParams {
            field_manager: Some(crate::model::node::FIELD_MANAGER.into()),
            ..Default::default()
        };
        match api
            .patch_status(name, &params, &kube::api::Patch::Merge(&body))
            .await
        {
            Ok(_) => {
                tracing::info!(cluster_policy = %name, ready, message = %message, "ClusterPolicy status written");
                written = Some(now);
            }
            Err(e) => {
                tracing::warn!(cluster_policy = %name, error = %e, "cannot write the ClusterPolicy's status")
            }
        }
    }
}

/// Every shard as the leader has it: its own shards' summaries, the
/// others' from the Leases (a malformed one said once, and not counted).
fn parts(
    map: &ShardMap,
    own: BTreeMap<u32, PolicySummary>,
    policy: &str,
    said: &mut BTreeMap<u32, String>,
) -> BTreeMap<u32, Part> {
    let mut parts: BTreeMap<u32, Part> = own
        .into_iter()
        .map(|(k, s)| (k, Part::Counted(s)))
        .collect();
    for k in 0..map.count {
        if parts.contains_key(&k) {
            continue;
        }
        let Some(h) = map.holders.get(&k) else {
            parts.insert(k, Part::NoReplica);
            continue;
        };
        let text = map.summaries.get(&k).map(String::as_str);
        let (part, err) = Part::read(k, &h.identity, text, policy);
        match err {
            Some(SummaryError { text, why, .. }) => {
                if said.get(&k) != Some(&text) {
                    tracing::warn!(shard = k, holder = %h.identity, text = %text, error = %why, "a shard's ClusterPolicy summary cannot be read; its nodes are not counted in the ClusterPolicy's status");
                    said.insert(k, text);
                }
            }
            None => {
                said.remove(&k);
            }
        }
        parts.insert(k, part);
    }
    parts
}

/// Follows the ClusterPolicies until the stream ends (the watcher retries
/// with backoff; a cluster without the CRD is said once a retry). The one
/// used (name, spec) goes to `chosen`, whose reader resolves the ConfigMaps
/// it names and sends it to the agents ([`crate::config_maps::run`]).
pub async fn run(
    client: kube::Client,
    fleet: Arc<Fleet>,
    name: String,
    chosen_tx: tokio::sync::watch::Sender<Option<(String, serde_json::Value)>>,
) {
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
        fleet.set_upgrade_policy(chosen.map(|o| {
            crate::model::upgrade_policy::UpgradePolicy::from_spec(
                o.data.get("spec").unwrap_or(&serde_json::Value::Null),
            )
            .map_err(|e| e.to_string())
        }));
        // Its status written back changes nothing here.
        let now = chosen.map(|o| {
            (
                o.metadata.name.clone().unwrap_or_default(),
                o.data.get("spec").cloned().unwrap_or(serde_json::json!({})),
            )
        });
        chosen_tx.send_if_modified(|cur| {
            let changed = *cur != now;
            if changed {
                *cur = now;
            }
            changed
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shards::Holder;

    #[test]
    fn the_leader_counts_its_own_shards_and_reads_the_others() {
        let holder = |id: &str| Holder {
            identity: id.into(),
            address: String::new(),
        };
        let theirs = PolicySummary {
            policy: "cp".into(),
            reporting: 3,
            running: 3,
            ..Default::default()
        };
        let mut map = ShardMap {
            count: 5,
            mine: [0].into(),
            holders: [
                (0, holder("a")),
                (1, holder("b")),
                (2, holder("b")),
                (3, holder("c")),
            ]
            .into(),
            replicas: 3,
            summaries: [(1, theirs.encode()), (2, "{oops".to_string())].into(),
        };
        let own = |n: u64| {
            let s = PolicySummary {
                policy: "cp".into(),
                reporting: n,
                running: n,
                ..Default::default()
            };
            BTreeMap::from([(0, s)])
        };
        let mut said = BTreeMap::new();
        let got = parts(&map, own(1), "cp", &mut said);
        assert_eq!(got[&0], Part::Counted(own(1)[&0].clone()));
        assert_eq!(got[&1], Part::Counted(theirs.clone()));
        assert_eq!(got[&2], Part::NotCounted { holder: "b".into() });
        assert_eq!(got[&3], Part::NotCounted { holder: "c".into() });
        assert_eq!(got[&4], Part::NoReplica);
        assert_eq!(
            said.keys().collect::<Vec<_>>(),
            [&2],
            "the malformed one, said"
        );
        let texts = crate::model::policy_texts::PolicyTexts::plain("cp", String::new());
        assert_eq!(
            fleet_status(&texts, &got),
            (
                false,
                "4 of 4 reporting nodes run it; shard 4 has no replica; shard 2 (replica b) not counted yet; shard 3 (replica c) not counted yet"
                    .to_string()
            )
        );
        // Fixed: no longer said, counted.
        map.summaries.insert(2, theirs.encode());
        let got = parts(&map, own(2), "cp", &mut said);
        assert!(said.is_empty());
        assert_eq!(got[&2], Part::Counted(theirs));
    }
}
