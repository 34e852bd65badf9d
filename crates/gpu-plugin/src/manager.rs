//! Runs one device-plugin server per resource and keeps each registered.
//!
//! The kubelet deletes every socket in its device-plugins directory when it
//! starts, then creates `kubelet.sock`. We watch the directory (inotify): on
//! a new `kubelet.sock` every plugin binds a NEW socket and registers again;
//! when only our own socket disappears, that plugin does the same. Each
//! plugin remembers which `kubelet.sock` (device, inode, change time) it
//! registered with, so the two signs of one kubelet restart (our socket
//! deleted, a new `kubelet.sock`) re-register once, not twice; likewise a
//! retry that reached a kubelet just started and that kubelet's socket
//! creation, seen a moment later. Nothing is dialled while there is no
//! `kubelet.sock` (the attempt counts as failed). A failed
//! registration is retried with backoff (2 ms doubling to 30 s: a new
//! `kubelet.sock` exists a moment before the kubelet accepts on it) and the
//! error is kept for `gpu-agent status`.
//!
//! A replaced (or, at shutdown, every) plugin server is stopped within a
//! bound: its `ListAndWatch` streams end at once with `Unavailable` (the
//! old kubelet's, or any client's that holds one), so tonic's graceful
//! shutdown finishes as soon as the clients read that; after
//! [`STOP_GRACE`] its connections are cut (reads see EOF, writes fail),
//! after [`CUT_GRACE`] more its task is aborted. Each stop is logged as
//! "plugin server for <socket> stopped", with how and how long it took.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hostlib::HostRoot;
use inotify::{EventMask, Inotify, WatchMask};
use serde::{Deserialize, Serialize};
use tokio::sync::{Notify, mpsc, watch};
use tokio::task::JoinSet;
use tokio_stream::StreamExt;

use super::kubelet;
use super::resources::{PluginSettings, Resource};
use super::server::{ALLOCATE_WAIT, PluginService, Preparing};
use gpu_model::health::HealthView;
use gpu_model::inventory::Inventory;

mod serving;

use serving::Server;
pub use serving::{CUT_GRACE, STOP_GRACE};

/// The kubelet's socket name in its device-plugins directory.
pub const KUBELET_SOCKET: &str = "kubelet.sock";
/// The device-plugins directory, as a host path.
pub const DEVICE_PLUGIN_DIR: &str = "/var/lib/kubelet/device-plugins";

const FIRST_RETRY: Duration = Duration::from_millis(2);
const MAX_RETRY: Duration = Duration::from_secs(30);
/// What `status` shows of one resource.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResourceStatus {
    pub resource: String,
    pub socket: String,
    pub devices: usize,
    pub unhealthy: usize,
    pub registered: bool,
    /// Successful registrations so far (1 + re-registrations).
    pub registrations: u64,
    /// The last registration error, while not registered.
    pub last_error: Option<String>,
    /// `ListAndWatch` streams the kubelet opened on the current socket (0:
    /// it has not listed the devices yet).
    #[serde(default)]
    pub lists: u64,
}

impl ResourceStatus {
    fn new(dir: &Path, r: &Resource) -> Self {
        ResourceStatus {
            resource: r.name.clone(),
            socket: dir.join(r.socket_name()).display().to_string(),
            devices: r.devices.len(),
            unhealthy: r.devices.iter().filter(|d| !d.healthy).count(),
            registered: false,
            registrations: 0,
            last_error: None,
            lists: 0,
        }
    }
}

/// Shared, live status of every resource.
pub type StatusBoard = Arc<Mutex<Vec<ResourceStatus>>>;

