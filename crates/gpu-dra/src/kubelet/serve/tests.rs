//! The sockets' paths, their making and cleaning, and a serve that stops.

use std::collections::BTreeMap;

use gpu_model::health::HealthView;

use super::*;
use crate::claim::{ClaimRef, PrepareOutcome};
use crate::claims::NodeDevice;

struct NoClaims;

impl Claims for NoClaims {
    fn prepare(&self, claims: &[ClaimRef]) -> BTreeMap<String, PrepareOutcome> {
        claims
            .iter()
            .map(|c| (c.uid.clone(), Ok(Vec::new())))
            .collect()
    }
    fn unprepare(&self, claims: &[ClaimRef]) -> BTreeMap<String, Result<(), String>> {
        claims.iter().map(|c| (c.uid.clone(), Ok(()))).collect()
    }
}

/// One GPU, and a health monitor that is gone (its devices Unknown).
fn health() -> HealthSource {
    let table = BTreeMap::from([(
        "gpu-0".to_string(),
        NodeDevice {
            minor: 0,
            uuid: "GPU-a".to_string(),
            gpu_uuid: "GPU-a".to_string(),
        },
    )]);
    HealthSource::new(
        "node-a",
        watch::channel(table).1,
        watch::channel(HealthView::default()).1,
    )
}

#[test]
fn default_paths_are_the_kubelets() {
    let d = Dirs::default();
    assert_eq!(
        d.registration_socket(),
        Path::new("/var/lib/kubelet/plugins_registry/gpu.nvidia.com-reg.sock")
    );
    assert_eq!(
        d.dra_socket(),
        Path::new("/var/lib/kubelet/plugins/gpu.nvidia.com/dra.sock")
    );
    assert_eq!(
        d.endpoint().unwrap(),
        Path::new("/var/lib/kubelet/plugins/gpu.nvidia.com/dra.sock")
    );
}

#[test]
fn dirs_on_a_host_root_are_reached_through_it_and_the_endpoint_is_the_hosts() {
    let tmp = tempfile::tempdir().unwrap();
    let host = HostRoot::new(tmp.path()).unwrap();
    let d = Dirs::on(&host, KUBELET_REGISTRY_DIR, KUBELET_PLUGINS_DIR).unwrap();
    assert_eq!(
        d.registration_socket(),
        tmp.path()
            .join("var/lib/kubelet/plugins_registry/gpu.nvidia.com-reg.sock")
    );
    assert_eq!(
        d.dra_socket(),
        tmp.path()
            .join("var/lib/kubelet/plugins/gpu.nvidia.com/dra.sock")
    );
    assert_eq!(
        d.endpoint().unwrap(),
        Path::new("/var/lib/kubelet/plugins/gpu.nvidia.com/dra.sock")
    );
    // On the process's own root nothing is mapped.
    let system = Dirs::on(
        &HostRoot::system(),
        KUBELET_REGISTRY_DIR,
        KUBELET_PLUGINS_DIR,
    )
    .unwrap();
    assert_eq!(system, Dirs::default());
    assert!(Dirs::on(&host, "relative", KUBELET_PLUGINS_DIR).is_err());
}

#[test]
fn the_endpoint_is_the_kubelets_path_and_absolute() {
    let d = Dirs {
        registry: PathBuf::from("/host/var/lib/kubelet/plugins_registry"),
        plugins: PathBuf::from("/host/var/lib/kubelet/plugins"),
        kubelet_plugins: Some(PathBuf::from("/var/lib/kubelet/plugins")),
    };
    assert_eq!(
        d.dra_socket(),
        Path::new("/host/var/lib/kubelet/plugins/gpu.nvidia.com/dra.sock")
    );
    assert_eq!(
        d.endpoint().unwrap(),
        Path::new("/var/lib/kubelet/plugins/gpu.nvidia.com/dra.sock")
    );
    let relative = Dirs {
        plugins: PathBuf::from("plugins"),
        ..Dirs::default()
    };
    let e = relative.endpoint().unwrap();
    assert!(e.is_absolute(), "{}", e.display());
    assert!(e.ends_with("plugins/gpu.nvidia.com/dra.sock"));
}

#[tokio::test]
async fn a_stale_socket_is_replaced_and_a_file_is_not() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.sock");
    drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
    assert!(path.exists());
    let (_listener, owned) = OwnedSocket::bind(&path).unwrap();
    assert!(tokio::net::UnixStream::connect(&path).await.is_ok());
    owned.remove();
    assert!(!path.exists());

    let file = dir.path().join("file.sock");
    fs::write(&file, "not a socket").unwrap();
    let err = OwnedSocket::bind(&file).unwrap_err();
    assert!(matches!(err, ServeError::NotASocket { .. }), "{err:?}");
    assert!(err.to_string().contains("file.sock"), "{err}");
    assert!(file.exists());
}

