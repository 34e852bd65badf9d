//! A scripted Kubernetes API server for the controller's tests: real HTTP
//! on loopback (so kube-rs's whole client path runs), a few nodes in
//! memory, TokenReview answers from a table, and a record of every request
//! (method, path and query, content type, body) for the tests to assert.
//! It answers the way the API server does where the controller depends on
//! it: server-side apply of labels per field manager, status conditions as
//! a map keyed by type, and 409 on a merge patch whose resourceVersion is
//! stale. It is not the proof that a real API server takes our requests:
//! [`schema`] checks each body against the real 1.36 schemas.
#![allow(dead_code)]

pub mod claims;
mod dra;
pub mod schema;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use serde_json::{Value, json};

#[derive(Clone, Debug)]
pub struct Recorded {
    pub method: String,
    /// Path and query.
    pub uri: String,
    pub content_type: String,
    pub body: Value,
    /// The `Authorization` header (`Bearer <token>`: which client sent it).
    pub bearer: String,
}

#[derive(Default)]
struct Inner {
    requests: Vec<Recorded>,
    nodes: BTreeMap<String, Value>,
    /// Pages of whole-node lists answered.
    node_pages: usize,
    /// Leases by path (`.../namespaces/NS/leases/NAME`).
    leases: BTreeMap<String, Value>,
    /// Label keys each field manager applied, by (node, manager).
    owned: BTreeMap<(String, String), BTreeSet<String>>,
    /// token → (username, node name, audiences)
    tokens: BTreeMap<String, (String, String)>,
    version: u64,
    /// Merge patches to answer with 409 (a write that raced another).
    conflicts: u32,
    /// Don't keep request bodies (the scale benchmark's millions).
    forget_bodies: bool,
    /// An outage: every request is answered 503 (recorded all the same).
    unavailable: bool,
    /// Events (core/v1) by `namespace/name`, as created and merge-patched.
    events: BTreeMap<String, Value>,
    /// Milliseconds from the `nvidia.com/bench.sent-ms` label's value (an
    /// agent's send time) to the label apply that carries it, and from an
    /// Event message's `sent-ms=MS...` word to the Event write carrying it.
    latencies: Vec<u64>,
    /// Those Event words, each with its latency (the scale benchmark).
    marks: Vec<(String, u64)>,
    /// The bearer tokens that wrote each node (its object or status).
    writers: BTreeMap<String, BTreeSet<String>>,
    /// Requests about Leases served so far.
    lease_requests: u64,
    /// The last patch of each node and subresource, and the shortest gap
    /// seen between two of them.
    last_patch: BTreeMap<String, std::time::Instant>,
    min_gap: Option<std::time::Duration>,
    counted: u64,
    /// Node watches: the label key each selects on, and where its events go.
    watches: Vec<(String, tokio::sync::mpsc::UnboundedSender<Value>)>,
    /// Watches of whole nodes, and the last [`NODE_LOG`] node events (with
    /// the resourceVersion each was made at) that a watch started at an
    /// older version is sent first.
    node_watches: Vec<tokio::sync::mpsc::UnboundedSender<Value>>,
    node_log: std::collections::VecDeque<(u64, Value)>,
    /// Whether events were left out of the log (a watch from before the
    /// oldest kept is answered 410 Gone, as etcd's compaction makes it).
    node_log_cut: bool,
    /// ClusterPolicies (nvidia.com/v1), and their watches.
    cluster_policies: BTreeMap<String, Value>,
    cp_watches: Vec<tokio::sync::mpsc::UnboundedSender<Value>>,
    /// ConfigMaps by `namespace/name`, and their watches (namespace, the
    /// name a field selector picks or "" for all, where events go).
    config_maps: BTreeMap<String, Value>,
    cm_watches: Vec<(String, String, tokio::sync::mpsc::UnboundedSender<Value>)>,
    /// Pods by `namespace/name`.
    pods: BTreeMap<String, Value>,
    /// DaemonSets that exist, as `namespace/name`.
    daemonsets: BTreeSet<String>,
    /// Names made from a `generateName` so far.
    generated: u64,
    /// Evictions to refuse with 429 (a disruption budget), per pod.
    pdb_refusals: BTreeMap<String, u32>,
    /// ResourceClaims and their watches (claims.rs).
    claims: claims::Claims,
    /// ResourceSlices and DeviceClasses, and their watches (dra.rs).
    dra: dra::Store,
    /// How long each PATCH of a node waits before it is served (a slow API
    /// server: what writes in turn cost).
    node_patch_delay: Option<std::time::Duration>,
}

fn stream_of(rx: tokio::sync::mpsc::UnboundedReceiver<Value>) -> hyper::Response<Body> {
    let stream = tokio_stream::StreamExt::map(
        tokio_stream::wrappers::UnboundedReceiverStream::new(rx),
        |ev| Ok(hyper::body::Frame::data(Bytes::from(format!("{ev}\n")))),
    );
    hyper::Response::builder()
        .status(200)
        .header("content-type", "application/json")
        .body(StreamBody::new(stream).boxed())
        .unwrap()
}

type Body = BoxBody<Bytes, std::convert::Infallible>;

/// A JSON answer with its status code.
fn json_reply(code: u16, body: &Value) -> hyper::Response<Body> {
    hyper::Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())).boxed())
        .unwrap()
}

fn meta_of(node: &Value) -> Value {
    json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata", "metadata": node["metadata"]})
}

fn has_label(node: &Value, key: &str) -> bool {
    node["metadata"]["labels"].get(key).is_some()
}

/// Node events kept for watches that start behind.
const NODE_LOG: usize = 20_000;

/// Tells the node watches that a node changed (`before`: as it was, `None`
/// for a new one; `kind`: ADDED, MODIFIED or DELETED), as the API server
/// does for every write: whole-node watches get the node; a metadata watch
/// selecting on a label key gets its metadata while the node carries the
/// key (ADDED when it comes to, DELETED when it loses it).
fn node_event(i: &mut Inner, kind: &str, before: Option<&Value>, node: &Value) {
    let rv: u64 = node["metadata"]["resourceVersion"]
        .as_str()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let ev = json!({"type": kind, "object": node});
    if i.node_log.len() == NODE_LOG {
        i.node_log.pop_front();
        i.node_log_cut = true;
    }
    i.node_log.push_back((rv, ev.clone()));
    i.node_watches.retain(|tx| tx.send(ev.clone()).is_ok());
    i.watches.retain(|(sel, tx)| {
        let had = before.is_some_and(|b| has_label(b, sel));
        let now = kind != "DELETED" && has_label(node, sel);
        let kind = match (had, now) {
            (false, true) => "ADDED",
            (true, true) => "MODIFIED",
            (true, false) => "DELETED",
            (false, false) => return !tx.is_closed(),
        };
        tx.send(json!({"type": kind, "object": meta_of(node)}))
            .is_ok()
    });
}

#[derive(Clone)]
pub struct MockApi {
    pub addr: SocketAddr,
    inner: Arc<Mutex<Inner>>,
}

