//! The report task: check-ins with the controller (`CheckIn`, one unary
//! call each), nothing held between them. The agent checks in at once when
//! its node's report changes, a health event comes or the DRA plugin waits
//! for a claim (`check_now`), gathering what comes within [`GATHER`];
//! otherwise on the interval the controller's last answer set. Each
//! check-in opens a connection, makes its call and closes it; the TLS
//! session is resumed from the controller's ticket, so a check-in costs a
//! round trip or two and no certificate work.
//!
//! A check-in carries the sections that changed since the last answered
//! one (the whole report on the first, when the controller asks, or after
//! a check-in that got no answer), and every health event and repair the
//! controller has not acknowledged: they wait in a bounded buffer (the
//! oldest are dropped first, and counted) until an answer takes them.
//! After a failure the next try waits a backoff with jitter; a redirect
//! (another replica holds the node's shard) is followed at once, and given
//! up for the configured endpoint when it fails.
//!
//! Nothing runs while nothing changes but the one timer of the interval.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpu_agent_proto::report::v1 as pb;
use gpu_agent_proto::report::v1::report_client::ReportClient;
use tokio::sync::{Notify, broadcast, mpsc, watch};
use tokio::time::Instant;

use super::{ControllerLink, ReportConfig, changes, repairs};
use gpu_model::health::EventRecord;

/// The largest message either side takes.
pub const MAX_MESSAGE: usize = 4 << 20;
/// Health events and repairs kept until the controller takes them.
pub const EVENT_BUFFER: usize = 1024;
/// The interval before the controller said one.
pub const FIRST_INTERVAL: Duration = Duration::from_secs(30);
/// What comes within this of a change goes in the same check-in.
pub const GATHER: Duration = Duration::from_millis(100);
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(60);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Redirects followed in a row before the agent waits a backoff.
const MAX_HOPS: u32 = 3;
/// A check-in not answered within this failed.
const CALL_TIMEOUT: Duration = Duration::from_secs(20);

