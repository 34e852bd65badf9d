//! The report messages on the controller's side: a stream of
//! length-delimited `AgentMessage`s decoded as the gRPC layer would, held to
//! the stream's rules (Hello first with seq 1, numbered, a snapshot before
//! changes) and applied to the fleet; what the controller then wants of the
//! node carries only labels Kubernetes takes. Never a panic.
#![no_main]

use gpu_agent_proto::report::v1 as pb;
use gpu_controller::fleet::Fleet;
use gpu_controller::node::{self, TaintPolicy};
use libfuzzer_sys::fuzz_target;
use prost::Message;

fuzz_target!(|data: &[u8]| {
    let Some((&first, mut buf)) = data.split_first() else {
        return;
    };
    let taint = match first % 3 {
        0 => TaintPolicy::Never,
        1 => TaintPolicy::NoneHealthy,
        _ => TaintPolicy::AnyUnhealthy,
    };
    let (fleet, _queue) = Fleet::new(taint, std::time::Duration::from_secs(1));
    let (events, _events_rx) = tokio::sync::mpsc::channel(4);
    let fleet = fleet.with_events(events);
    let (down, _down_rx) = tokio::sync::mpsc::channel(8);
    let mut node: Option<String> = None;
    let mut expect = 1u64;
    let mut snapshot = false;
    while !buf.is_empty() {
        let Ok(msg) = pb::AgentMessage::decode_length_delimited(&mut buf) else {
            break;
        };
        if msg.seq != expect {
            break;
        }
        expect += 1;
        let Some(body) = msg.body else {
            break;
        };
        match (&node, body) {
            (None, pb::agent_message::Body::Hello(h)) => {
                node = Some(h.node_name.clone());
                let _ = fleet.connect(h, down.clone());
            }
            (None, _) | (Some(_), pb::agent_message::Body::Hello(_)) => break,
            (Some(n), body) => {
                match &body {
                    pb::agent_message::Body::Snapshot(_) => snapshot = true,
                    pb::agent_message::Body::Change(_) if !snapshot => break,
                    _ => {}
                }
                fleet.apply(n, body);
            }
        }
    }
    let Some(n) = node else {
        return;
    };
    let desired = fleet.desired(&n);
    for (k, v) in &desired.labels {
        assert!(node::valid_label_key(k), "label key {k:?} would be refused");
        assert!(
            node::valid_label_value(v),
            "label {k}={v:?} would be refused"
        );
    }
    for c in &desired.conditions {
        assert!(
            c.message.len() <= 1024,
            "condition {} message too long",
            c.kind
        );
    }
    let view = fleet.view();
    let _ = serde_json::to_string(&view).expect("the fleet view serialises");
});
