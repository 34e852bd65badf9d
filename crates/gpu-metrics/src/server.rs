//! The exporter task: the HTTP endpoint and the sampler behind it.
//!
//! Sampling runs while someone scrapes: every `collectIntervalMs` until
//! [`IDLE_AFTER`] has passed without a scrape, then not at all until the
//! next one (an idle agent does nothing). A scrape renders the last sample
//! and never waits on NVML or the kubelet.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http::{Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::{Notify, watch};

use super::fields::FieldSet;
use super::pods::{self, PodMap};
use super::render::{CONTENT_TYPE, Scrape, render};
use crate::spec::{CountersConfig, DcgmExporterSpec};
use gpu_model::backend::{Sample, Sampler};
use gpu_model::inventory::Inventory;

/// Sampling stops this long after the last scrape.
pub const IDLE_AFTER: Duration = Duration::from_secs(300);
/// A connection that sends no complete request head for this long (a slow
/// client, or an idle keep-alive connection) is closed.
pub const READ_TIMEOUT: Duration = Duration::from_secs(10);
/// A connection whose response makes no progress for this long (a client
/// that does not read) is closed.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections served at once. When all are taken, a new connection closes
/// the oldest one that is not being answered (waiting for its request, as
/// a slow or idle client does); when every one is being answered, the new
/// one is closed on accept.
pub const MAX_CONNECTIONS: usize = 32;
/// Each connection's read and write buffer (hyper's smallest is 8 KiB); a
/// request head larger than this is refused (431).
pub const MAX_BUF_BYTES: usize = 16 * 1024;
/// Header fields taken in one request.
pub const MAX_HEADERS: usize = 64;

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
            Some(c @ CountersConfig::Inline { text, .. }) => FieldSet::parse(text, &c.origin())?,
            Some(CountersConfig::File(p)) => FieldSet::from_file(std::path::Path::new(p))?,
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

/// Whether the series carry pod labels, as the last sample found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum PodLabels {
    /// Not sampled yet.
    #[default]
    Unknown,
    /// The kubelet's pod-resources API answered.
    Attributed,
    /// It did not: why (the socket is missing, or what the kubelet said).
    Missing(String),
}

