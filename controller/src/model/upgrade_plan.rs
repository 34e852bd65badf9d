//! The driver rollout's decisions, pure: from what each node's agent says
//! and where each node is ([`Seen`]), which nodes move to which state and
//! which start next under the [`UpgradePolicy`] ([`plan`]). The API steps
//! that follow (cordon, evictions, uncordon) are the rollout's, in
//! `upgrade`.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::model::upgrade_policy::UpgradePolicy;
use crate::model::upgrade_state::{NodeUpgrade, Step, Unavailable};

/// A duration in words: `30 min`, `90 s`, `400 ms`.
fn span(d: Duration) -> String {
    let s = d.as_secs();
    if s == 0 {
        format!("{} ms", d.as_millis())
    } else if s >= 60 && s.is_multiple_of(60) {
        format!("{} min", s / 60)
    } else {
        format!("{s} s")
    }
}

/// What the orchestrator sees of one node.
#[derive(Clone, Debug)]
pub struct Seen {
    pub node: String,
    pub step: Option<NodeUpgrade>,
    /// The agent's own word: its upgrade state and the version it wants.
    pub agent_state: String,
    pub agent_version: String,
    pub agent_detail: String,
    /// The driver the agent reports loaded, and whether every stage validated.
    pub driver_version: String,
    pub ready: bool,
    /// The agent's stream is live, and it sent a report since this
    /// controller started (else nothing is known of it yet).
    pub connected: bool,
    pub reported: bool,
    /// Out of service apart from an upgrade (NotReady, cordoned by
    /// someone else); `None` also when not looked at.
    pub unavailable: Option<Unavailable>,
}

/// What [`plan`] decided.
#[derive(Debug)]
pub struct Planned {
    /// The nodes whose state changed, with the new state (`None`: no
    /// upgrade any more).
    pub moves: Vec<(String, Option<NodeUpgrade>)>,
    /// A node that could start was held back by nodes out of service
    /// (NotReady, cordoned by another, itself NotReady): they come back
    /// without a report, so the rollout must look again.
    pub held_back: bool,
}

