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