/// The plugin could not start.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    #[error("{path}: cannot create the device-plugins directory: {source}")]
    Dir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: cannot watch for kubelet restarts: {source}")]
    Watch {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: cannot listen: {source}")]
    Bind {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

struct Plugin {
    resource: watch::Sender<Resource>,
    name: String,
    socket: PathBuf,
    server: Option<Server>,
    /// Bumped on every restart; registration results of older generations are ignored.
    generation: u64,
    retry_delay: Duration,
    retry_at: Option<tokio::time::Instant>,
    /// The `kubelet.sock` this plugin last dialled (or restarted for).
    kubelet: Option<KubeletId>,
}

/// Which `kubelet.sock`: a restarted kubelet's new socket differs in inode
/// or change time even when the inode number is reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct KubeletId {
    dev: u64,
    ino: u64,
    ctime: i64,
    ctime_nsec: i64,
}

/// Runs the device plugins.
pub struct PluginManager {
    dir: PathBuf,
    plugins: Vec<Plugin>,
    updates: mpsc::UnboundedReceiver<Vec<Resource>>,
    updater: mpsc::UnboundedSender<Vec<Resource>>,
    next_generation: u64,
    inventory: Arc<Inventory>,
    settings: Arc<PluginSettings>,
    dev_root: HostRoot,
    board: StatusBoard,
    /// Told whenever the board changes.
    changed: Arc<Notify>,
    /// The GPUs' health, as the health monitor publishes it.
    health: Option<watch::Receiver<HealthView>>,
    /// Whether the node is ready for containers (allocations wait while not).
    preparing: Option<Preparing>,
    /// Replaced or removed servers being stopped (each within
    /// `STOP_GRACE + CUT_GRACE`); awaited at shutdown.
    stopping: JoinSet<()>,
    /// Registrations of resources no longer served, kept for when one
    /// comes back: counts never go back.
    registered_before: HashMap<String, u64>,
}

impl std::fmt::Debug for PluginManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginManager")
            .field("dir", &self.dir)
            .finish()
    }
}

struct Registered {
    /// Unique across plugins and restarts: finds the plugin (if it still
    /// exists and has not restarted since).
    generation: u64,
    /// The plugin's resource: an older generation's success still counts.
    resource: String,
    result: Result<(), String>,
}

impl PluginManager {
    /// Plugins for `resources` in the device-plugins directory `dir` (a
    /// resolved path). Resources without devices are not served.
    pub fn new(
        dir: PathBuf,
        resources: Vec<Resource>,
        inventory: Arc<Inventory>,
        settings: Arc<PluginSettings>,
        dev_root: HostRoot,
    ) -> Self {
        let resources: Vec<Resource> = resources
            .into_iter()
            .filter(|r| !r.devices.is_empty())
            .collect();
        let board = Arc::new(Mutex::new(
            resources
                .iter()
                .map(|r| ResourceStatus::new(&dir, r))
                .collect(),
        ));
        let plugins = resources.into_iter().map(|r| new_plugin(&dir, r)).collect();
        let (updater, updates) = mpsc::unbounded_channel();
        PluginManager {
            dir,
            plugins,
            updates,
            updater,
            next_generation: 1,
            inventory,
            settings,
            dev_root,
            board,
            changed: Arc::new(Notify::new()),
            health: None,
            preparing: None,
            stopping: JoinSet::new(),
            registered_before: HashMap::new(),
        }
    }

    /// `Allocate` waits (up to [`ALLOCATE_WAIT`], then refuses) while
    /// `preparing` says the node is not ready for containers (the first
    /// pass's device nodes, runtime configuration and CDI spec).
    pub fn with_preparing(mut self, preparing: Preparing) -> Self {
        self.preparing = Some(preparing);
        self
    }

    /// Follows the health monitor: a GPU's devices are `Unhealthy` in every
    /// `ListAndWatch` stream as soon as the monitor says so.
    pub fn with_health(mut self, health: watch::Receiver<HealthView>) -> Self {
        self.health = Some(health);
        self
    }

