//! `v1alpha1.DRAResourceHealth`, served on the DRA socket next to `v1` and
//! `v1beta1`: `NodeWatchResources` streams the node's **complete** DRA device
//! list with each device's health (docs/dra-facts.md §5), from the health
//! monitor's [`HealthView`] and the device table of
//! [`NodeClaims`](crate::claims::NodeClaims).
//!
//! - The first list goes out as soon as the kubelet opens the stream; a new
//!   complete list each time a device's health or message changes or the
//!   device list does; the same list again every [`REFRESH`] while nothing
//!   changes: the kubelet keeps a device's health only
//!   [`HEALTH_TIMEOUT_SECONDS`] after the last list that named it (30 s,
//!   its own default, for kubelets before 1.35, which do not read the field),
//!   then shows it as Unknown (kubelet `cm/dra/healthinfo.go`). Nothing else
//!   is sent: a health change for a GPU that is no DRA device sends nothing.
//! - A MIG device has its parent GPU's health (the monitor watches GPUs);
//!   the message says which GPU and why.
//! - No health monitor (its sender gone, or never there): every device
//!   Unknown, saying so.
//! - Each watcher has its own task; one that goes away ends only its own.
//!   The plugin stopping ends every stream (`UNAVAILABLE`), so the server's
//!   graceful stop does not wait on them.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use gpu_agent_proto::dra_health::v1alpha1 as proto;
use gpu_agent_proto::dra_health::v1alpha1::dra_resource_health_server::DraResourceHealth;
use gpu_model::health::HealthView;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::claim::DRIVER_NAME;
use crate::claims::{NodeClaims, NodeDevice};

/// How often the unchanged list is sent again, well within the kubelet's
/// timeout (and within the 30 s of kubelets that do not read ours).
pub const REFRESH: Duration = Duration::from_secs(10);
/// How long the kubelet may go without a list before it shows the devices
/// as Unknown (`DeviceHealth.health_check_timeout_seconds`, read by 1.35+).
pub const HEALTH_TIMEOUT_SECONDS: i64 = 60;
/// The message of every device while no health monitor runs.
pub const NO_MONITOR: &str = "gpu-agent's GPU health monitor is not running";

/// What the health stream reports from: the pool (the node's name), the
/// DRA devices by name, and the health monitor's view.
#[derive(Clone, Debug)]
pub struct HealthSource {
    pool: String,
    devices: watch::Receiver<BTreeMap<String, NodeDevice>>,
    health: watch::Receiver<HealthView>,
    refresh: Duration,
}

impl HealthSource {
    /// `pool`: the node's name; `devices`: the device table as
    /// [`NodeClaims::watch_devices`] gives it; `health`: the health monitor's
    /// view (a receiver whose sender is gone: every device Unknown).
    pub fn new(
        pool: impl Into<String>,
        devices: watch::Receiver<BTreeMap<String, NodeDevice>>,
        health: watch::Receiver<HealthView>,
    ) -> Self {
        HealthSource {
            pool: pool.into(),
            devices,
            health,
            refresh: REFRESH,
        }
    }

    /// The node's claims' devices and pool, with the monitor's `health`.
    pub fn from_claims(claims: &NodeClaims, health: watch::Receiver<HealthView>) -> Self {
        Self::new(claims.node_name(), claims.watch_devices(), health)
    }

    /// Sends the unchanged list again every `refresh` instead of [`REFRESH`].
    pub fn with_refresh(mut self, refresh: Duration) -> Self {
        self.refresh = refresh;
        self
    }
}

/// One device's health as the stream tells it (without the time).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceState {
    /// The device's name in the pool (`gpu-0`, a MIG device's name).
    pub device: String,
    pub health: proto::HealthStatus,
    /// Why, when it is not healthy.
    pub message: String,
}

/// Every device of `devices`, by name, with its health from `view` (`None`:
/// no monitor, so Unknown). A device is unhealthy when its GPU (a MIG
/// device's parent) or the device itself is in the view.
pub fn device_states(
    devices: &BTreeMap<String, NodeDevice>,
    view: Option<&HealthView>,
) -> Vec<DeviceState> {
    devices
        .iter()
        .map(|(name, d)| {
            let (health, message) = match view {
                None => (proto::HealthStatus::Unknown, NO_MONITOR.to_string()),
                Some(v) => match unhealthy(d, v) {
                    None => (proto::HealthStatus::Healthy, String::new()),
                    Some(why) => (proto::HealthStatus::Unhealthy, why),
                },
            };
            DeviceState {
                device: name.clone(),
                health,
                message,
            }
        })
        .collect()
}

/// Why `d` is unhealthy in `view`, or `None` when it is healthy.
fn unhealthy(d: &NodeDevice, view: &HealthView) -> Option<String> {
    let said = |uuid: &str, why: &str| {
        if why.is_empty() {
            format!("GPU {uuid} is unhealthy")
        } else {
            why.to_string()
        }
    };
    if let Some(why) = view.unhealthy.get(&d.uuid) {
        return Some(said(&d.uuid, why));
    }
    let why = view.unhealthy.get(&d.gpu_uuid)?;
    if d.gpu_uuid == d.uuid {
        Some(said(&d.uuid, why))
    } else if why.is_empty() {
        Some(format!("its GPU {} is unhealthy", d.gpu_uuid))
    } else {
        Some(format!("its GPU {}: {why}", d.gpu_uuid))
    }
}

