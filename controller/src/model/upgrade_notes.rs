//! The driver rollout across sharded replicas (`--shards`), in two node
//! annotations, so the one leader plans it and each node's holder applies
//! it, through the API only:
//!
//! - [`AGENT_UPGRADE`] (`gpu-agent.io/agent-upgrade`), written by the
//!   node's holder with its labels (the same apply): what its agent says of
//!   the rollout ([`AgentFacts`]), on nodes where that matters only (the
//!   agent reports an upgrade state, or the node has a step), not on a
//!   node done whose agent says nothing more (or only that it is done);
//!   absent otherwise.
//! - [`UPGRADE_STEP`] (`gpu-agent.io/upgrade-step`), written by the leader
//!   (a merge patch): the node's step as the leader decided it
//!   ([`encode_step`]; `null`: no upgrade any more). The holder takes it
//!   and writes the label, the condition, the go-ahead and the Event.
//!
//! Both are compact JSON. Pure: no API calls.

use serde::{Deserialize, Serialize};

use crate::model::node::cut;
use crate::model::upgrade_state::{NodeUpgrade, Step};

/// The holder's annotation: what the node's agent says of the rollout.
pub const AGENT_UPGRADE: &str = "gpu-agent.io/agent-upgrade";
/// The leader's annotation: the node's step.
pub const UPGRADE_STEP: &str = "gpu-agent.io/upgrade-step";

/// What the rollout plans from of a node's agent ([`crate::model::upgrade_plan::Seen`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentFacts {
    /// The agent's upgrade state (`upgrade-required`, `upgrade-done`, ...).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub state: String,
    /// The driver version it wants (or upgraded to).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub version: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub detail: String,
    /// The driver it reports loaded.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub driver: String,
    /// Every stage validated.
    #[serde(default)]
    pub ready: bool,
}

/// An annotation of ours that cannot be read.
#[derive(Debug, thiserror::Error)]
#[error("node {node}: annotation {key} is not one a gpu-controller writes ({text:?}): {why}")]
pub struct NoteError {
    pub node: String,
    pub key: &'static str,
    pub text: String,
    pub why: String,
}

impl AgentFacts {
    /// The annotation's value.
    pub fn encode(&self) -> String {
        let mut f = self.clone();
        f.detail = cut(f.detail);
        serde_json::to_string(&f).unwrap_or_default()
    }

    /// Reads the annotation's value of `node`.
    pub fn decode(node: &str, text: &str) -> Result<AgentFacts, NoteError> {
        serde_json::from_str(text).map_err(|e| NoteError {
            node: node.into(),
            key: AGENT_UPGRADE,
            text: short(text),
            why: e.to_string(),
        })
    }
}

/// A step as the leader's annotation carries it.
#[derive(Debug, Serialize, Deserialize)]
struct StepNote {
    step: String,
    #[serde(default)]
    target: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    detail: String,
}

/// The leader's annotation's value for a step (`None`: no upgrade).
pub fn encode_step(up: Option<&NodeUpgrade>) -> String {
    let note = up.map(|u| StepNote {
        step: u.step.label().into(),
        target: u.target.clone(),
        detail: cut(u.detail.clone()),
    });
    serde_json::to_string(&note).unwrap_or_default()
}

/// Reads the leader's annotation of `node` (`Ok(None)`: no upgrade); the
/// step begins now.
pub fn decode_step(node: &str, text: &str) -> Result<Option<NodeUpgrade>, NoteError> {
    let err = |why: String| NoteError {
        node: node.into(),
        key: UPGRADE_STEP,
        text: short(text),
        why,
    };
    let note: Option<StepNote> = serde_json::from_str(text).map_err(|e| err(e.to_string()))?;
    let Some(note) = note else {
        return Ok(None);
    };
    let step = Step::from_label(&note.step)
        .ok_or_else(|| err(format!("no upgrade state is called {:?}", note.step)))?;
    Ok(Some(NodeUpgrade::new(step, &note.target, note.detail)))
}

