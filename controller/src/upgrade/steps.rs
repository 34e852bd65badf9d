//! Each node's API step of a rollout, one method a state: cordon, wait
//! for jobs, pod deletion or drain (evictions), uncordon, and a failed
//! node's retry on request. Each moves the node's state on in the fleet.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams, Patch, PatchParams};
use serde_json::{Value, json};

use super::pods::{PodInfo, drained, evict, info, left, names, uses_gpus};
use super::{INITIAL_UNSCHEDULABLE, RECHECK, RETRY_LOOK, UPGRADE_REQUESTED, Upgrader};
use crate::fleet::Fleet;
use crate::model::node::{FIELD_MANAGER, Observed};
use crate::model::upgrade_notes::{UPGRADE_STEP, encode_step};
use crate::model::upgrade_policy::UpgradePolicy;
use crate::model::upgrade_state::{NodeUpgrade, Step, annotation};

/// Steps written for the nodes' holders at once (each a small PATCH: a
/// rollout's first look over 10,000 nodes takes 10,000 / this round trips).
const PUBLISH_AT_ONCE: usize = 16;

/// An API step that failed (tried again at the next look).
#[derive(Debug, thiserror::Error)]
#[error("node {node}: {what}: {source}")]
pub struct StepError {
    node: String,
    what: String,
    #[source]
    source: kube::Error,
}

impl Upgrader {
    fn api_err(node: &str, what: &str) -> impl FnOnce(kube::Error) -> StepError {
        let (node, what) = (node.to_string(), what.to_string());
        move |source| StepError { node, what, source }
    }

    async fn read_node(&self, node: &str) -> Result<Node, StepError> {
        self.nodes
            .get(node)
            .await
            .map_err(Self::api_err(node, "reading the node"))
    }

    /// A merge patch of the node under our field manager; `what` names it
    /// in an error.
    async fn patch_node(&self, node: &str, body: &Value, what: &str) -> Result<(), StepError> {
        self.nodes
            .patch(node, &merge_params(), &Patch::Merge(body))
            .await
            .map(|_| ())
            .map_err(Self::api_err(node, what))
    }

    /// Sharded: the steps decided that the nodes do not carry yet are
    /// written to each node's `gpu-agent.io/upgrade-step` annotation (a
    /// merge patch of that key only), for its holder to take: the nodes on
    /// their way first (a rollout's first look has a step for every node
    /// that wants the driver, and the one or few that start must not wait
    /// behind them), [`PUBLISH_AT_ONCE`] at a time. Returns the writes that
    /// failed (tried again at the next look).
    pub(super) async fn publish_steps(&self, fleet: &Fleet) -> Vec<StepError> {
        use futures::StreamExt;
        let mut todo = fleet.unpublished_steps();
        // Stable: by name within each part.
        todo.sort_by_key(|(_, s)| !s.as_ref().is_some_and(|u| u.step.in_progress()));
        futures::stream::iter(todo)
            .map(|(node, step)| async move { self.publish_step(fleet, &node, step.as_ref()).await })
            .buffer_unordered(PUBLISH_AT_ONCE)
            .filter_map(|r| async move { r.err() })
            .collect()
            .await
    }

    /// One node's step written for its holder (nothing once this replica
    /// no longer leads).
    async fn publish_step(
        &self,
        fleet: &Fleet,
        node: &str,
        step: Option<&NodeUpgrade>,
    ) -> Result<(), StepError> {
        if !self.leading() {
            return Ok(());
        }
        let body = json!({ "metadata": { "annotations": { UPGRADE_STEP: encode_step(step) } } });
        match self
            .nodes
            .patch(node, &merge_params(), &Patch::Merge(&body))
            .await
        {
            // The answer is the node as it is now: the step noted.
            Ok(n) => fleet.note_rollout(node, &Observed::of_node(&n)),
            // The node is gone: nothing to tell its holder.
            Err(kube::Error::Api(s)) if s.code == 404 => fleet.forget_in_api(node),
            Err(e) => return Err(Self::api_err(node, "writing its step for its replica")(e)),
        }
        Ok(())
    }

    /// The `gpu-agent.io/upgrade-step` annotation taken off the node (a
    /// controller that is not sharded keeps the step in the label only).
    pub(super) async fn drop_step_note(&self, node: &str) -> Result<(), kube::Error> {
        let body = json!({ "metadata": { "annotations": { UPGRADE_STEP: null } } });
        self.nodes
            .patch(node, &merge_params(), &Patch::Merge(&body))
            .await?;
        tracing::info!(
            node,
            "a sharded leader's driver upgrade step taken off the node"
        );
        Ok(())
    }

