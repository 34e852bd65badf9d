//! Clients we did not write, against our gRPC servers on Unix sockets:
//! - a raw HTTP/2 client (frames and HPACK by hand, no tonic, no h2) that
//!   sends the socket path, an empty string or a percent-encoded path as
//!   `:authority`, as kubelets before 1.26, grpc-java and grpcio do;
//! - Python grpcio acting as the kubelet against `gpu-agent run`.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use gpu_agent::backend::sim::SimulatedBackend;
use gpu_agent::inventory;
use gpu_agent::plugin::kubelet::MockKubelet;
use gpu_agent::plugin::manager::{KUBELET_SOCKET, PluginManager};
use gpu_agent::plugin::resources::{self, PluginSettings};
use gpu_agent::plugin::server::PluginService;
use gpu_agent_proto::deviceplugin::v1beta1::device_plugin_server::DevicePluginServer;
use gpu_agent_proto::deviceplugin::v1beta1::{
    AllocateRequest, AllocateResponse, ContainerAllocateRequest,
    ContainerPreferredAllocationRequest, DevicePluginOptions, Empty, ListAndWatchResponse,
    PreStartContainerRequest, PreStartContainerResponse, PreferredAllocationRequest,
    PreferredAllocationResponse,
};
use hostlib::HostRoot;
use loona_hpack::{Decoder, Encoder};
use prost::Message;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const ACK: u8 = 0x1;
/// HTTP/2 error code PROTOCOL_ERROR.
const PROTOCOL_ERROR: u32 = 1;

/// What the server made of one call.
#[derive(Debug)]
enum Outcome {
    /// RST_STREAM with this error code.
    Reset(u32),
    Answer {
        headers: Vec<(String, String)>,
        messages: Vec<Vec<u8>>,
        trailers: Vec<(String, String)>,
    },
}

impl Outcome {
    fn message<M: Message + Default>(&self) -> M {
        match self {
            Outcome::Answer {
                headers,
                messages,
                trailers,
            } => {
                assert!(
                    headers.iter().any(|(k, v)| k == ":status" && v == "200"),
                    "{headers:?}"
                );
                if let Some(status) = trailers.iter().find(|(k, _)| k == "grpc-status") {
                    assert_eq!(status.1, "0", "gRPC error: {trailers:?}");
                }
                M::decode(&messages.first().expect("a response message")[..]).unwrap()
            }
            Outcome::Reset(code) => panic!("stream reset with error code {code}"),
        }
    }
}

/// An HTTP/2 client with prior knowledge, written against the RFCs only.
struct RawH2 {
    s: UnixStream,
    enc: Encoder<'static>,
    dec: Decoder<'static>,
    next_stream: u32,
}

impl RawH2 {
    fn connect(path: &Path) -> Self {
        let mut s = UnixStream::connect(path).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(PREFACE).unwrap();
        let mut c = RawH2 {
            s,
            enc: Encoder::new(),
            dec: Decoder::new(),
            next_stream: 1,
        };
        c.send(SETTINGS, 0, 0, &[]);
        c
    }

    fn send(&mut self, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
        let len = (payload.len() as u32).to_be_bytes();
        let mut f = vec![len[1], len[2], len[3], kind, flags];
        f.extend(stream.to_be_bytes());
        f.extend(payload);
        self.s.write_all(&f).unwrap();
    }

    fn read_frame(&mut self) -> (u8, u8, u32, Vec<u8>) {
        let mut h = [0u8; 9];
        self.s.read_exact(&mut h).unwrap();
        let len = usize::from(h[0]) << 16 | usize::from(h[1]) << 8 | usize::from(h[2]);
        let mut payload = vec![0; len];
        self.s.read_exact(&mut payload).unwrap();
        let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
        (h[3], h[4], stream, payload)
    }

