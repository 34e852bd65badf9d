//! What the ClusterPolicy's status says when the nodes are sharded over
//! replicas (`--shards`): each replica summarises, for each shard it holds,
//! whether that shard's reporting nodes run the ClusterPolicy
//! ([`PolicySummary`]), and carries the summary in the shard's Lease, in
//! the annotation [`SUMMARY`] (compact JSON, bounded: at most
//! [`MAX_PROBLEMS`] problems and [`MAX_IGNORED`] ignored keys, each cut, so
//! the annotation stays under [`MAX_TEXT`] bytes at any fleet size). The
//! Lease is renewed every second anyway: the summary costs no request.
//!
//! The elected leader merges every shard's summary ([`fleet_status`]): its
//! own, computed locally, and the others' from the Leases. A ConfigMap the
//! ClusterPolicy names that is not used is the leader's to say (every
//! replica reads the same ConfigMaps); whether some node has no
//! `nvidia.com/device-plugin.config` label (which makes one of those
//! problems apply) travels as one flag per shard ([`PolicySummary::unlabelled`]),
//! not as node names. Pure: no API calls.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::model::policy_texts::PolicyTexts;

/// The shard Lease's annotation that carries its holder's summary.
pub const SUMMARY: &str = "gpu-agent.io/policy-summary";
/// Problems a summary lists at most (the first by node name); the rest are
/// counted.
pub const MAX_PROBLEMS: usize = 5;
/// Ignored keys a summary lists at most.
pub const MAX_IGNORED: usize = 20;
/// The merged status lists this many problems at most.
pub const MAX_LISTED: usize = 10;
/// Bytes a problem or a key is cut to.
const MAX_ITEM: usize = 256;
/// An annotation longer than this is not one a gpu-controller writes.
pub const MAX_TEXT: usize = 16 * 1024;

/// One shard's nodes, as their holder sees them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicySummary {
    /// The ClusterPolicy it is about.
    pub policy: String,
    /// The shard's nodes whose agent reports to the holder.
    pub reporting: u64,
    /// Of which, those that run the ClusterPolicy, every stage validated.
    pub running: u64,
    /// The first problems (`<node>: not running it yet`), by node name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub problems: Vec<String>,
    /// The keys of the ClusterPolicy the agents do not use.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub ignored: BTreeSet<String>,
    /// A reporting node has no `nvidia.com/device-plugin.config` label.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unlabelled: bool,
}

/// A summary annotation that cannot be read.
#[derive(Debug, thiserror::Error)]
#[error("shard {shard}: annotation {SUMMARY} is not one a gpu-controller writes ({text:?}): {why}")]
pub struct SummaryError {
    pub shard: u32,
    /// Its first 200 bytes.
    pub text: String,
    pub why: String,
}

/// `s` cut to `max` bytes (at a character's boundary).
fn cut_to(s: &str, max: usize) -> &str {
    let mut at = s.len().min(max);
    while !s.is_char_boundary(at) {
        at -= 1;
    }
    &s[..at]
}

impl PolicySummary {
    /// Adds one reporting node: `problem` is why it does not run the
    /// ClusterPolicy, if it does not (in two pieces, worded only if kept).
    /// Nodes come in any order; the first [`MAX_PROBLEMS`] by name are kept.
    pub fn add(&mut self, node: &str, problem: Option<(&str, &str)>, ignored: &[String]) {
        self.reporting += 1;
        for k in ignored {
            if self.ignored.len() >= MAX_IGNORED {
                break;
            }
            if !self.ignored.contains(k.as_str()) {
                self.ignored.insert(cut_to(k, MAX_ITEM).to_string());
            }
        }
        let Some((why, detail)) = problem else {
            self.running += 1;
            return;
        };
        let full = self.problems.len() >= MAX_PROBLEMS;
        // Problems begin with their node's name: the list stays sorted.
        let at = self
            .problems
            .partition_point(|p| p.split(": ").next().unwrap_or("") < node);
        if full && at >= MAX_PROBLEMS {
            return;
        }
        let text = format!("{node}: {why}{detail}");
        self.problems
            .insert(at, cut_to(&text, MAX_ITEM).to_string());
        self.problems.truncate(MAX_PROBLEMS);
    }

