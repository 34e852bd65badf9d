//! Publishes each node's DRA devices as ResourceSlices (issue 31,
//! docs/dra-facts.md §6–7): driver `gpu.nvidia.com`, pool = the node's
//! name, owned by the Node, built by [`crate::model::dra`] from the agent's
//! report and restricted to the GPUs its DRA plugin hands out
//! (`DraState.gpu_uuids`; the others are the device plugin's).
//!
//! - A node's slices are wanted while (and only while) its agent says its
//!   plugin is registered with the kubelet; when it says it is not, or
//!   stops reporting (past the grace), its slices are deleted. A node the
//!   controller has heard nothing of since it started is left as the API
//!   has it (its agent reconnects within seconds).
//! - What the API has comes from a watch of this driver's slices (field
//!   selector `spec.driver=gpu.nvidia.com`) and from the answers to our
//!   writes; nothing is written before the watch has listed them once. A
//!   node is written only when its slices in the API are not the wanted
//!   ones ([`dra::unchanged`]): a report that changes nothing costs no
//!   request. Slices that vanish (a 1.36 kubelet deletes every slice of its
//!   node when it starts) are written again.
//! - A change bumps the pool's generation ([`dra::next_generation`]) on
//!   every slice: the slices of the new generation are updated or created
//!   first, the extra old ones deleted last, so consumers that use only the
//!   highest generation and count its slices never take a mix.
//! - A node is written at most once per [`MIN_INTERVAL`], so a deleter we
//!   do not know of (the kubelet's cleanup after the plugin went) is never
//!   fought in a loop. Only the leader writes; every replica watches.
//! - The DeviceClasses ([`dra::device_classes`]) are made or put back by
//!   each new leader, and left alone when they are as wanted.
//!
//! Only our slices are touched: those named as [`dra::names::slice_name`]
//! names them. Another driver's slices (or another publisher's of this
//! driver) are neither counted nor deleted.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceSlice};
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::watcher::{self, Event};
use tokio::sync::{Semaphore, mpsc, watch};

use crate::error::error_chain;
use crate::fleet::{Fleet, NodeEntry};
use crate::model::dra::{self, DRIVER, NodeDevices};
use crate::model::node::FIELD_MANAGER;

/// A node's slices are written at most this often.
pub const MIN_INTERVAL: Duration = Duration::from_secs(1);
/// A failed write is tried again after this.
const RETRY: Duration = Duration::from_secs(10);
/// The DeviceClasses are tried again after RETRY, twice as long each time
/// up to this (an API server without `resource.k8s.io/v1` is not asked
/// every few seconds).
const CLASSES_RETRY_MAX: Duration = Duration::from_secs(300);
/// A write that met a change under way is looked at again after this (the
/// watch brings what the API has meanwhile).
const RACED: Duration = Duration::from_secs(1);
/// Nodes written at once.
const CONCURRENT: usize = 32;

/// The watch's field selector: this driver's slices only.
pub fn field_selector() -> String {
    format!("spec.driver={DRIVER}")
}

/// A write that failed.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error("node {node}: no such node in the cluster (it owns its ResourceSlices)")]
    NoNode { node: String },
    #[error("node {node}: reading the node (its uid owns its ResourceSlices): {source}")]
    Node {
        node: String,
        #[source]
        source: kube::Error,
    },
    #[error("node {node}: {what} ResourceSlice {slice}: {source}")]
    Slice {
        node: String,
        what: &'static str,
        slice: String,
        #[source]
        source: kube::Error,
    },
    #[error("DeviceClass {class}: {what}: {source}")]
    Class {
        class: String,
        what: &'static str,
        #[source]
        source: kube::Error,
    },
}

impl PublishError {
    /// The slice changed or went since the watch told us (409, 404): not
    /// a failure, the watch brings what is there.
    fn raced(&self) -> bool {
        matches!(self, PublishError::Slice { source: kube::Error::Api(s), .. } if s.code == 409 || s.code == 404)
    }
}

/// What the publisher did (for tests, the bench and, later, metrics).
#[derive(Debug, Default)]
pub struct Stats {
    /// Looks at a node, whether or not they wrote.
    pub looked: AtomicU64,
    /// ResourceSlices created, updated or deleted.
    pub writes: AtomicU64,
    /// DeviceClasses created or updated.
    pub class_writes: AtomicU64,
    /// Writes that failed.
    pub failures: AtomicU64,
}