    /// Applies the current health to every resource (only where it changed).
    fn apply_health(&mut self) {
        let Some(rx) = self.health.as_mut() else {
            return;
        };
        let view = rx.borrow_and_update().clone();
        let mut counts = Vec::new();
        for p in &self.plugins {
            p.resource.send_if_modified(|r| with_health(r, &view));
            counts.push(
                p.resource
                    .borrow()
                    .devices
                    .iter()
                    .filter(|d| !d.healthy)
                    .count(),
            );
        }
        let mut board = self.board.lock().unwrap();
        let mut changed = false;
        for (s, n) in board.iter_mut().zip(counts) {
            if s.unhealthy != n {
                s.unhealthy = n;
                changed = true;
            }
        }
        drop(board);
        if changed {
            self.changed.notify_one();
        }
    }

    /// Notifies `changed` whenever the board changes (registration, device
    /// counts, resources), so the agent's state is written at once and
    /// nothing has to poll the board.
    pub fn with_change_signal(mut self, changed: Arc<Notify>) -> Self {
        self.changed = changed;
        self
    }

    /// The live status of every resource.
    pub fn board(&self) -> StatusBoard {
        self.board.clone()
    }

    /// Sends the node's new set of resources (after re-discovery, e.g. a MIG
    /// layout change): resources that are gone stop being served and their
    /// sockets are removed, so the kubelet drops their capacity; new ones are
    /// served and registered; the rest get their new device lists.
    pub fn updater(&self) -> mpsc::UnboundedSender<Vec<Resource>> {
        self.updater.clone()
    }

    /// Senders that change a resource's devices (health): every
    /// `ListAndWatch` stream of it gets the new list.
    pub fn resource_senders(&self) -> HashMap<String, watch::Sender<Resource>> {
        self.plugins
            .iter()
            .map(|p| (p.name.clone(), p.resource.clone()))
            .collect()
    }

    fn kubelet_socket(&self) -> PathBuf {
        self.dir.join(KUBELET_SOCKET)
    }

    fn kubelet_id(&self) -> Option<KubeletId> {
        use std::os::unix::fs::MetadataExt;
        std::fs::symlink_metadata(self.kubelet_socket())
            .ok()
            .map(|m| KubeletId {
                dev: m.dev(),
                ino: m.ino(),
                ctime: m.ctime(),
                ctime_nsec: m.ctime_nsec(),
            })
    }

