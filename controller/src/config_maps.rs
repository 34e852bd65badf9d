//! The ConfigMaps the cluster's ClusterPolicy names, and the nodes'
//! device-plugin labels, followed for the agents: what they hold is
//! resolved into each node's policy text ([`crate::model::policy_texts`])
//! and handed to the fleet, which sends it.
//!
//! The ConfigMaps live in the controller's namespace (as the GPU
//! Operator's live in its own), each followed by its own watch (by name),
//! and so are the nodes' `nvidia.com/device-plugin.config` labels (a
//! metadata-only watch of the nodes that carry it) while a device-plugin
//! ConfigMap is named. A ConfigMap that changes reaches the agents as a
//! ClusterPolicy change does; the text a node is sent changes only where
//! its content does. A ConfigMap that is missing, cannot be read or does
//! not parse is left out (the agents run the ClusterPolicy without it) and
//! named, with why, in the ClusterPolicy's status.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Node};
use kube::api::Api;
use kube::core::PartialObjectMeta;
use kube::runtime::watcher::{self, Event};
use serde_json::Value;
use tokio::sync::{mpsc, watch};

use crate::fleet::Fleet;
use crate::model::policy_texts::{DEVICE_PLUGIN_LABEL, Named, PolicyTexts, Seen, resolve};

/// How long the first policy waits for the ConfigMaps' (and labels') first
/// reading before it is sent without those not read yet.
const FIRST_READ_WITHIN: Duration = Duration::from_secs(10);

/// What the watches hear.
#[derive(Debug)]
enum Heard {
    Map(String, Seen),
    /// Every labelled node, after a (re)list.
    Labels(BTreeMap<String, String>),
    /// One node's label changed (`None`: removed or the node went).
    Label(String, Option<String>),
}

/// Follows one ConfigMap by name until aborted.
async fn watch_map(api: Api<ConfigMap>, name: String, tx: mpsc::UnboundedSender<Heard>) {
    let mut stream = std::pin::pin!(kube::runtime::WatchStreamExt::default_backoff(
        watcher::watch_object(api, &name)
    ));
    while let Some(ev) = stream.next().await {
        let seen = match ev {
            Ok(Some(cm)) => Seen::of(&cm),
            Ok(None) => Seen::NotFound,
            Err(e) => Seen::Unreadable(crate::error::error_chain(&e)),
        };
        if tx.send(Heard::Map(name.clone(), seen)).is_err() {
            return;
        }
    }
}

/// Follows the nodes' `nvidia.com/device-plugin.config` labels (metadata
/// only, the nodes that carry it) until aborted.
async fn watch_labels(client: kube::Client, tx: mpsc::UnboundedSender<Heard>) {
    let api: Api<PartialObjectMeta<Node>> = Api::all(client);
    let cfg = watcher::Config::default().labels(DEVICE_PLUGIN_LABEL);
    let mut stream = std::pin::pin!(kube::runtime::WatchStreamExt::default_backoff(
        watcher::watcher(api, cfg)
    ));
    let label = |m: &PartialObjectMeta<Node>| {
        m.metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(DEVICE_PLUGIN_LABEL))
            .cloned()
    };
    let mut init = BTreeMap::new();
    while let Some(ev) = stream.next().await {
        let heard = match ev {
            Ok(Event::Init) => {
                init.clear();
                continue;
            }
            Ok(Event::InitApply(m)) => {
                if let (Some(n), Some(v)) = (m.metadata.name.clone(), label(&m)) {
                    init.insert(n, v);
                }
                continue;
            }
            Ok(Event::InitDone) => Heard::Labels(std::mem::take(&mut init)),
            Ok(Event::Apply(m)) => match m.metadata.name.clone() {
                Some(n) => Heard::Label(n, label(&m)),
                None => continue,
            },
            Ok(Event::Delete(m)) => match m.metadata.name.clone() {
                Some(n) => Heard::Label(n, None),
                None => continue,
            },
            Err(e) => {
                tracing::warn!(error = %e, "cannot watch the nodes' {DEVICE_PLUGIN_LABEL} labels");
                continue;
            }
        };
        if tx.send(heard).is_err() {
            return;
        }
    }
}

