//! Kubernetes Events (core/v1, about the node, as the kubelet writes its
//! own) for what agents tell as it happens (health events: a `Warning`
//! when a GPU went unhealthy, else `Normal`; repairs of drift) and for
//! driver upgrades (each step, and the outcome: `DriverUpgradeDone`,
//! `Warning DriverUpgradeFailed`).
//!
//! Events are for people reading `kubectl describe node`, so they are
//! aggregated, as client-go's event correlator does, with `count`,
//! `firstTimestamp` and `lastTimestamp` on one Event object (kubectl shows
//! "(x5 over 3m)"):
//!
//! - the same reason and words for the same node within [`SAME_WITHIN`]
//!   are counted on the Event written first;
//! - the steps of a node's driver upgrade are one Event (`DriverUpgrade`),
//!   its message the latest step, its count the steps so far;
//! - a node may cause [`BURST`] new Events at once, then one per
//!   [`REFILL`]; past that an Event is counted on the latest Event of the
//!   same reason for the node (message "(combined from similar events):
//!   ..."), and only a `Normal` one that has none is held back (counted
//!   and logged).
//!
//! So rate limits never drop a `Warning`, an upgrade's step or its
//! outcome: they are written, or counted on an Event that is. One Event
//! object is written at most once per [`UPDATE_EVERY`]; what happens
//! meanwhile is written together. Nothing waits on the API: the intake only
//! counts, and a writer sends what is due, [`WRITERS`] requests at once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Event;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

use crate::model::node::FIELD_MANAGER;
pub use crate::model::node_event::{NodeEvent, OUTCOMES, STEPS};

/// New Events one node may cause at once.
pub const BURST: f64 = 5.0;
/// Then one per this long.
pub const REFILL: Duration = Duration::from_secs(60);
/// The same reason and words for the same node within this are counted on
/// one Event.
pub const SAME_WITHIN: Duration = Duration::from_secs(600);
/// One Event object is written at most this often.
pub const UPDATE_EVERY: Duration = Duration::from_secs(10);
/// Events waiting to be counted, over all nodes.
pub const QUEUE: usize = 4096;

/// The limits (the constants above; tests make them shorter).
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub burst: f64,
    pub refill: Duration,
    pub same_within: Duration,
    pub update_every: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            burst: BURST,
            refill: REFILL,
            same_within: SAME_WITHIN,
            update_every: UPDATE_EVERY,
        }
    }
}

/// (node, type, reason, words: empty for [`STEPS`]), kept once per Event
/// (its index and the Event share it).
type Key = Arc<(String, &'static str, &'static str, String)>;

/// Events kept for counting at most (over all nodes): past this, the
/// written ones not seen for the longest are forgotten first (client-go's
/// correlator keeps 4,096). A fleet-wide burst on 10,000 nodes is 50,000
/// Events: kept all for [`SAME_WITHIN`], they held 35 MiB.
pub const KEPT: usize = 16_384;

/// One Event object and what it counts (about 100 bytes beside its key:
/// times are seconds, the name is made when written, and the words are
/// the key's unless they changed).
#[derive(Debug)]
struct Series {
    key: Key,
    /// The name's tail (nanoseconds at making, seq): `<node>.<tail>`.
    made: (u64, u16),
    /// Words other than the key's (an upgrade's latest step, a combined
    /// event's).
    message: Option<String>,
    count: i32,
    /// Wall clock seconds of the first and the last time.
    first: i64,
    last: i64,
    /// When it last happened (it is forgotten [`Limits::same_within`] later).
    seen: Instant,
    /// Bumped at each change; `sent` is the one the API has.
    version: u64,
    sent: Option<u64>,
    /// Whether the object exists in the API.
    created: bool,
    /// When a write last went out (or failed).
    wrote: Option<Instant>,
    in_flight: bool,
}

impl Series {
    fn name(&self) -> String {
        format!("{}.{:x}{:04x}", self.key.0, self.made.0, self.made.1)
    }

    fn message(&self) -> &str {
        self.message.as_deref().unwrap_or(&self.key.3)
    }

    /// Nothing left to write.
    fn settled(&self) -> bool {
        !self.in_flight && self.sent == Some(self.version)
    }
}

/// What [`Book::take`] did with an event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Taken {
    /// A new Event.
    New,
    /// Counted on the Event of the same words (or the same upgrade).
    Counted,
    /// Counted on the latest Event of the same reason (no new Event may
    /// be made for the node now).
    Combined,
    /// A `Normal` event past the node's limit with nothing to count it on.
    HeldBack,
}