impl MockApi {
    /// Serves on a free loopback port, on the current tokio runtime.
    pub async fn start() -> MockApi {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let api = MockApi {
            addr,
            inner: Arc::default(),
        };
        let served = api.clone();
        tokio::spawn(async move {
            loop {
                let Ok((conn, _)) = listener.accept().await else {
                    return;
                };
                let api = served.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| {
                        let api = api.clone();
                        async move { Ok::<_, std::convert::Infallible>(api.handle(req).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(conn), svc)
                        .await;
                });
            }
        });
        api
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A kube client for it.
    pub fn client(&self) -> kube::Client {
        let config = kube::Config::new(self.url().parse().unwrap());
        kube::Client::try_from(config).unwrap()
    }

    /// A kubeconfig file naming it, for a controller process.
    pub fn kubeconfig(&self, dir: &std::path::Path) -> std::path::PathBuf {
        let path = dir.join("kubeconfig");
        std::fs::write(
            &path,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: mock\n  cluster:\n    server: {}\nusers:\n- name: controller\n  user:\n    token: controller-token\ncontexts:\n- name: mock\n  context:\n    cluster: mock\n    user: controller\ncurrent-context: mock\n",
                self.url()
            ),
        )
        .unwrap();
        path
    }

    /// A node registers (a kubelet creates it): it gets a uid of its own;
    /// node watches hear.
    pub fn add_node(&self, name: &str, node: Value) {
        let mut i = self.inner.lock().unwrap();
        i.version += 1;
        let mut node = node;
        node["metadata"]["name"] = json!(name);
        node["metadata"]["resourceVersion"] = json!(i.version.to_string());
        if node["metadata"].get("uid").is_none() {
            node["metadata"]["uid"] = json!(format!("node-{name}-{}", i.version));
        }
        let before = i.nodes.insert(name.into(), node.clone());
        let kind = if before.is_some() {
            "MODIFIED"
        } else {
            "ADDED"
        };
        node_event(&mut i, kind, before.as_ref(), &node);
    }

    /// A node is deleted (`kubectl delete node`): what every field manager
    /// owned of it goes with it; node watches hear.
    pub fn delete_node(&self, name: &str) {
        let mut i = self.inner.lock().unwrap();
        let Some(mut node) = i.nodes.remove(name) else {
            return;
        };
        i.owned.retain(|(n, _), _| n != name);
        i.version += 1;
        node["metadata"]["resourceVersion"] = json!(i.version.to_string());
        node_event(&mut i, "DELETED", Some(&node.clone()), &node);
    }

    /// Pages of whole-node lists answered so far.
    pub fn node_pages(&self) -> usize {
        self.inner.lock().unwrap().node_pages
    }

    pub fn node(&self, name: &str) -> Value {
        self.inner.lock().unwrap().nodes[name].clone()
    }

    /// Changes a node as another writer would (its resourceVersion moves;
    /// node watches hear).
    pub fn touch_node(&self, name: &str, f: impl FnOnce(&mut Value)) {
        let mut i = self.inner.lock().unwrap();
        i.version += 1;
        let v = i.version.to_string();
        let n = i.nodes.get_mut(name).unwrap();
        let before = n.clone();
        f(n);
        n["metadata"]["resourceVersion"] = json!(v);
        let node = n.clone();
        node_event(&mut i, "MODIFIED", Some(&before), &node);
    }

    /// A pod in `namespace`, as the API server would keep it.
    pub fn add_pod(&self, namespace: &str, name: &str, pod: Value) {
        let mut i = self.inner.lock().unwrap();
        i.version += 1;
        let mut pod = pod;
        pod["metadata"]["name"] = json!(name);
        pod["metadata"]["namespace"] = json!(namespace);
        pod["metadata"]["resourceVersion"] = json!(i.version.to_string());
        i.pods.insert(format!("{namespace}/{name}"), pod);
    }

    /// A pod goes (its owner deleted it).
    pub fn remove_pod(&self, namespace: &str, name: &str) {
        self.inner
            .lock()
            .unwrap()
            .pods
            .remove(&format!("{namespace}/{name}"));
    }

    /// The pods left, as `namespace/name`.
    pub fn pods(&self) -> Vec<String> {
        self.inner.lock().unwrap().pods.keys().cloned().collect()
    }

    /// Every pod, whole.
    pub fn pod_objects(&self) -> Vec<Value> {
        self.inner.lock().unwrap().pods.values().cloned().collect()
    }

    /// A pod's `status.phase` changes (as its kubelet reports).
    pub fn set_pod_phase(&self, namespace: &str, name: &str, phase: &str) {
        let mut i = self.inner.lock().unwrap();
        i.version += 1;
        let v = i.version.to_string();
        if let Some(p) = i.pods.get_mut(&format!("{namespace}/{name}")) {
            p["status"]["phase"] = json!(phase);
            p["metadata"]["resourceVersion"] = json!(v);
        }
    }

    /// A DaemonSet that exists (only its name: deleting it is what is served).
    pub fn add_daemonset(&self, namespace: &str, name: &str) {
        self.inner
            .lock()
            .unwrap()
            .daemonsets
            .insert(format!("{namespace}/{name}"));
    }

    /// The DaemonSets left, as `namespace/name`.
    pub fn daemonsets(&self) -> Vec<String> {
        self.inner
            .lock()
            .unwrap()
            .daemonsets
            .iter()
            .cloned()
            .collect()
    }

    /// The next `n` evictions of the pod are refused as a disruption
    /// budget refuses them (429).
    pub fn refuse_evictions(&self, namespace: &str, name: &str, n: u32) {
        self.inner
            .lock()
            .unwrap()
            .pdb_refusals
            .insert(format!("{namespace}/{name}"), n);
    }

    /// A token the TokenReview accepts, for `username` on `node`.
    pub fn add_token(&self, token: &str, username: &str, node: &str) {
        self.inner
            .lock()
            .unwrap()
            .tokens
            .insert(token.into(), (username.into(), node.into()));
    }

    /// An outage begins (`true`: every request is answered 503 Service
    /// Unavailable, as an API server behind a failing load balancer is) or
    /// ends.
    pub fn set_unavailable(&self, down: bool) {
        self.inner.lock().unwrap().unavailable = down;
    }

    /// The Events (core/v1) as the API has them now, oldest name first.
    pub fn events(&self) -> Vec<Value> {
        self.inner
            .lock()
            .unwrap()
            .events
            .values()
            .cloned()
            .collect()
    }

    /// Keep counts, not request records (for the scale benchmark).
    pub fn forget_bodies(&self) {
        self.inner.lock().unwrap().forget_bodies = true;
    }

    /// Requests served so far.
    pub fn count(&self) -> u64 {
        self.inner.lock().unwrap().counted
    }

    /// The send-to-apply latencies seen (and forgets them), in ms.
    pub fn take_latencies(&self) -> Vec<u64> {
        std::mem::take(&mut self.inner.lock().unwrap().latencies)
    }

    /// The Events' `sent-ms=` words seen, with their latencies in ms (and
    /// forgets them).
    pub fn take_marks(&self) -> Vec<(String, u64)> {
        std::mem::take(&mut self.inner.lock().unwrap().marks)
    }

    /// Which bearer tokens wrote each node.
    pub fn node_writers(&self) -> BTreeMap<String, BTreeSet<String>> {
        self.inner.lock().unwrap().writers.clone()
    }

    /// Requests about Leases served so far.
    pub fn lease_requests(&self) -> u64 {
        self.inner.lock().unwrap().lease_requests
    }

    /// The shortest time between two patches of one node's object.
    pub fn min_gap(&self) -> Option<std::time::Duration> {
        self.inner.lock().unwrap().min_gap
    }