/// Why a check-in could not be made or was not answered.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("{path}: cannot read the controller's CA certificate: {source}")]
    Ca {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: no usable CA certificate in it: {message}")]
    BadCa { path: String, message: String },
    #[error("{path}: cannot read the service-account token: {source}")]
    Token {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: the service-account token is empty")]
    EmptyToken { path: String },
    #[error("{endpoint}: {message}")]
    Endpoint { endpoint: String, message: String },
    #[error("{endpoint}: cannot connect: {message}")]
    Connect { endpoint: String, message: String },
    #[error("{endpoint}: the controller refused the check-in: {code:?}: {message}")]
    Refused {
        endpoint: String,
        code: tonic::Code,
        message: String,
    },
}

/// Where the task's inputs come from.
#[derive(Debug)]
pub struct Inputs {
    pub report: watch::Receiver<Arc<pb::NodeReport>>,
    pub events: broadcast::Receiver<EventRecord>,
    pub link: Arc<Mutex<ControllerLink>>,
    /// Told whenever `link` changes.
    pub changed: Arc<Notify>,
    /// The controller's wishes, for the supervisor.
    pub desired: mpsc::UnboundedSender<pb::Desired>,
    /// The claims allocated to the node (DRA), the latest whole list: read
    /// by the DRA plugin at once, even while the supervisor runs a pass.
    pub dra_claims: watch::Sender<Option<Arc<pb::DraClaims>>>,
    /// Told to check in now (the DRA plugin waits for a claim's
    /// allocation).
    pub check_now: Arc<Notify>,
}

/// What the task keeps between check-ins.
struct Link {
    /// The report as the controller last took it (`None`: it must be sent
    /// whole).
    taken: Option<Arc<pb::NodeReport>>,
    base: String,
    /// Happenings not acknowledged, with their numbers, oldest first.
    pending: VecDeque<(u64, pb::Happening)>,
    next_seq: u64,
    dropped: u64,
    desired_version: u64,
    dra_version: u64,
    interval: Duration,
    /// The replica the last answer sent this agent to.
    redirect: Option<String>,
    /// Redirects followed since the last check-in served.
    hops: u32,
    /// The report last seen (repairs are what grew since it).
    seen: Arc<pb::NodeReport>,
}

impl Link {
    /// Nothing sent yet; `seen`: the report now.
    fn new(seen: Arc<pb::NodeReport>) -> Self {
        Link {
            taken: None,
            base: String::new(),
            pending: VecDeque::new(),
            next_seq: 1,
            dropped: 0,
            desired_version: 0,
            dra_version: 0,
            interval: FIRST_INTERVAL,
            redirect: None,
            hops: 0,
            seen,
        }
    }

    fn push(&mut self, h: pb::Happening) {
        if self.pending.len() == EVENT_BUFFER {
            self.pending.pop_front();
            self.dropped += 1;
        }
        self.pending.push_back((self.next_seq, h));
        self.next_seq += 1;
    }

    /// The report changed: repairs in it are queued.
    fn saw(&mut self, now: Arc<pb::NodeReport>) {
        for r in repairs(&self.seen, &now) {
            self.push(pb::Happening {
                body: Some(pb::happening::Body::Repair(r)),
            });
        }
        self.seen = now;
    }
}

/// Reports to the controller until cancelled (the supervisor aborts it).
pub async fn run(cfg: ReportConfig, mut inputs: Inputs) {
    let seen = inputs.report.borrow_and_update().clone();
    let mut link = Link::new(seen);
    let mut tls: Option<Arc<rustls::ClientConfig>> = None;
    let mut backoff = FIRST_BACKOFF;
    // A failure's retry, until which changes do not bring a check-in forward.
    let mut retry_at: Option<Instant> = None;
    let mut due = Instant::now();
    loop {
        tokio::select! {
            _ = tokio::time::sleep_until(due) => {}
            r = inputs.report.changed() => {
                if r.is_err() {
                    return; // The supervisor is stopping.
                }
                let now = inputs.report.borrow_and_update().clone();
                link.saw(now);
                due = soon(due, retry_at);
                continue;
            }
            e = inputs.events.recv() => {
                match e {
                    Ok(e) => link.push(event_happening(e)),
                    Err(broadcast::error::RecvError::Lagged(n)) => link.dropped += n,
                    Err(broadcast::error::RecvError::Closed) => return,
                }
                due = soon(due, retry_at);
                continue;
            }
            _ = inputs.check_now.notified() => {
                due = soon(due, retry_at);
                continue;
            }
        }
        // Whatever else is there goes too.
        loop {
            match inputs.events.try_recv() {
                Ok(e) => link.push(event_happening(e)),
                Err(broadcast::error::TryRecvError::Lagged(n)) => link.dropped += n,
                Err(_) => break,
            }
        }
        if inputs.report.has_changed().unwrap_or(false) {
            let now = inputs.report.borrow_and_update().clone();
            link.saw(now);
        }
        if tls.is_none() {
            match client_config(&cfg) {
                Ok(c) => tls = Some(c),
                Err(e) => {
                    failed(&inputs, &link, &e.to_string(), &mut backoff, &mut due);
                    retry_at = Some(due);
                    continue;
                }
            }
        }
        let config = tls.clone().unwrap_or_else(|| unreachable!());
        match check_in(&cfg, &config, &mut link, &inputs).await {
            Ok(again) => {
                backoff = FIRST_BACKOFF;
                retry_at = None;
                due = if again {
                    Instant::now()
                } else {
                    Instant::now() + link.interval
                };
            }
            Err(e) => {
                let e = e.to_string();
                // What the controller took is not known: all of it again.
                link.taken = None;
                if link.redirect.take().is_some() {
                    // The replica it was sent to: back to the Service.
                    due = Instant::now();
                    retry_at = None;
                    tracing::debug!(task = "report", error = %e, "the replica the agent was sent to failed; back to the configured endpoint");
                    continue;
                }
                failed(&inputs, &link, &e, &mut backoff, &mut due);
                retry_at = Some(due);
                // A CA file fixed later is read again.
                tls = None;
            }
        }
    }
}

/// The next check-in brought forward to gather what comes in [`GATHER`],
/// unless a failure's retry is pending.
fn soon(due: Instant, retry_at: Option<Instant>) -> Instant {
    if retry_at.is_some_and(|r| r > Instant::now()) {
        return due;
    }
    due.min(Instant::now() + GATHER)
}

/// A check-in failed: said (when it is news), shown, retried later.
fn failed(inputs: &Inputs, link: &Link, error: &str, backoff: &mut Duration, due: &mut Instant) {
    let wait = jitter(*backoff);
    *backoff = (*backoff * 2).min(MAX_BACKOFF);
    *due = Instant::now() + wait;
    let news = {
        let l = inputs.link.lock().unwrap_or_else(|e| e.into_inner());
        l.connected || l.last_error.as_deref() != Some(error)
    };
    if news {
        tracing::warn!(task = "report", error = %error, retry_in_ms = wait.as_millis() as u64, "cannot check in with the controller; the agent goes on without it");
    } else {
        tracing::debug!(task = "report", error = %error, retry_in_ms = wait.as_millis() as u64, "cannot check in with the controller; the agent goes on without it");
    }
    update(inputs, |l| {
        if l.connected || l.last_error.as_deref() != Some(error) {
            l.since = gpu_model::util::now();
        }
        l.connected = false;
        l.last_error = Some(error.to_string());
        l.dropped_events = link.dropped;
        l.pending = link.pending.len() as u64;
    });
}

/// Between half of `d` and all of it, at random: agents that lost the same
/// controller do not all come back at once.
fn jitter(d: Duration) -> Duration {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|t| t.as_nanos())
            .unwrap_or(0),
    );
    let r = h.finish() as f64 / u64::MAX as f64;
    d.mul_f64(0.5 + 0.5 * r)
}