/// A write the writer is to send.
#[derive(Clone, Debug, PartialEq)]
pub struct Write {
    /// The Event's number in the book (its making order).
    id: u64,
    version: u64,
    pub name: String,
    /// Create (POST) the Event, or merge-patch its count, last time and
    /// message.
    pub create: bool,
    pub body: Value,
}

/// Which Events are written, and what they count.
///
/// Every operation costs the same however many nodes and Events there are
/// (a burst of 50,000 health events over a fleet was quadratic before):
/// each Event is kept once by its number (making order), the Events that
/// wait to be written are a set of numbers in that order (`pending`), the
/// latest Event of each node, type and reason is kept by name (`latest`),
/// and what is old is forgotten at most once a second, at most [`KEPT`]
/// kept.
#[derive(Debug, Default)]
pub struct Book {
    limits: Limits,
    /// Per node: tokens, and when they were counted.
    buckets: HashMap<String, (f64, Instant)>,
    series: HashMap<u64, Series>,
    /// Each Event's number by its key.
    index: HashMap<Key, u64>,
    /// The Events with something to write and no write in flight.
    pending: std::collections::BTreeSet<u64>,
    /// The latest Event of each (node, type, reason).
    latest: HashMap<(String, &'static str, &'static str), u64>,
    /// When old Events were last forgotten.
    forgot: Option<Instant>,
    seq: u64,
    /// `reportingInstance` (the pod's name).
    instance: String,
    pub held_back: u64,
}

fn wall_now() -> i64 {
    jiff::Timestamp::now().as_second()
}

fn wall_text(secs: i64) -> String {
    jiff::Timestamp::from_second(secs)
        .map(|t| t.to_string())
        .unwrap_or_default()
}

impl Book {
    pub fn new(limits: Limits, instance: &str) -> Self {
        Book {
            limits,
            instance: instance.into(),
            ..Default::default()
        }
    }

    /// A new number, and a name tail that no Event had.
    fn made(&mut self) -> (u64, (u64, u16)) {
        self.seq += 1;
        let nanos = jiff::Timestamp::now().as_nanosecond() as u64;
        (self.seq, (nanos, (self.seq & 0xffff) as u16))
    }

    /// Counts `e` at `now`: a new Event, or one more on an Event.
    pub fn take(&mut self, e: NodeEvent, now: Instant) -> Taken {
        self.forget(now);
        let wall = wall_now();
        let steps = STEPS.contains(&e.reason);
        let kept = e.kept();
        let NodeEvent {
            node,
            kind,
            reason,
            message,
        } = e;
        let (words, step_words) = if steps {
            (String::new(), Some(message))
        } else {
            (message, None)
        };
        let key: Key = Arc::new((node, kind, reason, words));
        if let Some(&id) = self.index.get(&key)
            && let Some(s) = self.series.get_mut(&id)
        {
            s.count += 1;
            s.last = wall;
            s.seen = now;
            s.version += 1;
            if step_words.is_some() {
                s.message = step_words;
            }
            if !s.in_flight {
                self.pending.insert(id);
            }
            return Taken::Counted;
        }
        let limits = self.limits;
        let node = &key.0;
        let tokens = match self.buckets.get_mut(node.as_str()) {
            Some(b) => b,
            None => self
                .buckets
                .entry(node.clone())
                .or_insert((limits.burst, now)),
        };
        let (tokens, at) = tokens;
        *tokens = (*tokens + now.duration_since(*at).as_secs_f64() / limits.refill.as_secs_f64())
            .min(limits.burst);
        *at = now;
        let token = *tokens >= 1.0;
        let latest = (node.clone(), kind, reason);
        if token {
            *tokens -= 1.0;
        } else if let Some(&id) = self.latest.get(&latest)
            && let Some(s) = self.series.get_mut(&id)
        {
            s.count += 1;
            s.last = wall;
            s.seen = now;
            s.version += 1;
            let words = step_words.as_deref().unwrap_or(&key.3);
            s.message = Some(format!("(combined from similar events): {words}"));
            if !s.in_flight {
                self.pending.insert(id);
            }
            return Taken::Combined;
        } else if !kept {
            self.held_back += 1;
            return Taken::HeldBack;
        }
        let (id, made) = self.made();
        self.pending.insert(id);
        self.latest.insert(latest, id);
        self.index.insert(key.clone(), id);
        self.series.insert(
            id,
            Series {
                key,
                made,
                message: step_words,
                count: 1,
                first: wall,
                last: wall,
                seen: now,
                version: 1,
                sent: None,
                created: false,
                wrote: None,
                in_flight: false,
            },
        );
        Taken::New
    }