/// Sends the agents the ClusterPolicy `policy` has (name, spec) with the
/// ConfigMaps it names resolved, in `namespace`; follows the policy, the
/// ConfigMaps and the labels until the policy's sender goes.
pub async fn run(
    client: kube::Client,
    fleet: Arc<Fleet>,
    namespace: String,
    mut policy: watch::Receiver<Option<(String, Value)>>,
) {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let maps_api: Api<ConfigMap> = Api::namespaced(client.clone(), &namespace);
    let mut watches: BTreeMap<String, tokio::task::AbortHandle> = BTreeMap::new();
    let mut maps: BTreeMap<String, Seen> = BTreeMap::new();
    let mut labels_watch: Option<tokio::task::AbortHandle> = None;
    let mut labels: Option<BTreeMap<String, String>> = None;
    // Until every named ConfigMap was read once, nothing new is sent (so
    // that agents do not run the policy without a ConfigMap for a moment).
    let mut waiting_since: Option<tokio::time::Instant> = None;
    let mut said: BTreeSet<String> = BTreeSet::new();
    loop {
        let wait_until = waiting_since.map(|t| t + FIRST_READ_WITHIN);
        tokio::select! {
            changed = policy.changed() => {
                if changed.is_err() {
                    break;
                }
            }
            Some(h) = rx.recv() => match h {
                Heard::Map(name, seen) => {
                    if !watches.contains_key(&name) {
                        continue;
                    }
                    // Once read, a ConfigMap keeps its content through a
                    // broken watch (the watch retries on its own).
                    if let Seen::Unreadable(why) = &seen
                        && matches!(maps.get(&name), Some(Seen::Found { .. } | Seen::NotFound))
                    {
                        tracing::warn!(config_map = %name, namespace = %namespace, error = %why, "cannot watch the ConfigMap; its last content stays in use");
                        continue;
                    }
                    if maps.get(&name) == Some(&seen) {
                        continue;
                    }
                    tracing::info!(config_map = %name, namespace = %namespace, state = %match &seen {
                        Seen::Found { data, .. } => format!("read ({} key(s))", data.len()),
                        Seen::NotFound => "not found".into(),
                        Seen::Unreadable(why) => format!("cannot be read: {why}"),
                    }, "ConfigMap named by the ClusterPolicy");
                    maps.insert(name, seen);
                }
                Heard::Labels(all) => {
                    if labels_watch.is_none() || labels.as_ref() == Some(&all) {
                        continue;
                    }
                    labels = Some(all);
                }
                Heard::Label(node, value) => {
                    let Some(l) = labels.as_mut() else { continue };
                    let changed = match value {
                        Some(v) => l.insert(node, v.clone()).as_ref() != Some(&v),
                        None => l.remove(&node).is_some(),
                    };
                    if !changed {
                        continue;
                    }
                }
            },
            _ = async {
                match wait_until {
                    Some(t) => tokio::time::sleep_until(t).await,
                    None => std::future::pending().await,
                }
            } => {
                tracing::warn!(within_s = FIRST_READ_WITHIN.as_secs(), "ConfigMaps or node labels not read yet; sending the ClusterPolicy without them");
                waiting_since = None;
                send(&fleet, &policy.borrow(), &namespace, &maps, labels.as_ref(), &mut said);
                continue;
            }
        }
        let chosen = policy.borrow_and_update().clone();
        let named = chosen
            .as_ref()
            .map(|(_, spec)| Named::from_spec(spec))
            .unwrap_or_default();
        // Watches for the ConfigMaps named now, and no others.
        let wanted = named.names();
        watches.retain(|name, w| {
            let keep = wanted.contains(name);
            if !keep {
                w.abort();
                maps.remove(name);
            }
            keep
        });
        for name in &wanted {
            if !watches.contains_key(name) {
                let task = tokio::spawn(watch_map(maps_api.clone(), name.clone(), tx.clone()));
                watches.insert(name.clone(), task.abort_handle());
            }
        }
        match (named.device_plugin.is_some(), &labels_watch) {
            (true, None) => {
                let task = tokio::spawn(watch_labels(client.clone(), tx.clone()));
                labels_watch = Some(task.abort_handle());
            }
            (false, Some(w)) => {
                w.abort();
                labels_watch = None;
                labels = None;
            }
            _ => {}
        }
        let pending = wanted.iter().any(|n| !maps.contains_key(n))
            || (labels_watch.is_some() && labels.is_none());
        if pending && chosen.is_some() {
            waiting_since.get_or_insert_with(tokio::time::Instant::now);
            continue;
        }
        waiting_since = None;
        send(
            &fleet,
            &chosen,
            &namespace,
            &maps,
            labels.as_ref(),
            &mut said,
        );
    }
    for w in watches.values().chain(labels_watch.iter()) {
        w.abort();
    }
}

/// Resolves and hands the fleet what each agent is to be sent (it sends
/// only what changed); problems not said before are logged.
fn send(
    fleet: &Fleet,
    chosen: &Option<(String, Value)>,
    namespace: &str,
    maps: &BTreeMap<String, Seen>,
    labels: Option<&BTreeMap<String, String>>,
    said: &mut BTreeSet<String>,
) {
    let empty = BTreeMap::new();
    let texts = chosen
        .as_ref()
        .map(|(name, spec)| resolve(name, spec, namespace, maps, labels.unwrap_or(&empty)));
    let now: BTreeSet<String> = texts.iter().flat_map(PolicyTexts::problems).collect();
    for p in now.difference(said) {
        tracing::warn!(problem = %p, "a ConfigMap the ClusterPolicy names is not used");
    }
    *said = now;
    fleet.set_policy(texts);
}
