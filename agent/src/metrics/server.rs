//! The exporter task: the HTTP endpoint and the sampler behind it.
//!
//! Sampling runs while someone scrapes: every `collectIntervalMs` until
//! [`IDLE_AFTER`] has passed without a scrape, then not at all until the
//! next one (an idle agent does nothing). A scrape renders the last sample
//! and never waits on NVML or the kubelet.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::{Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{Notify, Semaphore, watch};

use super::fields::FieldSet;
use super::pods::{self, PodMap};
use super::render::{CONTENT_TYPE, Scrape, render};
use crate::backend::{Sample, Sampler};
use crate::inventory::Inventory;
use crate::policy::DcgmExporterSpec;

/// Sampling stops this long after the last scrape.
pub const IDLE_AFTER: Duration = Duration::from_secs(300);
/// A connection that sends no complete request head for this long (a slow
/// client, or an idle keep-alive connection) is closed.
pub const READ_TIMEOUT: Duration = Duration::from_secs(30);
/// Connections served at once; more are closed on accept.
pub const MAX_CONNECTIONS: usize = 32;

/// dcgm-exporter's listen address variable, read when the policy names none.
pub const LISTEN_ENV: &str = "DCGM_EXPORTER_LISTEN";
/// dcgm-exporter's default address.
pub const DEFAULT_LISTEN: &str = ":9400";

/// What the exporter needs from the policy, checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExporterConfig {
    pub listen: SocketAddr,
    pub fields: FieldSet,
    pub interval: Duration,
}

/// A policy the exporter cannot use: names the field or file.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("spec.dcgmExporter.listen: {value:?} is not host:port or :port")]
    Listen { value: String },
    #[error("spec.dcgmExporter.config: {0}")]
    Counters(#[from] super::fields::CountersError),
    #[error("spec.dcgmExporter.collectIntervalMs: must be at least 100")]
    Interval,
}

impl ExporterConfig {
    pub fn from_spec(spec: &DcgmExporterSpec) -> Result<Self, ConfigError> {
        // dcgm-exporter's variable, as the operator's `dcgmExporter.env` sets it.
        let given = spec
            .listen
            .clone()
            .or_else(|| std::env::var(LISTEN_ENV).ok().filter(|s| !s.is_empty()))
            .unwrap_or_else(|| DEFAULT_LISTEN.to_string());
        let listen = match given.strip_prefix(':') {
            Some(port) => format!("0.0.0.0:{port}"),
            None => given.clone(),
        };
        let listen: SocketAddr = listen
            .parse()
            .map_err(|_| ConfigError::Listen { value: given })?;
        let fields = match &spec.config {
            Some(p) => FieldSet::from_file(std::path::Path::new(p))?,
            None => FieldSet::default(),
        };
        if spec.collect_interval_ms < 100 {
            return Err(ConfigError::Interval);
        }
        Ok(ExporterConfig {
            listen,
            fields,
            interval: Duration::from_millis(spec.collect_interval_ms),
        })
    }
}

/// What scrapes read and the sampler writes.
struct Shared {
    fields: FieldSet,
    hostname: String,
    inventory: watch::Receiver<Arc<Inventory>>,
    sample: Mutex<Arc<Sample>>,
    pods: Mutex<Arc<PodMap>>,
    last_scrape: Mutex<Option<Instant>>,
    scraped: Notify,
}

impl Shared {
    fn scrape(&self) -> String {
        *self.last_scrape.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
        self.scraped.notify_one();
        let sample = self
            .sample
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let pods = self.pods.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let inventory = self.inventory.borrow().clone();
        let agent = super::agent::snapshot();
        render(&Scrape {
            sample: &sample,
            inventory: &inventory,
            pods: &pods,
            fields: &self.fields,
            hostname: &self.hostname,
            agent: &agent,
        })
    }

    fn active(&self) -> bool {
        self.last_scrape
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some_and(|t| t.elapsed() < IDLE_AFTER)
    }
}

/// The node's name for the `Hostname` label: `NODE_NAME` (set from the
/// downward API in a DaemonSet), else the host name.
pub fn hostname() -> String {
    std::env::var("NODE_NAME")
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| {
            nix::unistd::gethostname()
                .ok()
                .and_then(|h| h.into_string().ok())
        })
        .unwrap_or_default()
}