/// What the fleet says a node's pool should be.
#[derive(Debug)]
enum Want {
    /// Nothing known of the node since this controller started: its slices
    /// stay as the API has them.
    Unknown,
    /// No slices: the agent says its plugin is not registered, or it
    /// stopped reporting.
    Nothing,
    /// The devices DRA hands out, owned by the node with this uid (when
    /// the fleet knows it).
    Devices {
        devices: NodeDevices,
        uid: Option<String>,
    },
}

impl Want {
    fn of(e: &NodeEntry) -> Want {
        if e.gone.is_some() {
            return Want::Nothing;
        }
        if !e.reported {
            return Want::Unknown;
        }
        let Some(dra) = e.report.dra.as_ref().filter(|d| d.registered) else {
            return Want::Nothing;
        };
        let mut devices = NodeDevices::from_report(&e.report);
        devices.gpus.retain(|g| dra.gpu_uuids.contains(&g.uuid));
        Want::Devices {
            devices,
            uid: e.write.applied.as_ref().and_then(|a| a.uid.clone()),
        }
    }
}

/// One node's pool: our slices as the API has them, and the bookkeeping.
#[derive(Debug, Default)]
struct Pool {
    /// By name.
    slices: BTreeMap<String, ResourceSlice>,
    /// The node's uid as read from the API (when the fleet did not know
    /// it); forgotten when a slice of the node is deleted by someone else.
    uid: Option<String>,
    /// A look is under way; `again`: another is wanted after it.
    busy: bool,
    again: bool,
    last_write: Option<Instant>,
    /// The last failure said (said again only when it changes).
    last_error: Option<String>,
}

#[derive(Debug, Default)]
struct Pools {
    /// The watch has listed the slices once: what the API has is known.
    synced: bool,
    /// The slices of a listing under way.
    listing: Option<Vec<ResourceSlice>>,
    by_node: HashMap<String, Pool>,
}

/// The publisher.
#[derive(Debug)]
pub struct Publisher {
    slices: Api<ResourceSlice>,
    classes: Api<DeviceClass>,
    nodes: Api<Node>,
    /// Whether this replica leads: a stand-by writes nothing.
    leader: Option<watch::Receiver<bool>>,
    pools: Mutex<Pools>,
    slots: Arc<Semaphore>,
    pub stats: Stats,
}

/// The node and the name of a slice of ours (`None`: not ours).
fn ours(s: &ResourceSlice) -> Option<(String, String)> {
    let node = s.spec.node_name.as_deref()?;
    let name = s.metadata.name.as_deref()?;
    if s.spec.driver != DRIVER || s.spec.pool.name != node {
        return None;
    }
    let first = dra::names::slice_name(node, 0);
    let prefix = first.strip_suffix('0')?;
    let index = name.strip_prefix(prefix)?;
    (!index.is_empty() && index.bytes().all(|b| b.is_ascii_digit()))
        .then(|| (node.to_string(), name.to_string()))
}

fn rv(s: &ResourceSlice) -> Option<u64> {
    s.metadata.resource_version.as_deref()?.parse().ok()
}

/// Whether `a` is at least as new as `b` (either not known: it may be).
fn not_older(a: &ResourceSlice, b: &ResourceSlice) -> bool {
    match (rv(a), rv(b)) {
        (Some(x), Some(y)) => x >= y,
        _ => true,
    }
}

/// A slice as the API server gives it back: empty lists and maps left out
/// (`omitempty`), so that they compare equal to what we send.
fn normal(mut s: ResourceSlice) -> ResourceSlice {
    fn none_if_empty<T>(v: &mut Option<T>, empty: impl Fn(&T) -> bool) {
        if v.as_ref().is_some_and(empty) {
            *v = None;
        }
    }
    for d in s.spec.devices.iter_mut().flatten() {
        none_if_empty(&mut d.attributes, BTreeMap::is_empty);
        none_if_empty(&mut d.capacity, BTreeMap::is_empty);
        none_if_empty(&mut d.taints, Vec::is_empty);
    }
    none_if_empty(&mut s.spec.devices, Vec::is_empty);
    s
}

fn same(have: &[ResourceSlice], want: &[ResourceSlice]) -> bool {
    let n = |v: &[ResourceSlice]| v.iter().cloned().map(normal).collect::<Vec<_>>();
    dra::unchanged(&n(have), &n(want))
}