    /// Forgets Events that did not happen for [`Limits::same_within`] and
    /// have nothing left to write (past [`KEPT`], the written ones not seen
    /// for the longest), and full buckets.
    fn forget(&mut self, now: Instant) {
        if self
            .forgot
            .is_some_and(|t| now.duration_since(t) < Duration::from_secs(1))
        {
            return;
        }
        self.forgot = Some(now);
        let within = self.limits.same_within;
        self.series
            .retain(|_, s| !s.settled() || now.duration_since(s.seen) < within);
        if self.series.len() > KEPT {
            let mut old: Vec<(Instant, u64)> = self
                .series
                .iter()
                .filter(|(_, s)| s.settled())
                .map(|(id, s)| (s.seen, *id))
                .collect();
            old.sort_unstable();
            let over = self.series.len() - KEPT;
            for (_, id) in old.into_iter().take(over) {
                self.series.remove(&id);
            }
        }
        let series = &self.series;
        self.index.retain(|_, id| series.contains_key(id));
        self.latest.retain(|_, id| series.contains_key(id));
        let full = self.limits.refill.mul_f64(self.limits.burst);
        let with_events: std::collections::HashSet<&str> =
            self.series.values().map(|s| s.key.0.as_str()).collect();
        self.buckets.retain(|node, (_, at)| {
            now.duration_since(*at) < full || with_events.contains(node.as_str())
        });
        // A burst's tables are given back, not kept at their largest.
        for_shrink(&mut self.series);
        for_shrink(&mut self.index);
        for_shrink(&mut self.latest);
        for_shrink(&mut self.buckets);
    }

    /// When the next write is due (`None`: nothing to write).
    pub fn next_due(&self) -> Option<Instant> {
        self.pending
            .iter()
            .filter_map(|id| self.series.get(id))
            .map(|s| match s.wrote {
                Some(t) => t + self.limits.update_every,
                None => s.seen,
            })
            .min()
    }

    /// The next write due at `now`, taken (in flight until
    /// [`Book::written`]).
    pub fn due(&mut self, now: Instant) -> Option<Write> {
        let every = self.limits.update_every;
        // The first in making order whose last write is old enough (those
        // written within `every` wait; a burst's are all new).
        let id = *self.pending.iter().find(|id| {
            self.series
                .get(*id)
                .is_some_and(|s| s.wrote.is_none_or(|t| now >= t + every))
        })?;
        self.pending.remove(&id);
        let s = self.series.get_mut(&id)?;
        s.in_flight = true;
        let (node, kind, reason, _) = &*s.key;
        let body = if s.created {
            json!({"count": s.count, "lastTimestamp": wall_text(s.last), "message": s.message()})
        } else {
            json!({
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": { "name": s.name(), "namespace": "default" },
                "involvedObject": { "apiVersion": "v1", "kind": "Node", "name": node, "uid": node },
                "type": kind,
                "reason": reason,
                "message": s.message(),
                "source": { "component": FIELD_MANAGER, "host": node },
                "reportingComponent": FIELD_MANAGER,
                "reportingInstance": self.instance,
                "firstTimestamp": wall_text(s.first),
                "lastTimestamp": wall_text(s.last),
                "count": s.count,
            })
        };
        Some(Write {
            id,
            version: s.version,
            name: s.name(),
            create: !s.created,
            body,
        })
    }

    /// What became of a write: `Ok`, `Err(true)` when the Event is gone
    /// from the API (its time to live passed: made again), `Err(false)`
    /// for another failure (tried again later).
    pub fn written(&mut self, w: &Write, outcome: Result<(), bool>, now: Instant) {
        let fresh = (outcome == Err(true)).then(|| self.made().1);
        let Some(s) = self.series.get_mut(&w.id) else {
            return;
        };
        s.in_flight = false;
        match outcome {
            Ok(()) => {
                s.created = true;
                s.sent = Some(w.version);
                s.wrote = Some(now);
            }
            Err(_) => {
                if let Some(made) = fresh {
                    s.created = false;
                    s.made = made;
                } else {
                    s.wrote = Some(now);
                }
            }
        }
        if s.sent != Some(s.version) {
            self.pending.insert(w.id);
        }
    }
}