    /// Sets (or removes) a node's label as a user would; node watches hear.
    pub fn set_node_label(&self, name: &str, key: &str, value: Option<&str>) {
        let mut i = self.inner.lock().unwrap();
        i.version += 1;
        let v = i.version.to_string();
        let node = i.nodes.get_mut(name).unwrap();
        let before = node.clone();
        match value {
            Some(val) => node["metadata"]["labels"][key] = json!(val),
            None => {
                if let Some(l) = node["metadata"]["labels"].as_object_mut() {
                    l.remove(key);
                }
            }
        }
        node["metadata"]["resourceVersion"] = json!(v);
        let node = node.clone();
        node_event(&mut i, "MODIFIED", Some(&before), &node);
    }

    /// Creates or changes a ClusterPolicy; watches hear.
    pub fn set_cluster_policy(&self, name: &str, spec: Value) {
        let mut i = self.inner.lock().unwrap();
        i.version += 1;
        let obj = json!({"apiVersion": "nvidia.com/v1", "kind": "ClusterPolicy",
            "metadata": {"name": name, "resourceVersion": i.version.to_string(), "uid": format!("cp-{name}")},
            "spec": spec});
        let kind = if i.cluster_policies.contains_key(name) {
            "MODIFIED"
        } else {
            "ADDED"
        };
        i.cluster_policies.insert(name.into(), obj.clone());
        i.cp_watches
            .retain(|tx| tx.send(json!({"type": kind, "object": obj})).is_ok());
    }