impl Publisher {
    pub fn new(client: kube::Client) -> Self {
        Publisher {
            slices: Api::all(client.clone()),
            classes: Api::all(client.clone()),
            nodes: Api::all(client),
            leader: None,
            pools: Mutex::default(),
            slots: Arc::new(Semaphore::new(CONCURRENT)),
            stats: Stats::default(),
        }
    }

    /// Writes only while `leader` says this replica leads.
    pub fn with_leader(mut self, leader: watch::Receiver<bool>) -> Self {
        self.leader = Some(leader);
        self
    }

    /// The watch has listed the slices once and no node is being looked
    /// at (for tests and the bench: what was asked for is done).
    pub fn settled(&self) -> bool {
        let p = self.pools.lock().unwrap();
        p.synced && p.by_node.values().all(|pool| !pool.busy)
    }

    fn standing_by(&self) -> bool {
        self.leader.as_ref().is_some_and(|l| !*l.borrow())
    }

    /// Watches this driver's slices and publishes the nodes the fleet
    /// names (`names`: from [`Fleet::with_dra_slices`]), and keeps the
    /// DeviceClasses while leading, until the fleet is gone.
    pub async fn run(
        self: Arc<Self>,
        fleet: Arc<Fleet>,
        mut names: mpsc::UnboundedReceiver<String>,
    ) {
        tokio::spawn(self.clone().keep_classes());
        let cfg = watcher::Config::default().fields(&field_selector());
        let mut stream = std::pin::pin!(kube::runtime::WatchStreamExt::default_backoff(
            watcher::watcher(self.slices.clone(), cfg)
        ));
        // Whether the watch is failing (said once, when it begins).
        let mut failing = false;
        loop {
            tokio::select! {
                name = names.recv() => match name {
                    Some(node) => self.kick(&fleet, node),
                    None => return,
                },
                ev = stream.next() => match ev {
                    Some(Ok(ev)) => {
                        if failing {
                            tracing::info!("watching the ResourceSlices again");
                        }
                        failing = false;
                        self.seen(&fleet, ev);
                    }
                    Some(Err(e)) => {
                        if !failing {
                            tracing::warn!(error = %error_chain(&e), "cannot watch the ResourceSlices");
                        }
                        failing = true;
                    }
                    None => return,
                },
            }
        }
    }

    /// A watch event: what the API has of a pool changed.
    fn seen(self: &Arc<Self>, fleet: &Arc<Fleet>, ev: Event<ResourceSlice>) {
        let kick: Vec<String> = {
            let mut p = self.pools.lock().unwrap();
            match ev {
                Event::Init => {
                    p.listing = Some(Vec::new());
                    vec![]
                }
                Event::InitApply(s) => {
                    p.listing.get_or_insert_default().push(s);
                    vec![]
                }
                Event::InitDone => {
                    let listed = p.listing.take().unwrap_or_default();
                    let mut nodes: HashSet<String> = p.by_node.keys().cloned().collect();
                    for pool in p.by_node.values_mut() {
                        pool.slices.clear();
                    }
                    let mut count = 0;
                    for s in listed {
                        if let Some((node, name)) = ours(&s) {
                            count += 1;
                            nodes.insert(node.clone());
                            p.by_node.entry(node).or_default().slices.insert(name, s);
                        }
                    }
                    if !p.synced {
                        tracing::info!(slices = count, "ResourceSlices of gpu.nvidia.com listed");
                    }
                    p.synced = true;
                    nodes.extend(fleet.names());
                    nodes.into_iter().collect()
                }
                Event::Apply(s) => match ours(&s) {
                    Some((node, name)) => {
                        let pool = p.by_node.entry(node.clone()).or_default();
                        if pool
                            .slices
                            .get(&name)
                            .is_none_or(|have| not_older(&s, have))
                        {
                            pool.slices.insert(name, s);
                        }
                        vec![node]
                    }
                    None => vec![],
                },
                Event::Delete(s) => match ours(&s) {
                    Some((node, name)) => {
                        let pool = p.by_node.entry(node.clone()).or_default();
                        if pool
                            .slices
                            .get(&name)
                            .is_some_and(|have| not_older(&s, have))
                        {
                            pool.slices.remove(&name);
                            // The node may have been made again.
                            pool.uid = None;
                        }
                        vec![node]
                    }
                    None => vec![],
                },
            }
        };
        for node in kick {
            self.kick(fleet, node);
        }
    }

