//! A GPU node's labels, conditions and health taint, the part of the Node
//! the controller owns: what it should carry, worked out from its agent's
//! report ([`desired`], [`Desired`]); what the API has of it ([`Observed`],
//! from a watch event or a write's answer); and what the controller knows
//! it wrote ([`Applied`]). Pure: no API calls.

use std::collections::BTreeMap;

use gpu_agent_proto::report::v1 as pb;
use k8s_openapi::api::core::v1::{Node, NodeCondition, Taint};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

/// The field manager of every write (server-side apply and patches).
pub const FIELD_MANAGER: &str = "gpu-controller";
/// The taint put on a node whose GPUs are unhealthy (by policy).
pub const HEALTH_TAINT_KEY: &str = "nvidia.com/gpu.health";
pub const HEALTH_TAINT_VALUE: &str = "unhealthy";
pub const HEALTH_TAINT_EFFECT: &str = "NoSchedule";
/// The MIG state label (mig-parted's protocol).
pub const MIG_STATE_LABEL: &str = "nvidia.com/mig.config.state";
/// NVIDIA's driver upgrade state label.
pub const UPGRADE_STATE_LABEL: &str = "nvidia.com/gpu-driver-upgrade-state";
/// Only labels under this prefix are taken from an agent: an agent must not
/// be able to set `node-role.kubernetes.io/...` or any other label.
pub const LABEL_PREFIX: &str = "nvidia.com/";
/// The annotations of ours a node may carry begin with this.
pub const ANNOTATION_PREFIX: &str = "gpu-agent.io/";
/// A condition's message is cut to this many bytes.
const MAX_MESSAGE: usize = 1024;

/// The node conditions the controller owns, always written.
pub const CONDITIONS: [&str; 4] = [
    "GPUDriverReady",
    "GPUContainerRuntimeReady",
    "GPUDevicePluginReady",
    "GPUHealthy",
];
/// Written while a node is in a driver rollout (and after: `True` once done).
pub const UPGRADE_CONDITION: &str = "GPUDriverUpgraded";
/// Every condition type the controller owns.
pub const ALL_CONDITIONS: [&str; 5] = [
    CONDITIONS[0],
    CONDITIONS[1],
    CONDITIONS[2],
    CONDITIONS[3],
    UPGRADE_CONDITION,
];

/// When the health taint goes on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum TaintPolicy {
    /// Never.
    Never,
    /// When the node has GPUs and none of them is healthy.
    #[default]
    NoneHealthy,
    /// When any GPU is unhealthy.
    AnyUnhealthy,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Condition {
    pub kind: &'static str,
    /// `True`, `False` or `Unknown`.
    pub status: &'static str,
    pub reason: String,
    pub message: String,
}

/// What the node should carry.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Desired {
    pub labels: BTreeMap<String, String>,
    /// Annotations of ours, applied with the labels (sharded: the agent's
    /// word on the driver rollout, `model::upgrade_notes`).
    pub annotations: BTreeMap<String, String>,
    pub conditions: Vec<Condition>,
    pub taint: bool,
    /// The labels (and those annotations) are not known (no agent has
    /// reported since this controller started): they stay as the API has
    /// them.
    pub keep_labels: bool,
    /// Nothing is known of the GPUs' health (the agent is not reporting):
    /// the taint stays as the API has it.
    pub keep_taint: bool,
}

/// A label key Kubernetes takes (`prefix/name`, the name ≤ 63 characters of
/// alphanumerics, `-`, `_`, `.`, starting and ending alphanumeric).
pub fn valid_label_key(key: &str) -> bool {
    let Some((prefix, name)) = key.split_once('/') else {
        return false;
    };
    valid_dns_subdomain(prefix) && valid_label_value(name) && !name.is_empty()
}

fn valid_dns_subdomain(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|part| {
            !part.is_empty()
                && part
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !part.starts_with('-')
                && !part.ends_with('-')
        })
}