/// Whether two steps say the same (when each began aside), their details
/// as the annotation carries them (cut: a long one read back is the same).
pub fn same_step(a: Option<&NodeUpgrade>, b: Option<&NodeUpgrade>) -> bool {
    let same_detail = |a: &str, b: &str| a == b || cut(a.to_owned()) == cut(b.to_owned());
    match (a, b) {
        (Some(a), Some(b)) => {
            a.step == b.step && a.target == b.target && same_detail(&a.detail, &b.detail)
        }
        (None, None) => true,
        _ => false,
    }
}

/// A value as an error shows it: its first 200 bytes.
fn short(text: &str) -> String {
    let mut at = text.len().min(200);
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    text[..at].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_keys_are_qualified_names() {
        // Annotation keys follow the label keys' rules (prefix/name).
        assert!(crate::model::node::valid_label_key(AGENT_UPGRADE));
        assert!(crate::model::node::valid_label_key(UPGRADE_STEP));
    }

    #[test]
    fn agent_facts_round_trip_compactly() {
        let f = AgentFacts {
            state: "upgrade-required".into(),
            version: "560.35.03".into(),
            detail: "driver 550.127.08 loaded".into(),
            driver: "550.127.08".into(),
            ready: true,
        };
        let text = f.encode();
        assert_eq!(
            text,
            r#"{"state":"upgrade-required","version":"560.35.03","detail":"driver 550.127.08 loaded","driver":"550.127.08","ready":true}"#
        );
        assert_eq!(AgentFacts::decode("n", &text).unwrap(), f);
        // Empty words are left out, and read back empty.
        let quiet = AgentFacts::default();
        assert_eq!(quiet.encode(), r#"{"ready":false}"#);
        assert_eq!(AgentFacts::decode("n", "{}").unwrap(), quiet);
        // A long detail is cut.
        let long = AgentFacts {
            detail: "x".repeat(5000),
            ..Default::default()
        };
        assert!(long.encode().len() < 1100);
    }

    #[test]
    fn steps_round_trip_and_none_is_null() {
        let up = NodeUpgrade::new(Step::ValidationRequired, "560.35.03", "");
        let text = encode_step(Some(&up));
        assert_eq!(
            text,
            r#"{"step":"validation-required","target":"560.35.03"}"#
        );
        let back = decode_step("n", &text).unwrap().unwrap();
        assert!(same_step(Some(&back), Some(&up)));
        assert_eq!(encode_step(None), "null");
        assert_eq!(decode_step("n", "null").unwrap(), None);
        let failed = NodeUpgrade::new(Step::UpgradeFailed, "560.35.03", "rolled back");
        let back = decode_step("n", &encode_step(Some(&failed))).unwrap();
        assert!(same_step(back.as_ref(), Some(&failed)));
        assert!(!same_step(back.as_ref(), Some(&up)));
        assert!(!same_step(None, Some(&up)));
    }

    #[test]
    fn a_malformed_annotation_is_an_error_naming_the_node() {
        let e = AgentFacts::decode("gpu-node-7", "state=upgrade-required").unwrap_err();
        assert_eq!(e.node, "gpu-node-7");
        assert!(
            e.to_string().starts_with(
                "node gpu-node-7: annotation gpu-agent.io/agent-upgrade is not one a gpu-controller writes (\"state=upgrade-required\"): "
            ),
            "{e}"
        );
        let e = decode_step("gpu-node-7", r#"{"step":"rebooting","target":"1"}"#).unwrap_err();
        assert_eq!(
            e.to_string(),
            "node gpu-node-7: annotation gpu-agent.io/upgrade-step is not one a gpu-controller writes (\"{\\\"step\\\":\\\"rebooting\\\",\\\"target\\\":\\\"1\\\"}\"): no upgrade state is called \"rebooting\""
        );
        assert!(decode_step("n", "").is_err());
        assert!(decode_step("n", "[1,2]").is_err());
        assert!(AgentFacts::decode("n", r#"{"ready":"yes"}"#).is_err());
        // A very long value is shown cut, on a character boundary.
        let e = decode_step("n", &"é".repeat(300)).unwrap_err();
        assert!(e.text.len() <= 200);
    }
}