    /// Looks at the node soon (after the look under way, if any).
    fn kick(self: &Arc<Self>, fleet: &Arc<Fleet>, node: String) {
        // Another replica's shard: its to publish.
        if !fleet.owns(&node) {
            return;
        }
        {
            let mut p = self.pools.lock().unwrap();
            if !p.synced {
                // Every node is looked at once the listing is done.
                return;
            }
            let pool = p.by_node.entry(node.clone()).or_default();
            if pool.busy {
                pool.again = true;
                return;
            }
            pool.busy = true;
        }
        tokio::spawn(self.clone().looks(fleet.clone(), node));
    }

    async fn looks(self: Arc<Self>, fleet: Arc<Fleet>, node: String) {
        let Ok(slot) = self.slots.clone().acquire_owned().await else {
            return;
        };
        loop {
            let retry = self.look(&fleet, &node).await;
            let again = {
                let mut p = self.pools.lock().unwrap();
                let pool = p.by_node.entry(node.clone()).or_default();
                let again = std::mem::take(&mut pool.again);
                if !again {
                    pool.busy = false;
                }
                again
            };
            if again {
                continue;
            }
            drop(slot);
            if let Some(after) = retry {
                let me = self.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(after).await;
                    me.kick(&fleet, node);
                });
            }
            return;
        }
    }

    /// One look at a node: writes what differs. Returns when to look again
    /// (a write failed).
    async fn look(&self, fleet: &Fleet, node: &str) -> Option<Duration> {
        self.stats.looked.fetch_add(1, Ordering::Relaxed);
        loop {
            if self.standing_by() {
                return None;
            }
            let want = fleet.peek(node, Want::of).unwrap_or(Want::Unknown);
            let (have, known_uid, last_write) = {
                let mut p = self.pools.lock().unwrap();
                let pool = p.by_node.entry(node.to_string()).or_default();
                let have: Vec<ResourceSlice> = pool.slices.values().cloned().collect();
                (have, pool.uid.clone(), pool.last_write)
            };
            let (wanted, devices) = match want {
                Want::Unknown => return None,
                Want::Nothing if have.is_empty() => return None,
                Want::Nothing => (vec![], None),
                Want::Devices { devices, uid } => {
                    let uid = match uid.or(known_uid) {
                        Some(u) => u,
                        None => match self.node_uid(node).await {
                            Ok(u) => u,
                            Err(e) => return self.failed(node, e),
                        },
                    };
                    let wanted = dra::slices(node, &uid, &devices, 0);
                    if same(&have, &wanted) {
                        self.clear_error(node);
                        return None;
                    }
                    let generation = dra::next_generation(&have);
                    (dra::slices(node, &uid, &devices, generation), Some(devices))
                }
            };
            if let Some(at) = last_write
                && at.elapsed() < MIN_INTERVAL
            {
                tokio::time::sleep_until((at + MIN_INTERVAL).into()).await;
                // What is wanted and what the API has may have moved.
                continue;
            }
            let count = wanted.len();
            let generation = wanted.first().map(|s| s.spec.pool.generation);
            let result = self.write(node, &have, wanted).await;
            {
                let mut p = self.pools.lock().unwrap();
                p.by_node.entry(node.to_string()).or_default().last_write = Some(Instant::now());
            }
            if let Err(e) = result {
                return self.failed(node, e);
            }
            self.clear_error(node);
            match (devices, generation) {
                (Some(devices), Some(generation)) => {
                    let (devs, left) = dra::devices(&devices);
                    for l in left {
                        tracing::warn!(node, device = %l.device, why = %l.why, "a device left out of the node's ResourceSlices");
                    }
                    tracing::info!(
                        node,
                        generation,
                        slices = count,
                        devices = devs.len(),
                        "ResourceSlices published"
                    );
                }
                _ => tracing::info!(node, slices = have.len(), "ResourceSlices deleted"),
            }
            return None;
        }
    }

    /// The node's uid, read from the API and kept.
    async fn node_uid(&self, node: &str) -> Result<String, PublishError> {
        let n = match self.nodes.get(node).await {
            Ok(n) => n,
            Err(kube::Error::Api(s)) if s.code == 404 => {
                return Err(PublishError::NoNode {
                    node: node.to_string(),
                });
            }
            Err(source) => {
                return Err(PublishError::Node {
                    node: node.to_string(),
                    source,
                });
            }
        };
        let uid = n.metadata.uid.ok_or_else(|| PublishError::NoNode {
            node: node.to_string(),
        })?;
        let mut p = self.pools.lock().unwrap();
        p.by_node.entry(node.to_string()).or_default().uid = Some(uid.clone());
        Ok(uid)
    }

    /// Makes the API's slices of the node `wanted`: the new generation's
    /// updated or created, then the others deleted.
    async fn write(
        &self,
        node: &str,
        have: &[ResourceSlice],
        wanted: Vec<ResourceSlice>,
    ) -> Result<(), PublishError> {
        let err = |what: &'static str, slice: &str| {
            let slice = slice.to_string();
            move |source| PublishError::Slice {
                node: node.to_string(),
                what,
                slice,
                source,
            }
        };
        let pp = PostParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..Default::default()
        };
        let names: HashSet<String> = wanted
            .iter()
            .filter_map(|s| s.metadata.name.clone())
            .collect();
        for mut s in wanted {
            let name = s.metadata.name.clone().unwrap_or_default();
            let old = have
                .iter()
                .find(|h| h.metadata.name.as_deref() == Some(name.as_str()));
            let answer = match old {
                Some(h) => {
                    s.metadata.resource_version = h.metadata.resource_version.clone();
                    self.slices
                        .replace(&name, &pp, &s)
                        .await
                        .map_err(err("updating", &name))?
                }
                None => self
                    .slices
                    .create(&pp, &s)
                    .await
                    .map_err(err("creating", &name))?,
            };
            self.stats.writes.fetch_add(1, Ordering::Relaxed);
            self.keep(node, name, Some(answer));
        }
        for h in have {
            let Some(name) = h.metadata.name.as_deref() else {
                continue;
            };
            if names.contains(name) {
                continue;
            }
            match self.slices.delete(name, &DeleteParams::default()).await {
                Ok(_) => {
                    self.stats.writes.fetch_add(1, Ordering::Relaxed);
                }
                // Gone already (the kubelet's cleanup).
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => return Err(err("deleting", name)(e)),
            }
            self.keep(node, name.to_string(), None);
        }
        Ok(())
    }

    /// What the API answered (`None`: the slice is gone), unless the watch
    /// told of a later version already.
    fn keep(&self, node: &str, name: String, answer: Option<ResourceSlice>) {
        let mut p = self.pools.lock().unwrap();
        let pool = p.by_node.entry(node.to_string()).or_default();
        match answer {
            Some(s) => {
                if pool
                    .slices
                    .get(&name)
                    .is_none_or(|have| not_older(&s, have))
                {
                    pool.slices.insert(name, s);
                }
            }
            None => {
                pool.slices.remove(&name);
            }
        }
    }

    fn failed(&self, node: &str, e: PublishError) -> Option<Duration> {
        if e.raced() {
            tracing::debug!(node, error = %error_chain(&e), "ResourceSlice changed under the write: looked at again");
            return Some(RACED);
        }
        self.stats.failures.fetch_add(1, Ordering::Relaxed);
        let text = error_chain(&e);
        let say = {
            let mut p = self.pools.lock().unwrap();
            let pool = p.by_node.entry(node.to_string()).or_default();
            let say = pool.last_error.as_deref() != Some(text.as_str());
            pool.last_error = Some(text.clone());
            say
        };
        if say {
            tracing::warn!(node, error = %text, "cannot publish the node's ResourceSlices");
        }
        Some(RETRY)
    }

    fn clear_error(&self, node: &str) {
        let mut p = self.pools.lock().unwrap();
        if let Some(pool) = p.by_node.get_mut(node) {
            pool.last_error = None;
        }
    }

    /// Makes the DeviceClasses as wanted each time this replica begins to
    /// lead (tried again until they are).
    async fn keep_classes(self: Arc<Self>) {
        let mut leader = self.leader.clone();
        loop {
            if let Some(l) = leader.as_mut()
                && l.wait_for(|v| *v).await.is_err()
            {
                return;
            }
            let mut said = None;
            let mut pause = RETRY;
            while let Err(e) = self.ensure_classes().await {
                let text = error_chain(&e);
                if said.as_deref() != Some(text.as_str()) {
                    tracing::warn!(error = %text, "cannot write the DeviceClasses");
                    said = Some(text);
                }
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(CLASSES_RETRY_MAX);
                if self.standing_by() {
                    break;
                }
            }
            match leader.as_mut() {
                Some(l) => {
                    if l.wait_for(|v| !*v).await.is_err() {
                        return;
                    }
                }
                None => return,
            }
        }
    }

    /// Creates the DeviceClasses that are missing and puts back those whose
    /// spec differs (their other metadata kept); nothing is written for
    /// those as wanted.
    pub async fn ensure_classes(&self) -> Result<(), PublishError> {
        let pp = PostParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..Default::default()
        };
        for want in dra::device_classes() {
            let class = want.metadata.name.clone().unwrap_or_default();
            let err = |what: &'static str| {
                let class = class.clone();
                move |source| PublishError::Class {
                    class,
                    what,
                    source,
                }
            };
            match self.classes.get_opt(&class).await.map_err(err("reading"))? {
                None => match self.classes.create(&pp, &want).await {
                    Ok(_) => {
                        self.stats.class_writes.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(class, "DeviceClass created");
                    }
                    // Made meanwhile by another replica (sharded, each
                    // makes them as it starts), as this one wants it.
                    Err(kube::Error::Api(s)) if s.code == 409 => {
                        tracing::debug!(class, "DeviceClass made by another replica meanwhile");
                    }
                    Err(e) => return Err(err("creating")(e)),
                },
                Some(have) if same_class(&have, &want) => {}
                Some(mut have) => {
                    have.spec = want.spec;
                    self.classes
                        .replace(&class, &pp, &have)
                        .await
                        .map_err(err("updating"))?;
                    self.stats.class_writes.fetch_add(1, Ordering::Relaxed);
                    tracing::info!(class, "DeviceClass updated");
                }
            }
        }
        Ok(())
    }
}