/// Serves `/metrics` on `listener` and samples until an error.
/// `pod_socket` is the kubelet's pod-resources socket in this process's
/// filesystem; whether it answers goes to `pod_labels` (with `changed`
/// told when that changes).
pub async fn run(
    cfg: ExporterConfig,
    listener: std::net::TcpListener,
    inventory: watch::Receiver<Arc<Inventory>>,
    sampler: Box<dyn Sampler>,
    pod_socket: PathBuf,
    pod_labels: watch::Sender<PodLabels>,
    changed: Arc<Notify>,
) -> Result<(), String> {
    let listener = TcpListener::from_std(listener)
        .map_err(|e| format!("cannot listen on {}: {e}", cfg.listen))?;
    for skipped in &cfg.fields.skipped {
        tracing::warn!(stage = "metrics", "not exported: {skipped}");
    }
    for note in &cfg.fields.notes {
        tracing::info!(stage = "metrics", "{note}");
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
    let publish = |now: PodLabels| {
        if pod_labels.send_if_modified(|p| {
            let differs = *p != now;
            *p = now;
            differs
        }) {
            changed.notify_one();
        }
    };
    // The first sample, so that the first scrape has one.
    publish(match sample_once(&shared, &sampler, &pod_socket).await {
        None => PodLabels::Attributed,
        Some(e) => PodLabels::Missing(e),
    });
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
        let pods = sample_once(&shared, &sampler, &pod_socket).await;
        publish(match &pods {
            None => PodLabels::Attributed,
            Some(e) => PodLabels::Missing(e.clone()),
        });
        if let Some(e) = pods {
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

/// One open connection, as the accept loop sees it.
#[derive(Debug, Default)]
struct Conn {
    /// Answering a request now (from its head until its body is handed over).
    busy: AtomicBool,
    /// Told when the connection is to be closed to make room.
    close: Notify,
    /// When the answer to the latest request must have been written.
    deadline: Mutex<Option<Instant>>,
}

/// The open connections, oldest first.
#[derive(Debug, Default)]
struct Conns {
    next: u64,
    open: BTreeMap<u64, Arc<Conn>>,
}

impl Conns {
    /// A place for a new connection: free, or made by closing the oldest
    /// connection that is not being answered. None when all are answering.
    fn admit(&mut self) -> Option<(u64, Arc<Conn>)> {
        if self.open.len() >= MAX_CONNECTIONS {
            let idle = self
                .open
                .iter()
                .find(|(_, c)| !c.busy.load(Ordering::Acquire))
                .map(|(id, _)| *id)?;
            if let Some(c) = self.open.remove(&idle) {
                c.close.notify_one();
            }
        }
        let id = self.next;
        self.next += 1;
        let conn = Arc::new(Conn::default());
        self.open.insert(id, conn.clone());
        Some((id, conn))
    }
}

/// A response body that marks its connection busy while it lives.
struct Answer {
    body: Full<Bytes>,
    _busy: Busy,
}

struct Busy(Arc<Conn>);

impl Busy {
    fn new(conn: Arc<Conn>) -> Self {
        conn.busy.store(true, Ordering::Release);
        *conn.deadline.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(Instant::now() + WRITE_TIMEOUT);
        Busy(conn)
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.busy.store(false, Ordering::Release);
    }
}

impl hyper::body::Body for Answer {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Bytes>, Infallible>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// A socket whose writes fail with `TimedOut` once [`WRITE_TIMEOUT`] has
/// passed since the request being answered came in (a client that does not
/// read, or reads a trickle): the answer's deadline, as Go's
/// `http.Server.WriteTimeout`. HTTP/1 answers in order and takes no new
/// request while an answer is stuck, so a stuck one is not rescued by the
/// requests behind it.
struct WriteDeadline<T> {
    io: T,
    conn: Arc<Conn>,
    sleep: Pin<Box<tokio::time::Sleep>>,
}

impl<T> WriteDeadline<T> {
    fn new(io: T, conn: Arc<Conn>) -> Self {
        WriteDeadline {
            io,
            conn,
            sleep: Box::pin(tokio::time::sleep(WRITE_TIMEOUT)),
        }
    }

    /// Runs a write unless the answer's deadline has passed; a write that
    /// cannot go on wakes the task at the deadline.
    fn write<R>(
        &mut self,
        cx: &mut Context<'_>,
        f: impl FnOnce(Pin<&mut T>, &mut Context<'_>) -> Poll<io::Result<R>>,
    ) -> Poll<io::Result<R>>
    where
        T: Unpin,
    {
        let deadline = *self.conn.deadline.lock().unwrap_or_else(|p| p.into_inner());
        let Some(deadline) = deadline else {
            return f(Pin::new(&mut self.io), cx);
        };
        let late = || {
            Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the answer was not taken within {WRITE_TIMEOUT:?}"),
            )))
        };
        if Instant::now() >= deadline {
            return late();
        }
        let p = f(Pin::new(&mut self.io), cx);
        if p.is_pending() {
            let at = tokio::time::Instant::from_std(deadline);
            if self.sleep.deadline() != at {
                self.sleep.as_mut().reset(at);
            }
            if self.sleep.as_mut().poll(cx).is_ready() {
                return late();
            }
        }
        p
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for WriteDeadline<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for WriteDeadline<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.write(cx, |io, cx| io.poll_write(cx, buf))
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.write(cx, |io, cx| io.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.write(cx, |io, cx| io.poll_flush(cx))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

async fn accept(listener: TcpListener, shared: Arc<Shared>) {
    let conns = Arc::new(Mutex::new(Conns::default()));
    // Connections closed on accept so far (logged at 1, 2, 4, 8...).
    let mut refused = 0u64;
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
        let admitted = conns.lock().unwrap_or_else(|p| p.into_inner()).admit();
        let Some((id, conn)) = admitted else {
            refused += 1;
            if refused.is_power_of_two() {
                tracing::warn!(stage = "metrics", %peer, limit = MAX_CONNECTIONS, refused, "every connection is being answered; closing this one");
            }
            continue;
        };
        let (shared, conns) = (shared.clone(), conns.clone());
        tokio::spawn(async move {
            let on_request = conn.clone();
            let service = hyper::service::service_fn(move |req| {
                let shared = shared.clone();
                let busy = Busy::new(on_request.clone());
                async move {
                    let r = answer(&shared, &req);
                    Ok::<_, Infallible>(r.map(|body| Answer { body, _busy: busy }))
                }
            });
            let served = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(READ_TIMEOUT)
                .max_buf_size(MAX_BUF_BYTES)
                .max_headers(MAX_HEADERS)
                .serve_connection(
                    TokioIo::new(WriteDeadline::new(stream, conn.clone())),
                    service,
                );
            tokio::select! {
                r = served => if let Err(e) = r {
                    tracing::debug!(stage = "metrics", %peer, error = %e, "connection ended");
                },
                () = conn.close.notified() => {
                    tracing::debug!(stage = "metrics", %peer, "closed an idle connection to make room for a new one");
                }
            }
            conns
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .open
                .remove(&id);
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
    use gpu_model::backend::GpuBackend;
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

    /// The counters ConfigMap's file as gpu-controller sends it: the
    /// fields it lists, its bad lines named by ConfigMap and line.
    #[test]
    fn an_inline_counters_file_is_read_as_a_file_would_be() {
        let spec = DcgmExporterSpec {
            listen: Some("127.0.0.1:0".into()),
            config: Some(CountersConfig::Inline {
                name: Some("custom-dcgm-metrics".into()),
                text: "# field, type, help\nDCGM_FI_DEV_GPU_TEMP, gauge, t\nnot a line\n".into(),
            }),
            ..Default::default()
        };
        let cfg = ExporterConfig::from_spec(&spec).unwrap();
        assert_eq!(
            cfg.fields.fields.iter().copied().collect::<Vec<_>>(),
            [super::super::fields::Field::GpuTemp]
        );
        assert_eq!(cfg.fields.skipped.len(), 1);
        assert!(
            cfg.fields.skipped[0]
                .starts_with("ConfigMap custom-dcgm-metrics, dcgm-metrics.csv:3: "),
            "{:?}",
            cfg.fields.skipped
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn answers_get_on_its_paths_only_and_makes_room_by_closing_idle_connections() {
        let (_d, sys, backend) = crate::test_support::sim_node("a10g-1");
        let inv = gpu_backend::discover::discover(&sys, &backend);
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
            watch::channel(PodLabels::Unknown).0,
            Arc::new(Notify::new()),
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
        // Idle connections hold every slot: the next one closes the oldest
        // and is answered.
        let mut held = Vec::new();
        for _ in 0..MAX_CONNECTIONS {
            held.push(
                tokio::net::TcpStream::connect(("127.0.0.1", port))
                    .await
                    .unwrap(),
            );
            // Accepted in this order.
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let served = tokio::time::timeout(
            Duration::from_secs(5),
            get(port, "GET /metrics HTTP/1.0\r\n\r\n"),
        )
        .await
        .expect("a scrape is answered while idle connections hold every slot");
        assert!(served.starts_with("HTTP/1.0 200 OK"), "{served}");
        let mut oldest = held.remove(0);
        let mut rest = Vec::new();
        let closed = tokio::time::timeout(Duration::from_secs(5), oldest.read_to_end(&mut rest))
            .await
            .expect("the oldest idle connection was closed");
        assert!(matches!(closed, Ok(0)), "{closed:?}");
        drop(held);
        task.abort();
    }
}