fn update(inputs: &Inputs, f: impl FnOnce(&mut ControllerLink)) {
    let mut l = inputs.link.lock().unwrap_or_else(|e| e.into_inner());
    let before = l.clone();
    f(&mut l);
    if *l != before {
        inputs.changed.notify_one();
    }
}

fn read_token(cfg: &ReportConfig) -> Result<String, ReportError> {
    let path = cfg.token_file.display().to_string();
    let token = std::fs::read_to_string(&cfg.token_file).map_err(|source| ReportError::Token {
        path: path.clone(),
        source,
    })?;
    let token = token.trim().to_string();
    if token.is_empty() {
        return Err(ReportError::EmptyToken { path });
    }
    Ok(token)
}

/// The TLS client settings, kept across check-ins: their session cache
/// holds the controller's tickets.
fn client_config(cfg: &ReportConfig) -> Result<Arc<rustls::ClientConfig>, ReportError> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let path = cfg.ca_file.display().to_string();
    let pem = std::fs::read(&cfg.ca_file).map_err(|source| ReportError::Ca {
        path: path.clone(),
        source,
    })?;
    let bad = |message: String| ReportError::BadCa {
        path: path.clone(),
        message,
    };
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&pem) {
        let cert = cert.map_err(|e| bad(e.to_string()))?;
        roots.add(cert).map_err(|e| bad(e.to_string()))?;
    }
    if roots.is_empty() {
        return Err(bad("no CERTIFICATE block".into()));
    }
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| bad(e.to_string()))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(config))
}

fn event_happening(e: EventRecord) -> pb::Happening {
    pb::Happening {
        body: Some(pb::happening::Body::HealthEvent(pb::HealthEvent {
            gpu_uuid: e.uuid,
            xid: e.xid.unwrap_or(0),
            reason: e.reason,
            advice: e.advice.unwrap_or_default(),
            unhealthy: e.unhealthy,
            at_unix_ms: e.at_unix_ms,
        })),
    }
}

/// `https://host:port` → (host, port).
fn host_port(url: &str) -> Option<(String, u16)> {
    let rest = url.strip_prefix("https://")?;
    let authority = rest.split('/').next()?;
    let (host, port) = match authority.strip_prefix('[') {
        // [v6]:port
        Some(v6) => {
            let (host, after) = v6.split_once(']')?;
            let port = match after.strip_prefix(':') {
                Some(p) => p.parse().ok()?,
                None if after.is_empty() => 443,
                None => return None,
            };
            (host, port)
        }
        None => match authority.rsplit_once(':') {
            Some((h, p)) => (h, p.parse().ok()?),
            None => (authority, 443),
        },
    };
    (!host.is_empty()).then(|| (host.to_string(), port))
}