    /// Creates or changes a ConfigMap's `data`; watches hear.
    pub fn set_config_map(&self, namespace: &str, name: &str, data: Value) {
        let mut i = self.inner.lock().unwrap();
        i.version += 1;
        let obj = json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": namespace, "resourceVersion": i.version.to_string(),
                         "uid": format!("cm-{namespace}-{name}")},
            "data": data});
        let key = format!("{namespace}/{name}");
        let kind = if i.config_maps.contains_key(&key) {
            "MODIFIED"
        } else {
            "ADDED"
        };
        i.config_maps.insert(key, obj.clone());
        i.cm_watches.retain(|(ns, sel, tx)| {
            if ns != namespace || (!sel.is_empty() && sel != name) {
                return !tx.is_closed();
            }
            tx.send(json!({"type": kind, "object": obj})).is_ok()
        });
    }

    /// Deletes a ConfigMap; watches hear.
    pub fn delete_config_map(&self, namespace: &str, name: &str) {
        let mut i = self.inner.lock().unwrap();
        i.version += 1;
        let Some(mut obj) = i.config_maps.remove(&format!("{namespace}/{name}")) else {
            return;
        };
        obj["metadata"]["resourceVersion"] = json!(i.version.to_string());
        i.cm_watches.retain(|(ns, sel, tx)| {
            if ns != namespace || (!sel.is_empty() && sel != name) {
                return !tx.is_closed();
            }
            tx.send(json!({"type": "DELETED", "object": obj})).is_ok()
        });
    }

    /// A ClusterPolicy as the API has it now.
    pub fn cluster_policy(&self, name: &str) -> Value {
        self.inner.lock().unwrap().cluster_policies[name].clone()
    }

    /// A Lease as another replica holds it.
    pub fn add_lease(&self, namespace: &str, name: &str, lease: Value) {
        let mut i = self.inner.lock().unwrap();
        i.version += 1;
        let mut l = lease;
        l["metadata"]["resourceVersion"] = json!(i.version.to_string());
        i.leases.insert(
            format!("/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}"),
            l,
        );
    }

    /// The next `n` merge patches meet a conflicting write.
    pub fn conflict_next(&self, n: u32) {
        self.inner.lock().unwrap().conflicts = n;
    }

    /// Each PATCH of a node waits `d` before it is served.
    pub fn delay_node_patches(&self, d: std::time::Duration) {
        self.inner.lock().unwrap().node_patch_delay = Some(d);
    }

    /// The requests so far (and forgets them).
    pub fn take(&self) -> Vec<Recorded> {
        std::mem::take(&mut self.inner.lock().unwrap().requests)
    }

    pub fn requests(&self) -> Vec<Recorded> {
        self.inner.lock().unwrap().requests.clone()
    }

    async fn handle(&self, req: hyper::Request<hyper::body::Incoming>) -> hyper::Response<Body> {
        let method = req.method().to_string();
        let uri = req.uri().to_string();
        let header = |name: &str| {
            req.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string()
        };
        let content_type = header("content-type");
        let accept = header("accept");
        let bearer = header("authorization");
        let bytes = req.into_body().collect().await.unwrap().to_bytes();
        let body: Value = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).unwrap_or_else(|_| {
                // Apply patches may be YAML; ours are JSON (a YAML subset).
                json!({ "unparsed": String::from_utf8_lossy(&bytes) })
            })
        };
        let delay = self.inner.lock().unwrap().node_patch_delay;
        if let Some(d) = delay.filter(|_| method == "PATCH" && uri.starts_with("/api/v1/nodes/")) {
            tokio::time::sleep(d).await;
        }
        let mut i = self.inner.lock().unwrap();
        i.counted += 1;
        let path = uri.split('?').next().unwrap().to_string();
        if method == "PATCH" {
            let now = std::time::Instant::now();
            if let Some(last) = i.last_patch.insert(path.clone(), now) {
                let gap = now - last;
                i.min_gap = Some(i.min_gap.map_or(gap, |g| g.min(gap)));
            }
            if let Some(sent) = body["metadata"]["labels"]["nvidia.com/bench.sent-ms"]
                .as_str()
                .and_then(|v| v.parse::<u64>().ok())
            {
                let now_ms = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_millis() as u64;
                i.latencies.push(now_ms.saturating_sub(sent));
            }
        }
        bench_marks(&mut i, &method, &path, &bearer, &body);
        if !i.forget_bodies {
            i.requests.push(Recorded {
                method: method.clone(),
                uri: uri.clone(),
                content_type: content_type.clone(),
                body: body.clone(),
                bearer: bearer.clone(),
            });
        }
        if i.unavailable {
            return json_reply(
                503,
                &json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "code": 503,
                        "reason": "ServiceUnavailable", "message": "the server is currently unable to handle the request"}),
            );
        }
        let query: BTreeMap<String, String> = uri
            .split_once('?')
            .map(|(_, q)| {
                q.split('&')
                    .filter_map(|kv| kv.split_once('='))
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect()
            })
            .unwrap_or_default();
        if let Some(answer) = dra::handle(&mut i, &method, &path, &query, &body) {
            return answer;
        }
        if let Some(answer) = claims::route(&mut i, &method, &path, &query) {
            return answer;
        }
        if method == "PATCH"
            && path.starts_with("/apis/nvidia.com/v1/clusterpolicies/")
            && path.ends_with("/status")
        {
            let name = path
                .trim_start_matches("/apis/nvidia.com/v1/clusterpolicies/")
                .trim_end_matches("/status")
                .to_string();
            let (code, answer) = match (content_type.as_str(), i.cluster_policies.get_mut(&name)) {
                ("application/merge-patch+json", Some(obj)) => {
                    obj["status"] = body["status"].clone();
                    (200, obj.clone())
                }
                (_, None) => (
                    404,
                    json!({"kind": "Status", "code": 404, "reason": "NotFound"}),
                ),
                _ => (415, json!({"message": "merge patches only"})),
            };
            return json_reply(code, &answer);
        }
        if method == "GET" && path == "/apis/nvidia.com/v1/clusterpolicies" {
            if query.get("watch").map(String::as_str) == Some("true") {
                let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Value>();
                i.cp_watches.push(tx);
                return stream_of(rx);
            }
            let list = json!({"apiVersion": "nvidia.com/v1", "kind": "ClusterPolicyList",
                "metadata": {"resourceVersion": i.version.to_string()},
                "items": i.cluster_policies.values().cloned().collect::<Vec<_>>()});
            return json_reply(200, &list);
        }
        if method == "GET"
            && let Some(rest) = path.strip_prefix("/api/v1/namespaces/")
            && let Some(ns) = rest.strip_suffix("/configmaps")
            && !ns.contains('/')
        {
            // One namespace's ConfigMaps, all or one by name
            // (fieldSelector=metadata.name=NAME): list and watch.
            let sel = query
                .get("fieldSelector")
                .map(|f| f.replace("%3D", "="))
                .and_then(|f| f.strip_prefix("metadata.name=").map(str::to_string))
                .unwrap_or_default();
            if query.get("watch").map(String::as_str) == Some("true") {
                let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Value>();
                i.cm_watches.push((ns.to_string(), sel, tx));
                return stream_of(rx);
            }
            let items: Vec<Value> = i
                .config_maps
                .iter()
                .filter(|(k, _)| {
                    k.split_once('/')
                        .is_some_and(|(n, name)| n == ns && (sel.is_empty() || name == sel))
                })
                .map(|(_, v)| v.clone())
                .collect();
            let list = json!({"apiVersion": "v1", "kind": "ConfigMapList",
                "metadata": {"resourceVersion": i.version.to_string()}, "items": items});
            return json_reply(200, &list);
        }
        if method == "GET" && path == "/api/v1/pods" {
            // Every namespace, by node (fieldSelector) and labels (k=v,...).
            let decode = |s: &str| {
                s.replace("%3D", "=")
                    .replace("%2F", "/")
                    .replace("%2C", ",")
            };
            let node = query
                .get("fieldSelector")
                .map(|f| decode(f))
                .and_then(|f| f.strip_prefix("spec.nodeName=").map(str::to_string));
            let sel = query
                .get("labelSelector")
                .map(|s| decode(s))
                .unwrap_or_default();
            let items: Vec<Value> = i
                .pods
                .values()
                .filter(|p| node.as_deref().is_none_or(|n| p["spec"]["nodeName"] == n))
                .filter(|p| {
                    sel.split(',')
                        .filter(|t| !t.is_empty())
                        .all(|t| match t.split_once('=') {
                            Some((k, v)) => p["metadata"]["labels"][k] == v,
                            None => p["metadata"]["labels"].get(t).is_some(),
                        })
                })
                .cloned()
                .collect();
            let list = json!({"apiVersion": "v1", "kind": "PodList",
                "metadata": {"resourceVersion": i.version.to_string()}, "items": items});
            return json_reply(200, &list);
        }
        if method == "POST"
            && path.ends_with("/eviction")
            && path.starts_with("/api/v1/namespaces/")
        {
            // /api/v1/namespaces/NS/pods/NAME/eviction
            let parts: Vec<&str> = path.split('/').collect();
            let key = format!("{}/{}", parts[4], parts[6]);
            let status = |code: u16, reason: &str, message: String| json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "code": code, "reason": reason, "message": message});
            let (code, answer) = if !i.pods.contains_key(&key) {
                (
                    404,
                    status(404, "NotFound", format!("pods {:?} not found", parts[6])),
                )
            } else if i.pdb_refusals.get(&key).is_some_and(|n| *n > 0) {
                *i.pdb_refusals.get_mut(&key).unwrap() -= 1;
                (
                    429,
                    status(
                        429,
                        "TooManyRequests",
                        "Cannot evict pod as it would violate the pod's disruption budget.".into(),
                    ),
                )
            } else {
                // Evicted: the pod is gone (its grace period is not modelled).
                i.pods.remove(&key);
                (
                    201,
                    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}),
                )
            };
            return json_reply(code, &answer);
        }
        if let Some(rest) = path.strip_prefix("/api/v1/namespaces/")
            && let Some((ns, rest)) = rest.split_once("/pods")
            && (rest.is_empty() || (rest.starts_with('/') && !rest[1..].contains('/')))
        {
            // One namespace's pods: list (by labels), create (generateName
            // too), merge-patch, delete.
            let status = |code: u16, reason: &str, message: String| json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "code": code, "reason": reason, "message": message});
            let name = rest.trim_start_matches('/');
            let key = format!("{ns}/{name}");
            let (code, answer) = match (method.as_str(), name.is_empty()) {
                ("GET", true) => {
                    let sel = query
                        .get("labelSelector")
                        .map(|s| {
                            s.replace("%3D", "=")
                                .replace("%2F", "/")
                                .replace("%2C", ",")
                        })
                        .unwrap_or_default();
                    let items: Vec<Value> = i
                        .pods
                        .iter()
                        .filter(|(k, _)| k.starts_with(&format!("{ns}/")))
                        .map(|(_, p)| p)
                        .filter(|p| {
                            sel.split(',').filter(|t| !t.is_empty()).all(|t| {
                                match t.split_once('=') {
                                    Some((k, v)) => p["metadata"]["labels"][k] == v,
                                    None => p["metadata"]["labels"].get(t).is_some(),
                                }
                            })
                        })
                        .cloned()
                        .collect();
                    (
                        200,
                        json!({"apiVersion": "v1", "kind": "PodList",
                               "metadata": {"resourceVersion": i.version.to_string()}, "items": items}),
                    )
                }
                ("POST", true) => {
                    let mut pod = body.clone();
                    let name = match pod["metadata"]["name"].as_str() {
                        Some(n) => n.to_string(),
                        None => {
                            i.generated += 1;
                            format!(
                                "{}{:05x}",
                                pod["metadata"]["generateName"].as_str().unwrap_or("pod-"),
                                i.generated
                            )
                        }
                    };
                    let key = format!("{ns}/{name}");
                    if i.pods.contains_key(&key) {
                        (
                            409,
                            status(
                                409,
                                "AlreadyExists",
                                format!("pods {name:?} already exists"),
                            ),
                        )
                    } else {
                        i.version += 1;
                        pod["metadata"]["name"] = json!(name);
                        pod["metadata"]["namespace"] = json!(ns);
                        pod["metadata"]["uid"] = json!(format!("uid-{}", i.version));
                        pod["metadata"]["resourceVersion"] = json!(i.version.to_string());
                        pod["status"] = json!({"phase": "Pending"});
                        i.pods.insert(key, pod.clone());
                        (201, pod)
                    }
                }
                ("PATCH", false) if content_type == "application/merge-patch+json" => {
                    if !i.pods.contains_key(&key) {
                        (
                            404,
                            status(404, "NotFound", format!("pods {name:?} not found")),
                        )
                    } else {
                        i.version += 1;
                        let v = i.version.to_string();
                        let p = i.pods.get_mut(&key).unwrap();
                        merge_patch(p, &body);
                        p["metadata"]["resourceVersion"] = json!(v);
                        (200, p.clone())
                    }
                }
                ("DELETE", false) => match i.pods.remove(&key) {
                    Some(p) => (200, p),
                    None => (
                        404,
                        status(404, "NotFound", format!("pods {name:?} not found")),
                    ),
                },
                _ => (
                    405,
                    status(
                        405,
                        "MethodNotAllowed",
                        format!("mock API: {method} {path}"),
                    ),
                ),
            };
            return json_reply(code, &answer);
        }
        if method == "DELETE"
            && let Some(rest) = path.strip_prefix("/apis/apps/v1/namespaces/")
            && let Some((ns, name)) = rest.split_once("/daemonsets/")
        {
            let key = format!("{ns}/{name}");
            let (code, answer) = if i.daemonsets.remove(&key) {
                (
                    200,
                    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 200}),
                )
            } else {
                (
                    404,
                    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "code": 404, "reason": "NotFound",
                           "message": format!("daemonsets.apps {name:?} not found")}),
                )
            };
            return json_reply(code, &answer);
        }
        if method == "GET"
            && path == "/api/v1/nodes"
            && !accept.contains("PartialObjectMetadata")
            && query.get("watch").map(String::as_str) == Some("true")
        {
            // A watch of whole nodes from `resourceVersion`: the events
            // after it first (410 Gone when they are no longer kept), a
            // bookmark when asked for, then every change as it happens.
            // From "0" or none: every node as ADDED, then the changes.
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Value>();
            let from: Option<u64> = query
                .get("resourceVersion")
                .and_then(|v| v.parse().ok())
                .filter(|v| *v > 0);
            match from {
                None => {
                    for n in i.nodes.values() {
                        let _ = tx.send(json!({"type": "ADDED", "object": n}));
                    }
                }
                Some(from) => {
                    let oldest = i.node_log.front().map(|(v, _)| *v);
                    if i.node_log_cut && oldest.is_some_and(|o| from + 1 < o) {
                        let _ = tx.send(json!({"type": "ERROR", "object": {
                            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                            "code": 410, "reason": "Expired",
                            "message": format!("too old resource version: {from} ({})", oldest.unwrap_or(0))}}));
                        return stream_of(rx);
                    }
                    for (_, ev) in i.node_log.iter().filter(|(v, _)| *v > from) {
                        let _ = tx.send(ev.clone());
                    }
                }
            }
            if query.get("allowWatchBookmarks").map(String::as_str) == Some("true") {
                let _ = tx.send(json!({"type": "BOOKMARK", "object": {
                    "kind": "Node", "apiVersion": "v1",
                    "metadata": {"resourceVersion": i.version.to_string()}}}));
            }
            i.node_watches.push(tx);
            return stream_of(rx);
        }
        if method == "GET" && path == "/api/v1/nodes" && !accept.contains("PartialObjectMetadata") {
            // A list of whole nodes, paged by `limit` and `continue` (the
            // token: how many nodes came before, by name).
            let skip: usize = query
                .get("continue")
                .and_then(|c| c.parse().ok())
                .unwrap_or(0);
            let limit: usize = query
                .get("limit")
                .and_then(|l| l.parse().ok())
                .unwrap_or(usize::MAX);
            let items: Vec<Value> = i.nodes.values().skip(skip).take(limit).cloned().collect();
            let mut meta = json!({"resourceVersion": i.version.to_string()});
            if skip + items.len() < i.nodes.len() {
                meta["continue"] = json!((skip + items.len()).to_string());
            }
            i.node_pages += 1;
            let list =
                json!({"apiVersion": "v1", "kind": "NodeList", "metadata": meta, "items": items});
            return json_reply(200, &list);
        }
        if method == "GET" && path == "/api/v1/nodes" {
            // Metadata list and watch, selecting on one label key.
            let sel = query
                .get("labelSelector")
                .map(|s| s.replace("%2F", "/"))
                .unwrap_or_default();
            if query.get("watch").map(String::as_str) == Some("true") {
                let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Value>();
                i.watches.push((sel, tx));
                return stream_of(rx);
            }
            let items: Vec<Value> = i
                .nodes
                .values()
                .filter(|n| sel.is_empty() || has_label(n, &sel))
                .map(meta_of)
                .collect();
            let list = json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadataList",
                              "metadata": {"resourceVersion": i.version.to_string()}, "items": items});
            return json_reply(200, &list);
        }
        let (code, answer) = match (method.as_str(), path.as_str()) {
            ("POST", "/apis/authentication.k8s.io/v1/tokenreviews") => {
                let token = body["spec"]["token"].as_str().unwrap_or("");
                let audiences = body["spec"]["audiences"].clone();
                let status = match i.tokens.get(token) {
                    Some((user, node)) => json!({
                        "authenticated": true,
                        "audiences": audiences,
                        "user": {
                            "username": user,
                            "uid": "u-1",
                            "extra": {
                                "authentication.kubernetes.io/node-name": [node],
                                "authentication.kubernetes.io/pod-name": ["gpu-agent-x"],
                            }
                        }
                    }),
                    None => json!({ "authenticated": false, "error": "invalid bearer token" }),
                };
                let mut r = body.clone();
                r["status"] = status;
                (201, r)
            }
            ("POST", "/api/v1/namespaces/default/events") => {
                // Kept by name (a name taken already is a 409).
                let name = body["metadata"]["name"].as_str().unwrap_or_default();
                let key = format!("default/{name}");
                if i.events.contains_key(&key) {
                    (
                        409,
                        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 409, "reason": "AlreadyExists",
                               "message": format!("events {name:?} already exists")}),
                    )
                } else {
                    i.version += 1;
                    let mut r = body.clone();
                    r["metadata"]["resourceVersion"] = json!(i.version.to_string());
                    i.events.insert(key, r.clone());
                    (201, r)
                }
            }
            ("PATCH", p) if p.starts_with("/api/v1/namespaces/default/events/") => {
                let name = &p["/api/v1/namespaces/default/events/".len()..];
                let key = format!("default/{name}");
                match (content_type.as_str(), i.events.contains_key(&key)) {
                    ("application/merge-patch+json", true) => {
                        i.version += 1;
                        let v = i.version.to_string();
                        let e = i.events.get_mut(&key).unwrap();
                        merge_patch(e, &body);
                        e["metadata"]["resourceVersion"] = json!(v);
                        (200, e.clone())
                    }
                    (_, false) => (
                        404,
                        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404, "reason": "NotFound",
                               "message": format!("events {name:?} not found")}),
                    ),
                    _ => (415, json!({"message": "mock API: merge patches only"})),
                }
            }
            (m, p) if p.starts_with("/apis/coordination.k8s.io/v1/namespaces/") => {
                lease(&mut i, m, p, &query, &body)
            }
            (m, p) if p.starts_with("/api/v1/nodes/") => {
                let rest = &p["/api/v1/nodes/".len()..];
                let (name, sub) = match rest.split_once('/') {
                    Some((n, s)) => (n.to_string(), Some(s.to_string())),
                    None => (rest.to_string(), None),
                };
                if !i.nodes.contains_key(&name) {
                    (404, not_found(&name))
                } else {
                    match m {
                        "GET" => (200, i.nodes[&name].clone()),
                        "PATCH" => {
                            patch(&mut i, &name, sub.as_deref(), &content_type, &query, &body)
                        }
                        _ => (405, json!({})),
                    }
                }
            }
            _ => (
                404,
                json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404, "reason": "NotFound", "message": format!("mock API: no route {method} {path}")}),
            ),
        };
        json_reply(code, &answer)
    }
}