    /// Problems beyond those listed.
    pub fn more(&self) -> u64 {
        (self.reporting - self.running).saturating_sub(self.problems.len() as u64)
    }

    /// The annotation's value.
    pub fn encode(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Reads shard `shard`'s annotation.
    pub fn decode(shard: u32, text: &str) -> Result<PolicySummary, SummaryError> {
        let err = |why: String| SummaryError {
            shard,
            text: cut_to(text, 200).to_string(),
            why,
        };
        if text.len() > MAX_TEXT {
            return Err(err(format!("{} bytes, more than {MAX_TEXT}", text.len())));
        }
        let s: PolicySummary = serde_json::from_str(text).map_err(|e| err(e.to_string()))?;
        if s.running > s.reporting {
            return Err(err(format!(
                "{} running of {} reporting",
                s.running, s.reporting
            )));
        }
        if s.problems.len() > MAX_PROBLEMS
            || s.problems.len() as u64 > s.reporting - s.running
            || s.ignored.len() > MAX_IGNORED
        {
            return Err(err("more problems or keys than it may list".into()));
        }
        Ok(s)
    }
}

/// What the leader has of one shard.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Part {
    /// Its holder's summary (the leader's own, or read from the Lease).
    Counted(PolicySummary),
    /// Nobody holds it.
    NoReplica,
    /// Its holder has no summary of it for this ClusterPolicy (not yet, or
    /// not one that can be read).
    NotCounted { holder: String },
}

impl Part {
    /// A shard held by another replica, `holder`, from its annotation
    /// (`None`: it has none), for the ClusterPolicy `policy`. An annotation
    /// that cannot be read is not counted, and its error returned.
    pub fn read(
        shard: u32,
        holder: &str,
        text: Option<&str>,
        policy: &str,
    ) -> (Part, Option<SummaryError>) {
        let not = || Part::NotCounted {
            holder: holder.to_string(),
        };
        match text.map(|t| PolicySummary::decode(shard, t)) {
            Some(Ok(s)) if s.policy == policy => (Part::Counted(s), None),
            Some(Err(e)) => (not(), Some(e)),
            _ => (not(), None),
        }
    }
}