/// Gives a table's room back once it holds under a quarter of it.
fn for_shrink<K: std::hash::Hash + Eq, V>(m: &mut HashMap<K, V>) {
    if m.capacity() > 64 && m.len() < m.capacity() / 4 {
        m.shrink_to_fit();
    }
}

/// Event writes in flight at once: a burst over a large fleet is written
/// in seconds, not one round trip at a time.
pub const WRITERS: usize = 16;

/// One write: `Ok`, `Err(true)` when the Event is gone from the API,
/// `Err(false)` for another failure.
async fn write(api: &Api<Event>, w: &Write) -> Result<(), bool> {
    let outcome = if w.create {
        let event: Result<Event, _> = serde_json::from_value(w.body.clone());
        match event {
            Ok(ev) => api.create(&PostParams::default(), &ev).await.map(|_| ()),
            Err(err) => {
                tracing::error!(error = %err, "cannot make an Event");
                Ok(())
            }
        }
    } else {
        api.patch(&w.name, &PatchParams::default(), &Patch::Merge(&w.body))
            .await
            .map(|_| ())
    };
    match outcome {
        Ok(()) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 && !w.create => Err(true),
        Err(err) => {
            tracing::warn!(event = %w.name, error = %crate::error::error_chain(&err), "cannot write the Event");
            Err(false)
        }
    }
}

/// Writes events from `rx` as core/v1 Events about the node (in the
/// `default` namespace, with the node's name as its uid, as the kubelet
/// does, so `kubectl describe node` lists them), by the default limits.
pub async fn run(
    client: kube::Client,
    rx: tokio::sync::mpsc::Receiver<NodeEvent>,
    written: Arc<AtomicU64>,
) {
    run_with(client, rx, written, Limits::default()).await
}