/// What the scale benchmark measures of a request: the bearer of a node
/// write, a Lease request, the latency of an Event whose message carries a
/// `sent-ms=MS...` word (an agent's send time).
fn bench_marks(i: &mut Inner, method: &str, path: &str, bearer: &str, body: &Value) {
    if path.contains("/leases") {
        i.lease_requests += 1;
    }
    if method == "GET" {
        return;
    }
    if let Some(node) = path.strip_prefix("/api/v1/nodes/") {
        let node = node.split('/').next().unwrap_or_default().to_string();
        i.writers
            .entry(node)
            .or_default()
            .insert(bearer.to_string());
    }
    let word = path
        .contains("/events")
        .then(|| body["message"].as_str())
        .flatten()
        .and_then(|m| m.split_whitespace().find(|w| w.starts_with("sent-ms=")));
    if let Some(word) = word {
        let digits: String = word["sent-ms=".len()..]
            .chars()
            .take_while(|c| c.is_ascii_digit())
            .collect();
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        let latency = now_ms.saturating_sub(digits.parse().unwrap_or(now_ms));
        i.latencies.push(latency);
        i.marks.push((word.to_string(), latency));
    }
}

/// Leases as the API server keeps them: create once (409 AlreadyExists),
/// replace only at the resourceVersion read (409 Conflict); a namespace's
/// listed (by labels, `k=v,...`); deleted (at the resourceVersion of the
/// preconditions, if any).
fn lease(
    i: &mut Inner,
    method: &str,
    path: &str,
    query: &BTreeMap<String, String>,
    body: &Value,
) -> (u16, Value) {
    let status = |code: u16, reason: &str, message: String| json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code, "reason": reason, "message": message});
    match method {
        "GET" if path.ends_with("/leases") => {
            let sel = query
                .get("labelSelector")
                .map(|s| {
                    s.replace("%3D", "=")
                        .replace("%2F", "/")
                        .replace("%2C", ",")
                })
                .unwrap_or_default();
            let items: Vec<Value> = i
                .leases
                .iter()
                .filter(|(k, _)| k.strip_prefix(path).is_some_and(|n| n.starts_with('/')))
                .map(|(_, l)| l)
                .filter(|l| {
                    sel.split(',')
                        .filter(|t| !t.is_empty())
                        .all(|t| match t.split_once('=') {
                            Some((k, v)) => l["metadata"]["labels"][k] == v,
                            None => l["metadata"]["labels"].get(t).is_some(),
                        })
                })
                .cloned()
                .collect();
            let list = json!({"apiVersion": "coordination.k8s.io/v1", "kind": "LeaseList",
                "metadata": {"resourceVersion": i.version.to_string()}, "items": items});
            (200, list)
        }
        "DELETE" => {
            let Some(cur) = i.leases.get(path) else {
                return (
                    404,
                    status(404, "NotFound", format!("leases {path:?} not found")),
                );
            };
            let want = &body["preconditions"]["resourceVersion"];
            if !want.is_null() && *want != cur["metadata"]["resourceVersion"] {
                return (409, status(409, "Conflict", "Precondition failed: the resourceVersion in the precondition does not match the object's".into()));
            }
            i.leases.remove(path);
            (
                200,
                json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"}),
            )
        }
        "GET" => match i.leases.get(path) {
            Some(l) => (200, l.clone()),
            None => (
                404,
                status(404, "NotFound", format!("leases {path:?} not found")),
            ),
        },
        "POST" => {
            let name = body["metadata"]["name"].as_str().unwrap_or_default();
            let key = format!("{path}/{name}");
            if i.leases.contains_key(&key) {
                return (
                    409,
                    status(
                        409,
                        "AlreadyExists",
                        format!("leases {name:?} already exists"),
                    ),
                );
            }
            i.version += 1;
            let mut l = body.clone();
            l["metadata"]["resourceVersion"] = json!(i.version.to_string());
            i.leases.insert(key, l.clone());
            (201, l)
        }
        "PUT" => {
            let Some(cur) = i.leases.get(path) else {
                return (
                    404,
                    status(404, "NotFound", format!("leases {path:?} not found")),
                );
            };
            if body["metadata"]["resourceVersion"] != cur["metadata"]["resourceVersion"] {
                return (409, status(409, "Conflict", "the object has been modified; please apply your changes to the latest version and try again".into()));
            }
            i.version += 1;
            let mut l = body.clone();
            l["metadata"]["resourceVersion"] = json!(i.version.to_string());
            i.leases.insert(path.to_string(), l.clone());
            (200, l)
        }
        _ => (405, json!({})),
    }
}