/// A label value Kubernetes takes (empty, or ≤ 63 characters of
/// alphanumerics, `-`, `_`, `.`, starting and ending alphanumeric).
pub fn valid_label_value(v: &str) -> bool {
    if v.is_empty() {
        return true;
    }
    v.len() <= 63
        && v.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && v.as_bytes()[0].is_ascii_alphanumeric()
        && v.as_bytes()[v.len() - 1].is_ascii_alphanumeric()
}

pub(crate) fn cut(mut s: String) -> String {
    if s.len() > MAX_MESSAGE {
        let mut at = MAX_MESSAGE;
        while !s.is_char_boundary(at) {
            at -= 1;
        }
        s.truncate(at);
    }
    s
}

fn stage<'a>(r: &'a pb::NodeReport, name: &str) -> Option<&'a pb::Stage> {
    r.stages.as_ref()?.stages.iter().find(|s| s.name == name)
}

/// A condition from the stages that make it up: True when each is done (or
/// turned off by policy) and passed its validation.
fn stages_condition(r: &pb::NodeReport, kind: &'static str, names: &[&str]) -> Condition {
    let mut off = Vec::new();
    for name in names {
        let Some(s) = stage(r, name) else {
            return Condition {
                kind,
                status: "Unknown",
                reason: "NotReported".into(),
                message: format!("the agent did not report its {name} stage"),
            };
        };
        let bad = |reason: &str, message: String| Condition {
            kind,
            status: "False",
            reason: reason.into(),
            message: cut(format!("{name}: {message}")),
        };
        match s.state.as_str() {
            "disabled" => off.push(*name),
            "failed" => return bad("StageFailed", s.detail.clone()),
            "blocked" => return bad("StageBlocked", s.detail.clone()),
            "waiting" => return bad("StageWaiting", s.detail.clone()),
            "not implemented" => return bad("NotImplemented", s.detail.clone()),
            _ => {
                if s.validated == Some(false) {
                    return bad("ValidationFailed", s.validation_message.clone());
                }
                if s.validated.is_none() {
                    return Condition {
                        kind,
                        status: "False",
                        reason: "NotValidated".into(),
                        message: cut(format!("{name}: not validated yet: {}", s.detail)),
                    };
                }
            }
        }
    }
    if off.len() == names.len() {
        return Condition {
            kind,
            status: "True",
            reason: "DisabledByPolicy".into(),
            message: format!("{} turned off by the agent's policy", off.join(", ")),
        };
    }
    let checked: Vec<&str> = names.iter().copied().filter(|n| !off.contains(n)).collect();
    Condition {
        kind,
        status: "True",
        reason: "Validated".into(),
        message: cut(checked
            .iter()
            .filter_map(|n| stage(r, n))
            .map(|s| format!("{}: {}", s.name, s.validation_message))
            .collect::<Vec<_>>()
            .join("; ")),
    }
}

fn health_condition(r: &pb::NodeReport) -> (Condition, usize, usize) {
    let gpus = r.health.as_ref().map(|h| h.gpus.as_slice()).unwrap_or(&[]);
    let unhealthy: Vec<&pb::GpuHealth> = gpus.iter().filter(|g| !g.healthy).collect();
    let cond = if r.health.is_none() {
        Condition {
            kind: "GPUHealthy",
            status: "Unknown",
            reason: "NotReported".into(),
            message: "the agent did not report GPU health".into(),
        }
    } else if unhealthy.is_empty() {
        Condition {
            kind: "GPUHealthy",
            status: "True",
            reason: "AllHealthy".into(),
            message: format!("{} of {} GPUs healthy", gpus.len(), gpus.len()),
        }
    } else {
        let said: Vec<String> = unhealthy
            .iter()
            .map(|g| {
                let mut s = format!("{} on {}", g.reason, g.uuid);
                if !g.advice.is_empty() {
                    s.push_str(&format!(": {}", g.advice));
                }
                s
            })
            .collect();
        Condition {
            kind: "GPUHealthy",
            status: "False",
            reason: "Unhealthy".into(),
            message: cut(format!(
                "{} of {} GPUs unhealthy: {}",
                unhealthy.len(),
                gpus.len(),
                said.join("; ")
            )),
        }
    };
    (cond, gpus.len(), unhealthy.len())
}

