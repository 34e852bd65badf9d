//! `gpu-controller uninstall-agents`: every node that has a gpu-agent left
//! as it was before gpu-agent, when gpu-agent is removed from the cluster
//! (the Helm chart's pre-delete hook runs it; so can you, before `kubectl
//! delete -k`).
//!
//! An agent that is stopped cannot tell a rollout from an uninstall, and
//! `gpu-agent uninstall` refuses to run while the agent runs (the agent
//! would redo what it undoes at its next reconcile). So the work is done
//! from outside, in this order:
//!
//! 1. One uninstall pod per node that has an agent pod, pinned to that node
//!    and held back by a scheduling gate. These pods are the record of which
//!    nodes still need cleaning, kept by the API server: should this command
//!    die and run again (a second `helm uninstall`), it finds them.
//! 2. The agents' DaemonSet is deleted, and its pods waited for until they
//!    are gone: each agent stops as on any SIGTERM (sockets removed, state
//!    written, GPU containers untouched).
//! 3. The gates are lifted: each pod runs `gpu-agent uninstall` on its node
//!    (host files put back byte for byte, everything gpu-agent made
//!    removed). A pod left failed by an earlier try is replaced.
//! 4. Every pod is waited for. All succeeded: they are deleted, and this
//!    returns the nodes. One failed, or did not finish in time: the pods are
//!    kept (their logs say why) and this fails naming each node and how to
//!    read its pod's log.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{
    Affinity, NodeAffinity, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, Pod,
    PodSchedulingGate,
};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};

/// The scheduling gate that holds an uninstall pod until its node's agent
/// has stopped.
pub const GATE: &str = "gpu-agent.io/agent-stopped";
/// The annotation naming the node an uninstall pod is for.
pub const NODE_ANNOTATION: &str = "gpu-agent.io/node";

/// What `uninstall-agents` was asked for.
#[derive(Debug, Clone)]
pub struct Options {
    /// The namespace of the agents and of the uninstall pods.
    pub namespace: String,
    /// The agents' DaemonSet.
    pub daemonset: String,
    /// A label selector of the agents' pods (`k=v,k=v`).
    pub agent_selector: String,
    /// The uninstall pod, as the chart renders it: its labels select the
    /// uninstall pods (they must not select the agents'); its name is the
    /// prefix of theirs.
    pub pod_template: Pod,
    /// The whole run's limit.
    pub timeout: Duration,
    /// How often the API is asked again while waiting.
    pub poll: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum UninstallError {
    #[error(
        "the uninstall pod template has no labels: they are what finds its pods again (and must differ from the agents')"
    )]
    NoLabels,
    #[error("the uninstall pod template's labels {0} also select the agents' pods")]
    SelectsAgents(String),
    #[error("cannot {what}: {source}")]
    Api {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error(
        "after {secs} s the agents' pods are still there on {nodes}; nothing was uninstalled (run again once they are gone)"
    )]
    AgentsStayed { secs: u64, nodes: String },
    #[error("not uninstalled on {0}")]
    Failed(String),
}

fn api(what: impl Into<String>) -> impl FnOnce(kube::Error) -> UninstallError {
    let what = what.into();
    move |source| UninstallError::Api { what, source }
}

fn not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404)
}

/// `k=v,k=v` of a label map, sorted.
fn selector(labels: &BTreeMap<String, String>) -> String {
    labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// Whether `labels` match a `k=v,k=v` selector (equality terms only).
fn matches(sel: &str, labels: &BTreeMap<String, String>) -> bool {
    sel.split(',')
        .filter(|t| !t.trim().is_empty())
        .all(|t| match t.split_once('=') {
            Some((k, v)) => labels.get(k.trim()).map(String::as_str) == Some(v.trim()),
            None => labels.contains_key(t.trim()),
        })
}

fn phase(p: &Pod) -> &str {
    p.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("Pending")
}

fn name(p: &Pod) -> String {
    p.metadata.name.clone().unwrap_or_default()
}

fn gated(p: &Pod) -> bool {
    p.spec
        .as_ref()
        .and_then(|s| s.scheduling_gates.as_ref())
        .is_some_and(|g| !g.is_empty())
}

/// The uninstall pod for `node`: the template, named after it
/// (generateName), pinned to the node by affinity (through the scheduler,
/// so that a gate can hold it), gated while its agent may still run.
pub fn pod_for(template: &Pod, node: &str, gate: bool) -> Pod {
    let mut p = template.clone();
    let base = p
        .metadata
        .name
        .take()
        .unwrap_or_else(|| "gpu-agent-uninstall-node".into());
    p.metadata.generate_name = Some(format!("{base}-"));
    p.metadata.resource_version = None;
    p.metadata.uid = None;
    p.metadata
        .annotations
        .get_or_insert_with(Default::default)
        .insert(NODE_ANNOTATION.into(), node.into());
    let spec = p.spec.get_or_insert_with(Default::default);
    spec.node_name = None;
    spec.affinity = Some(Affinity {
        node_affinity: Some(NodeAffinity {
            required_during_scheduling_ignored_during_execution: Some(NodeSelector {
                node_selector_terms: vec![NodeSelectorTerm {
                    match_fields: Some(vec![NodeSelectorRequirement {
                        key: "metadata.name".into(),
                        operator: "In".into(),
                        values: Some(vec![node.into()]),
                    }]),
                    ..Default::default()
                }],
            }),
            ..Default::default()
        }),
        ..Default::default()
    });
    spec.scheduling_gates = gate.then(|| vec![PodSchedulingGate { name: GATE.into() }]);
    if spec.restart_policy.is_none() {
        spec.restart_policy = Some("Never".into());
    }
    p.status = None;
    p
}

/// The node an uninstall pod is for.
fn node_of(p: &Pod) -> Option<String> {
    p.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(NODE_ANNOTATION))
        .cloned()
}

