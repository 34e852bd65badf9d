//! The scripted API server's `resource.k8s.io/v1` ResourceSlices and
//! DeviceClasses (issue 31), as the API server keeps them where the
//! controller depends on it: create (409 when the name is taken), replace
//! at the resourceVersion read (409 when stale, 404 when gone), delete
//! (404 when gone), list and watch by field selector (`spec.driver`,
//! `spec.nodeName`, `metadata.name`) from a resourceVersion, and what the
//! server fills: uid, resourceVersion, a taint's `timeAdded`, empty lists
//! left out (`omitempty`).

use serde_json::{Value, json};

use super::{Body, Inner, MockApi, json_reply, stream_of};

const SLICES: &str = "/apis/resource.k8s.io/v1/resourceslices";
const CLASSES: &str = "/apis/resource.k8s.io/v1/deviceclasses";

/// A slice watch: its field selector, where its events go.
type Watch = (
    Vec<(String, String)>,
    tokio::sync::mpsc::UnboundedSender<Value>,
);

#[derive(Default)]
pub(super) struct Store {
    /// By name.
    slices: std::collections::BTreeMap<String, Value>,
    classes: std::collections::BTreeMap<String, Value>,
    /// Slice watches: their field selector, where events go.
    watches: Vec<Watch>,
    /// Every slice event with the resourceVersion it was made at.
    log: Vec<(u64, Value)>,
}

fn status(code: u16, reason: &str, message: String) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "code": code, "reason": reason, "message": message})
}

fn decode(s: &str) -> String {
    s.replace("%3D", "=")
        .replace("%2C", ",")
        .replace("%2F", "/")
        .replace("%21", "!")
}

/// `a=b,c=d` → pairs (only `=`, what the controller sends).
fn selector(q: Option<&String>) -> Vec<(String, String)> {
    q.map(|s| decode(s))
        .unwrap_or_default()
        .split(',')
        .filter_map(|t| t.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn field<'a>(obj: &'a Value, path: &str) -> &'a Value {
    path.split('.').fold(obj, |v, k| &v[k])
}

fn selected(sel: &[(String, String)], obj: &Value) -> bool {
    sel.iter().all(|(k, v)| {
        assert!(
            ["spec.driver", "spec.nodeName", "metadata.name"].contains(&k.as_str()),
            "resourceslices are not field-selectable by {k}"
        );
        field(obj, k) == v.as_str()
    })
}

/// What the API server fills in a slice it takes.
fn server_side(obj: &mut Value, rv: u64) {
    obj["metadata"]["resourceVersion"] = json!(rv.to_string());
    if obj["metadata"].get("uid").is_none() {
        obj["metadata"]["uid"] = json!(format!("slice-{rv}"));
    }
    let devices = obj["spec"].get_mut("devices").and_then(Value::as_array_mut);
    for d in devices.into_iter().flatten() {
        let taints = d.get_mut("taints").and_then(Value::as_array_mut);
        for t in taints.into_iter().flatten() {
            if t.get("timeAdded").is_none() {
                t["timeAdded"] = json!("2026-01-01T00:00:00Z");
            }
        }
    }
    if obj["spec"]["devices"]
        .as_array()
        .is_some_and(|d| d.is_empty())
    {
        obj["spec"].as_object_mut().unwrap().remove("devices");
    }
}

fn slice_event(store: &mut Store, rv: u64, kind: &str, obj: &Value) {
    let ev = json!({"type": kind, "object": obj});
    store.log.push((rv, ev.clone()));
    store
        .watches
        .retain(|(sel, tx)| !selected(sel, obj) || tx.send(ev.clone()).is_ok());
}

/// Answers a request for ResourceSlices or DeviceClasses (`None`: another
/// path).
pub(super) fn handle(
    i: &mut Inner,
    method: &str,
    path: &str,
    query: &std::collections::BTreeMap<String, String>,
    body: &Value,
) -> Option<hyper::Response<Body>> {
    if let Some(rest) = path.strip_prefix(SLICES) {
        let name = rest.trim_start_matches('/').to_string();
        return Some(slices(i, method, &name, query, body));
    }
    if let Some(rest) = path.strip_prefix(CLASSES) {
        let name = rest.trim_start_matches('/').to_string();
        let (code, answer) = classes(i, method, &name, body);
        return Some(json_reply(code, &answer));
    }
    None
}