/// Moves each node's state on from what its agent says, then starts the
/// next nodes the policy allows. Pure: the API steps follow in the
/// rollout (`upgrade::Upgrader`).
pub fn plan(policy: &UpgradePolicy, nodes: &[Seen]) -> Planned {
    let mut out: BTreeMap<String, Option<NodeUpgrade>> = BTreeMap::new();
    let mut now: BTreeMap<&str, Option<Step>> = BTreeMap::new();
    for n in nodes {
        let cur = n.step.as_ref().map(|s| s.step);
        // validation-required past its limit: the agent did not report the
        // driver validated (it may be gone): the node fails, visibly.
        let timed_out = |s: &NodeUpgrade| -> Option<NodeUpgrade> {
            let limit = policy.validation_timeout?;
            if s.step != Step::ValidationRequired || s.since.elapsed() < limit {
                return None;
            }
            let mut why = format!(
                "the agent did not report driver {} validated within {}",
                s.target,
                span(limit)
            );
            if !n.connected {
                why.push_str("; it is not connected");
            } else if !n.agent_detail.is_empty() {
                why.push_str("; it last said: ");
                why.push_str(&n.agent_detail);
            }
            Some(NodeUpgrade::new(Step::UpgradeFailed, &s.target, why))
        };
        if !n.reported {
            // Nothing is known of the node yet (a state read back from its
            // label waits for its agent's report), but for a validation
            // that took too long.
            match n.step.as_ref().and_then(timed_out) {
                Some(failed) => {
                    now.insert(&n.node, Some(Step::UpgradeFailed));
                    out.insert(n.node.clone(), Some(failed));
                }
                None => {
                    now.insert(&n.node, cur);
                }
            }
            continue;
        }
        let wants = n.agent_state == "upgrade-required" && !n.agent_version.is_empty();
        // The agent's word that the version is loaded and validated (its
        // inventory may still show the one it discovered before).
        let done_with =
            |target: &str| n.agent_state == "upgrade-done" && n.agent_version == target && n.ready;
        let next: Option<Option<NodeUpgrade>> = match (&n.step, cur) {
            (None, _) | (_, Some(Step::UpgradeDone)) if wants => Some(Some(NodeUpgrade::new(
                Step::UpgradeRequired,
                &n.agent_version,
                format!("driver {} loaded", n.driver_version),
            ))),
            // The cluster asks for the running driver again.
            (Some(_), Some(Step::UpgradeRequired)) if !wants => Some(None),
            (Some(s), Some(Step::UpgradeRequired)) if s.target != n.agent_version => {
                Some(Some(NodeUpgrade::new(
                    Step::UpgradeRequired,
                    &n.agent_version,
                    format!("driver {} loaded", n.driver_version),
                )))
            }
            (Some(s), Some(Step::ValidationRequired)) if done_with(&s.target) => Some(Some(
                NodeUpgrade::new(Step::UncordonRequired, &s.target, n.agent_detail.clone()),
            )),
            (Some(s), Some(Step::ValidationRequired)) if n.agent_state == "upgrade-failed" => {
                Some(Some(NodeUpgrade::new(
                    Step::UpgradeFailed,
                    &s.target,
                    n.agent_detail.clone(),
                )))
            }
            (Some(s), Some(Step::ValidationRequired)) if timed_out(s).is_some() => {
                Some(timed_out(s))
            }
            (Some(s), Some(Step::UpgradeFailed)) if done_with(&s.target) => {
                Some(Some(NodeUpgrade::new(
                    Step::UncordonRequired,
                    &s.target,
                    "fixed: the agent reports it validated",
                )))
            }
            // The cluster changed its mind in mid-upgrade: a node that runs
            // what is wanted now is done; one that wants another version
            // goes on towards that one.
            (Some(s), Some(st))
                if (st.in_progress() || st == Step::UpgradeFailed)
                    && st != Step::UncordonRequired
                    && n.agent_state == "upgrade-done"
                    && n.ready
                    && !n.agent_version.is_empty()
                    && n.agent_version != s.target =>
            {
                Some(Some(NodeUpgrade::new(
                    Step::UncordonRequired,
                    &n.agent_version,
                    "the cluster now asks for the driver it runs",
                )))
            }
            (Some(s), Some(st))
                if st.in_progress()
                    && wants
                    && !s.target.is_empty()
                    && n.agent_version != s.target =>
            {
                Some(Some(NodeUpgrade {
                    target: n.agent_version.clone(),
                    ..s.clone()
                }))
            }
            _ => None,
        };
        let step = match &next {
            Some(s) => s.as_ref().map(|s| s.step),
            None => cur,
        };
        now.insert(&n.node, step);
        if let Some(s) = next {
            out.insert(n.node.clone(), s);
        }
    }
    let in_progress = now.values().flatten().filter(|s| s.in_progress()).count();
    let failed = now
        .values()
        .flatten()
        .filter(|s| **s == Step::UpgradeFailed)
        .count();
    let mut held_back = false;
    if policy.auto_upgrade && failed == 0 {
        let allowed = policy.max_unavailable.of(nodes.len());
        let mut upgrading = in_progress;
        // Out of service now: upgrading, NotReady or cordoned by another.
        let upgrading_now = |n: &Seen| {
            now.get(n.node.as_str())
                .copied()
                .flatten()
                .is_some_and(Step::in_progress)
        };
        let mut down = nodes
            .iter()
            .filter(|n| n.unavailable.is_some() || upgrading_now(n))
            .count();
        let others_out = nodes
            .iter()
            .any(|n| n.unavailable.is_some() && !upgrading_now(n));
        for n in nodes {
            if now.get(n.node.as_str()).copied().flatten() != Some(Step::UpgradeRequired) {
                continue;
            }
            // A node whose agent is away would be cordoned and drained for
            // an upgrade nobody can do; a NotReady one's pods cannot be
            // moved off it.
            if !n.connected {
                continue;
            }
            if n.unavailable == Some(Unavailable::NotReady) {
                held_back = true;
                continue;
            }
            if policy.max_parallel > 0 && upgrading >= policy.max_parallel as usize {
                break;
            }
            // A node cordoned already takes nothing more out of service.
            let already_down = n.unavailable.is_some();
            if !already_down && down >= allowed {
                held_back |= others_out;
                continue;
            }
            let target = out
                .get(&n.node)
                .cloned()
                .flatten()
                .or_else(|| n.step.clone())
                .map(|s| s.target)
                .unwrap_or_default();
            out.insert(
                n.node.clone(),
                Some(NodeUpgrade::new(Step::CordonRequired, &target, "")),
            );
            upgrading += 1;
            if !already_down {
                down += 1;
            }
        }
    }
    Planned {
        moves: out.into_iter().collect(),
        held_back,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    use crate::model::upgrade_policy::Amount;

    fn seen(node: &str, step: Option<Step>, agent: &str, driver: &str) -> Seen {
        Seen {
            node: node.into(),
            step: step.map(|s| NodeUpgrade::new(s, "560.35.03", "")),
            agent_state: agent.into(),
            agent_version: if agent.is_empty() {
                String::new()
            } else {
                "560.35.03".into()
            },
            agent_detail: String::new(),
            driver_version: driver.into(),
            ready: true,
            connected: true,
            reported: true,
            unavailable: None,
        }
    }

    #[test]
    fn one_node_at_a_time_by_default_in_name_order() {
        let nodes = vec![
            seen("b", None, "upgrade-required", "550.127.08"),
            seen("a", None, "upgrade-required", "550.127.08"),
            seen("c", None, "", "560.35.03"),
        ];
        let mut nodes = nodes;
        nodes.sort_by(|x, y| x.node.cmp(&y.node));
        let out = plan(&UpgradePolicy::default(), &nodes).moves;
        let steps: Vec<(&str, Option<Step>)> = out
            .iter()
            .map(|(n, s)| (n.as_str(), s.as_ref().map(|s| s.step)))
            .collect();
        assert_eq!(
            steps,
            [
                ("a", Some(Step::CordonRequired)),
                ("b", Some(Step::UpgradeRequired))
            ]
        );
    }

    #[test]
    fn a_failed_node_stops_the_rollout_until_it_is_fixed() {
        let mut nodes = vec![
            seen(
                "a",
                Some(Step::ValidationRequired),
                "upgrade-failed",
                "550.127.08",
            ),
            seen(
                "b",
                Some(Step::UpgradeRequired),
                "upgrade-required",
                "550.127.08",
            ),
        ];
        nodes[0].agent_detail = "rolled back to 550.127.08".into();
        let out = plan(&UpgradePolicy::default(), &nodes).moves;
        assert_eq!(out.len(), 1, "{out:?}");
        let a = out[0].1.clone().unwrap();
        assert_eq!(a.step, Step::UpgradeFailed);
        assert_eq!(
            a.condition().message,
            "upgrade to driver 560.35.03 failed: rolled back to 550.127.08"
        );
        // Still failed: nothing starts.
        let nodes = vec![
            seen(
                "a",
                Some(Step::UpgradeFailed),
                "upgrade-failed",
                "550.127.08",
            ),
            seen(
                "b",
                Some(Step::UpgradeRequired),
                "upgrade-required",
                "550.127.08",
            ),
        ];
        assert!(plan(&UpgradePolicy::default(), &nodes).moves.is_empty());
        // Fixed by hand: the agent runs the wanted driver, validated.
        let nodes = vec![
            seen("a", Some(Step::UpgradeFailed), "upgrade-done", "560.35.03"),
            seen(
                "b",
                Some(Step::UpgradeRequired),
                "upgrade-required",
                "550.127.08",
            ),
        ];
        let out = plan(&UpgradePolicy::default(), &nodes).moves;
        assert_eq!(out[0].1.as_ref().unwrap().step, Step::UncordonRequired);
    }

    #[test]
    fn parallel_and_unavailable_limits() {
        let nodes: Vec<Seen> = (0..8)
            .map(|i| seen(&format!("n{i}"), None, "upgrade-required", "550.127.08"))
            .collect();
        let started = |p: &UpgradePolicy| {
            plan(p, &nodes)
                .moves
                .iter()
                .filter(|(_, s)| s.as_ref().is_some_and(|s| s.step == Step::CordonRequired))
                .count()
        };
        let mut p = UpgradePolicy {
            max_parallel: 0,
            ..Default::default()
        };
        assert_eq!(started(&p), 2, "25% of 8");
        p.max_unavailable = Amount::Count(5);
        p.max_parallel = 3;
        assert_eq!(started(&p), 3);
        p.auto_upgrade = false;
        assert_eq!(started(&p), 0);
    }

    #[test]
    fn nodes_out_of_service_count_against_max_unavailable() {
        // 8 GPU nodes, 4 want the new driver; maxUnavailable 25% = 2.
        let mut nodes: Vec<Seen> = (0..8)
            .map(|i| {
                let want = if i < 4 { "upgrade-required" } else { "" };
                seen(&format!("n{i}"), None, want, "550.127.08")
            })
            .collect();
        let p = UpgradePolicy {
            max_parallel: 0,
            ..Default::default()
        };
        // The nodes started, and whether others were held back by nodes
        // out of service (the rollout looks again for those).
        let started = |nodes: &[Seen]| -> (Vec<String>, bool) {
            let planned = plan(&p, nodes);
            let started = planned
                .moves
                .into_iter()
                .filter(|(_, s)| s.as_ref().is_some_and(|s| s.step == Step::CordonRequired))
                .map(|(n, _)| n)
                .collect();
            (started, planned.held_back)
        };
        let none = Vec::<String>::new();
        // Held back by the allowance alone (no node out of service): not
        // held by others.
        assert_eq!(started(&nodes), (vec!["n0".into(), "n1".into()], false));
        // One node NotReady elsewhere: one starts, the others wait for it.
        nodes[6].unavailable = Some(Unavailable::NotReady);
        assert_eq!(started(&nodes), (vec!["n0".into()], true));
        // Two out of service: none starts...
        nodes[7].unavailable = Some(Unavailable::Cordoned);
        assert_eq!(started(&nodes), (none, true));
        // ...but one cordoned already may (it takes nothing more out).
        nodes[2].unavailable = Some(Unavailable::Cordoned);
        assert_eq!(started(&nodes), (vec!["n2".into()], true));
        // A NotReady node that wants the driver waits until it is Ready.
        nodes[2].unavailable = Some(Unavailable::NotReady);
        nodes[6].unavailable = None;
        nodes[7].unavailable = None;
        assert_eq!(
            started(&nodes),
            (vec!["n0".into()], true),
            "n2 NotReady counts and waits"
        );
        // maxParallelUpgrades still bounds a cordoned node's start.
        let one = UpgradePolicy::default();
        nodes[2].unavailable = Some(Unavailable::Cordoned);
        let out = plan(&one, &nodes).moves;
        let s: Vec<&str> = out
            .iter()
            .filter(|(_, s)| s.as_ref().is_some_and(|s| s.step == Step::CordonRequired))
            .map(|(n, _)| n.as_str())
            .collect();
        assert_eq!(s, ["n0"], "one at a time, by name");
    }

    #[test]
    fn a_validation_that_takes_too_long_fails_the_node() {
        let late = |since: Duration| -> NodeUpgrade {
            NodeUpgrade {
                since: Instant::now().checked_sub(since).unwrap(),
                ..NodeUpgrade::new(Step::ValidationRequired, "560.35.03", "")
            }
        };
        let mut n = seen("n0", None, "upgrade-required", "550.127.08");
        n.agent_detail = "driver 550.127.08 loaded".into();
        n.step = Some(late(Duration::from_secs(31 * 60)));
        let p = UpgradePolicy::default();
        let out = plan(&p, std::slice::from_ref(&n)).moves;
        let failed = out[0].1.as_ref().unwrap();
        assert_eq!(failed.step, Step::UpgradeFailed);
        assert_eq!(
            failed.detail,
            "the agent did not report driver 560.35.03 validated within 30 min; it last said: driver 550.127.08 loaded"
        );
        // Its agent gone (and not heard since this controller started).
        n.connected = false;
        n.reported = false;
        let out = plan(&p, std::slice::from_ref(&n)).moves;
        assert_eq!(
            out[0].1.as_ref().unwrap().detail,
            "the agent did not report driver 560.35.03 validated within 30 min; it is not connected"
        );
        // Within the limit, or without one, it waits.
        n.step = Some(late(Duration::from_secs(29 * 60)));
        assert!(plan(&p, std::slice::from_ref(&n)).moves.is_empty());
        n.step = Some(late(Duration::from_secs(31 * 60)));
        let unlimited = UpgradePolicy {
            validation_timeout: None,
            ..Default::default()
        };
        assert!(plan(&unlimited, std::slice::from_ref(&n)).moves.is_empty());
        // Reported done in time (or late): it goes on as usual.
        n.connected = true;
        n.reported = true;
        n.agent_state = "upgrade-done".into();
        n.agent_version = "560.35.03".into();
        let out = plan(&p, std::slice::from_ref(&n)).moves;
        assert_eq!(out[0].1.as_ref().unwrap().step, Step::UncordonRequired);
    }
}