/// Whether the class has the wanted spec (empty lists as none).
fn same_class(have: &DeviceClass, want: &DeviceClass) -> bool {
    let n = |c: &DeviceClass| {
        let mut s = c.spec.clone();
        if s.config.as_ref().is_some_and(Vec::is_empty) {
            s.config = None;
        }
        if s.selectors.as_ref().is_some_and(Vec::is_empty) {
            s.selectors = None;
        }
        s
    };
    n(have) == n(want)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice(node: &str, name: &str, pool: &str) -> ResourceSlice {
        let mut s = dra::slices(node, "uid-1", &NodeDevices::default(), 1).remove(0);
        s.metadata.name = Some(name.into());
        s.spec.pool.name = pool.into();
        s
    }

    #[test]
    fn only_slices_named_as_ours_are_ours() {
        let n = "node-a";
        let name0 = dra::names::slice_name(n, 0);
        let name12 = dra::names::slice_name(n, 12);
        assert_eq!(
            ours(&slice(n, &name0, n)),
            Some((n.to_string(), name0.clone()))
        );
        assert_eq!(
            ours(&slice(n, &name12, n)),
            Some((n.to_string(), name12.clone()))
        );
        // NVIDIA's driver's names (generateName), another pool, another
        // node's name.
        assert_eq!(ours(&slice(n, "0-gpu.nvidia.com-node-a-x7k2p", n)), None);
        assert_eq!(ours(&slice(n, &name0, "other")), None);
        assert_eq!(
            ours(&slice(n, &dra::names::slice_name("node-b", 0), n)),
            None
        );
        let mut other = slice(n, &name0, n);
        other.spec.driver = "example.com".into();
        assert_eq!(ours(&other), None);
        // A name too long is cut and hashed, and still ours.
        let long = "n".repeat(250);
        let cut = dra::names::slice_name(&long, 3);
        assert!(ours(&slice(&long, &cut, &long)).is_some());
    }

    #[test]
    fn empty_lists_compare_as_left_out() {
        let want = dra::slices("node-a", "uid-1", &NodeDevices::default(), 1);
        assert_eq!(want[0].spec.devices.as_deref(), Some(&[][..]));
        let mut back = want.clone();
        back[0].spec.devices = None;
        back[0].metadata.resource_version = Some("7".into());
        back[0].metadata.uid = Some("s-1".into());
        assert!(same(&back, &want));
        back[0].metadata.owner_references.as_mut().unwrap()[0].uid = "uid-2".into();
        assert!(!same(&back, &want), "another owner: written again");
    }
}
