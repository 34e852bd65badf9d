//! The fleet as people see it: `/fleet.json` (the page) and what the
//! running ClusterPolicy's status says.

use std::collections::{BTreeMap, HashMap};

use gpu_agent_proto::report::v1 as pb;

use super::Fleet;
use crate::model::policy_summary::PolicySummary;
use crate::model::policy_texts::PolicyTexts;
use crate::model::upgrade_state::Step;

impl Fleet {
    /// The fleet as the page and `/fleet.json` show it, nodes by name.
    pub fn view(&self) -> serde_json::Value {
        let nodes = self.nodes.lock().unwrap();
        let mut names: Vec<&String> = nodes.keys().collect();
        names.sort();
        let (mut gpus, mut unhealthy, mut connected) = (0usize, 0usize, 0usize);
        let mut rollout: std::collections::BTreeMap<Step, usize> = Default::default();
        let mut failed: Vec<&str> = Vec::new();
        let list: Vec<serde_json::Value> = names
            .into_iter()
            .map(|name| {
                let e = &nodes[name];
                let r = &e.report;
                let health: HashMap<&str, &pb::GpuHealth> = r
                    .health
                    .iter()
                    .flat_map(|h| &h.gpus)
                    .map(|g| (g.uuid.as_str(), g))
                    .collect();
                let inv = r.inventory.clone().unwrap_or_default();
                let gpu_list: Vec<serde_json::Value> = inv
                    .gpus
                    .iter()
                    .map(|g| {
                        let h = health.get(g.uuid.as_str());
                        let healthy = h.is_none_or(|h| h.healthy);
                        gpus += 1;
                        if !healthy {
                            unhealthy += 1;
                        }
                        serde_json::json!({
                            "index": g.index,
                            "uuid": g.uuid,
                            "model": g.model,
                            "pciBusId": g.pci_bus_id,
                            "memoryMiB": g.memory_mib,
                            "healthy": healthy,
                            "reason": h.map(|h| h.reason.as_str()).unwrap_or(""),
                            "advice": h.map(|h| h.advice.as_str()).unwrap_or(""),
                            "migDevices": g.mig_devices.iter().map(|m| &m.profile).collect::<Vec<_>>(),
                        })
                    })
                    .collect();
                if e.live() {
                    connected += 1;
                }
                let desired = self.wanted(e);
                let api = e.write.applied.as_ref();
                let (conditions, tainted) = match api.and_then(|a| a.conditions.as_ref()) {
                    // Not reported to this replica yet, within the grace:
                    // as the API has them.
                    Some(c) if !e.reported && e.gone.is_none() => (
                        c.iter().map(|(c, _)| c.clone()).collect(),
                        api.and_then(|a| a.taint).unwrap_or(false),
                    ),
                    _ => (desired.conditions, desired.taint),
                };
                if let Some(u) = &e.upgrade {
                    *rollout.entry(u.step).or_insert(0usize) += 1;
                    if u.step == Step::UpgradeFailed {
                        failed.push(name.as_str());
                    }
                }
                serde_json::json!({
                    "name": name,
                    "connected": e.live(),
                    "notReporting": e.gone,
                    "agentVersion": e.hello.as_ref().map(|h| h.agent_version.as_str()).unwrap_or(""),
                    "driverVersion": inv.driver_version,
                    "cudaVersion": inv.cuda_version,
                    "simulated": inv.simulated,
                    "ready": r.stages.as_ref().is_some_and(|s| s.ready),
                    "gpus": gpu_list,
                    "conditions": conditions.iter().map(|c| serde_json::json!({
                        "type": c.kind, "status": c.status, "reason": c.reason, "message": c.message,
                    })).collect::<Vec<_>>(),
                    "tainted": tainted,
                    "mig": r.mig.as_ref().map(|m| serde_json::json!({"layout": m.layout, "state": m.state, "detail": m.detail})),
                    "upgrade": e.upgrade.as_ref().map(|u| serde_json::json!({"state": u.step.label(), "driverVersion": u.target, "detail": u.detail})),
                    "events": e.events.iter().rev().take(super::RECENT).map(|ev| serde_json::json!({
                        "gpu": ev.gpu_uuid, "xid": ev.xid, "reason": ev.reason, "advice": ev.advice,
                        "unhealthy": ev.unhealthy, "atUnixMs": ev.at_unix_ms,
                    })).collect::<Vec<_>>(),
                    "repairs": e.repairs.iter().rev().take(super::RECENT).map(|r| serde_json::json!({
                        "stage": r.stage, "what": r.what, "atUnix": r.at_unix,
                    })).collect::<Vec<_>>(),
                    "writeError": e.write.last_error,
                })
            })
            .collect();
        // The driver rollout in one line: how many nodes at each step.
        let rollout = (!rollout.is_empty()).then(|| {
            let mut text = format!(
                "driver rollout: {}",
                rollout
                    .iter()
                    .map(|(step, n)| format!("{n} {}", step.label()))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            if !failed.is_empty() {
                text.push_str(&format!("; stopped by {}", failed.join(", ")));
            }
            text
        });
        serde_json::json!({
            "summary": {
                "nodes": list.len(),
                "connected": connected,
                "gpus": gpus,
                "unhealthyGpus": unhealthy,
                "rollout": rollout,
                // Check-ins answered since this replica started, and
                // health events and repairs not made Events (a full queue).
                "checkIns": self.check_ins_answered.load(std::sync::atomic::Ordering::Relaxed),
                "eventsDropped": self.events_dropped.load(std::sync::atomic::Ordering::Relaxed),
            },
            "nodes": list,
        })
    }

    /// The running ClusterPolicy's name, and what its status should say:
    /// (ready, message). `None` when no ClusterPolicy is sent.
    pub fn policy_status(&self) -> Option<(String, bool, String)> {
        let policy = self.policy.lock().unwrap().clone()?;
        let name = policy.name.clone();
        let nodes = self.nodes.lock().unwrap();
        let mut names: Vec<&String> = nodes.keys().filter(|n| nodes[*n].live()).collect();
        names.sort();
        let mut ignored = std::collections::BTreeSet::new();
        let mut problems = Vec::new();
        for n in &names {
            let r = &nodes[*n].report;
            let p = r.policy.clone().unwrap_or_default();
            ignored.extend(p.ignored_keys.iter().cloned());
            if !p.error.is_empty() {
                problems.push(format!("{n}: the policy is not applied: {}", p.error));
            } else if p.source != "ClusterPolicy" {
                problems.push(format!("{n}: not running it yet"));
            } else if !r.stages.as_ref().is_some_and(|s| s.ready) {
                problems.push(format!("{n}: not every stage is validated"));
            }
        }
        // ConfigMaps it names that are not used come first.
        let unused = policy.problems_for(&names);
        let mut message = unused.iter().map(|p| format!("{p}; ")).collect::<String>();
        message.push_str(&format!(
            "{} of {} reporting nodes run it",
            names.len() - problems.len(),
            names.len()
        ));
        if !problems.is_empty() {
            message.push_str(&format!(" ({})", problems.join("; ")));
        }
        if !ignored.is_empty() {
            message.push_str(&format!(
                "; keys gpu-agent does not use: {}",
                ignored.into_iter().collect::<Vec<_>>().join(", ")
            ));
        }
        Some((name, problems.is_empty() && unused.is_empty(), message))
    }

    /// Sharded: the running ClusterPolicy, and what this replica says of
    /// the reporting nodes of each shard in `shards` (`shard_of` says a
    /// node's), by the same rule as [`Fleet::policy_status`], bounded
    /// ([`PolicySummary::add`]). A shard without a reporting node has a
    /// summary too. `None` when no ClusterPolicy is sent. One pass over
    /// the nodes; problems are worded only for the few kept.
    pub fn policy_summaries(
        &self,
        shards: &std::collections::BTreeSet<u32>,
        shard_of: impl Fn(&str) -> u32,
    ) -> Option<(std::sync::Arc<PolicyTexts>, BTreeMap<u32, PolicySummary>)> {
        let policy = self.policy.lock().unwrap().clone()?;
        let mut out: BTreeMap<u32, PolicySummary> = shards
            .iter()
            .map(|k| {
                let s = PolicySummary {
                    policy: policy.name.clone(),
                    ..Default::default()
                };
                (*k, s)
            })
            .collect();
        let mut names: BTreeMap<u32, Vec<&String>> = BTreeMap::new();
        let nodes = self.nodes.lock().unwrap();
        for (n, e) in nodes.iter().filter(|(_, e)| e.live()) {
            let k = shard_of(n);
            let Some(s) = out.get_mut(&k) else { continue };
            let r = &e.report;
            let p = r.policy.as_ref();
            let error = p.map(|p| p.error.as_str()).unwrap_or("");
            let problem = if !error.is_empty() {
                Some(("the policy is not applied: ", error))
            } else if p.is_none_or(|p| p.source != "ClusterPolicy") {
                Some(("not running it yet", ""))
            } else if !r.stages.as_ref().is_some_and(|s| s.ready) {
                Some(("not every stage is validated", ""))
            } else {
                None
            };
            let ignored = p.map(|p| &p.ignored_keys[..]).unwrap_or(&[]);
            s.add(n, problem, ignored);
            names.entry(k).or_default().push(n);
        }
        // Whether a node lacks the device-plugin label: the one problem
        // that depends on which nodes there are.
        let base = policy.problems_for(&[]).len();
        for (k, names) in &names {
            if let Some(s) = out.get_mut(k) {
                s.unlabelled = policy.problems_for(names).len() > base;
            }
        }
        drop(nodes);
        Some((policy, out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::node::TaintPolicy;
    use crate::model::policy_summary::{Part, fleet_status};

    /// A live node reporting the policy as `source`, validated or not.
    fn report(fleet: &Fleet, node: &str, source: &str, ready: bool, error: &str) {
        let (down, _) = tokio::sync::mpsc::channel(8);
        let hello = pb::Hello {
            node_name: node.into(),
            ..Default::default()
        };
        let _ = fleet.connect(hello, down);
        let r = pb::NodeReport {
            policy: Some(pb::PolicyState {
                source: source.into(),
                ignored_keys: vec!["spec.sandboxWorkloads".into()],
                error: error.into(),
            }),
            stages: Some(pb::Stages {
                ready,
                ..Default::default()
            }),
            ..Default::default()
        };
        fleet.apply(node, pb::agent_message::Body::Snapshot(r));
    }

    #[test]
    fn each_shards_summary_adds_up_to_what_the_unsharded_status_says() {
        let fleet = Fleet::new(TaintPolicy::default(), std::time::Duration::from_secs(1)).0;
        assert!(fleet.policy_summaries(&[0].into(), |_| 0).is_none());
        fleet.set_policy(Some(PolicyTexts::plain("cp", "{}".into())));
        report(&fleet, "n1", "ClusterPolicy", true, "");
        report(&fleet, "n2", "file", false, "");
        report(&fleet, "n3", "ClusterPolicy", false, "");
        report(&fleet, "n4", "ClusterPolicy", true, "bad key");
        let (_, whole, unsharded) = fleet.policy_status().unwrap();
        // n1, n2 on shard 0; n3, n4 on shard 1; shard 2 has none; shard 3
        // is not this replica's.
        let of = |n: &str| {
            if n <= "n2" {
                0
            } else if n <= "n4" {
                1
            } else {
                3
            }
        };
        let (policy, by) = fleet.policy_summaries(&[0, 1, 2].into(), of).unwrap();
        assert_eq!(by.len(), 3);
        assert_eq!((by[&0].reporting, by[&0].running), (2, 1));
        assert_eq!(by[&0].problems, ["n2: not running it yet"]);
        assert_eq!(
            by[&1].problems,
            [
                "n3: not every stage is validated",
                "n4: the policy is not applied: bad key"
            ]
        );
        assert_eq!((by[&2].reporting, by[&2].policy.as_str()), (0, "cp"));
        assert!(by.values().all(|s| !s.unlabelled));
        let parts = by.into_iter().map(|(k, s)| (k, Part::Counted(s))).collect();
        assert_eq!(fleet_status(&policy, &parts), (whole, unsharded));
    }
}