/// One check-in. Returns whether another is due at once (a snapshot was
/// asked for, or a redirect came).
async fn check_in(
    cfg: &ReportConfig,
    tls: &Arc<rustls::ClientConfig>,
    link: &mut Link,
    inputs: &Inputs,
) -> Result<bool, ReportError> {
    let endpoint = link
        .redirect
        .clone()
        .unwrap_or_else(|| cfg.endpoint.clone());
    let token = read_token(cfg)?;
    let bad = |message: String| ReportError::Endpoint {
        endpoint: endpoint.clone(),
        message,
    };
    let (host, port) =
        host_port(&endpoint).ok_or_else(|| bad("not an https://host:port URL".into()))?;
    let name = cfg.server_name.clone().unwrap_or_else(|| host.clone());
    let server_name = rustls::pki_types::ServerName::try_from(name.clone())
        .map_err(|e| bad(format!("{name}: not a server name: {e}")))?;
    let connector = {
        let tls = tls.clone();
        tower::service_fn(move |_: http::Uri| {
            let tls = tls.clone();
            let host = host.clone();
            let server_name = server_name.clone();
            async move {
                let tcp = tokio::net::TcpStream::connect((host.as_str(), port)).await?;
                let _ = tcp.set_nodelay(true);
                let io = tokio_rustls::TlsConnector::from(tls)
                    .connect(server_name, tcp)
                    .await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(io))
            }
        })
    };
    // The scheme is http: the connector above does the TLS itself.
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{name}:{port}"))
        .map_err(|e| bad(gpu_model::util::error_words(&e)))?
        .connect_timeout(CONNECT_TIMEOUT)
        .timeout(CALL_TIMEOUT)
        .connect_with_connector(connector)
        .await
        .map_err(|e| ReportError::Connect {
            endpoint: endpoint.clone(),
            message: gpu_model::util::error_words(&e),
        })?;
    let mut client = ReportClient::new(channel)
        .max_decoding_message_size(MAX_MESSAGE)
        .max_encoding_message_size(MAX_MESSAGE);
    let now = link.seen.clone();
    let (snapshot, change) = match &link.taken {
        None => (Some((*now).clone()), None),
        Some(taken) => (None, changes(taken, &now)),
    };
    let sent_report = snapshot.is_some() || change.is_some();
    let first_seq = link.pending.front().map_or(link.next_seq, |(n, _)| *n);
    let request = pb::CheckInRequest {
        hello: Some(pb::Hello {
            node_name: cfg.node_name.clone(),
            agent_version: env!("CARGO_PKG_VERSION").to_string(),
            boot_id: cfg.boot_id.clone(),
            agent_started_at: cfg.started_at,
            dropped_events: link.dropped,
        }),
        base: link.base.clone(),
        snapshot,
        change,
        first_seq,
        happenings: link.pending.iter().map(|(_, h)| h.clone()).collect(),
        desired_version: link.desired_version,
        dra_claims_version: link.dra_version,
    };
    let mut request = tonic::Request::new(request);
    let bearer = format!("Bearer {token}")
        .parse()
        .map_err(|_| bad("the service-account token is not a valid header value".into()))?;
    request.metadata_mut().insert("authorization", bearer);
    let answer = client
        .check_in(request)
        .await
        .map_err(|s| ReportError::Refused {
            endpoint: endpoint.clone(),
            code: s.code(),
            message: s.message().to_string(),
        })?
        .into_inner();
    // The connection closes with the client, here.
    drop(client);
    if !answer.redirect.is_empty() {
        // Replicas that disagree on who holds the shard (one just took
        // it over) do not send the agent to and fro at once, for ever.
        link.hops += 1;
        if link.hops > MAX_HOPS || Some(&answer.redirect) == link.redirect.as_ref() {
            let to = answer.redirect;
            link.redirect = None;
            link.hops = 0;
            return Err(ReportError::Endpoint {
                endpoint,
                message: format!(
                    "sent on to {to} again: the replicas do not agree yet on who serves this node"
                ),
            });
        }
        tracing::debug!(task = "report", to = %answer.redirect, "the controller sends this node to another replica");
        link.redirect = Some(answer.redirect);
        link.taken = None;
        return Ok(true);
    }
    link.hops = 0;
    link.pending.retain(|(n, _)| *n > answer.acked_seq);
    link.base = answer.base;
    if answer.interval_seconds > 0 {
        link.interval = Duration::from_secs(u64::from(answer.interval_seconds));
    }
    let mut again = false;
    if answer.send_snapshot {
        link.taken = None;
        again = true;
    } else if sent_report || link.taken.is_none() {
        link.taken = Some(now);
    }
    if let Some(d) = answer.desired {
        desired(inputs, d);
    }
    link.desired_version = answer.desired_version;
    if let Some(c) = answer.dra_claims {
        tracing::debug!(
            task = "report",
            claims = c.claims.len(),
            "the controller's claims for this node"
        );
        inputs.dra_claims.send_replace(Some(Arc::new(c)));
    }
    link.dra_version = answer.dra_claims_version;
    let was = {
        let l = inputs.link.lock().unwrap_or_else(|e| e.into_inner());
        l.connected
    };
    if !was {
        tracing::info!(task = "report", endpoint = %endpoint, node = %cfg.node_name, interval_s = link.interval.as_secs(), "reporting to the controller");
    }
    update(inputs, |l| {
        if !l.connected {
            l.since = gpu_model::util::now();
        }
        l.connected = true;
        l.last_error = None;
        l.connects += 1;
        l.dropped_events = link.dropped;
        l.pending = link.pending.len() as u64;
        l.interval_s = link.interval.as_secs();
        l.served_by = link.redirect.clone();
    });
    Ok(again)
}