/// The same, by `limits`. Returns when `rx` closes.
pub async fn run_with(
    client: kube::Client,
    mut rx: tokio::sync::mpsc::Receiver<NodeEvent>,
    written: Arc<AtomicU64>,
    limits: Limits,
) {
    let api: Api<Event> = Api::namespaced(client, "default");
    let instance = std::env::var("POD_NAME").unwrap_or_else(|_| FIELD_MANAGER.to_string());
    let book = Arc::new(Mutex::new(Book::new(limits, &instance)));
    let wake = Arc::new(tokio::sync::Notify::new());
    let intake = {
        let (book, wake) = (book.clone(), wake.clone());
        async move {
            while let Some(e) = rx.recv().await {
                let (node, reason) = (e.node.clone(), e.reason);
                let mut b = book.lock().unwrap();
                if b.take(e, Instant::now()) == Taken::HeldBack {
                    tracing::debug!(node = %node, reason, held_back = b.held_back, "event held back (rate limit)");
                }
                drop(b);
                wake.notify_one();
            }
        }
    };
    let api = Arc::new(api);
    let slots = Arc::new(tokio::sync::Semaphore::new(WRITERS));
    let writer = async move {
        loop {
            // A slot first: at most WRITERS writes in flight.
            let Ok(slot) = slots.clone().acquire_owned().await else {
                return;
            };
            let (next, at) = {
                let mut b = book.lock().unwrap();
                let now = Instant::now();
                match b.due(now) {
                    Some(w) => (Some(w), None),
                    None => (None, b.next_due()),
                }
            };
            let Some(w) = next else {
                drop(slot);
                match at {
                    Some(t) => {
                        tokio::select! {
                            _ = tokio::time::sleep_until(t.into()) => {}
                            _ = wake.notified() => {}
                        }
                    }
                    None => wake.notified().await,
                }
                continue;
            };
            let (api, book, written, wake) =
                (api.clone(), book.clone(), written.clone(), wake.clone());
            tokio::spawn(async move {
                let outcome = write(&api, &w).await;
                if outcome.is_ok() {
                    written.fetch_add(1, Ordering::Relaxed);
                }
                book.lock().unwrap().written(&w, outcome, Instant::now());
                drop(slot);
                // What was counted meanwhile may be due.
                wake.notify_one();
            });
        }
    };
    tokio::select! {
        _ = intake => {}
        _ = writer => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(kind: &'static str, reason: &'static str, msg: &str) -> NodeEvent {
        NodeEvent {
            node: "n".into(),
            kind,
            reason,
            message: msg.into(),
        }
    }

    fn book() -> Book {
        Book::new(Limits::default(), "me")
    }

    /// Writes everything due at `t`, all succeeding; the bodies.
    fn flush(b: &mut Book, t: Instant) -> Vec<Write> {
        let mut out = Vec::new();
        while let Some(w) = b.due(t) {
            b.written(&w, Ok(()), t);
            out.push(w);
        }
        out
    }

    #[test]
    fn a_burst_then_one_a_minute_the_same_words_counted_and_the_rest_combined() {
        let mut b = book();
        let t = Instant::now();
        assert_eq!(b.take(ev("Normal", "GPUHealthEvent", "a"), t), Taken::New);
        assert_eq!(
            b.take(ev("Normal", "GPUHealthEvent", "a"), t),
            Taken::Counted,
            "the same words again"
        );
        for m in ["b", "c", "d", "e"] {
            assert_eq!(b.take(ev("Normal", "GPUHealthEvent", m), t), Taken::New);
        }
        assert_eq!(
            b.take(ev("Normal", "GPUHealthEvent", "f"), t),
            Taken::Combined,
            "the burst is spent: counted on the latest of its reason"
        );
        assert_eq!(
            b.take(ev("Normal", "DriftRepaired", "x"), t),
            Taken::HeldBack,
            "nothing of its reason to count it on"
        );
        assert_eq!(b.held_back, 1);
        assert_eq!(
            b.take(ev("Normal", "DriftRepaired", "x"), t + REFILL),
            Taken::New,
            "one more after a minute"
        );
        let writes = flush(&mut b, t + REFILL);
        assert_eq!(writes.len(), 6, "five, and one a minute later");
        assert!(writes.iter().all(|w| w.create));
        assert_eq!(writes[0].body["count"], 2);
        assert_eq!(
            writes[4].body["message"],
            "(combined from similar events): f"
        );
        assert_eq!(writes[4].body["count"], 2);
        // Said again: counted on the Event written, one patch at most per
        // UPDATE_EVERY.
        let t2 = t + REFILL + Duration::from_secs(1);
        for _ in 0..3 {
            assert_eq!(
                b.take(ev("Normal", "GPUHealthEvent", "a"), t2),
                Taken::Counted
            );
        }
        assert!(flush(&mut b, t2).is_empty(), "written a second ago");
        let patches = flush(&mut b, t + REFILL + UPDATE_EVERY);
        assert_eq!(patches.len(), 1);
        assert!(!patches[0].create);
        assert_eq!(patches[0].name, writes[0].name);
        assert_eq!(patches[0].body["count"], 5);
        assert_eq!(patches[0].body["message"], "a");
        // Much later the words are new again.
        let later = t + REFILL + UPDATE_EVERY + SAME_WITHIN + REFILL;
        assert_eq!(
            b.take(ev("Normal", "GPUHealthEvent", "a"), later),
            Taken::New
        );
    }

    /// A fleet-wide burst (5 events on each of 4,000 nodes): every one is
    /// a new Event (the burst allowance), written once each, in the order
    /// they came; a sixth on a node is combined on its latest.
    #[test]
    fn a_fleet_wide_burst_is_written_once_each_in_order() {
        let mut b = book();
        let t = Instant::now();
        for n in 0..5 {
            for node in 0..4000 {
                let mut e = ev("Normal", "GPUEvent", &format!("XID 94 #{n}"));
                e.node = format!("node-{node}");
                assert_eq!(b.take(e, t), Taken::New);
            }
        }
        let mut e = ev("Normal", "GPUEvent", "XID 94 #5");
        e.node = "node-7".into();
        assert_eq!(b.take(e, t), Taken::Combined);
        let writes = flush(&mut b, t);
        assert_eq!(writes.len(), 20_000);
        assert!(writes.iter().all(|w| w.create));
        assert_eq!(writes[0].body["message"], "XID 94 #0");
        assert_eq!(writes[0].body["involvedObject"]["name"], "node-0");
        assert_eq!(writes[19_999].body["involvedObject"]["name"], "node-3999");
        assert_eq!(writes[19_999].body["message"], "XID 94 #4");
        let seven: Vec<_> = writes
            .iter()
            .filter(|w| w.body["involvedObject"]["name"] == "node-7")
            .collect();
        assert_eq!(seven.len(), 5);
        assert_eq!(
            seven[4].body["message"],
            "(combined from similar events): XID 94 #5"
        );
        assert_eq!(seven[4].body["count"], 2);
        assert!(flush(&mut b, t).is_empty(), "nothing written twice");
    }

    #[test]
    fn past_the_kept_limit_the_oldest_written_events_are_forgotten_first() {
        let mut b = book();
        let t = Instant::now();
        let e = |node: usize, n: usize| {
            let mut e = ev("Normal", "GPUEvent", &format!("XID 94 #{n}"));
            e.node = format!("node-{node}");
            e
        };
        // 20,000 Events, the first 4,000 a second before the rest; all
        // but the last 10 written.
        for node in 0..4000 {
            assert_eq!(b.take(e(node, 0), t), Taken::New);
        }
        let later = t + Duration::from_secs(1);
        flush(&mut b, later);
        for n in 1..5 {
            for node in 0..4000 {
                b.take(e(node, n), later);
            }
        }
        let mut writes = 0;
        while writes < 16_000 - 10 {
            let w = b.due(later).expect("due");
            b.written(&w, Ok(()), later);
            writes += 1;
        }
        assert_eq!(b.series.len(), 20_000);
        // Forgotten at the next take a second on: down to KEPT, the first
        // second's first; those not written yet are kept.
        let next = later + Duration::from_secs(1);
        assert_eq!(b.take(e(9000, 0), next), Taken::New);
        assert_eq!(b.series.len(), KEPT + 1);
        assert_eq!(b.index.len(), KEPT + 1);
        assert_eq!(b.pending.len(), 11, "the 10 not written and the new one");
        assert_eq!(
            b.take(e(3999, 4), next),
            Taken::Counted,
            "a recent one is still counted"
        );
        // An old one is not: node-0 has no token left, so it is combined
        // on its latest Event of the reason (kept), not counted on its
        // forgotten first.
        assert_eq!(b.take(e(0, 0), next), Taken::Combined);
    }

    #[test]
    fn warnings_steps_and_outcomes_are_never_held_back() {
        let mut b = book();
        let t = Instant::now();
        for m in ["1", "2", "3", "4", "5"] {
            assert_eq!(b.take(ev("Normal", "DriftRepaired", m), t), Taken::New);
        }
        // The burst is spent on repairs; an upgrade's steps are one Event,
        // its outcome another, a Warning a third.
        for step in ["upgrade-required", "cordon-required", "uncordon-required"] {
            b.take(ev("Normal", "DriverUpgrade", step), t);
        }
        assert_eq!(
            b.take(ev("Normal", "DriverUpgradeDone", "driver 2 validated"), t),
            Taken::New
        );
        assert_eq!(
            b.take(ev("Warning", "GPUUnhealthy", "XID 79 on GPU-0"), t),
            Taken::New
        );
        assert_eq!(
            b.take(ev("Warning", "GPUUnhealthy", "XID 79 on GPU-1"), t),
            Taken::Combined,
            "a second Warning of the reason is counted on the first"
        );
        assert_eq!(
            b.take(
                ev(
                    "Warning",
                    "DriverUpgradeFailed",
                    "upgrade to driver 3 failed"
                ),
                t
            ),
            Taken::New
        );
        assert_eq!(b.held_back, 0);
        let writes = flush(&mut b, t);
        let reasons: Vec<&Value> = writes.iter().map(|w| &w.body["reason"]).collect();
        assert_eq!(
            reasons,
            [
                "DriftRepaired",
                "DriftRepaired",
                "DriftRepaired",
                "DriftRepaired",
                "DriftRepaired",
                "DriverUpgrade",
                "DriverUpgradeDone",
                "GPUUnhealthy",
                "DriverUpgradeFailed"
            ]
        );
        assert_eq!(writes[5].body["count"], 3);
        assert_eq!(writes[5].body["message"], "uncordon-required");
        assert_eq!(writes[7].body["count"], 2);
        assert_eq!(writes[8].body["type"], "Warning");
    }

    #[test]
    fn an_event_gone_from_the_api_is_made_again_and_a_failure_tried_again_later() {
        let mut b = book();
        let t = Instant::now();
        b.take(ev("Warning", "GPUUnhealthy", "x"), t);
        let w = b.due(t).unwrap();
        b.written(&w, Err(false), t);
        assert!(b.due(t).is_none(), "not again at once");
        let w = b.due(t + UPDATE_EVERY).unwrap();
        assert!(w.create);
        b.written(&w, Ok(()), t + UPDATE_EVERY);
        b.take(ev("Warning", "GPUUnhealthy", "x"), t + UPDATE_EVERY);
        let p = b.due(t + UPDATE_EVERY * 2).unwrap();
        assert!(!p.create);
        b.written(&p, Err(true), t + UPDATE_EVERY * 2);
        let again = b.due(t + UPDATE_EVERY * 2).unwrap();
        assert!(again.create, "made again");
        assert_ne!(again.name, w.name);
        assert_eq!(again.body["count"], 2);
    }
}
