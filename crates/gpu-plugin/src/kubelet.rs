//! gRPC over Unix sockets: dialing a socket, registering with the kubelet,
//! and a mock kubelet (the `Registration` service) for the demo, the tests
//! and the benchmark.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpu_agent_proto::deviceplugin::v1beta1::registration_client::RegistrationClient;
use gpu_agent_proto::deviceplugin::v1beta1::registration_server::{
    Registration, RegistrationServer,
};
use gpu_agent_proto::deviceplugin::v1beta1::{Empty, RegisterRequest, VERSION};
use tokio::net::UnixListener;
use tokio::sync::{Notify, oneshot};
use tonic::transport::Server;
use tonic::{Request, Response, Status};

/// Dialing a socket is gpu-grpc's (metrics and the workload check dial too).
pub use gpu_grpc::{DIAL_TIMEOUT, connect};

/// Why a registration failed.
#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    #[error("cannot reach the kubelet at {path}: {source}")]
    Dial {
        path: PathBuf,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("the kubelet at {path} refused {resource}: {status}")]
    Refused {
        path: PathBuf,
        resource: String,
        status: Status,
    },
}

/// Registers `resource`, served on `endpoint` (a socket name in the kubelet's
/// device-plugins directory), with the kubelet listening on `kubelet_sock`.
pub async fn register(
    kubelet_sock: &Path,
    endpoint: &str,
    resource: &str,
) -> Result<(), RegisterError> {
    let channel = connect(kubelet_sock)
        .await
        .map_err(|source| RegisterError::Dial {
            path: kubelet_sock.to_path_buf(),
            source,
        })?;
    RegistrationClient::new(channel)
        .register(RegisterRequest {
            version: VERSION.to_string(),
            endpoint: endpoint.to_string(),
            resource_name: resource.to_string(),
            options: Some(super::server::options()),
        })
        .await
        .map_err(|status| RegisterError::Refused {
            path: kubelet_sock.to_path_buf(),
            resource: resource.to_string(),
            status,
        })?;
    Ok(())
}

/// A stand-in for the kubelet's registration endpoint: it records every
/// `RegisterRequest` and answers OK (or refuses, when told to).
#[derive(Debug)]
pub struct MockKubelet {
    socket: PathBuf,
    state: Arc<MockState>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

#[derive(Debug, Default)]
struct MockState {
    requests: Mutex<Vec<RegisterRequest>>,
    /// When each registration arrived.
    times: Mutex<Vec<std::time::Instant>>,
    refuse: Mutex<Option<String>>,
    notify: Notify,
    /// Like a kubelet: list a registered plugin's devices (and keep the
    /// stream open) in the directory of `kubelet.sock`.
    list_in: Mutex<Option<PathBuf>>,
}

#[derive(Debug, Clone)]
struct MockService(Arc<MockState>);

#[tonic::async_trait]
impl Registration for MockService {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let req = request.into_inner();
        if let Some(why) = self.0.refuse.lock().unwrap().clone() {
            return Err(Status::failed_precondition(why));
        }
        if req.version != VERSION {
            return Err(Status::invalid_argument(format!(
                "unsupported version {:?}",
                req.version
            )));
        }
        self.0.times.lock().unwrap().push(std::time::Instant::now());
        if let Some(dir) = self.0.list_in.lock().unwrap().clone() {
            let endpoint = dir.join(&req.endpoint);
            tokio::spawn(async move {
                use gpu_agent_proto::deviceplugin::v1beta1::device_plugin_client::DevicePluginClient;
                let Ok(channel) = connect(&endpoint).await else {
                    return;
                };
                let Ok(stream) = DevicePluginClient::new(channel)
                    .list_and_watch(Empty {})
                    .await
                else {
                    return;
                };
                let mut stream = stream.into_inner();
                while let Ok(Some(_)) = stream.message().await {}
            });
        }
        self.0.requests.lock().unwrap().push(req);
        self.0.notify.notify_waiters();
        Ok(Response::new(Empty {}))
    }
}

impl MockKubelet {
    /// Listens on `socket` (the kubelet's `kubelet.sock`), replacing a stale file.
    pub fn start(socket: &Path) -> std::io::Result<Self> {
        let _ = std::fs::remove_file(socket);
        let listener = UnixListener::bind(socket)?;
        Ok(Self::serve(socket, async { Ok(listener) }))
    }

    /// Like a real kubelet at start: `socket` exists at once (bound) but
    /// refuses connections until it listens, `delay` later.
    pub fn start_accepting_after(socket: &Path, delay: Duration) -> std::io::Result<Self> {
        use nix::sys::socket::{AddressFamily, Backlog, SockFlag, SockType, UnixAddr};
        let _ = std::fs::remove_file(socket);
        let fd = nix::sys::socket::socket(
            AddressFamily::Unix,
            SockType::Stream,
            SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
            None,
        )?;
        nix::sys::socket::bind(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            &UnixAddr::new(socket)?,
        )?;
        Ok(Self::serve(socket, async move {
            tokio::time::sleep(delay).await;
            nix::sys::socket::listen(&fd, Backlog::new(128)?)?;
            UnixListener::from_std(std::os::unix::net::UnixListener::from(fd))
        }))
    }

    fn serve(
        socket: &Path,
        listener: impl std::future::Future<Output = std::io::Result<UnixListener>> + Send + 'static,
    ) -> Self {
        let state = Arc::new(MockState::default());
        let (stop, stopped) = oneshot::channel::<()>();
        let svc = RegistrationServer::new(MockService(state.clone()));
        let task = tokio::spawn(async move {
            let Ok(listener) = listener.await else {
                return;
            };
            let incoming = gpu_grpc::incoming(listener);
            let _ = Server::builder()
                .add_service(svc)
                .serve_with_incoming_shutdown(incoming, async {
                    let _ = stopped.await;
                })
                .await;
        });
        MockKubelet {
            socket: socket.to_path_buf(),
            state,
            stop: Some(stop),
            task: Some(task),
        }
    }

    /// Lists every registered plugin's devices, as a kubelet does (the
    /// `ListAndWatch` streams stay open).
    pub fn list_devices(self) -> Self {
        *self.state.list_in.lock().unwrap() = self.socket.parent().map(Path::to_path_buf);
        self
    }

    /// Every registration received, in order.
    pub fn registrations(&self) -> Vec<RegisterRequest> {
        self.state.requests.lock().unwrap().clone()
    }

    /// When each registration arrived, in order (for benchmarks).
    pub fn registration_times(&self) -> Vec<std::time::Instant> {
        self.state.times.lock().unwrap().clone()
    }

    /// Refuse registrations with this message (`None`: accept again).
    pub fn refuse(&self, why: Option<&str>) {
        *self.state.refuse.lock().unwrap() = why.map(str::to_string);
    }

    /// Waits until at least `n` registrations were received, or `timeout`.
    pub async fn wait_for(&self, n: usize, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.state.notify.notified();
            if self.state.requests.lock().unwrap().len() >= n {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return self.state.requests.lock().unwrap().len() >= n;
            }
        }
    }

    /// Stops serving and removes the socket.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
        let _ = std::fs::remove_file(&self.socket);
    }
}