/// What the node should carry while its agent reports `r`. Labels that are
/// not under `nvidia.com/` or that Kubernetes would refuse are left out
/// (and named in the returned list).
pub fn desired(r: &pb::NodeReport, taint: TaintPolicy) -> (Desired, Vec<String>) {
    let mut refused = Vec::new();
    let mut labels = BTreeMap::new();
    for (k, v) in r.labels.iter().flat_map(|l| &l.labels) {
        if !k.starts_with(LABEL_PREFIX) {
            refused.push(format!("{k}: not under {LABEL_PREFIX}"));
        } else if !valid_label_key(k) {
            refused.push(format!("{k}: not a valid label key"));
        } else if !valid_label_value(v) {
            refused.push(format!("{k}={v}: not a valid label value"));
        } else {
            labels.insert(k.clone(), v.clone());
        }
    }
    if let Some(m) = &r.mig
        && !m.layout.is_empty()
        && valid_label_value(&m.state)
    {
        labels.insert(MIG_STATE_LABEL.into(), m.state.clone());
    }
    // The labels come as a map in no order.
    refused.sort();
    let (health, gpus, unhealthy) = health_condition(r);
    let conditions = vec![
        stages_condition(r, "GPUDriverReady", &["driver", "devnodes"]),
        stages_condition(r, "GPUContainerRuntimeReady", &["runtime", "cdi"]),
        stages_condition(r, "GPUDevicePluginReady", &["plugin"]),
        health,
    ];
    let taint = match taint {
        TaintPolicy::Never => false,
        TaintPolicy::NoneHealthy => gpus > 0 && unhealthy == gpus,
        TaintPolicy::AnyUnhealthy => unhealthy > 0,
    };
    (
        Desired {
            labels,
            annotations: BTreeMap::new(),
            conditions,
            taint,
            keep_labels: false,
            keep_taint: false,
        },
        refused,
    )
}

/// The conditions while no agent reports (it stopped, or its node lost it):
/// every one `Unknown`, saying so.
pub fn unreported(why: &str) -> Vec<Condition> {
    CONDITIONS
        .iter()
        .map(|kind| Condition {
            kind,
            status: "Unknown",
            reason: "AgentNotReporting".into(),
            message: cut(format!("gpu-agent on this node is not reporting: {why}")),
        })
        .collect()
}

/// A map as [`Applied`] keeps it: equal maps, equal digests (SipHash
/// with fixed keys, within this process; a collision, one in 2^64, would
/// leave a label change unwritten until the next change).
pub type Digest = u64;

pub fn digest(m: &BTreeMap<String, String>) -> Digest {
    use std::hash::{Hash, Hasher};
    let mut h = std::hash::DefaultHasher::new();
    m.hash(&mut h);
    h.finish()
}

/// What the API has for one node, as far as this controller knows.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Applied {
    /// Our labels as last applied, as a [`digest`] (`None`: not applied
    /// since start): they are only held against what is wanted, and the
    /// map itself, kept for every node, was 1.6 KiB a node (16 MiB at
    /// 10,000 nodes, heaptrack in the scale bench).
    pub labels: Option<Digest>,
    /// Our annotations as last applied with them, as a [`digest`].
    pub annotations: Option<Digest>,
    /// Our conditions as the API has them, with their transition times.
    pub conditions: Option<Vec<(Condition, String)>>,
    /// Whether the node carries our taint.
    pub taint: Option<bool>,
    /// The node's `resourceVersion` this is known at (a number, as etcd's
    /// revisions are: an event at or before it says nothing new).
    pub rv: Option<u64>,
    /// The node's uid (another one: the node was deleted and made again).
    pub uid: Option<String>,
}

