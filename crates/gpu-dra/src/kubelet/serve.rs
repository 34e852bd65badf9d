//! The plugin's two Unix sockets and the servers on them: the DRA socket
//! (`v1`, `v1beta1` and the `v1alpha1` health stream) bound first, then the
//! registration socket the kubelet discovers it by; on shutdown the
//! registration socket goes first.

use std::fs::{self, DirBuilder, Permissions};
use std::future::Future;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use gpu_agent_proto::dra;
use gpu_agent_proto::dra_health::v1alpha1::dra_resource_health_server::DraResourceHealthServer;
use gpu_agent_proto::pluginregistration::registration_server::RegistrationServer;
use hostlib::{HostError, HostRoot};
use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::transport::Server;

use super::dra::DraService;
use super::health::{HealthService, HealthSource};
use super::registration::{Registration, RegistrationService};
use crate::claim::{Claims, DRIVER_NAME};

/// Where the kubelet watches for plugin registration sockets (its default
/// `--root-dir` of `/var/lib/kubelet`).
pub const KUBELET_REGISTRY_DIR: &str = "/var/lib/kubelet/plugins_registry";
/// Where plugins keep their own sockets, one directory per driver.
pub const KUBELET_PLUGINS_DIR: &str = "/var/lib/kubelet/plugins";
/// The DRA socket's name in the driver's plugin directory.
pub const DRA_SOCKET: &str = "dra.sock";

/// The registration socket's name in the registry directory:
/// `<driver>-reg.sock`.
pub fn registration_socket_name() -> String {
    format!("{DRIVER_NAME}-reg.sock")
}

/// How long the servers have, once told to stop, to finish their calls;
/// then they are aborted.
pub const STOP_GRACE: Duration = Duration::from_secs(5);
/// The plugin directory's mode (and the registry directory's, when made here).
const DIR_MODE: u32 = 0o750;

/// Where the sockets go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dirs {
    /// The kubelet's registry directory, as this process sees it.
    pub registry: PathBuf,
    /// The kubelet's plugins directory, as this process sees it; the plugin's
    /// own directory (`<driver>/`) is made in it.
    pub plugins: PathBuf,
    /// The plugins directory as the kubelet sees it, when it differs (the
    /// host's path when this process sees the host under a prefix); the
    /// `GetInfo` endpoint is made from it.
    pub kubelet_plugins: Option<PathBuf>,
}

impl Default for Dirs {
    fn default() -> Self {
        Dirs {
            registry: PathBuf::from(KUBELET_REGISTRY_DIR),
            plugins: PathBuf::from(KUBELET_PLUGINS_DIR),
            kubelet_plugins: None,
        }
    }
}

impl Dirs {
    /// The kubelet's directories `registry` and `plugins` (host paths, e.g.
    /// [`KUBELET_REGISTRY_DIR`] and [`KUBELET_PLUGINS_DIR`]) as this process
    /// reaches them through `host`; the endpoint stays the host path the
    /// kubelet dials. The one way the agent should make them (as the device
    /// plugin's directory is `gpu_plugin::manager::plugin_dir`).
    pub fn on(host: &HostRoot, registry: &str, plugins: &str) -> Result<Dirs, HostError> {
        Ok(Dirs {
            registry: host.resolve(registry)?,
            plugins: host.resolve(plugins)?,
            kubelet_plugins: (!host.is_system()).then(|| PathBuf::from(plugins)),
        })
    }

    /// The registration socket: `<registry>/gpu.nvidia.com-reg.sock`.
    pub fn registration_socket(&self) -> PathBuf {
        self.registry.join(registration_socket_name())
    }

    /// The plugin's directory: `<plugins>/gpu.nvidia.com`.
    pub fn plugin_dir(&self) -> PathBuf {
        self.plugins.join(DRIVER_NAME)
    }

    /// The DRA socket: `<plugins>/gpu.nvidia.com/dra.sock`.
    pub fn dra_socket(&self) -> PathBuf {
        self.plugin_dir().join(DRA_SOCKET)
    }

    /// The DRA socket's absolute path as the kubelet sees it.
    pub fn endpoint(&self) -> Result<PathBuf, ServeError> {
        let base = self.kubelet_plugins.as_ref().unwrap_or(&self.plugins);
        let socket = base.join(DRIVER_NAME).join(DRA_SOCKET);
        std::path::absolute(&socket).map_err(|source| ServeError::Endpoint {
            path: socket,
            source,
        })
    }
}