fn slices(
    i: &mut Inner,
    method: &str,
    name: &str,
    query: &std::collections::BTreeMap<String, String>,
    body: &Value,
) -> hyper::Response<Body> {
    let sel = selector(query.get("fieldSelector"));
    let (code, answer) = match (method, name.is_empty()) {
        ("GET", true) if query.get("watch").map(String::as_str) == Some("true") => {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Value>();
            let from: u64 = query
                .get("resourceVersion")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            for (rv, ev) in &i.dra.log {
                if *rv > from && selected(&sel, &ev["object"]) {
                    let _ = tx.send(ev.clone());
                }
            }
            if query.get("allowWatchBookmarks").map(String::as_str) == Some("true") {
                let _ = tx.send(json!({"type": "BOOKMARK", "object": {
                    "kind": "ResourceSlice", "apiVersion": "resource.k8s.io/v1",
                    "metadata": {"resourceVersion": i.version.to_string()}}}));
            }
            i.dra.watches.push((sel, tx));
            return stream_of(rx);
        }
        ("GET", true) => {
            let items: Vec<Value> = i
                .dra
                .slices
                .values()
                .filter(|s| selected(&sel, s))
                .cloned()
                .collect();
            (
                200,
                json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSliceList",
                       "metadata": {"resourceVersion": i.version.to_string()}, "items": items}),
            )
        }
        ("GET", false) => match i.dra.slices.get(name) {
            Some(s) => (200, s.clone()),
            None => (404, not_found("resourceslices", name)),
        },
        ("POST", true) => {
            let name = body["metadata"]["name"].as_str().unwrap_or_default();
            if i.dra.slices.contains_key(name) {
                (
                    409,
                    status(
                        409,
                        "AlreadyExists",
                        format!("resourceslices.resource.k8s.io {name:?} already exists"),
                    ),
                )
            } else {
                i.version += 1;
                let mut obj = body.clone();
                server_side(&mut obj, i.version);
                i.dra.slices.insert(name.to_string(), obj.clone());
                let v = i.version;
                slice_event(&mut i.dra, v, "ADDED", &obj);
                (201, obj)
            }
        }
        ("PUT", false) => match i.dra.slices.get(name) {
            None => (404, not_found("resourceslices", name)),
            Some(have)
                if body["metadata"]["resourceVersion"].is_string()
                    && body["metadata"]["resourceVersion"]
                        != have["metadata"]["resourceVersion"] =>
            {
                (
                    409,
                    status(
                        409,
                        "Conflict",
                        format!(
                            "Operation cannot be fulfilled on resourceslices.resource.k8s.io {name:?}: the object has been modified; please apply your changes to the latest version and try again"
                        ),
                    ),
                )
            }
            Some(have) => {
                i.version += 1;
                let mut obj = body.clone();
                obj["metadata"]["uid"] = have["metadata"]["uid"].clone();
                server_side(&mut obj, i.version);
                i.dra.slices.insert(name.to_string(), obj.clone());
                let v = i.version;
                slice_event(&mut i.dra, v, "MODIFIED", &obj);
                (200, obj)
            }
        },
        ("DELETE", false) => match i.dra.slices.remove(name) {
            None => (404, not_found("resourceslices", name)),
            Some(mut obj) => {
                i.version += 1;
                obj["metadata"]["resourceVersion"] = json!(i.version.to_string());
                let v = i.version;
                slice_event(&mut i.dra, v, "DELETED", &obj);
                (200, obj)
            }
        },
        _ => (
            405,
            status(
                405,
                "MethodNotAllowed",
                format!("mock API: {method} resourceslices"),
            ),
        ),
    };
    json_reply(code, &answer)
}

fn not_found(resource: &str, name: &str) -> Value {
    status(
        404,
        "NotFound",
        format!("{resource}.resource.k8s.io {name:?} not found"),
    )
}