struct Run<'a> {
    pods: Api<Pod>,
    opts: &'a Options,
    /// The uninstall pods' selector.
    mine: String,
    deadline: Instant,
}

impl Run<'_> {
    /// Nodes with an agent pod, and whether any agent pod is left at all.
    async fn agents(&self) -> Result<(BTreeSet<String>, usize), UninstallError> {
        let list = self
            .pods
            .list(&ListParams::default().labels(&self.opts.agent_selector))
            .await
            .map_err(api("list the agents' pods"))?;
        let nodes = list
            .items
            .iter()
            .filter_map(|p| p.spec.as_ref().and_then(|s| s.node_name.clone()))
            .collect();
        Ok((nodes, list.items.len()))
    }

    /// The uninstall pods by node (one each: a live one before a failed
    /// one; pods being deleted are not counted).
    async fn uninstall_pods(&self) -> Result<BTreeMap<String, Pod>, UninstallError> {
        let list = self
            .pods
            .list(&ListParams::default().labels(&self.mine))
            .await
            .map_err(api("list the uninstall pods"))?;
        let mut by_node: BTreeMap<String, Pod> = BTreeMap::new();
        for p in list.items {
            if p.metadata.deletion_timestamp.is_some() {
                continue;
            }
            let Some(node) = node_of(&p) else { continue };
            match by_node.get(&node) {
                Some(old) if phase(old) != "Failed" => {}
                _ => {
                    by_node.insert(node, p);
                }
            }
        }
        Ok(by_node)
    }

    async fn create(&self, node: &str, gate: bool) -> Result<Pod, UninstallError> {
        self.pods
            .create(
                &PostParams::default(),
                &pod_for(&self.opts.pod_template, node, gate),
            )
            .await
            .map_err(api(format!("make the uninstall pod of node {node}")))
    }

    async fn delete(&self, pod: &str) -> Result<(), UninstallError> {
        match self.pods.delete(pod, &DeleteParams::default()).await {
            Ok(_) => Ok(()),
            Err(e) if not_found(&e) => Ok(()),
            Err(e) => Err(api(format!("delete pod {pod}"))(e)),
        }
    }

    fn over(&self) -> bool {
        Instant::now() >= self.deadline
    }
}