/// The message for `states` in `pool`, determined at `at` (Unix seconds).
pub fn response(pool: &str, states: &[DeviceState], at: i64) -> proto::NodeWatchResourcesResponse {
    proto::NodeWatchResourcesResponse {
        devices: states
            .iter()
            .map(|s| proto::DeviceHealth {
                device: Some(proto::DeviceIdentifier {
                    pool_name: pool.to_string(),
                    device_name: s.device.clone(),
                }),
                health: s.health as i32,
                last_updated_time: at,
                health_check_timeout_seconds: HEALTH_TIMEOUT_SECONDS,
                message: s.message.clone(),
            })
            .collect(),
    }
}

fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

type Item = Result<proto::NodeWatchResourcesResponse, Status>;

/// The health service: one task per watcher.
#[derive(Clone, Debug)]
pub struct HealthService {
    source: HealthSource,
    /// Set to true when the plugin stops: every stream ends.
    stopping: watch::Receiver<bool>,
    watchers: Arc<AtomicU64>,
}

impl HealthService {
    /// `stopping`: true once the plugin stops (every stream ends then).
    pub fn new(source: HealthSource, stopping: watch::Receiver<bool>) -> Self {
        HealthService {
            source,
            stopping,
            watchers: Arc::new(AtomicU64::new(0)),
        }
    }

    /// A stream for one watcher, fed by its own task.
    pub fn watch(&self) -> ReceiverStream<Item> {
        let (tx, rx) = mpsc::channel(1);
        let watcher = self.watchers.fetch_add(1, Ordering::Relaxed) + 1;
        tokio::spawn(feed(
            self.source.clone(),
            self.stopping.clone(),
            tx,
            watcher,
        ));
        ReceiverStream::new(rx)
    }
}

/// How a watcher's feed ended.
#[derive(Debug, PartialEq, Eq)]
enum End {
    /// The watcher went away.
    Gone,
    /// The plugin is stopping.
    Stopping,
}

/// Feeds one watcher until it goes away or the plugin stops.
async fn feed(
    source: HealthSource,
    stopping: watch::Receiver<bool>,
    tx: mpsc::Sender<Item>,
    watcher: u64,
) {
    let devices = source.devices.borrow().len();
    tracing::info!(
        driver = DRIVER_NAME,
        watcher,
        pool = %source.pool,
        devices,
        "the kubelet watches the DRA devices' health"
    );
    let end = send_lists(source, stopping, &tx, watcher).await;
    if end == End::Stopping {
        // Err: the watcher is gone already.
        let _ = tx
            .send(Err(Status::unavailable(format!(
                "DRA plugin {DRIVER_NAME} is stopping"
            ))))
            .await;
    }
    tracing::info!(
        driver = DRIVER_NAME,
        watcher,
        ?end,
        "a DRA health watch ended"
    );
}

/// Sends the list at once, again on every change and every refresh.
async fn send_lists(
    source: HealthSource,
    mut stopping: watch::Receiver<bool>,
    tx: &mpsc::Sender<Item>,
    watcher: u64,
) -> End {
    let HealthSource {
        pool,
        mut devices,
        mut health,
        refresh,
    } = source;
    // A monitor that is gone already (or never was) is not waited for.
    let (mut devices_open, mut health_open) = (true, health.has_changed().is_ok());
    if !health_open {
        tracing::info!(
            driver = DRIVER_NAME,
            watcher,
            "no GPU health monitor; the DRA devices' health is Unknown"
        );
    }
    let mut last: Option<Vec<DeviceState>> = None;
    let mut next_refresh = Instant::now();
    loop {
        if *stopping.borrow_and_update() {
            return End::Stopping;
        }
        let states = {
            let table = devices.borrow_and_update();
            let view = health.borrow_and_update();
            device_states(&table, health_open.then_some(&*view))
        };
        let changed = last.as_ref() != Some(&states);
        if changed || Instant::now() >= next_refresh {
            if changed && last.is_some() {
                let unhealthy = states
                    .iter()
                    .filter(|s| s.health != proto::HealthStatus::Healthy)
                    .count();
                tracing::info!(
                    driver = DRIVER_NAME,
                    watcher,
                    devices = states.len(),
                    not_healthy = unhealthy,
                    "the DRA devices' health changed; sent the kubelet the new list"
                );
            }
            if tx
                .send(Ok(response(&pool, &states, unix_now())))
                .await
                .is_err()
            {
                return End::Gone;
            }
            last = Some(states);
            next_refresh = Instant::now() + refresh;
        }
        tokio::select! {
            () = tx.closed() => return End::Gone,
            r = stopping.changed() => {
                if r.is_err() {
                    // The server that owns the flag is gone.
                    return End::Stopping;
                }
            }
            r = devices.changed(), if devices_open => {
                if r.is_err() {
                    // The node's claims are gone: the last table stays.
                    devices_open = false;
                }
            }
            r = health.changed(), if health_open => {
                if r.is_err() {
                    tracing::info!(driver = DRIVER_NAME, watcher, "the GPU health monitor stopped; the DRA devices' health is Unknown");
                    health_open = false;
                }
            }
            () = tokio::time::sleep_until(next_refresh) => {}
        }
    }
}

#[tonic::async_trait]
impl DraResourceHealth for HealthService {
    type NodeWatchResourcesStream = ReceiverStream<Item>;

    async fn node_watch_resources(
        &self,
        _: Request<proto::NodeWatchResourcesRequest>,
    ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
        Ok(Response::new(self.watch()))
    }
}

#[cfg(test)]
mod tests;