/// A node as the API has it, as far as the controller cares: its labels,
/// the conditions of the controller's types (with their transition
/// times), whether it carries the health taint.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Observed {
    pub rv: Option<u64>,
    pub uid: Option<String>,
    pub labels: BTreeMap<String, String>,
    /// Its annotations under `gpu-agent.io/` (the driver rollout's).
    pub annotations: BTreeMap<String, String>,
    pub conditions: Vec<(Condition, String)>,
    pub taint: bool,
}

impl Observed {
    pub fn of(
        meta: &ObjectMeta,
        taints: Option<&[Taint]>,
        conditions: Option<&[NodeCondition]>,
    ) -> Self {
        let cs = conditions.unwrap_or_default();
        Observed {
            rv: meta
                .resource_version
                .as_deref()
                .and_then(|v| v.parse().ok()),
            uid: meta.uid.clone(),
            labels: meta.labels.clone().unwrap_or_default(),
            annotations: meta
                .annotations
                .iter()
                .flatten()
                .filter(|(k, _)| k.starts_with(ANNOTATION_PREFIX))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            conditions: ALL_CONDITIONS
                .iter()
                .filter_map(|kind| {
                    let c = cs.iter().find(|c| c.type_ == *kind)?;
                    let status = match c.status.as_str() {
                        "True" => "True",
                        "False" => "False",
                        _ => "Unknown",
                    };
                    Some((
                        Condition {
                            kind,
                            status,
                            reason: c.reason.clone().unwrap_or_default(),
                            message: c.message.clone().unwrap_or_default(),
                        },
                        c.last_transition_time
                            .as_ref()
                            .map(|t| t.0.to_string())
                            .unwrap_or_default(),
                    ))
                })
                .collect(),
            taint: taints
                .unwrap_or_default()
                .iter()
                .any(|t| t.key == HEALTH_TAINT_KEY && t.effect == HEALTH_TAINT_EFFECT),
        }
    }

    pub fn of_node(n: &Node) -> Self {
        Self::of(
            &n.metadata,
            n.spec.as_ref().and_then(|s| s.taints.as_deref()),
            n.status.as_ref().and_then(|s| s.conditions.as_deref()),
        )
    }

    /// Whether the node carries a condition the controller writes from an
    /// agent's report: a GPU node of this controller's.
    pub fn ours(&self) -> bool {
        self.conditions
            .iter()
            .any(|(c, _)| CONDITIONS.contains(&c.kind))
    }
}