/// Runs the four steps (module docs); returns the nodes uninstalled.
/// `say` gets one line per thing done.
pub async fn run(
    client: kube::Client,
    opts: &Options,
    say: &mut (dyn FnMut(String) + Send),
) -> Result<Vec<String>, UninstallError> {
    let labels = opts
        .pod_template
        .metadata
        .labels
        .clone()
        .filter(|l| !l.is_empty())
        .ok_or(UninstallError::NoLabels)?;
    if matches(&opts.agent_selector, &labels) {
        return Err(UninstallError::SelectsAgents(selector(&labels)));
    }
    let r = Run {
        pods: Api::namespaced(client.clone(), &opts.namespace),
        opts,
        mine: selector(&labels),
        deadline: Instant::now() + opts.timeout,
    };
    let daemonsets: Api<DaemonSet> = Api::namespaced(client, &opts.namespace);

    // 1. A held uninstall pod for every node with an agent.
    let (agent_nodes, _) = r.agents().await?;
    let mut pods = r.uninstall_pods().await?;
    for node in &agent_nodes {
        if !pods.contains_key(node) {
            let p = r.create(node, true).await?;
            say(format!(
                "{node}: uninstall pod {} made, held until the agent has stopped",
                name(&p)
            ));
            pods.insert(node.clone(), p);
        }
    }
    if pods.is_empty() {
        say("no node has an agent: nothing to uninstall on nodes".into());
    }

    // 2. The agents stop for good.
    match daemonsets
        .delete(&opts.daemonset, &DeleteParams::background())
        .await
    {
        Ok(_) => say(format!(
            "daemonset {} deleted; waiting for its pods to stop",
            opts.daemonset
        )),
        Err(e) if not_found(&e) => {}
        Err(e) => return Err(api(format!("delete daemonset {}", opts.daemonset))(e)),
    }
    loop {
        let (nodes, left) = r.agents().await?;
        if left == 0 {
            break;
        }
        if r.over() {
            return Err(UninstallError::AgentsStayed {
                secs: opts.timeout.as_secs(),
                nodes: if nodes.is_empty() {
                    format!("{left} pod(s) not yet on a node")
                } else {
                    nodes.into_iter().collect::<Vec<_>>().join(", ")
                },
            });
        }
        tokio::time::sleep(opts.poll).await;
    }

    // 3. Each node's uninstall goes ahead; an earlier failed try is replaced.
    for (node, p) in pods.iter_mut() {
        if phase(p) == "Failed" {
            r.delete(&name(p)).await?;
            *p = r.create(node, false).await?;
            say(format!(
                "{node}: an earlier uninstall failed; trying again in pod {}",
                name(p)
            ));
        } else if gated(p) {
            let pod = name(p);
            r.pods
                .patch(
                    &pod,
                    &PatchParams::default(),
                    &Patch::Merge(serde_json::json!({"spec": {"schedulingGates": null}})),
                )
                .await
                .map_err(api(format!("let pod {pod} run")))?;
        }
    }

    // 4. Every node's result.
    let (done, failed) = loop {
        let now = r.uninstall_pods().await?;
        let (mut done, mut failed, mut waiting) = (Vec::new(), Vec::new(), Vec::new());
        for (node, p) in &pods {
            let pod = name(p);
            match now.get(node) {
                Some(q) if phase(q) == "Succeeded" => done.push((node.clone(), name(q))),
                Some(q) if phase(q) == "Failed" => failed.push(format!(
                    "{node} (kubectl -n {} logs {})",
                    opts.namespace,
                    name(q)
                )),
                Some(q) => waiting.push((node.clone(), name(q), phase(q).to_string())),
                None => failed.push(format!("{node} (its uninstall pod {pod} is gone)")),
            }
        }
        if waiting.is_empty() {
            break (done, failed);
        }
        if r.over() {
            failed.extend(waiting.into_iter().map(|(node, pod, phase)| {
                format!(
                    "{node} (pod {pod} still {phase} after {} s: kubectl -n {} describe pod {pod})",
                    opts.timeout.as_secs(),
                    opts.namespace
                )
            }));
            break (done, failed);
        }
        tokio::time::sleep(opts.poll).await;
    };
    for (node, _) in &done {
        say(format!("{node}: uninstalled"));
    }
    if !failed.is_empty() {
        return Err(UninstallError::Failed(failed.join(", ")));
    }
    for (_, pod) in &done {
        r.delete(pod).await?;
    }
    Ok(done.into_iter().map(|(n, _)| n).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template() -> Pod {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "gpu-agent-uninstall", "namespace": "gpu-agent",
                         "labels": {"app.kubernetes.io/name": "gpu-agent-uninstall"}},
            "spec": {"containers": [{"name": "uninstall", "image": "x"}]}
        }))
        .unwrap()
    }

    #[test]
    fn a_nodes_pod_is_pinned_gated_and_named_after_the_template() {
        let p = serde_json::to_value(pod_for(&template(), "gpu-1", true)).unwrap();
        assert_eq!(p["metadata"]["generateName"], "gpu-agent-uninstall-");
        assert!(p["metadata"].get("name").is_none());
        assert_eq!(p["metadata"]["annotations"][NODE_ANNOTATION], "gpu-1");
        assert_eq!(
            p["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
                ["nodeSelectorTerms"][0]["matchFields"][0],
            serde_json::json!({"key": "metadata.name", "operator": "In", "values": ["gpu-1"]})
        );
        assert_eq!(
            p["spec"]["schedulingGates"],
            serde_json::json!([{"name": GATE}])
        );
        assert_eq!(p["spec"]["restartPolicy"], "Never");
        let free = serde_json::to_value(pod_for(&template(), "gpu-1", false)).unwrap();
        assert!(free["spec"].get("schedulingGates").is_none());
    }

    #[test]
    fn selectors_match_equality_terms() {
        let l: BTreeMap<String, String> =
            [("a".into(), "1".into()), ("b".into(), "2".into())].into();
        assert_eq!(selector(&l), "a=1,b=2");
        assert!(matches("a=1", &l));
        assert!(matches("a=1,b=2", &l));
        assert!(!matches("a=1,c=3", &l));
        assert!(matches("b", &l));
    }
}