    /// Calls `path` with one request message; a streaming call returns
    /// after its first response message.
    fn call(&mut self, authority: &[u8], path: &str, request: &[u8]) -> Outcome {
        let stream = self.next_stream;
        self.next_stream += 2;
        let headers: Vec<(&[u8], &[u8])> = vec![
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", path.as_bytes()),
            (b":authority", authority),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        ];
        let block = self.enc.encode(headers);
        self.send(HEADERS, END_HEADERS, stream, &block);
        let mut body = vec![0];
        body.extend((request.len() as u32).to_be_bytes());
        body.extend(request);
        self.send(DATA, END_STREAM, stream, &body);
        let mut response_headers = Vec::new();
        let mut data = Vec::new();
        loop {
            let (kind, flags, id, payload) = self.read_frame();
            match kind {
                SETTINGS if flags & ACK == 0 => self.send(SETTINGS, ACK, 0, &[]),
                PING if flags & ACK == 0 => self.send(PING, ACK, 0, &payload),
                GOAWAY => panic!("GOAWAY: {payload:?}"),
                RST_STREAM if id == stream => {
                    return Outcome::Reset(u32::from_be_bytes(payload[..4].try_into().unwrap()));
                }
                HEADERS => {
                    let list: Vec<(String, String)> = self
                        .dec
                        .decode(&payload)
                        .unwrap()
                        .into_iter()
                        .map(|(k, v)| {
                            (String::from_utf8(k).unwrap(), String::from_utf8(v).unwrap())
                        })
                        .collect();
                    if id != stream {
                        continue;
                    }
                    if flags & END_STREAM != 0 {
                        return Outcome::Answer {
                            headers: response_headers,
                            messages: grpc_messages(&data),
                            trailers: list,
                        };
                    }
                    response_headers = list;
                }
                DATA if id == stream => {
                    data.extend(payload);
                    let messages = grpc_messages(&data);
                    if path.ends_with("ListAndWatch") && !messages.is_empty() {
                        self.send(RST_STREAM, 0, stream, &8u32.to_be_bytes()); // CANCEL
                        return Outcome::Answer {
                            headers: response_headers,
                            messages,
                            trailers: Vec::new(),
                        };
                    }
                }
                _ => {}
            }
        }
    }
}

/// Whole gRPC messages (1-byte flag, 4-byte length, body) in `data`.
fn grpc_messages(mut data: &[u8]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    while data.len() >= 5 {
        let len = u32::from_be_bytes(data[1..5].try_into().unwrap()) as usize;
        if data.len() < 5 + len {
            break;
        }
        out.push(data[5..5 + len].to_vec());
        data = &data[5 + len..];
    }
    out
}

fn sim_node() -> (
    tempfile::TempDir,
    HostRoot,
    Arc<inventory::Inventory>,
    PathBuf,
) {
    let dir = tempfile::tempdir().unwrap();
    let desc = simnode::NodeDescription::load("h100-sxm-8").unwrap();
    desc.materialize(dir.path()).unwrap();
    let host = HostRoot::new(dir.path()).unwrap();
    let inv = Arc::new(inventory::discover(&host, &SimulatedBackend::new(desc)));
    let plugin_dir = dir.path().join("var/lib/kubelet/device-plugins");
    std::fs::create_dir_all(&plugin_dir).unwrap();
    (dir, host, inv, plugin_dir)
}

/// Every DevicePlugin RPC from the raw client with `authority`.
fn every_rpc(sock: &Path, authority: &[u8]) {
    let mut c = RawH2::connect(sock);
    let opts: DevicePluginOptions = c
        .call(
            authority,
            "/v1beta1.DevicePlugin/GetDevicePluginOptions",
            &Empty {}.encode_to_vec(),
        )
        .message();
    assert!(opts.get_preferred_allocation_available);
    let list: ListAndWatchResponse = c
        .call(
            authority,
            "/v1beta1.DevicePlugin/ListAndWatch",
            &Empty {}.encode_to_vec(),
        )
        .message();
    assert_eq!(list.devices.len(), 8);
    let ids: Vec<String> = list.devices.iter().map(|d| d.id.clone()).collect();
    let pref: PreferredAllocationResponse = c
        .call(
            authority,
            "/v1beta1.DevicePlugin/GetPreferredAllocation",
            &PreferredAllocationRequest {
                container_requests: vec![ContainerPreferredAllocationRequest {
                    available_device_i_ds: ids.clone(),
                    must_include_device_i_ds: vec![],
                    allocation_size: 2,
                }],
            }
            .encode_to_vec(),
        )
        .message();
    assert_eq!(pref.container_responses[0].device_i_ds.len(), 2);
    let alloc: AllocateResponse = c
        .call(
            authority,
            "/v1beta1.DevicePlugin/Allocate",
            &AllocateRequest {
                container_requests: vec![ContainerAllocateRequest {
                    devices_ids: ids[..2].to_vec(),
                }],
            }
            .encode_to_vec(),
        )
        .message();
    assert_eq!(
        alloc.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"],
        ids[..2].join(",")
    );
    let _: PreStartContainerResponse = c
        .call(
            authority,
            "/v1beta1.DevicePlugin/PreStartContainer",
            &PreStartContainerRequest {
                devices_ids: ids[..1].to_vec(),
            }
            .encode_to_vec(),
        )
        .message();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_http2_client_gets_every_answer_whatever_its_authority() {
    let (_dir, host, inv, plugin_dir) = sim_node();
    let kubelet = MockKubelet::start(&plugin_dir.join(KUBELET_SOCKET)).unwrap();
    let settings = PluginSettings::default();
    let mgr = PluginManager::new(
        plugin_dir.clone(),
        resources::build(&inv, &settings).unwrap(),
        inv.clone(),
        Arc::new(settings),
        host,
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(mgr.run(async {
        let _ = stopped.await;
    }));
    assert!(kubelet.wait_for(1, Duration::from_secs(5)).await);
    let sock = plugin_dir.join("nvidia-gpu.sock");
    let path = sock.display().to_string();
    let encoded = path.replace('/', "%2F");
    tokio::task::spawn_blocking(move || {
        for authority in [path.as_bytes(), b"", encoded.as_bytes(), b"localhost"] {
            every_rpc(&sock, authority);
        }
    })
    .await
    .unwrap();
    let _ = stop.send(());
    task.await.unwrap().unwrap();
    kubelet.stop().await;
}

/// The control: tonic served without our layer resets the same call. When
/// h2 learns to accept such authorities, this fails, and the layer can go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_layer_h2_resets_a_path_authority() {
    let (dir, host, inv, _) = sim_node();
    let settings = PluginSettings::default();
    let resource = resources::build(&inv, &settings).unwrap().remove(0);
    let svc = PluginService::new(
        tokio::sync::watch::channel(resource).1,
        inv,
        Arc::new(settings),
        host,
    );
    let sock = dir.path().join("plain.sock");
    let listener = tokio::net::UnixListener::bind(&sock).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(DevicePluginServer::new(svc))
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::UnixListenerStream::new(listener),
                async {
                    let _ = stopped.await;
                },
            ),
    );
    let path = sock.display().to_string();
    let outcome = tokio::task::spawn_blocking(move || {
        RawH2::connect(Path::new(&path)).call(
            path.as_bytes(),
            "/v1beta1.DevicePlugin/GetDevicePluginOptions",
            &Empty {}.encode_to_vec(),
        )
    })
    .await
    .unwrap();
    assert!(
        matches!(outcome, Outcome::Reset(PROTOCOL_ERROR)),
        "{outcome:?}"
    );
    let _ = stop.send(());
    server.await.unwrap().unwrap();
}