fn classes(i: &mut Inner, method: &str, name: &str, body: &Value) -> (u16, Value) {
    match (method, name.is_empty()) {
        ("GET", false) => match i.dra.classes.get(name) {
            Some(c) => (200, c.clone()),
            None => (404, not_found("deviceclasses", name)),
        },
        ("POST", true) => {
            let name = body["metadata"]["name"].as_str().unwrap_or_default();
            if i.dra.classes.contains_key(name) {
                return (
                    409,
                    status(409, "AlreadyExists", format!("{name:?} already exists")),
                );
            }
            i.version += 1;
            let mut obj = body.clone();
            obj["metadata"]["resourceVersion"] = json!(i.version.to_string());
            obj["metadata"]["uid"] = json!(format!("class-{}", i.version));
            i.dra.classes.insert(name.to_string(), obj.clone());
            (201, obj)
        }
        ("PUT", false) => match i.dra.classes.get(name) {
            None => (404, not_found("deviceclasses", name)),
            Some(have)
                if body["metadata"]["resourceVersion"] != have["metadata"]["resourceVersion"] =>
            {
                (
                    409,
                    status(
                        409,
                        "Conflict",
                        format!("{name:?}: the object has been modified"),
                    ),
                )
            }
            Some(_) => {
                i.version += 1;
                let mut obj = body.clone();
                obj["metadata"]["resourceVersion"] = json!(i.version.to_string());
                i.dra.classes.insert(name.to_string(), obj.clone());
                (200, obj)
            }
        },
        _ => (
            405,
            status(
                405,
                "MethodNotAllowed",
                format!("mock API: {method} deviceclasses"),
            ),
        ),
    }
}

impl MockApi {
    /// The ResourceSlices as the API has them now, by name.
    pub fn resource_slices(&self) -> Vec<Value> {
        self.inner
            .lock()
            .unwrap()
            .dra
            .slices
            .values()
            .cloned()
            .collect()
    }

    /// How many ResourceSlices of `node` the API has now.
    pub fn node_slice_count(&self, node: &str) -> usize {
        let i = self.inner.lock().unwrap();
        i.dra
            .slices
            .values()
            .filter(|s| s["spec"]["nodeName"] == node)
            .count()
    }

    /// Deletes every ResourceSlice of `node` as a starting kubelet does;
    /// watches hear. Returns how many.
    pub fn delete_node_slices(&self, node: &str) -> usize {
        let mut i = self.inner.lock().unwrap();
        let names: Vec<String> = i
            .dra
            .slices
            .iter()
            .filter(|(_, s)| s["spec"]["nodeName"] == node)
            .map(|(n, _)| n.clone())
            .collect();
        for name in &names {
            let mut obj = i.dra.slices.remove(name).unwrap();
            i.version += 1;
            obj["metadata"]["resourceVersion"] = json!(i.version.to_string());
            let v = i.version;
            slice_event(&mut i.dra, v, "DELETED", &obj);
        }
        names.len()
    }

    /// A ResourceSlice made by another writer (another driver, NVIDIA's
    /// plugin); watches hear.
    pub fn add_resource_slice(&self, slice: Value) {
        let mut i = self.inner.lock().unwrap();
        i.version += 1;
        let mut obj = slice;
        server_side(&mut obj, i.version);
        let name = obj["metadata"]["name"].as_str().unwrap().to_string();
        i.dra.slices.insert(name, obj.clone());
        let v = i.version;
        slice_event(&mut i.dra, v, "ADDED", &obj);
    }

    /// The DeviceClasses as the API has them now, by name.
    pub fn device_classes(&self) -> Vec<Value> {
        self.inner
            .lock()
            .unwrap()
            .dra
            .classes
            .values()
            .cloned()
            .collect()
    }

    /// A DeviceClass as someone else made it.
    pub fn add_device_class(&self, class: Value) {
        let mut i = self.inner.lock().unwrap();
        i.version += 1;
        let mut obj = class;
        obj["metadata"]["resourceVersion"] = json!(i.version.to_string());
        let name = obj["metadata"]["name"].as_str().unwrap().to_string();
        i.dra.classes.insert(name, obj);
    }
}