#[tokio::test]
async fn a_socket_replaced_since_is_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.sock");
    let (_old, owned) = OwnedSocket::bind(&path).unwrap();
    // A newer instance binds the same path.
    let (_new, _newer) = OwnedSocket::bind(&path).unwrap();
    owned.remove();
    assert!(path.exists());
}

#[tokio::test]
async fn serve_makes_the_sockets_and_removes_them_when_told_to_stop() {
    let dir = tempfile::tempdir().unwrap();
    let dirs = Dirs {
        registry: dir.path().join("plugins_registry"),
        plugins: dir.path().join("plugins"),
        kubelet_plugins: None,
    };
    // A stale registration socket from an earlier run.
    fs::create_dir_all(&dirs.registry).unwrap();
    drop(std::os::unix::net::UnixListener::bind(dirs.registration_socket()).unwrap());
    let (tx, rx) = watch::channel(Registration::Registered);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn({
        let dirs = dirs.clone();
        async move {
            serve(&dirs, Arc::new(NoClaims), health(), tx, async {
                let _ = stopped.await;
            })
            .await
        }
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while tokio::net::UnixStream::connect(dirs.registration_socket())
        .await
        .is_err()
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no registration socket"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        tokio::net::UnixStream::connect(dirs.dra_socket())
            .await
            .is_ok()
    );
    let mode = fs::metadata(dirs.plugin_dir())
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o750);
    stop.send(()).unwrap();
    task.await.unwrap().unwrap();
    assert!(!dirs.registration_socket().exists());
    assert!(!dirs.dra_socket().exists());
    assert!(dirs.plugin_dir().is_dir());
    assert_eq!(*rx.borrow(), Registration::Unknown);
}

#[tokio::test]
async fn serve_names_the_path_it_cannot_bind() {
    let dir = tempfile::tempdir().unwrap();
    let dirs = Dirs {
        registry: dir.path().join("plugins_registry"),
        plugins: dir.path().join("plugins"),
        kubelet_plugins: None,
    };
    fs::create_dir_all(&dirs.registry).unwrap();
    fs::write(dirs.registration_socket(), "").unwrap();
    let (tx, _rx) = watch::channel(Registration::Unknown);
    let err = serve(
        &dirs,
        Arc::new(NoClaims),
        health(),
        tx,
        std::future::pending(),
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("gpu.nvidia.com-reg.sock"), "{err}");
    // The DRA socket bound before it is gone again.
    assert!(!dirs.dra_socket().exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubelet_connection_left_open_does_not_hold_up_the_stop() {
    use gpu_agent_proto::dra::v1::dra_plugin_client::DraPluginClient;
    use gpu_agent_proto::dra::v1::{Claim, NodePrepareResourcesRequest};
    use gpu_agent_proto::dra_health::v1alpha1::NodeWatchResourcesRequest;
    use gpu_agent_proto::dra_health::v1alpha1::dra_resource_health_client::DraResourceHealthClient;

    let dir = tempfile::tempdir().unwrap();
    let dirs = Dirs {
        registry: dir.path().join("plugins_registry"),
        plugins: dir.path().join("plugins"),
        kubelet_plugins: None,
    };
    let (tx, _rx) = watch::channel(Registration::Unknown);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn({
        let dirs = dirs.clone();
        async move {
            serve(&dirs, Arc::new(NoClaims), health(), tx, async {
                let _ = stopped.await;
            })
            .await
        }
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let channel = loop {
        if let Ok(c) = gpu_grpc::connect(&dirs.dra_socket()).await {
            break c;
        }
        assert!(tokio::time::Instant::now() < deadline, "no DRA socket");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    // One call, and the connection kept, as the kubelet keeps it.
    let mut client = DraPluginClient::new(channel);
    let r = client
        .node_prepare_resources(NodePrepareResourcesRequest {
            claims: vec![Claim {
                namespace: "ns".to_string(),
                uid: "u".to_string(),
                name: "c".to_string(),
            }],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.claims["u"].error, "");
    // And a health stream held open, as the kubelet holds it.
    let mut watch = DraResourceHealthClient::new(client_channel(&dirs).await)
        .node_watch_resources(NodeWatchResourcesRequest {})
        .await
        .unwrap()
        .into_inner();
    let first = watch.message().await.unwrap().unwrap();
    assert_eq!(first.devices.len(), 1);
    let started = std::time::Instant::now();
    stop.send(()).unwrap();
    task.await.unwrap().unwrap();
    assert!(
        started.elapsed() < STOP_GRACE,
        "the stop took {:?}",
        started.elapsed()
    );
    assert!(!dirs.dra_socket().exists());
    // The stream ended, saying why.
    let end = watch.message().await.unwrap_err();
    assert_eq!(end.code(), tonic::Code::Unavailable, "{end:?}");
    assert!(end.message().contains("stopping"), "{end:?}");
    drop(client);
}

async fn client_channel(dirs: &Dirs) -> tonic::transport::Channel {
    gpu_grpc::connect(&dirs.dra_socket()).await.unwrap()
}