/// The controller's wishes for the node, shown in `status`; the
/// supervisor acts on them (policy, MIG layout, the driver rollout's
/// go-ahead). A drain request is not acted on, and the agent says so.
fn desired(inputs: &Inputs, d: pb::Desired) {
    let _ = inputs.desired.send(d.clone());
    let mut parts = Vec::new();
    if !d.policy_yaml.is_empty() {
        parts.push("the cluster's ClusterPolicy (runs instead of the policy file)".to_string());
    }
    if !d.mig_layout.is_empty() {
        parts.push(format!(
            "MIG layout {} (applied as spec.migManager.default)",
            d.mig_layout
        ));
    }
    if !d.driver_version.is_empty() {
        parts.push(format!(
            "driver {}{}",
            d.driver_version,
            if d.upgrade_go_ahead {
                " (upgrade now)"
            } else {
                " (when the rollout reaches this node)"
            }
        ));
    }
    if d.drain {
        parts.push(
            "drain (not acted on: the controller drains nodes through the API; this agent takes no drain request)"
                .into(),
        );
    }
    let text = if parts.is_empty() {
        "nothing".to_string()
    } else {
        parts.join("; ")
    };
    tracing::info!(task = "report", desired = %text, "the controller's wishes for this node");
    update(inputs, |l| l.desired = Some(text));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jitter_stays_within_half_and_whole() {
        for _ in 0..100 {
            let j = jitter(Duration::from_secs(10));
            assert!(
                j >= Duration::from_secs(5) && j <= Duration::from_secs(10),
                "{j:?}"
            );
        }
    }

    #[test]
    fn an_endpoint_gives_its_host_and_port() {
        assert_eq!(
            host_port("https://gpu-controller.gpu-agent.svc:8443"),
            Some(("gpu-controller.gpu-agent.svc".into(), 8443))
        );
        assert_eq!(
            host_port("https://10.0.0.5:8443/"),
            Some(("10.0.0.5".into(), 8443))
        );
        assert_eq!(
            host_port("https://[fd00::5]:8443"),
            Some(("fd00::5".into(), 8443))
        );
        assert_eq!(host_port("https://ctl"), Some(("ctl".into(), 443)));
        assert_eq!(host_port("http://ctl:80"), None);
    }

    #[test]
    fn the_buffer_drops_the_oldest_and_counts_them() {
        let mut link = Link::new(Arc::new(pb::NodeReport::default()));
        for _ in 0..EVENT_BUFFER + 3 {
            link.push(pb::Happening::default());
        }
        assert_eq!(link.pending.len(), EVENT_BUFFER);
        assert_eq!(link.dropped, 3);
        assert_eq!(link.pending.front().unwrap().0, 4, "numbers keep counting");
    }

    #[test]
    fn an_empty_token_is_refused_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let token = dir.path().join("token");
        std::fs::write(&token, "\n").unwrap();
        let cfg = ReportConfig {
            endpoint: "https://127.0.0.1:1".into(),
            ca_file: dir.path().join("ca.crt"),
            server_name: None,
            token_file: token.clone(),
            node_name: "n".into(),
            boot_id: String::new(),
            started_at: 0,
        };
        let e = read_token(&cfg).unwrap_err().to_string();
        assert_eq!(
            e,
            format!("{}: the service-account token is empty", token.display())
        );
    }
}