/// `1,3`.
fn listed(shards: &[u32]) -> String {
    shards
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// What the ClusterPolicy's status says of a sharded fleet: (ready,
/// message). The message reads as the unsharded one does, with the
/// fleet's counts, and names the shards not counted.
pub fn fleet_status(policy: &PolicyTexts, parts: &BTreeMap<u32, Part>) -> (bool, String) {
    let (mut reporting, mut running, mut more) = (0u64, 0u64, 0u64);
    let mut problems: Vec<&str> = Vec::new();
    let mut ignored: BTreeSet<&str> = BTreeSet::new();
    let mut unlabelled = false;
    let mut no_replica = Vec::new();
    let mut not_counted: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
    for (k, part) in parts {
        match part {
            Part::Counted(s) => {
                reporting += s.reporting;
                running += s.running;
                more += s.more();
                problems.extend(s.problems.iter().map(String::as_str));
                ignored.extend(s.ignored.iter().map(String::as_str));
                unlabelled |= s.unlabelled;
            }
            Part::NoReplica => no_replica.push(*k),
            Part::NotCounted { holder } => not_counted.entry(holder).or_default().push(*k),
        }
    }
    problems.sort_unstable();
    if problems.len() > MAX_LISTED {
        more += (problems.len() - MAX_LISTED) as u64;
        problems.truncate(MAX_LISTED);
    }
    // A ConfigMap it names that is not used comes first (as unsharded).
    let unused = if unlabelled {
        policy.problems()
    } else {
        policy.problems_for(&[])
    };
    let mut message = unused.iter().map(|p| format!("{p}; ")).collect::<String>();
    message.push_str(&format!("{running} of {reporting} reporting nodes run it"));
    if !problems.is_empty() {
        message.push_str(&format!(" ({}", problems.join("; ")));
        if more > 0 {
            message.push_str(&format!("; and {more} more"));
        }
        message.push(')');
    } else if more > 0 {
        message.push_str(&format!(" ({more} do not)"));
    }
    if !ignored.is_empty() {
        message.push_str(&format!(
            "; keys gpu-agent does not use: {}",
            ignored.into_iter().collect::<Vec<_>>().join(", ")
        ));
    }
    match no_replica.len() {
        0 => {}
        1 => message.push_str(&format!("; shard {} has no replica", no_replica[0])),
        _ => message.push_str(&format!("; shards {} have no replica", listed(&no_replica))),
    }
    for (holder, ks) in &not_counted {
        let which = match ks.len() {
            1 => format!("shard {}", ks[0]),
            _ => format!("shards {}", listed(ks)),
        };
        message.push_str(&format!("; {which} (replica {holder}) not counted yet"));
    }
    let ready = reporting == running
        && unused.is_empty()
        && no_replica.is_empty()
        && not_counted.is_empty();
    (ready, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary(policy: &str, nodes: &[(&str, Option<&str>)]) -> PolicySummary {
        let mut s = PolicySummary {
            policy: policy.into(),
            ..Default::default()
        };
        for (n, p) in nodes {
            s.add(n, p.map(|p| (p, "")), &[]);
        }
        s
    }

    #[test]
    fn a_summary_keeps_the_first_problems_by_name_and_counts_the_rest() {
        let mut s = summary("cp", &[]);
        for i in (0..12).rev() {
            s.add(&format!("n{i:02}"), Some(("not running it yet", "")), &[]);
        }
        s.add("a", None, &["spec.x".into(), "spec.y".into()]);
        s.add("b", None, &["spec.x".into()]);
        assert_eq!(s.reporting, 14);
        assert_eq!(s.running, 2);
        assert_eq!(
            s.problems,
            (0..5)
                .map(|i| format!("n{i:02}: not running it yet"))
                .collect::<Vec<_>>()
        );
        assert_eq!(s.more(), 7);
        assert_eq!(s.ignored, ["spec.x".to_string(), "spec.y".into()].into());
        // Bounded keys, and a long problem cut.
        let keys: Vec<String> = (0..100).map(|i| format!("spec.k{i}")).collect();
        let long = "é".repeat(1000);
        s.add("0", Some(("", &long)), &keys);
        assert_eq!(s.ignored.len(), MAX_IGNORED);
        assert!(s.problems[0].starts_with("0: é") && s.problems[0].len() <= MAX_ITEM);
        assert_eq!(s.problems.len(), MAX_PROBLEMS);
    }

    #[test]
    fn encoded_and_read_back() {
        let mut s = summary("cp", &[("n1", Some("not running it yet")), ("n2", None)]);
        s.unlabelled = true;
        s.ignored.insert("spec.sandboxWorkloads".into());
        let text = s.encode();
        assert_eq!(
            text,
            r#"{"policy":"cp","reporting":2,"running":1,"problems":["n1: not running it yet"],"ignored":["spec.sandboxWorkloads"],"unlabelled":true}"#
        );
        assert_eq!(PolicySummary::decode(3, &text).unwrap(), s);
        let empty = summary("cp", &[]).encode();
        assert_eq!(empty, r#"{"policy":"cp","reporting":0,"running":0}"#);
        assert!(PolicySummary::decode(0, &empty).is_ok());
        // The largest a summary gets stays well under the limit.
        let mut big = summary(&"p".repeat(253), &[]);
        let keys: Vec<String> = (0..50).map(|i| format!("{i}{}", "k".repeat(400))).collect();
        for i in 0..10_000 {
            big.add(&format!("{i}{}", "n".repeat(300)), Some(("x", "")), &keys);
        }
        assert!(big.encode().len() < MAX_TEXT, "{}", big.encode().len());
        assert!(PolicySummary::decode(0, &big.encode()).is_ok());
    }

    #[test]
    fn a_malformed_or_oversized_annotation_is_an_error_naming_the_shard() {
        for (text, why) in [
            ("not json", "expected"),
            (r#"{"reporting":1}"#, "missing field"),
            (
                r#"{"policy":"cp","reporting":1,"running":2}"#,
                "2 running of 1 reporting",
            ),
            (
                r#"{"policy":"cp","reporting":1,"running":1,"problems":["a: x"]}"#,
                "more problems",
            ),
            (
                r#"{"policy":"cp","reporting":-1,"running":0}"#,
                "invalid value",
            ),
        ] {
            let e = PolicySummary::decode(2, text).unwrap_err();
            assert!(e.why.contains(why), "{text}: {e}");
            assert!(
                e.to_string()
                    .starts_with("shard 2: annotation gpu-agent.io/policy-summary is not one"),
                "{e}"
            );
        }
        let huge = format!(
            r#"{{"policy":"cp","reporting":0,"running":0,"x":"{}"}}"#,
            "a".repeat(MAX_TEXT)
        );
        let e = PolicySummary::decode(1, &huge).unwrap_err();
        assert!(e.why.contains("more than 16384"), "{e}");
        assert!(e.text.len() <= 200);
        // Read for a shard: not counted, the error returned once.
        let (part, err) = Part::read(1, "r2", Some("{"), "cp");
        assert_eq!(
            part,
            Part::NotCounted {
                holder: "r2".into()
            }
        );
        assert!(err.is_some());
        // Another ClusterPolicy's summary, or none: not counted, no error.
        let other = summary("old", &[]).encode();
        let (part, err) = Part::read(1, "r2", Some(&other), "cp");
        assert_eq!(
            part,
            Part::NotCounted {
                holder: "r2".into()
            }
        );
        assert!(err.is_none());
        assert_eq!(
            Part::read(1, "r2", None, "cp").0,
            Part::NotCounted {
                holder: "r2".into()
            }
        );
    }

    #[test]
    fn the_shards_merge_into_the_fleets_counts() {
        let policy = PolicyTexts::plain("cp", String::new());
        let mut own = summary("cp", &[("n1", None), ("n3", Some("not running it yet"))]);
        own.ignored.insert("spec.b".into());
        let mut other = summary(
            "cp",
            &[("n2", None), ("n0", Some("not every stage is validated"))],
        );
        other.ignored.insert("spec.a".into());
        let third = summary("cp", &[("n4", None)]);
        let mut parts = BTreeMap::from([
            (0, Part::Counted(own)),
            (1, Part::Counted(other)),
            (2, Part::Counted(third.clone())),
        ]);
        assert_eq!(
            fleet_status(&policy, &parts),
            (
                false,
                "3 of 5 reporting nodes run it (n0: not every stage is validated; n3: not running it yet); keys gpu-agent does not use: spec.a, spec.b".into()
            )
        );
        // A shard nobody holds, and one whose holder has not said.
        parts.insert(3, Part::NoReplica);
        parts.insert(4, Part::NoReplica);
        parts.insert(
            5,
            Part::NotCounted {
                holder: "r2".into(),
            },
        );
        let (ready, message) = fleet_status(&policy, &parts);
        assert!(!ready);
        assert!(
            message.ends_with("; shards 3,4 have no replica; shard 5 (replica r2) not counted yet"),
            "{message}"
        );
        // Every shard counted, every node running it: ready.
        let all = BTreeMap::from([(0, Part::Counted(third.clone())), (1, Part::Counted(third))]);
        assert_eq!(
            fleet_status(&policy, &all),
            (true, "2 of 2 reporting nodes run it".into())
        );
        assert_eq!(
            fleet_status(&policy, &BTreeMap::from([(0, Part::NoReplica)])),
            (
                false,
                "0 of 0 reporting nodes run it; shard 0 has no replica".into()
            )
        );
    }

    #[test]
    fn the_merged_list_is_bounded() {
        let policy = PolicyTexts::plain("cp", String::new());
        let parts: BTreeMap<u32, Part> = (0..4)
            .map(|k| {
                let nodes: Vec<String> = (0..20).map(|i| format!("s{k}-n{i:02}")).collect();
                let list: Vec<(&str, Option<&str>)> =
                    nodes.iter().map(|n| (n.as_str(), Some("x"))).collect();
                (k, Part::Counted(summary("cp", &list)))
            })
            .collect();
        let (_, message) = fleet_status(&policy, &parts);
        assert!(
            message.starts_with("0 of 80 reporting nodes run it (s0-n00: x; "),
            "{message}"
        );
        assert!(message.ends_with("; s1-n04: x; and 70 more)"), "{message}");
    }

    #[test]
    fn the_key_is_a_qualified_name() {
        assert!(crate::model::node::valid_label_key(SUMMARY));
    }
}