    /// Serves and keeps registered until `shutdown` resolves; then stops the
    /// servers and removes their sockets.
    pub async fn run(
        mut self,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> Result<(), PluginError> {
        std::fs::create_dir_all(&self.dir).map_err(|source| PluginError::Dir {
            path: self.dir.clone(),
            source,
        })?;
        let watch_err = |source| PluginError::Watch {
            path: self.dir.clone(),
            source,
        };
        let inotify = Inotify::init().map_err(watch_err)?;
        inotify
            .watches()
            .add(
                &self.dir,
                WatchMask::CREATE | WatchMask::DELETE | WatchMask::MOVED_TO | WatchMask::MOVED_FROM,
            )
            .map_err(watch_err)?;
        let mut events = inotify.into_event_stream([0u8; 4096]).map_err(watch_err)?;
        let (done_tx, mut done_rx) = mpsc::unbounded_channel::<Registered>();
        if self.plugins.is_empty() {
            tracing::info!(stage = "plugin", "no devices to advertise; waiting");
        }
        self.apply_health();
        for i in 0..self.plugins.len() {
            self.restart(i, &done_tx)?;
        }
        tokio::pin!(shutdown);
        loop {
            let mut health = self.health.clone();
            let health_changed = async {
                match health.as_mut() {
                    Some(rx) => {
                        if rx.changed().await.is_err() {
                            std::future::pending::<()>().await;
                        }
                    }
                    None => std::future::pending().await,
                }
            };
            let next_retry = self.plugins.iter().filter_map(|p| p.retry_at).min();
            let retry = async {
                match next_retry {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = &mut shutdown => break,
                _ = health_changed => self.apply_health(),
                Some(ev) = events.next() => {
                    let Ok(ev) = ev else { continue };
                    let Some(name) = ev.name.as_ref().map(|n| n.to_string_lossy().into_owned()) else { continue };
                    let created = ev.mask.intersects(EventMask::CREATE | EventMask::MOVED_TO);
                    let deleted = ev.mask.intersects(EventMask::DELETE | EventMask::MOVED_FROM);
                    if name == KUBELET_SOCKET && created {
                        // Plugins that already restarted for this kubelet
                        // (their socket's deletion came first) stay as they are.
                        let kubelet = self.kubelet_id();
                        let stale: Vec<usize> = (0..self.plugins.len())
                            .filter(|&i| kubelet.is_none() || self.plugins[i].kubelet != kubelet)
                            .collect();
                        if !stale.is_empty() {
                            tracing::info!(stage = "plugin", "kubelet restarted; serving on new sockets and registering again");
                        }
                        for i in stale {
                            self.restart(i, &done_tx)?;
                        }
                    } else if deleted && self.kubelet_socket().exists() {
                        // (Without kubelet.sock the kubelet is restarting: its
                        // new socket's creation restarts every plugin.)
                        let kubelet = self.kubelet_id();
                        for i in 0..self.plugins.len() {
                            let p = &self.plugins[i];
                            // Our own restarts delete the old socket too: only
                            // act when the socket is really gone.
                            if p.socket.file_name().is_some_and(|f| f.to_string_lossy() == name) && !p.socket.exists() {
                                // A kubelet.sock other than the one we registered
                                // with: a kubelet restart, read after the new
                                // kubelet's socket was made (routine).
                                if p.kubelet != kubelet {
                                    tracing::info!(stage = "plugin", resource = %p.name, "kubelet restarted; serving on new sockets and registering again");
                                } else {
                                    tracing::info!(stage = "plugin", resource = %p.name, socket = %p.socket.display(), "our socket was removed, not by a kubelet restart; serving on a new one and registering again");
                                }
                                self.restart(i, &done_tx)?;
                            }
                        }
                    }
                }
                Some(done) = done_rx.recv() => self.registered(done),
                Some(_) = self.stopping.join_next() => {}
                Some(resources) = self.updates.recv() => self.update(resources, &done_tx)?,
                _ = retry => {
                    let now = tokio::time::Instant::now();
                    for i in 0..self.plugins.len() {
                        if self.plugins[i].retry_at.is_some_and(|t| t <= now) {
                            self.plugins[i].retry_at = None;
                            self.register(i, &done_tx);
                        }
                    }
                }
            }
        }
        // Every server stops at once (their streams end now), then the
        // sockets go; the stops are awaited, each bounded.
        for p in &mut self.plugins {
            if let Some(server) = p.server.take() {
                self.stopping.spawn(server.stop());
            }
            let _ = std::fs::remove_file(&p.socket);
        }
        while self.stopping.join_next().await.is_some() {}
        Ok(())
    }

    /// Stops plugin `i`'s server (if any), binds a new socket, serves, registers.
    fn restart(
        &mut self,
        i: usize,
        done: &mpsc::UnboundedSender<Registered>,
    ) -> Result<(), PluginError> {
        let p = &mut self.plugins[i];
        if let Some(server) = p.server.take() {
            self.stopping.spawn(server.stop());
        }
        let _ = std::fs::remove_file(&p.socket);
        let listener =
            super::socket::bind_private(&p.socket).map_err(|source| PluginError::Bind {
                path: p.socket.clone(),
                source,
            })?;
        let (draining, drain_rx) = watch::channel(false);
        let (board, changed, resource) = (self.board.clone(), self.changed.clone(), p.name.clone());
        let svc = PluginService::new(
            p.resource.subscribe(),
            self.inventory.clone(),
            self.settings.clone(),
            self.dev_root.clone(),
        )
        .with_stopping(drain_rx.clone());
        let svc = match &self.preparing {
            Some(rx) => svc.with_preparing(rx.clone(), ALLOCATE_WAIT),
            None => svc,
        };
        let svc = svc.on_list(move || {
            if let Some(s) = board
                .lock()
                .unwrap()
                .iter_mut()
                .find(|s| s.resource == resource)
            {
                s.lists += 1;
            }
            changed.notify_one();
        });
        p.server = Some(Server::start(
            listener,
            svc,
            draining,
            drain_rx,
            p.socket.clone(),
            p.name.clone(),
        ));
        p.generation = self.next_generation;
        self.next_generation += 1;
        p.retry_delay = FIRST_RETRY;
        p.retry_at = None;
        self.plugins[i].kubelet = None;
        self.set_status(i, |s| {
            s.registered = false;
            s.lists = 0;
        });
        self.register(i, done);
        Ok(())
    }

    /// Registers plugin `i` with the kubelet listening on `kubelet.sock` now,
    /// and remembers which socket that is: its creation, seen later, is then
    /// not a restart. Without a `kubelet.sock` nothing is dialled (a dial
    /// that went out now could reach a kubelet that appears meanwhile, and
    /// that socket's creation would register the plugin a second time); the
    /// attempt counts as failed and is retried with backoff.
    fn register(&mut self, i: usize, done: &mpsc::UnboundedSender<Registered>) {
        let kubelet = self.kubelet_socket();
        let Some(id) = self.kubelet_id() else {
            let (generation, resource) = (self.plugins[i].generation, self.plugins[i].name.clone());
            self.registered(Registered {
                generation,
                resource,
                result: Err(format!(
                    "{}: no such socket; the kubelet is not running or is restarting",
                    kubelet.display()
                )),
            });
            return;
        };
        self.plugins[i].kubelet = Some(id);
        let p = &self.plugins[i];
        let endpoint = p
            .socket
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_default();
        let resource = p.name.clone();
        let generation = p.generation;
        let done = done.clone();
        tokio::spawn(async move {
            let result = kubelet::register(&kubelet, &endpoint, &resource)
                .await
                .map_err(|e| e.to_string());
            let _ = done.send(Registered {
                generation,
                resource,
                result,
            });
        });
    }

    fn registered(&mut self, done: Registered) {
        let Some(index) = self
            .plugins
            .iter()
            .position(|p| p.generation == done.generation)
        else {
            // The plugin restarted while this registration was under way:
            // it says nothing of the current server, but the kubelet did
            // accept it, and the count says how many times it did.
            if done.result.is_ok()
                && let Some(index) = self.plugins.iter().position(|p| p.name == done.resource)
            {
                self.set_status(index, |s| s.registrations += 1);
            }
            return;
        };
        let p = &mut self.plugins[index];
        match done.result {
            Ok(()) => {
                p.retry_delay = FIRST_RETRY;
                tracing::info!(stage = "plugin", resource = %p.name, socket = %p.socket.display(), "registered with the kubelet");
                self.set_status(index, |s| {
                    s.registered = true;
                    s.registrations += 1;
                    s.last_error = None;
                });
            }
            Err(e) => {
                // A kubelet that is not there yet will announce itself by
                // creating kubelet.sock; keep retrying anyway in case the
                // event was missed.
                let delay = p.retry_delay;
                p.retry_at = Some(tokio::time::Instant::now() + delay);
                p.retry_delay = (delay * 2).min(MAX_RETRY);
                // Said once the kubelet has not answered for a second (the
                // first retry of 1 s or more), and again when its answer
                // changes: a node without a kubelet does not warn every 30 s.
                let said_before = self
                    .board
                    .lock()
                    .unwrap()
                    .get(index)
                    .is_some_and(|s| s.last_error.as_deref() == Some(e.as_str()));
                let p = &self.plugins[index];
                if delay >= Duration::from_secs(1)
                    && (delay < Duration::from_secs(2) || !said_before)
                {
                    tracing::warn!(stage = "plugin", resource = %p.name, error = %e, retry_in = ?delay, "registration failed");
                } else {
                    tracing::debug!(stage = "plugin", resource = %p.name, error = %e, "registration failed");
                }
                self.set_status(index, |s| {
                    s.registered = false;
                    s.last_error = Some(e.clone());
                });
            }
        }
    }

    fn update(
        &mut self,
        resources: Vec<Resource>,
        done: &mpsc::UnboundedSender<Registered>,
    ) -> Result<(), PluginError> {
        let resources: Vec<Resource> = resources
            .into_iter()
            .filter(|r| !r.devices.is_empty())
            .collect();
        // Gone: stop serving and remove the socket (registration results of
        // the removed plugin are ignored through its index going away).
        let mut i = 0;
        while i < self.plugins.len() {
            if resources.iter().any(|r| r.name == self.plugins[i].name) {
                i += 1;
                continue;
            }
            let mut p = self.plugins.remove(i);
            let gone = self.board.lock().unwrap().remove(i);
            // Its count goes on if the resource comes back (a MIG layout
            // change, advertising stopped for a driver change).
            self.registered_before
                .insert(gone.resource, gone.registrations);
            // The kubelet hears the resource has no devices (capacity 0 at
            // once, not after its endpoint grace period) before it goes.
            p.resource.send_modify(|r| r.devices.clear());
            if let Some(server) = p.server.take() {
                self.stopping.spawn(async move {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    server.stop().await;
                });
            }
            let _ = std::fs::remove_file(&p.socket);
            tracing::info!(stage = "plugin", resource = %p.name, "resource no longer exists; stopped serving it and removed its socket");
        }
        let view = self.health.as_ref().map(|h| h.borrow().clone());
        for mut r in resources {
            if let Some(view) = &view {
                with_health(&mut r, view);
            }
            if let Some(p) = self.plugins.iter().find(|p| p.name == r.name) {
                let count = r.devices.len();
                // Streams hear of it only when the device list differs.
                p.resource.send_if_modified(|old| {
                    if *old == r {
                        false
                    } else {
                        *old = r;
                        true
                    }
                });
                let name = p.name.clone();
                if let Some(s) = self
                    .board
                    .lock()
                    .unwrap()
                    .iter_mut()
                    .find(|s| s.resource == name)
                {
                    s.devices = count;
                }
                continue;
            }
            tracing::info!(stage = "plugin", resource = %r.name, devices = r.devices.len(), "new resource");
            let mut status = ResourceStatus::new(&self.dir, &r);
            status.registrations = self.registered_before.get(&r.name).copied().unwrap_or(0);
            self.board.lock().unwrap().push(status);
            self.plugins.push(new_plugin(&self.dir, r));
            self.restart(self.plugins.len() - 1, done)?;
        }
        self.changed.notify_one();
        Ok(())
    }

    fn set_status(&self, i: usize, f: impl FnOnce(&mut ResourceStatus)) {
        if let Some(s) = self.board.lock().unwrap().get_mut(i) {
            f(s);
        }
        self.changed.notify_one();
    }
}

/// Sets each device's health from `view`; true when something changed.
fn with_health(r: &mut Resource, view: &HealthView) -> bool {
    let mut changed = false;
    for d in &mut r.devices {
        let h = view.healthy(&d.gpu_uuid);
        if d.healthy != h {
            d.healthy = h;
            changed = true;
        }
    }
    changed
}

fn new_plugin(dir: &Path, r: Resource) -> Plugin {
    Plugin {
        name: r.name.clone(),
        socket: dir.join(r.socket_name()),
        resource: watch::channel(r).0,
        server: None,
        generation: 0,
        retry_delay: FIRST_RETRY,
        retry_at: None,
        kubelet: None,
    }
}

/// The kubelet's device-plugins directory (`dir`, a host path, e.g.
/// [`DEVICE_PLUGIN_DIR`] or the policy's `spec.hostPaths`) under `host`, as
/// this process sees it.
pub fn plugin_dir(host: &HostRoot, dir: &str) -> Result<PathBuf, hostlib::HostError> {
    host.resolve(dir)
}

/// True when `path` is a socket (for tests and status).
pub fn is_socket(path: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket())
}