/// Why the plugin could not serve, naming the path.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("creating directory {}: {source}", path.display())]
    CreateDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{} exists and is not a socket; not replacing it", path.display())]
    NotASocket { path: PathBuf },
    #[error("removing the stale socket {}: {source}", path.display())]
    RemoveStale {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("binding {}: {source}", path.display())]
    Bind {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("making the DRA socket's path {} absolute: {source}", path.display())]
    Endpoint {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("serving on {}: {source}", path.display())]
    Serve {
        path: PathBuf,
        source: tonic::transport::Error,
    },
    #[error("the server on {} ended by itself: {why}", path.display())]
    Ended { path: PathBuf, why: String },
}

/// Makes `path` (and its parents) with mode 0750 when it is missing.
fn create_dir(path: &Path) -> Result<(), ServeError> {
    if path.is_dir() {
        return Ok(());
    }
    let err = |source| ServeError::CreateDir {
        path: path.to_path_buf(),
        source,
    };
    DirBuilder::new()
        .recursive(true)
        .mode(DIR_MODE)
        .create(path)
        .map_err(err)?;
    // The mode asked for, whatever the umask.
    fs::set_permissions(path, Permissions::from_mode(DIR_MODE)).map_err(err)?;
    tracing::info!(dir = %path.display(), mode = "0750", "created the directory");
    Ok(())
}

/// A socket this process bound: removed on shutdown only while it is still
/// the same file (not one a newer instance bound since).
#[derive(Debug)]
struct OwnedSocket {
    path: PathBuf,
    dev: u64,
    ino: u64,
}

impl OwnedSocket {
    /// Binds `path`, removing a stale socket there first.
    fn bind(path: &Path) -> Result<(UnixListener, OwnedSocket), ServeError> {
        match fs::symlink_metadata(path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(ServeError::RemoveStale {
                    path: path.to_path_buf(),
                    source,
                });
            }
            Ok(m) if m.file_type().is_socket() => {
                fs::remove_file(path).map_err(|source| ServeError::RemoveStale {
                    path: path.to_path_buf(),
                    source,
                })?;
                tracing::info!(socket = %path.display(), "removed a stale socket");
            }
            Ok(_) => {
                return Err(ServeError::NotASocket {
                    path: path.to_path_buf(),
                });
            }
        }
        let bind_err = |source| ServeError::Bind {
            path: path.to_path_buf(),
            source,
        };
        let listener = UnixListener::bind(path).map_err(bind_err)?;
        let meta = fs::symlink_metadata(path).map_err(bind_err)?;
        let owned = OwnedSocket {
            path: path.to_path_buf(),
            dev: meta.dev(),
            ino: meta.ino(),
        };
        Ok((listener, owned))
    }

    fn remove(&self) {
        match fs::symlink_metadata(&self.path) {
            Ok(m) if m.dev() == self.dev && m.ino() == self.ino => {
                match fs::remove_file(&self.path) {
                    Ok(()) => tracing::info!(socket = %self.path.display(), "removed the socket"),
                    Err(e) => {
                        tracing::warn!(socket = %self.path.display(), error = %e, "could not remove the socket")
                    }
                }
            }
            Ok(_) => {
                tracing::info!(socket = %self.path.display(), "the socket was replaced since; left as it is")
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(socket = %self.path.display(), error = %e, "could not check the socket")
            }
        }
    }
}

/// The outcome of one server's task, as an error when it ended.
fn ended(
    path: &Path,
    result: Result<Result<(), tonic::transport::Error>, tokio::task::JoinError>,
    stopping: bool,
) -> Option<ServeError> {
    let path = path.to_path_buf();
    match result {
        Ok(Ok(())) if stopping => None,
        Ok(Ok(())) => Some(ServeError::Ended {
            path,
            why: "no error".to_string(),
        }),
        Ok(Err(source)) => Some(ServeError::Serve { path, source }),
        Err(e) => Some(ServeError::Ended {
            path,
            why: e.to_string(),
        }),
    }
}