/// Binds the exporter's address (before the task starts, so that the
/// agent knows the port and a taken port is reported at once).
pub fn bind(cfg: &ExporterConfig) -> Result<std::net::TcpListener, String> {
    let l = std::net::TcpListener::bind(cfg.listen)
        .map_err(|e| format!("cannot listen on {}: {e}", cfg.listen))?;
    l.set_nonblocking(true)
        .map_err(|e| format!("cannot listen on {}: {e}", cfg.listen))?;
    Ok(l)
}

/// Serves `/metrics` on `listener` and samples until an error.
/// `pod_socket` is the kubelet's pod-resources socket in this process's
/// filesystem.
pub async fn run(
    cfg: ExporterConfig,
    listener: std::net::TcpListener,
    inventory: watch::Receiver<Arc<Inventory>>,
    sampler: Box<dyn Sampler>,
    pod_socket: PathBuf,
) -> Result<(), String> {
    let listener = TcpListener::from_std(listener)
        .map_err(|e| format!("cannot listen on {}: {e}", cfg.listen))?;
    for skipped in &cfg.fields.skipped {
        tracing::warn!(stage = "metrics", "not exported: {skipped}");
    }
    tracing::info!(stage = "metrics", listen = %cfg.listen, fields = cfg.fields.fields.len(), "serving /metrics");
    let shared = Arc::new(Shared {
        fields: cfg.fields.clone(),
        hostname: hostname(),
        inventory,
        sample: Mutex::new(Arc::new(Sample::default())),
        pods: Mutex::new(Arc::default()),
        last_scrape: Mutex::new(None),
        scraped: Notify::new(),
    });
    let sampler = Arc::new(Mutex::new(sampler));
    // The first sample, so that the first scrape has one.
    sample_once(&shared, &sampler, &pod_socket).await;
    let serving = tokio::spawn(accept(listener, shared.clone()));
    let mut pods_error: Option<String> = None;
    loop {
        if shared.active() {
            tokio::time::sleep(cfg.interval).await;
        } else {
            tracing::debug!(stage = "metrics", "no scrape for a while; sampling stops");
            shared.scraped.notified().await;
        }
        if serving.is_finished() {
            return Err("the metrics listener stopped".into());
        }
        if let Some(e) = sample_once(&shared, &sampler, &pod_socket).await {
            if pods_error.as_ref() != Some(&e) {
                tracing::info!(stage = "metrics", "no pod labels: {e}");
            }
            pods_error = Some(e);
        } else {
            pods_error = None;
        }
    }
}

/// One NVML pass and one pod-resources `List`; returns why pods are unknown.
async fn sample_once(
    shared: &Arc<Shared>,
    sampler: &Arc<Mutex<Box<dyn Sampler>>>,
    pod_socket: &std::path::Path,
) -> Option<String> {
    let s = sampler.clone();
    let fields = shared.fields.clone();
    let taken = tokio::task::spawn_blocking(move || {
        s.lock().unwrap_or_else(|p| p.into_inner()).sample(&fields)
    })
    .await;
    match taken {
        Ok(Ok(sample)) => {
            *shared.sample.lock().unwrap_or_else(|p| p.into_inner()) = Arc::new(sample);
        }
        Ok(Err(e)) => {
            tracing::warn!(stage = "metrics", error = %e, "NVML sample failed; serving the last one")
        }
        Err(e) => tracing::error!(stage = "metrics", error = %e, "the sampler panicked"),
    }
    if !pod_socket.exists() {
        *shared.pods.lock().unwrap_or_else(|p| p.into_inner()) = Arc::default();
        return Some(format!("{} does not exist", pod_socket.display()));
    }
    match pods::list(pod_socket).await {
        Ok(list) => {
            let inv = shared.inventory.borrow().clone();
            *shared.pods.lock().unwrap_or_else(|p| p.into_inner()) =
                Arc::new(PodMap::from_list(&list, &inv));
            None
        }
        Err(e) => Some(e.to_string()),
    }
}

async fn accept(listener: TcpListener, shared: Arc<Shared>) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                // Out of descriptors and the like: wait, do not spin.
                tracing::warn!(stage = "metrics", error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tracing::warn!(stage = "metrics", %peer, "too many connections; closing this one");
            continue;
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let shared = shared.clone();
                async move { Ok::<_, Infallible>(answer(&shared, &req)) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(READ_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service);
            if let Err(e) = conn.await {
                tracing::debug!(stage = "metrics", %peer, error = %e, "connection ended");
            }
            drop(slot);
        });
    }
}

