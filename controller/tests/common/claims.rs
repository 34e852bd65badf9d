//! ResourceClaims (`resource.k8s.io/v1`) in the scripted API server: list
//! and watch in every namespace, as the API server answers them (a watch
//! from a resourceVersion gets the changes after it first, or 410 Gone when
//! they are no longer kept), and tests that make, change and delete them.
//! And a fake agent's reading of the `DraClaims` that come down its stream.

use std::collections::BTreeMap;
use std::time::Duration;

use gpu_agent_proto::report::v1 as pb;
use serde_json::{Value, json};
use tokio::sync::mpsc::UnboundedSender;

use super::{Body, FakeAgent, Inner, MockApi, json_reply, stream_of};

/// The claims the server holds.
#[derive(Default)]
pub(super) struct Claims {
    /// By `namespace/name`.
    objects: BTreeMap<String, Value>,
    watches: Vec<UnboundedSender<Value>>,
    /// Every change, with the resourceVersion it was made at.
    log: Vec<(u64, Value)>,
    /// A watch from before this version is answered 410 Gone.
    expired_before: u64,
}

const PATH: &str = "/apis/resource.k8s.io/v1/resourceclaims";

/// Answers a request for the claims of every namespace; `None` for any
/// other request.
pub(super) fn route(
    i: &mut Inner,
    method: &str,
    path: &str,
    query: &BTreeMap<String, String>,
) -> Option<hyper::Response<Body>> {
    if method != "GET" || path != PATH {
        return None;
    }
    let version = i.version;
    let c = &mut i.claims;
    if query.get("watch").map(String::as_str) != Some("true") {
        let list = json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimList",
            "metadata": {"resourceVersion": version.to_string()},
            "items": c.objects.values().cloned().collect::<Vec<_>>()});
        return Some(json_reply(200, &list));
    }
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Value>();
    let from: u64 = query
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    if from < c.expired_before {
        let _ = tx.send(json!({"type": "ERROR", "object": {
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "code": 410, "reason": "Expired",
            "message": format!("too old resource version: {from} ({})", c.expired_before)}}));
        return Some(stream_of(rx));
    }
    for (_, ev) in c.log.iter().filter(|(v, _)| *v > from) {
        let _ = tx.send(ev.clone());
    }
    c.watches.push(tx);
    Some(stream_of(rx))
}

fn key_of(claim: &Value) -> String {
    format!(
        "{}/{}",
        claim["metadata"]["namespace"].as_str().unwrap(),
        claim["metadata"]["name"].as_str().unwrap()
    )
}

fn tell(i: &mut Inner, kind: &str, claim: Value) {
    let ev = json!({"type": kind, "object": claim});
    i.claims.log.push((i.version, ev.clone()));
    i.claims.watches.retain(|tx| tx.send(ev.clone()).is_ok());
}

impl MockApi {
    /// Creates or replaces a ResourceClaim (`metadata.namespace`, `name`
    /// and `uid` set by the caller); watches hear.
    pub fn set_claim(&self, mut claim: Value) {
        let mut i = self.inner.lock().unwrap();
        i.version += 1;
        claim["apiVersion"] = json!("resource.k8s.io/v1");
        claim["kind"] = json!("ResourceClaim");
        claim["metadata"]["resourceVersion"] = json!(i.version.to_string());
        let key = key_of(&claim);
        let kind = if i.claims.objects.contains_key(&key) {
            "MODIFIED"
        } else {
            "ADDED"
        };
        i.claims.objects.insert(key, claim.clone());
        tell(&mut i, kind, claim);
    }

    /// Deletes a ResourceClaim; watches hear.
    pub fn delete_claim(&self, namespace: &str, name: &str) {
        let mut i = self.inner.lock().unwrap();
        let Some(mut claim) = i.claims.objects.remove(&format!("{namespace}/{name}")) else {
            return;
        };
        i.version += 1;
        claim["metadata"]["resourceVersion"] = json!(i.version.to_string());
        tell(&mut i, "DELETED", claim);
    }

    /// Ends every claims watch and forgets the changes made so far, as
    /// etcd's compaction does: a watch from an older version is answered
    /// 410 Gone, and the watcher lists the claims again.
    pub fn expire_claim_watches(&self) {
        let mut i = self.inner.lock().unwrap();
        i.version += 1;
        i.claims.expired_before = i.version;
        i.claims.log.clear();
        i.claims.watches.clear();
    }

    /// Claims watches open now.
    pub fn claim_watches(&self) -> usize {
        let mut i = self.inner.lock().unwrap();
        i.claims.watches.retain(|tx| !tx.is_closed());
        i.claims.watches.len()
    }
}

impl FakeAgent {
    /// The next `DraClaims` down the stream, other messages skipped;
    /// `None` when none comes within `within` or the stream ends.
    pub async fn dra_claims(&mut self, within: Duration) -> Option<pb::DraClaims> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let m = tokio::time::timeout_at(deadline, self.down.message()).await;
            match m {
                Ok(Ok(Some(pb::ControllerMessage {
                    body: Some(pb::controller_message::Body::DraClaims(l)),
                    ..
                }))) => return Some(l),
                Ok(Ok(Some(_))) => {}
                _ => return None,
            }
        }
    }
}

/// A claim in namespace `ml` allocated to `results` on `node` (`None`: not
/// allocated), as the API serves it.
pub fn claim(name: &str, node: Option<&str>, results: Value) -> Value {
    let mut c = json!({
        "metadata": {"namespace": "ml", "name": name, "uid": format!("uid-{name}")},
        "spec": {"devices": {"requests": [
            {"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
    });
    if let Some(node) = node {
        c["status"] = json!({"allocation": {
            "devices": {"results": results},
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [node]}]}]},
        }});
    }
    c
}