    pub(super) async fn cordon(
        &self,
        fleet: &Fleet,
        node: &str,
        up: &NodeUpgrade,
    ) -> Result<(), StepError> {
        let n = self.read_node(node).await?;
        let was = n
            .spec
            .as_ref()
            .and_then(|s| s.unschedulable)
            .unwrap_or(false);
        let noted = annotation(&n, INITIAL_UNSCHEDULABLE).is_some();
        let mut body = json!({ "spec": { "unschedulable": true } });
        // The state before the upgrade is noted once, with the cordon: a
        // retry (or a new leader) finds it and does not take its own
        // cordon for the admin's.
        if !noted {
            let before = if was { "true" } else { "false" };
            body["metadata"] = json!({ "annotations": { INITIAL_UNSCHEDULABLE: before } });
        }
        self.patch_node(node, &body, "cordoning").await?;
        self.forget_availability();
        tracing::info!(node, to = %up.target, already_cordoned = was, "driver upgrade: node cordoned");
        fleet.set_upgrade(
            node,
            Some(NodeUpgrade::new(Step::WaitForJobsRequired, &up.target, "")),
        );
        Ok(())
    }

    /// A failed node is tried again when an admin asks, with the GPU
    /// Operator's annotation `nvidia.com/gpu-driver-upgrade-requested=true`
    /// (looked for every [`RETRY_LOOK`] while a node is failed): its GPU
    /// pods are looked at again and its agent given a new go-ahead.
    pub(super) async fn retry_requested(
        &self,
        fleet: &Fleet,
        node: &str,
        up: &NodeUpgrade,
    ) -> Result<Option<Duration>, StepError> {
        let n = self.read_node(node).await?;
        let asked = annotation(&n, UPGRADE_REQUESTED) == Some("true");
        if !asked {
            return Ok(Some(RETRY_LOOK));
        }
        let body = json!({ "metadata": { "annotations": { UPGRADE_REQUESTED: null } } });
        self.patch_node(node, &body, "taking the retry request")
            .await?;
        tracing::info!(node, to = %up.target, "driver upgrade: tried again, as asked");
        fleet.set_upgrade(
            node,
            Some(NodeUpgrade::new(
                Step::PodDeletionRequired,
                &up.target,
                "tried again, as asked",
            )),
        );
        Ok(Some(Duration::ZERO))
    }

    pub(super) async fn uncordon(
        &self,
        fleet: &Fleet,
        node: &str,
        up: &NodeUpgrade,
    ) -> Result<(), StepError> {
        let n = self.read_node(node).await?;
        let keep = annotation(&n, INITIAL_UNSCHEDULABLE) == Some("true");
        let mut body = json!({ "metadata": { "annotations": { INITIAL_UNSCHEDULABLE: null } } });
        if !keep {
            body["spec"] = json!({ "unschedulable": false });
        }
        self.patch_node(node, &body, "uncordoning").await?;
        self.forget_availability();
        tracing::info!(node, driver = %up.target, left_cordoned = keep, "driver upgrade done");
        let mut detail = up.detail.clone();
        if keep {
            if !detail.is_empty() {
                detail.push_str("; ");
            }
            detail.push_str("left cordoned: it was before the upgrade");
        }
        fleet.set_upgrade(
            node,
            Some(NodeUpgrade::new(Step::UpgradeDone, &up.target, detail)),
        );
        Ok(())
    }

    /// The node's pods that still run (not finished), with `selector`.
    async fn pods_on(&self, node: &str, selector: &str) -> Result<Vec<Pod>, StepError> {
        let mut lp = ListParams::default().fields(&format!("spec.nodeName={node}"));
        if !selector.is_empty() {
            lp = lp.labels(selector);
        }
        let list = self
            .pods
            .list(&lp)
            .await
            .map_err(Self::api_err(node, "listing its pods"))?;
        Ok(list
            .items
            .into_iter()
            .filter(|p| {
                !matches!(
                    p.status.as_ref().and_then(|s| s.phase.as_deref()),
                    Some("Succeeded" | "Failed")
                )
            })
            .collect())
    }