fn answer(shared: &Shared, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    let reply = |status: StatusCode, ctype: &str, body: String| {
        Response::builder()
            .status(status)
            .header(header::CONTENT_TYPE, ctype)
            .body(Full::new(Bytes::from(body)))
            .unwrap_or_default()
    };
    let path = req.uri().path();
    if path != "/metrics" && path != "/" {
        return reply(
            StatusCode::NOT_FOUND,
            "text/plain",
            format!("{path}: not found; metrics are at /metrics\n"),
        );
    }
    if req.method() != Method::GET {
        let mut r = reply(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            format!("{} is not allowed; use GET\n", req.method()),
        );
        r.headers_mut()
            .insert(header::ALLOW, header::HeaderValue::from_static("GET"));
        return r;
    }
    if path == "/" {
        return reply(
            StatusCode::OK,
            "text/plain",
            "gpu-agent: GPU metrics under dcgm-exporter's names at /metrics\n".into(),
        );
    }
    reply(StatusCode::OK, CONTENT_TYPE, shared.scrape())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::GpuBackend;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn try_get(port: u16, request: &str) -> std::io::Result<String> {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        s.write_all(request.as_bytes()).await?;
        let mut out = String::new();
        s.read_to_string(&mut out).await?;
        Ok(out)
    }

    async fn get(port: u16, request: &str) -> String {
        try_get(port, request).await.unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn answers_get_on_its_paths_only_and_caps_connections() {
        let (_d, sys, backend) = crate::test_support::sim_node("a10g-1");
        let inv = crate::inventory::discover(&sys, &backend).unwrap();
        let spec = DcgmExporterSpec {
            listen: Some("127.0.0.1:0".into()),
            ..Default::default()
        };
        let cfg = ExporterConfig::from_spec(&spec).unwrap();
        let listener = bind(&cfg).unwrap();
        let port = listener.local_addr().unwrap().port();
        let (_tx, rx) = watch::channel(Arc::new(inv));
        let task = tokio::spawn(run(
            cfg,
            listener,
            rx,
            backend.sampler().unwrap(),
            PathBuf::from("/nonexistent/kubelet.sock"),
        ));
        let ok = get(port, "GET /metrics HTTP/1.0\r\n\r\n").await;
        assert!(ok.starts_with("HTTP/1.0 200 OK"), "{ok}");
        assert!(
            ok.contains("content-type: text/plain; version=0.0.4"),
            "{ok}"
        );
        assert!(ok.contains("\nDCGM_FI_DEV_GPU_TEMP{gpu=\"0\","), "{ok}");
        let post = get(port, "POST /metrics HTTP/1.0\r\ncontent-length: 0\r\n\r\n").await;
        assert!(post.starts_with("HTTP/1.0 405"), "{post}");
        assert!(post.contains("allow: GET"), "{post}");
        let missing = get(port, "GET /debug/pprof HTTP/1.0\r\n\r\n").await;
        assert!(missing.starts_with("HTTP/1.0 404"), "{missing}");
        // Idle connections hold every slot: the next one is closed at once.
        let mut held = Vec::new();
        for _ in 0..MAX_CONNECTIONS {
            held.push(
                tokio::net::TcpStream::connect(("127.0.0.1", port))
                    .await
                    .unwrap(),
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let refused = tokio::time::timeout(
            Duration::from_secs(5),
            try_get(port, "GET /metrics HTTP/1.0\r\n\r\n"),
        )
        .await
        .expect("an over-limit connection is closed, not left hanging");
        // Closed unanswered: an empty read, or a reset when the request
        // was still unread at the close.
        match refused {
            Ok(text) => assert_eq!(text, ""),
            Err(e) => assert!(
                matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
                ),
                "{e}"
            ),
        }
        drop(held);
        tokio::time::sleep(Duration::from_millis(200)).await;
        let again = get(port, "GET /metrics HTTP/1.0\r\n\r\n").await;
        assert!(again.starts_with("HTTP/1.0 200 OK"), "{again}");
        task.abort();
    }
}