/// A JSON merge patch (RFC 7386): objects merge, null removes, anything
/// else replaces.
fn merge_patch(target: &mut Value, patch: &Value) {
    match (target.as_object_mut(), patch.as_object()) {
        (Some(t), Some(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        _ => *target = patch.clone(),
    }
}

fn not_found(name: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": format!("nodes \"{name}\" not found"), "reason": "NotFound",
           "details": {"name": name, "kind": "nodes"}, "code": 404})
}

fn patch(
    i: &mut Inner,
    name: &str,
    sub: Option<&str>,
    content_type: &str,
    query: &BTreeMap<String, String>,
    body: &Value,
) -> (u16, Value) {
    let manager = query.get("fieldManager").cloned().unwrap_or_default();
    let mut node = i.nodes[name].clone();
    match (content_type, sub) {
        ("application/apply-patch+yaml", None) => {
            if manager.is_empty() {
                return (
                    422,
                    json!({"message": "fieldManager is required for apply"}),
                );
            }
            let new: BTreeMap<String, String> =
                serde_json::from_value(body["metadata"]["labels"].clone()).unwrap_or_default();
            let owner = (name.to_string(), manager.clone());
            let old = i.owned.get(&owner).cloned().unwrap_or_default();
            let labels = node["metadata"]["labels"]
                .as_object_mut()
                .cloned()
                .unwrap_or_default();
            let mut labels = labels;
            for k in old.difference(&new.keys().cloned().collect()) {
                labels.remove(k);
            }
            for (k, v) in &new {
                labels.insert(k.clone(), json!(v));
            }
            node["metadata"]["labels"] = Value::Object(labels);
            i.owned.insert(owner, new.keys().cloned().collect());
            // Annotations of the apply: owned the same way.
            let new: BTreeMap<String, String> =
                serde_json::from_value(body["metadata"]["annotations"].clone()).unwrap_or_default();
            let owner = (name.to_string(), format!("{manager}/annotations"));
            let old = i.owned.get(&owner).cloned().unwrap_or_default();
            let mut notes = node["metadata"]["annotations"]
                .as_object()
                .cloned()
                .unwrap_or_default();
            for k in old.difference(&new.keys().cloned().collect()) {
                notes.remove(k);
            }
            for (k, v) in &new {
                notes.insert(k.clone(), json!(v));
            }
            if !notes.is_empty() || node["metadata"].get("annotations").is_some() {
                node["metadata"]["annotations"] = Value::Object(notes);
            }
            i.owned.insert(owner, new.keys().cloned().collect());
        }
        ("application/apply-patch+yaml", Some("status")) => {
            // A map keyed by type: the manager's types replace theirs; a
            // type it applied before and no longer does is removed.
            let mut conds: Vec<Value> = node["status"]["conditions"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            let applied = body["status"]["conditions"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            let types: BTreeSet<String> = applied
                .iter()
                .filter_map(|c| c["type"].as_str().map(str::to_string))
                .collect();
            let owner = (name.to_string(), format!("{manager}/status"));
            let old = i.owned.get(&owner).cloned().unwrap_or_default();
            conds.retain(|o| {
                let t = o["type"].as_str().unwrap_or_default();
                !old.contains(t) || types.contains(t)
            });
            for c in applied {
                conds.retain(|o| o["type"] != c["type"]);
                conds.push(c);
            }
            node["status"]["conditions"] = Value::Array(conds);
            i.owned.insert(owner, types);
        }
        ("application/merge-patch+json", None) => {
            let want = body["metadata"]["resourceVersion"].as_str();
            let raced = i.conflicts > 0;
            if raced {
                i.conflicts -= 1;
                i.version += 1;
                let v = i.version.to_string();
                let n = i.nodes.get_mut(name).unwrap();
                n["metadata"]["resourceVersion"] = json!(v);
                node = n.clone();
            }
            if want.is_some() && want != node["metadata"]["resourceVersion"].as_str() {
                return (
                    409,
                    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 409, "reason": "Conflict",
                    "message": format!("Operation cannot be fulfilled on nodes \"{name}\": the object has been modified; please apply your changes to the latest version and try again")}),
                );
            }
            if let Some(t) = body["spec"].get("taints") {
                node["spec"]["taints"] = t.clone();
            }
            // Merge patch (RFC 7386): null removes.
            match body["spec"].get("unschedulable") {
                Some(Value::Null) => {
                    if let Some(o) = node["spec"].as_object_mut() {
                        o.remove("unschedulable");
                    }
                }
                Some(v) => node["spec"]["unschedulable"] = v.clone(),
                None => {}
            }
            if let Some(a) = body["metadata"]["annotations"].as_object() {
                for (k, v) in a {
                    if v.is_null() {
                        if let Some(o) = node["metadata"]["annotations"].as_object_mut() {
                            o.remove(k);
                        }
                    } else {
                        node["metadata"]["annotations"][k] = v.clone();
                    }
                }
            }
        }
        _ => {
            return (
                415,
                json!({"message": format!("mock API: {content_type} not handled")}),
            );
        }
    }
    i.version += 1;
    node["metadata"]["resourceVersion"] = json!(i.version.to_string());
    let before = i.nodes.insert(name.into(), node.clone());
    node_event(i, "MODIFIED", before.as_ref(), &node);
    (200, node)
}