    pub(super) async fn wait_for_jobs(
        &self,
        fleet: &Fleet,
        node: &str,
        up: &NodeUpgrade,
        policy: &UpgradePolicy,
    ) -> Result<Option<Duration>, StepError> {
        if !policy.wait_selector.is_empty() {
            let left = self.pods_on(node, &policy.wait_selector).await?;
            let timed_out = policy.wait_timeout.is_some_and(|t| up.since.elapsed() >= t);
            if !left.is_empty() && !timed_out {
                let detail = format!("waiting for {} ({})", names(&left), policy.wait_selector);
                if detail != up.detail {
                    fleet.set_upgrade(
                        node,
                        Some(NodeUpgrade {
                            detail,
                            ..up.clone()
                        }),
                    );
                }
                return Ok(Some(RECHECK));
            }
        }
        fleet.set_upgrade(
            node,
            Some(NodeUpgrade::new(Step::PodDeletionRequired, &up.target, "")),
        );
        Ok(Some(Duration::ZERO))
    }

    /// Pod deletion (`drain` false: the pods that use GPUs) or drain
    /// (every pod but DaemonSets' and static ones): evicts what may be
    /// evicted; moves on when none is left.
    pub(super) async fn remove(
        &self,
        fleet: &Fleet,
        node: &str,
        up: &NodeUpgrade,
        policy: &UpgradePolicy,
        drain: bool,
    ) -> Result<Option<Duration>, StepError> {
        let rules = if drain {
            policy
                .drain
                .clone()
                .unwrap_or_else(|| policy.pod_deletion.clone())
        } else {
            policy.pod_deletion.clone()
        };
        let pods: Vec<PodInfo> = self
            .pods_on(node, &rules.selector)
            .await?
            .iter()
            .filter(|p| drained(p) && (drain || uses_gpus(p)))
            .map(|p| info(p, &rules))
            .collect();
        if pods.is_empty() {
            tracing::info!(node, to = %up.target, "driver upgrade: no GPU work left; the agent may upgrade");
            fleet.set_upgrade(
                node,
                Some(NodeUpgrade::new(Step::ValidationRequired, &up.target, "")),
            );
            return Ok(None);
        }
        let refused: Vec<String> = pods
            .iter()
            .filter(|p| p.terminating.is_none())
            .filter_map(|p| {
                p.refused
                    .as_ref()
                    .map(|why| format!("{}/{}: {why}", p.namespace, p.name))
            })
            .collect();
        let timed_out = rules.timeout.is_some_and(|t| up.since.elapsed() >= t);
        if !refused.is_empty() || timed_out {
            let why = if refused.is_empty() {
                format!(
                    "{} after {} s",
                    left(&pods),
                    rules.timeout.map_or(0, |t| t.as_secs())
                )
            } else {
                refused.join("; ")
            };
            if !drain && policy.drain.is_some() {
                tracing::warn!(node, why = %why, "driver upgrade: GPU pods not all evicted; draining the node");
                fleet.set_upgrade(
                    node,
                    Some(NodeUpgrade::new(Step::DrainRequired, &up.target, why)),
                );
                return Ok(Some(Duration::ZERO));
            }
            let what = if drain { "drain" } else { "GPU pod deletion" };
            tracing::error!(node, why = %why, "driver upgrade failed: {what} could not finish");
            fleet.set_upgrade(
                node,
                Some(NodeUpgrade::new(
                    Step::UpgradeFailed,
                    &up.target,
                    format!("{what} could not finish: {why}"),
                )),
            );
            return Ok(None);
        }
        let mut blocked = Vec::new();
        for p in pods.iter().filter(|p| p.terminating.is_none()) {
            if !self.leading() {
                // The next leader evicts what is left.
                return Ok(None);
            }
            let api: Api<Pod> = Api::namespaced(self.client.clone(), &p.namespace);
            match evict(&api, &p.namespace, &p.name).await {
                Ok(_) => {
                    tracing::info!(node, pod = %format!("{}/{}", p.namespace, p.name), "evicted")
                }
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                // A disruption budget says not now.
                Err(kube::Error::Api(s)) if s.code == 429 => {
                    blocked.push(format!("{}/{}: {}", p.namespace, p.name, s.message))
                }
                Err(e) => {
                    return Err(StepError {
                        node: node.into(),
                        what: format!("evicting {}/{}", p.namespace, p.name),
                        source: e,
                    });
                }
            }
        }
        let detail = if blocked.is_empty() {
            format!(
                "waiting for {} to go",
                pods.iter()
                    .map(PodInfo::said)
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        } else {
            format!("eviction refused for now: {}", blocked.join("; "))
        };
        if detail != up.detail {
            fleet.set_upgrade(
                node,
                Some(NodeUpgrade {
                    detail,
                    ..up.clone()
                }),
            );
        }
        Ok(Some(RECHECK))
    }
}

fn merge_params() -> PatchParams {
    PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..Default::default()
    }
}
