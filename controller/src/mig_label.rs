//! The MIG label protocol: a node's `nvidia.com/mig.config` label names the
//! layout its agent applies (sent down as `Desired.mig_layout`); the agent
//! reports its MIG state, which becomes `nvidia.com/mig.config.state`
//! (pending, rebooting, success, failed). The labels are followed with a
//! metadata-only watch of the nodes that carry the label (a few hundred
//! bytes a node, not the whole Node).

use std::collections::HashSet;
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;
use kube::core::PartialObjectMeta;
use kube::runtime::watcher::{self, Event};

use crate::fleet::Fleet;

/// The label users set to select a node's layout.
pub const MIG_CONFIG_LABEL: &str = "nvidia.com/mig.config";

/// Follows the label until the stream ends (the watcher retries on its own
/// with backoff).
pub async fn run(client: kube::Client, fleet: Arc<Fleet>) {
    // Api<PartialObjectMeta<Node>> asks for metadata only.
    let api: Api<PartialObjectMeta<Node>> = Api::all(client);
    let cfg = watcher::Config::default().labels(MIG_CONFIG_LABEL);
    let mut stream = std::pin::pin!(kube::runtime::WatchStreamExt::default_backoff(
        watcher::watcher(api, cfg)
    ));
    let mut seen: HashSet<String> = HashSet::new();
    while let Some(ev) = stream.next().await {
        let label = |m: &PartialObjectMeta<Node>| {
            m.metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(MIG_CONFIG_LABEL))
                .filter(|v| !v.is_empty())
                .cloned()
        };
        match ev {
            Ok(Event::Apply(m)) | Ok(Event::InitApply(m)) => {
                let Some(name) = m.metadata.name.clone() else {
                    continue;
                };
                seen.insert(name.clone());
                fleet.set_mig_label(&name, label(&m));
            }
            Ok(Event::Delete(m)) => {
                if let Some(name) = &m.metadata.name {
                    fleet.set_mig_label(name, None);
                }
            }
            Ok(Event::Init) => seen.clear(),
            Ok(Event::InitDone) => {
                // Labels removed while the watch was down.
                for node in fleet.mig_labelled() {
                    if !seen.contains(&node) {
                        fleet.set_mig_label(&node, None);
                    }
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot watch the nodes' {MIG_CONFIG_LABEL} labels")
            }
        }
    }
}