#[test]
fn python_grpcio_kubelet_gets_every_answer_from_gpu_agent_run() {
    let py = common::python();
    let host = tempfile::tempdir().unwrap();
    let dir = host.path().join("var/lib/kubelet/device-plugins");
    std::fs::create_dir_all(&dir).unwrap();
    let kubelet = std::process::Command::new(&py)
        .arg(repo().join("tests/interop/kubelet_standin.py"))
        .arg("--proto")
        .arg(repo().join("proto/proto/deviceplugin_v1beta1.proto"))
        .arg("--dir")
        .arg(&dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait for its kubelet.sock before the agent starts.
    let ksock = dir.join(KUBELET_SOCKET);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !ksock.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "the Python kubelet did not listen"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut agent = at(host.path())
        .args(["--simulate", "h100-sxm-8", "--log-format", "json", "run"])
        .env("GPU_AGENT_LOG", "info,gpu_grpc=debug")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = kubelet.wait_with_output().unwrap();
    // The agent's status shows the grpcio kubelet's registration and list
    // (written when they happened; read here as soon as it is there).
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let st = loop {
        let (_, status, _) = run(at(host.path()).args(["status", "-o", "json"]));
        let st = json(&status);
        if st["plugin"][0]["lists"] == 1 || std::time::Instant::now() > deadline {
            break st;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(sigterm(&mut agent), Some(0));
    assert_eq!(st["plugin"][0]["registered"], true, "{st}");
    assert_eq!(st["plugin"][0]["lists"], 1, "{st}");
    let mut log = String::new();
    agent
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut log)
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the Python kubelet failed: {stdout}\n{}\nagent log:\n{log}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r = json(&stdout);
    assert_eq!(r["registrations"].as_array().unwrap().len(), 1);
    assert_eq!(r["registrations"][0]["resource_name"], "nvidia.com/gpu");
    assert_eq!(r["registrations"][0]["endpoint"], "nvidia-gpu.sock");
    assert_eq!(r["options"]["preferred"], true);
    let devices = r["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 8);
    assert!(devices.iter().all(|d| d["health"] == "Healthy"));
    let preferred: Vec<&str> = r["preferred"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(preferred.len(), 2);
    assert_eq!(
        r["allocate"]["envs"]["NVIDIA_VISIBLE_DEVICES"],
        preferred.join(",")
    );
    assert_eq!(r["bad_allocate"]["code"], "INVALID_ARGUMENT");
    assert!(
        r["bad_allocate"]["details"]
            .as_str()
            .unwrap()
            .contains("no-such-gpu")
    );
    assert_eq!(r["prestart"], "ok");
    // The allocation is logged with the devices it handed out.
    assert!(
        log.lines()
            .any(|l| l.contains("\"allocated\"") && l.contains(&preferred.join(","))),
        "no allocated line naming {preferred:?}:\n{log}"
    );
    // grpcio really sent the socket path (percent-encoded) as :authority.
    assert!(
        log.lines()
            .any(|l| l.contains("serving it as localhost") && l.contains("nvidia-gpu.sock")),
        "no rewrite logged:\n{log}"
    );
}
