//! Kubernetes Events for what agents tell as it happens: health events (a
//! `Warning` when a GPU went unhealthy, else `Normal`) and repairs of drift.
//! Events are for people reading `kubectl describe node`, so they are
//! rate-limited per node (a burst of [`BURST`], then one per
//! [`REFILL`]) and the same words for the same node are said once per
//! [`SAME_WITHIN`]; what is held back is counted and logged, never queued
//! without bound.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use gpu_agent_proto::report::v1 as pb;
use k8s_openapi::api::core::v1::Event;
use kube::api::{Api, PostParams};
use serde_json::json;

use crate::node::FIELD_MANAGER;

/// Events one node may cause at once.
pub const BURST: f64 = 5.0;
/// Then one per this long.
pub const REFILL: Duration = Duration::from_secs(60);
/// The same reason and message for the same node is said once per this.
pub const SAME_WITHIN: Duration = Duration::from_secs(600);
/// Events waiting to be written, over all nodes.
pub const QUEUE: usize = 4096;

/// What an agent told that becomes an Event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeEvent {
    pub node: String,
    /// `Normal` or `Warning`.
    pub kind: &'static str,
    pub reason: &'static str,
    pub message: String,
}

impl NodeEvent {
    pub fn health(node: &str, e: &pb::HealthEvent) -> Self {
        let mut message = format!("{} on {}", e.reason, e.gpu_uuid);
        if !e.advice.is_empty() {
            message.push_str(&format!(": {}", e.advice));
        }
        NodeEvent {
            node: node.into(),
            kind: if e.unhealthy { "Warning" } else { "Normal" },
            reason: if e.unhealthy {
                "GPUUnhealthy"
            } else {
                "GPUHealthEvent"
            },
            message,
        }
    }

    pub fn repair(node: &str, r: &pb::Repair) -> Self {
        NodeEvent {
            node: node.into(),
            kind: "Normal",
            reason: "DriftRepaired",
            message: format!("{}: {}", r.stage, r.what),
        }
    }
}

#[derive(Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
    said: HashMap<(&'static str, String), Instant>,
}

/// Decides which events are written.
#[derive(Debug, Default)]
pub struct Limiter {
    nodes: HashMap<String, Bucket>,
    pub held_back: u64,
}

impl Limiter {
    /// Whether `e` may be written at `now` (and takes its token).
    pub fn admit(&mut self, e: &NodeEvent, now: Instant) -> bool {
        let b = self.nodes.entry(e.node.clone()).or_insert(Bucket {
            tokens: BURST,
            at: now,
            said: HashMap::new(),
        });
        b.tokens =
            (b.tokens + now.duration_since(b.at).as_secs_f64() / REFILL.as_secs_f64()).min(BURST);
        b.at = now;
        b.said.retain(|_, t| now.duration_since(*t) < SAME_WITHIN);
        let key = (e.reason, e.message.clone());
        if b.said.contains_key(&key) || b.tokens < 1.0 {
            self.held_back += 1;
            return false;
        }
        b.tokens -= 1.0;
        b.said.insert(key, now);
        true
    }
}

/// Writes events from `rx` as core/v1 Events about the node (in the
/// `default` namespace, with the node's name as its uid, as the kubelet
/// does, so `kubectl describe node` lists them).
pub async fn run(
    client: kube::Client,
    mut rx: tokio::sync::mpsc::Receiver<NodeEvent>,
    written: std::sync::Arc<AtomicU64>,
) {
    let api: Api<Event> = Api::namespaced(client, "default");
    let instance = std::env::var("POD_NAME").unwrap_or_else(|_| FIELD_MANAGER.to_string());
    let mut limiter = Limiter::default();
    let mut seq = 0u64;
    while let Some(e) = rx.recv().await {
        if !limiter.admit(&e, Instant::now()) {
            tracing::debug!(node = %e.node, reason = e.reason, held_back = limiter.held_back, "event held back (rate limit)");
            continue;
        }
        seq += 1;
        let now = jiff::Timestamp::from_second(jiff::Timestamp::now().as_second())
            .map(|t| t.to_string())
            .unwrap_or_default();
        let name = format!(
            "{}.{:x}{:04x}",
            e.node,
            jiff::Timestamp::now().as_nanosecond() as u64,
            seq & 0xffff
        );
        let body = json!({
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": { "name": name, "namespace": "default" },
            "involvedObject": { "apiVersion": "v1", "kind": "Node", "name": e.node, "uid": e.node },
            "type": e.kind,
            "reason": e.reason,
            "message": e.message,
            "source": { "component": FIELD_MANAGER, "host": e.node },
            "reportingComponent": FIELD_MANAGER,
            "reportingInstance": instance,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        });
        let event: Event = match serde_json::from_value(body) {
            Ok(ev) => ev,
            Err(err) => {
                tracing::error!(error = %err, "cannot make an Event");
                continue;
            }
        };
        match api.create(&PostParams::default(), &event).await {
            Ok(_) => {
                written.fetch_add(1, Ordering::Relaxed);
            }
            Err(err) => {
                tracing::warn!(node = %e.node, reason = e.reason, error = %err, "cannot write the Event")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(msg: &str) -> NodeEvent {
        NodeEvent {
            node: "n".into(),
            kind: "Warning",
            reason: "GPUUnhealthy",
            message: msg.into(),
        }
    }

    #[test]
    fn a_burst_then_one_a_minute_and_the_same_words_once() {
        let mut l = Limiter::default();
        let t = Instant::now();
        assert!(l.admit(&ev("a"), t));
        assert!(!l.admit(&ev("a"), t), "the same words again");
        for m in ["b", "c", "d", "e"] {
            assert!(l.admit(&ev(m), t));
        }
        assert!(!l.admit(&ev("f"), t), "the burst is spent");
        assert!(l.admit(&ev("f"), t + REFILL), "one more after a minute");
        assert!(!l.admit(&ev("g"), t + REFILL));
        assert_eq!(l.held_back, 3);
        assert!(
            l.admit(&ev("a"), t + SAME_WITHIN + REFILL),
            "said again later"
        );
    }
}