/// A node as a kubelet would have made it, with labels and a taint of
/// others.
pub fn kubelet_node() -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "labels": {
                "kubernetes.io/hostname": "gpu-node-1",
                "node.kubernetes.io/instance-type": "p5.48xlarge"
            }
        },
        "spec": {
            "taints": [{"key": "dedicated", "value": "ml", "effect": "NoSchedule"}]
        },
        "status": {
            "conditions": [
                {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet is posting ready status",
                 "lastHeartbeatTime": "2026-11-24T06:00:00Z", "lastTransitionTime": "2026-11-24T06:00:00Z"}
            ]
        }
    })
}

/// A CA, and a serving certificate for localhost signed by it.
pub fn certs(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    use rcgen::{
        BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair,
        KeyUsagePurpose,
    };
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "gpu-controller test CA");
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().unwrap()).unwrap();
    let key = KeyPair::generate().unwrap();
    let leaf = CertificateParams::new(vec!["localhost".to_string()])
        .unwrap()
        .signed_by(&key, &ca)
        .unwrap();
    let (ca_path, cert, key_path) = (dir.join("ca.crt"), dir.join("tls.crt"), dir.join("tls.key"));
    std::fs::write(&ca_path, ca.pem()).unwrap();
    std::fs::write(&cert, leaf.pem()).unwrap();
    std::fs::write(&key_path, key.serialize_pem()).unwrap();
    (ca_path, cert, key_path)
}

pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A copy of the 8x H100 host fixture at `host`.
pub fn h100_host(host: &Path) {
    fixture_host("h100-sxm-8", host)
}