/// What a node read from the API carries of ours: the conditions of our
/// types (with their transition times) and the taint. Labels are applied
/// once after a start whatever they are (server-side apply is idempotent).
pub fn read_applied(n: &Node) -> Applied {
    let seen = Observed::of_node(n);
    Applied {
        labels: None,
        annotations: None,
        conditions: Some(seen.conditions),
        taint: Some(seen.taint),
        rv: seen.rv,
        uid: seen.uid,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st(name: &str, state: &str, validated: Option<bool>, msg: &str) -> pb::Stage {
        pb::Stage {
            name: name.into(),
            state: state.into(),
            detail: format!("{name} detail"),
            validated,
            validation_message: msg.into(),
            ..Default::default()
        }
    }

    fn report() -> pb::NodeReport {
        pb::NodeReport {
            stages: Some(pb::Stages {
                stages: vec![
                    st("driver", "disabled", None, ""),
                    st("devnodes", "done", Some(true), "8 nodes"),
                    st("runtime", "done", Some(true), "containerd has nvidia"),
                    st("cdi", "done", Some(true), "spec ok"),
                    st("plugin", "done", Some(true), "registered"),
                ],
                ready: true,
            }),
            labels: Some(pb::Labels {
                labels: [
                    ("nvidia.com/gpu.count", "2"),
                    ("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3"),
                    ("node-role.kubernetes.io/control-plane", ""),
                    ("nvidia.com/bad", "has space"),
                ]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            }),
            health: Some(pb::Health {
                gpus: vec![
                    pb::GpuHealth {
                        uuid: "GPU-a".into(),
                        healthy: true,
                        ..Default::default()
                    },
                    pb::GpuHealth {
                        uuid: "GPU-b".into(),
                        healthy: false,
                        reason: "XID 79".into(),
                        advice: "fallen off the bus; drain and reboot".into(),
                        ..Default::default()
                    },
                ],
            }),
            mig: Some(pb::MigState {
                layout: "all-balanced".into(),
                state: "success".into(),
                detail: String::new(),
            }),
            ..Default::default()
        }
    }

    #[test]
    fn labels_are_only_nvidia_ones_that_kubernetes_takes() {
        let (d, refused) = desired(&report(), TaintPolicy::NoneHealthy);
        assert_eq!(
            d.labels.keys().collect::<Vec<_>>(),
            [
                "nvidia.com/gpu.count",
                "nvidia.com/gpu.product",
                "nvidia.com/mig.config.state"
            ]
        );
        assert_eq!(
            refused,
            [
                "node-role.kubernetes.io/control-plane: not under nvidia.com/",
                "nvidia.com/bad=has space: not a valid label value"
            ]
        );
    }

    #[test]
    fn conditions_say_what_the_stages_say() {
        let (d, _) = desired(&report(), TaintPolicy::NoneHealthy);
        let c: Vec<(&str, &str, &str)> = d
            .conditions
            .iter()
            .map(|c| (c.kind, c.status, c.reason.as_str()))
            .collect();
        assert_eq!(
            c,
            [
                ("GPUDriverReady", "True", "Validated"),
                ("GPUContainerRuntimeReady", "True", "Validated"),
                ("GPUDevicePluginReady", "True", "Validated"),
                ("GPUHealthy", "False", "Unhealthy"),
            ]
        );
        assert_eq!(
            d.conditions[3].message,
            "1 of 2 GPUs unhealthy: XID 79 on GPU-b: fallen off the bus; drain and reboot"
        );
        assert_eq!(d.conditions[0].message, "devnodes: 8 nodes");
        assert!(!d.taint, "one of two GPUs is still healthy");
        assert!(desired(&report(), TaintPolicy::AnyUnhealthy).0.taint);
    }

    #[test]
    fn a_failed_validation_is_false_with_its_words() {
        let mut r = report();
        r.stages.as_mut().unwrap().stages[2] = st(
            "runtime",
            "done",
            Some(false),
            "containerd has no nvidia runtime",
        );
        let (d, _) = desired(&r, TaintPolicy::Never);
        assert_eq!(d.conditions[1].status, "False");
        assert_eq!(d.conditions[1].reason, "ValidationFailed");
        assert_eq!(
            d.conditions[1].message,
            "runtime: containerd has no nvidia runtime"
        );
    }

    #[test]
    fn no_healthy_gpu_taints_by_default() {
        let mut r = report();
        r.health.as_mut().unwrap().gpus[0].healthy = false;
        assert!(desired(&r, TaintPolicy::NoneHealthy).0.taint);
        assert!(!desired(&r, TaintPolicy::Never).0.taint);
    }

    #[test]
    fn label_syntax() {
        assert!(valid_label_key("nvidia.com/gpu.product"));
        assert!(!valid_label_key("nvidia.com/"));
        assert!(!valid_label_key("Nvidia.com/x"));
        assert!(valid_label_value(""));
        assert!(valid_label_value("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb"));
        assert!(!valid_label_value("-x"));
        assert!(!valid_label_value(&"a".repeat(64)));
    }
}