/// Waits up to `grace` for a stopped server; aborts it after that.
async fn join(
    path: &Path,
    task: &mut JoinHandle<Result<(), tonic::transport::Error>>,
    grace: Duration,
) -> Option<ServeError> {
    match tokio::time::timeout(grace, &mut *task).await {
        Ok(result) => ended(path, result, true),
        Err(_) => {
            tracing::warn!(socket = %path.display(), ?grace, "the server's calls did not finish; aborting it");
            task.abort();
            None
        }
    }
}

/// Serves the DRA plugin for the kubelet until `shutdown` resolves: makes the
/// plugin directory (0750), binds `dra.sock` (v1 and v1beta1 answering
/// through `claims`, and the health stream from `health`) and then the
/// registration socket (stale sockets removed first), keeps the kubelet's
/// verdict on `registration`, and on shutdown removes the registration
/// socket, ends the health streams, stops both servers (within
/// [`STOP_GRACE`]), removes `dra.sock` and sets `registration` back to
/// [`Registration::Unknown`]. An error: a directory or socket could not be
/// made, or a server failed (the sockets are removed then too).
pub async fn serve(
    dirs: &Dirs,
    claims: Arc<dyn Claims>,
    health: HealthSource,
    registration: watch::Sender<Registration>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let endpoint = dirs.endpoint()?;
    create_dir(&dirs.registry)?;
    create_dir(&dirs.plugin_dir())?;
    let dra_path = dirs.dra_socket();
    let reg_path = dirs.registration_socket();
    // The endpoint first: the kubelet dials it as soon as it sees the
    // registration socket.
    let (dra_listener, dra_socket) = OwnedSocket::bind(&dra_path)?;
    let (reg_listener, reg_socket) = match OwnedSocket::bind(&reg_path) {
        Ok(bound) => bound,
        Err(e) => {
            dra_socket.remove();
            return Err(e);
        }
    };

    let (stop, stopped) = watch::channel(false);
    let until_stopped = |mut rx: watch::Receiver<bool>| async move {
        // Err: the sender is gone, and serve() with it.
        let _ = rx.wait_for(|s| *s).await;
    };
    let service = DraService::new(claims);
    let health = HealthService::new(health, stopped.clone());
    let dra_server = Server::builder()
        .add_service(dra::v1::dra_plugin_server::DraPluginServer::new(
            service.clone(),
        ))
        .add_service(dra::v1beta1::dra_plugin_server::DraPluginServer::new(
            service,
        ))
        .add_service(DraResourceHealthServer::new(health))
        .serve_with_incoming_shutdown(
            gpu_grpc::incoming(dra_listener),
            until_stopped(stopped.clone()),
        );
    let reg_server = Server::builder()
        .add_service(RegistrationServer::new(RegistrationService::new(
            endpoint.clone(),
            registration.clone(),
        )))
        .serve_with_incoming_shutdown(gpu_grpc::incoming(reg_listener), until_stopped(stopped));
    let mut dra_task = tokio::spawn(dra_server);
    let mut reg_task = tokio::spawn(reg_server);
    tracing::info!(
        driver = DRIVER_NAME,
        registration = %reg_path.display(),
        dra = %dra_path.display(),
        endpoint = %endpoint.display(),
        "serving the DRA plugin"
    );

    let shutdown = std::pin::pin!(shutdown);
    // Which server ended by itself, if one did (its task is joined then).
    let (mut failure, dra_done, reg_done) = tokio::select! {
        () = shutdown => (None, false, false),
        r = &mut dra_task => (ended(&dra_path, r, false), true, false),
        r = &mut reg_task => (ended(&reg_path, r, false), false, true),
    };
    if let Some(e) = &failure {
        tracing::error!(driver = DRIVER_NAME, error = %e, "a DRA plugin server failed; stopping both");
    }
    // Deregister first, then stop serving.
    reg_socket.remove();
    let _ = stop.send(true);
    if !reg_done {
        let e = join(&reg_path, &mut reg_task, STOP_GRACE).await;
        failure = failure.or(e);
    }
    if !dra_done {
        let e = join(&dra_path, &mut dra_task, STOP_GRACE).await;
        failure = failure.or(e);
    }
    dra_socket.remove();
    registration.send_replace(Registration::Unknown);
    tracing::info!(driver = DRIVER_NAME, "the DRA plugin stopped serving");
    failure.map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests;