/// A copy of the host fixture `name` (tests/fixtures/hosts/NAME) at `host`.
pub fn fixture_host(name: &str, host: &Path) {
    std::fs::create_dir_all(host).unwrap();
    let ok = Command::new("cp")
        .arg("-a")
        .arg(format!(
            "{}/.",
            repo().join("tests/fixtures/hosts").join(name).display()
        ))
        .arg(host)
        .status()
        .unwrap();
    assert!(
        ok.success(),
        "cannot copy the {name} fixture to {}",
        host.display()
    );
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub struct Proc {
    pub child: Child,
    pub log: PathBuf,
}

impl Proc {
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
    pub fn term(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn wait_for(what: &str, timeout: Duration, logs: &[&Proc], mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        if Instant::now() > deadline {
            let logs: Vec<String> = logs.iter().map(|p| p.log()).collect();
            panic!(
                "timed out waiting for {what}\nlogs:\n{}",
                logs.join("\n----\n")
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One gpu-controller replica of several, named as its pod (`POD_NAME`,
/// in `POD_NAMESPACE` gpu-agent), on `port` with [`certs`]' files in
/// `dir`, `args` added, its log in `dir/<name>.log`; returns once it
/// listens. With `own_token` it talks to `api` with a kubeconfig token of
/// its own, `token-<name>` (the API server records which token sent each
/// request).
pub fn spawn_replica(
    api: &MockApi,
    dir: &Path,
    name: &str,
    port: u16,
    own_token: bool,
    args: &[&str],
) -> Proc {
    let kubeconfig = if own_token {
        let path = dir.join(format!("kubeconfig-{name}"));
        let text = std::fs::read_to_string(api.kubeconfig(dir)).unwrap();
        std::fs::write(
            &path,
            text.replace("controller-token", &format!("token-{name}")),
        )
        .unwrap();
        path
    } else {
        api.kubeconfig(dir)
    };
    let log = dir.join(format!("{name}.log"));
    let proc = Proc {
        child: Command::new(env!("CARGO_BIN_EXE_gpu-controller"))
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .arg("--tls-cert")
            .arg(dir.join("tls.crt"))
            .arg("--tls-key")
            .arg(dir.join("tls.key"))
            .args(args)
            .env("KUBECONFIG", &kubeconfig)
            .env("RUST_LOG", "info")
            // What is wanted of a node reaches its agent at its next
            // check-in: tests do not wait the default 30 s.
            .env("GPU_CONTROLLER_CHECK_IN_INTERVAL", "2")
            .env("POD_NAMESPACE", "gpu-agent")
            .env("POD_NAME", name)
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
        log,
    };
    wait_for(
        &format!("{name} to listen"),
        Duration::from_secs(20),
        &[&proc],
        || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok(),
    );
    proc
}

/// A replica of [`spawn_replica`] with its own token, sharding the nodes
/// over `shards` Leases and advertising `https://localhost:<port>` (the
/// test CA's name) to the agents it redirects; no fleet page.
pub fn sharded_replica(api: &MockApi, dir: &Path, name: &str, port: u16, shards: u32) -> Proc {
    let (shards, advertise) = (shards.to_string(), format!("https://localhost:{port}"));
    spawn_replica(
        api,
        dir,
        name,
        port,
        true,
        &[
            "--agent-grace-seconds",
            "1",
            "--http-listen",
            "off",
            "--shards",
            &shards,
            "--advertise",
            &advertise,
        ],
    )
}

/// gpu-controller on a free loopback port, talking to `api`.
pub fn start_controller(api: &MockApi, dir: &Path, http: Option<u16>) -> (Proc, u16, PathBuf) {
    start_controller_with(api, dir, http, &[])
}

/// The same, with more environment.
pub fn start_controller_with(
    api: &MockApi,
    dir: &Path,
    http: Option<u16>,
    env: &[(&str, &str)],
) -> (Proc, u16, PathBuf) {
    let (ca, cert, key) = certs(dir);
    let port = free_port();
    let log = dir.join("controller.log");
    let controller = Proc {
        child: Command::new(env!("CARGO_BIN_EXE_gpu-controller"))
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .arg("--tls-cert")
            .arg(&cert)
            .arg("--tls-key")
            .arg(&key)
            .args(["--agent-grace-seconds", "1"])
            .args([
                "--http-listen",
                &http
                    .map(|p| format!("127.0.0.1:{p}"))
                    .unwrap_or("off".into()),
            ])
            .env("KUBECONFIG", api.kubeconfig(dir))
            .env("RUST_LOG", "info")
            // What is wanted of a node reaches its agent at its next
            // check-in: tests do not wait the default 30 s.
            .env("GPU_CONTROLLER_CHECK_IN_INTERVAL", "2")
            .envs(env.iter().copied())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
        log,
    };
    // Serving once the port answers.
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "gpu-controller never listened:\n{}",
            controller.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    (controller, port, ca)
}

/// The Python interpreter with grpcio (scripts/test makes the venv;
/// GPU_AGENT_PYTHON names another).
pub fn python() -> PathBuf {
    let py = std::env::var_os("GPU_AGENT_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join("target/pyvenv/bin/python"));
    assert!(
        py.exists(),
        "{} is missing: scripts/test makes it (python3 -m venv target/pyvenv && target/pyvenv/bin/pip install grpcio grpcio-tools)",
        py.display()
    );
    py
}

/// Runs the Python grpcio agent (tests/interop/report_client.py, a client
/// we did not write the stack of) against the controller on `port`, trusting
/// `ca`, reporting for `node`; `args` are the scenario's own (`--token`, ...).
pub fn report_client(port: u16, ca: &Path, node: &str, args: &[&str]) -> std::process::Output {
    std::process::Command::new(python())
        .arg(repo().join("tests/interop/report_client.py"))
        .arg("--proto")
        .arg(repo().join("proto/proto/report_v1.proto"))
        .arg("--ca")
        .arg(ca)
        .args(["--target", &format!("localhost:{port}"), "--node", node])
        .args(args)
        .output()
        .unwrap()
}

/// A stand-in agent (our tonic client, not gpu-agent): Hello, `report` as
/// its snapshot, then `events`; the stream stays open while this lives.
pub struct FakeAgent {
    _tx: tokio::sync::mpsc::Sender<gpu_agent_proto::report::v1::AgentMessage>,
    down: tonic::Streaming<gpu_agent_proto::report::v1::ControllerMessage>,
}

impl FakeAgent {
    /// Returns when the stream ends (the controller closed it, or went).
    pub async fn ended(&mut self) {
        while let Ok(Some(_)) = self.down.message().await {}
    }

    /// Returns when the stream ends: the status it ended with, if any.
    pub async fn end_status(&mut self) -> Option<tonic::Status> {
        loop {
            match self.down.message().await {
                Ok(Some(_)) => {}
                Ok(None) => return None,
                Err(s) => return Some(s),
            }
        }
    }
}

pub async fn fake_agent(
    port: u16,
    ca: &Path,
    token: &str,
    node: &str,
    report: gpu_agent_proto::report::v1::NodeReport,
    events: Vec<gpu_agent_proto::report::v1::HealthEvent>,
) -> Result<FakeAgent, tonic::Status> {
    use gpu_agent_proto::report::v1 as pb;
    let tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(
            std::fs::read(ca).unwrap(),
        ))
        .domain_name("localhost");
    let channel = tonic::transport::Endpoint::from_shared(format!("https://localhost:{port}"))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .map_err(|e| tonic::Status::unavailable(format!("cannot connect: {e}")))?;
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let mut msgs = vec![
        pb::agent_message::Body::Hello(pb::Hello {
            node_name: node.into(),
            agent_version: "0.1.0".into(),
            ..Default::default()
        }),
        pb::agent_message::Body::Snapshot(report),
    ];
    msgs.extend(events.into_iter().map(pb::agent_message::Body::HealthEvent));
    for (n, body) in msgs.into_iter().enumerate() {
        tx.send(pb::AgentMessage {
            seq: n as u64 + 1,
            body: Some(body),
        })
        .await
        .unwrap();
    }
    let mut req = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
    req.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    let down = gpu_agent_proto::report::v1::report_client::ReportClient::new(channel)
        .attach(req)
        .await?
        .into_inner();
    Ok(FakeAgent { _tx: tx, down })
}

/// gpu-agent, built beside gpu-controller by `cargo test --workspace`.
pub fn agent_bin() -> PathBuf {
    let p = Path::new(env!("CARGO_BIN_EXE_gpu-controller")).with_file_name("gpu-agent");
    assert!(
        p.exists(),
        "{} is missing: build it first (cargo build -p gpu-agent, or cargo test --workspace)",
        p.display()
    );
    p
}

/// `gpu-agent --host-root HOST status`'s text.
pub fn agent_status(host: &Path) -> String {
    let out = Command::new(agent_bin())
        .arg("--host-root")
        .arg(host)
        .arg("status")
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `gpu-agent --host-root HOST GLOBAL... run`, reporting to the controller
/// on `port` (trusting `ca`) with the token `token` (written to a file in
/// `dir`) as `node`; its log is `dir/agent-<token>.log`.
#[allow(clippy::too_many_arguments)]
pub fn reporting_agent(
    dir: &Path,
    host: &Path,
    global: &[&std::ffi::OsStr],
    env: &[(&str, &std::ffi::OsStr)],
    port: u16,
    ca: &Path,
    token: &str,
    node: &str,
) -> Proc {
    let token_file = dir.join(format!("{token}.jwt"));
    std::fs::write(&token_file, format!("{token}\n")).unwrap();
    let log = dir.join(format!("agent-{token}.log"));
    let child = Command::new(agent_bin())
        .arg("--host-root")
        .arg(host)
        .args(global)
        .args(["--log-format", "text", "run", "--controller"])
        .arg(format!("https://localhost:{port}"))
        .arg("--controller-ca")
        .arg(ca)
        .arg("--token-file")
        .arg(&token_file)
        .args(["--node-name", node])
        .envs(env.iter().copied())
        .env("DCGM_EXPORTER_LISTEN", "127.0.0.1:0")
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    Proc { child, log }
}

/// The EKS policy (driver and toolkit off): what a simulated node runs.
pub fn eks_policy() -> PathBuf {
    repo().join("tests/fixtures/policies/valid/eks-al2023.yaml")
}

/// Headless Chromium: Debian's, or `GPU_AGENT_CHROMIUM`.
pub fn chromium_path() -> PathBuf {
    let p =
        PathBuf::from(std::env::var_os("GPU_AGENT_CHROMIUM").unwrap_or("/usr/bin/chromium".into()));
    assert!(
        p.exists(),
        "{} is missing: scripts/test installs Debian's chromium (apt-get install chromium)",
        p.display()
    );
    p
}

/// Headless Chromium on `url` with `args` (`--dump-dom`,
/// `--screenshot=FILE`), in a throwaway profile, the window `window`
/// wide and high ("1400,900"), scripts given 5 s of virtual time.
pub fn chromium(args: &[&str], url: &str, window: &str) -> std::process::Output {
    let profile = tempfile::tempdir().unwrap();
    std::process::Command::new(chromium_path())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-quic",
            "--virtual-time-budget=5000",
        ])
        .arg(format!("--window-size={window}"))
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(args)
        .arg(url)
        .output()
        .unwrap()
}
