//! The report task: one stream to the controller, held open; after any
//! break, a new one after a backoff with jitter, starting again with Hello
//! and a whole snapshot. Health events that happen while there is no stream
//! wait in a bounded buffer (the oldest are dropped first, and counted).
//!
//! Nothing runs while nothing changes: the task waits on the node's report,
//! the health events and the stream. A dead peer is found by TCP keepalive
//! (the kernel's, not a timer of ours).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpu_agent_proto::report::v1 as pb;
use gpu_agent_proto::report::v1::report_client::ReportClient;
use tokio::sync::{Notify, broadcast, mpsc, watch};
use tokio::time::Instant;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};

use super::{ControllerLink, ReportConfig, changes, repairs};
use gpu_model::health::EventRecord;

/// The largest message either side takes.
pub const MAX_MESSAGE: usize = 4 << 20;
/// Health events kept while disconnected (the broadcast channel's size).
pub const EVENT_BUFFER: usize = 1024;
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(60);
/// A stream that lived this long starts the backoff afresh.
const STABLE_AFTER: Duration = Duration::from_secs(60);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a stream could not start or ended.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("{path}: cannot read the controller's CA certificate: {source}")]
    Ca {
        path: String,
        #[source]
        source: std::io::Error,
    },
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
    #[error("{endpoint}: the controller refused the stream: {code:?}: {message}")]
    Refused {
        endpoint: String,
        code: tonic::Code,
        message: String,
    },
    #[error("{endpoint}: the stream ended: {message}")]
    Ended { endpoint: String, message: String },
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
}

/// Reports to the controller until cancelled (the supervisor aborts it).
pub async fn run(cfg: ReportConfig, mut inputs: Inputs) {
    let mut backoff = FIRST_BACKOFF;
    let mut dropped = 0u64;
    loop {
        let started = Instant::now();
        let outcome = stream_once(&cfg, &mut inputs, &mut dropped).await;
        let error = match outcome {
            Ok(()) => "the controller closed the stream".to_string(),
            Err(e) => e.to_string(),
        };
        if started.elapsed() >= STABLE_AFTER {
            backoff = FIRST_BACKOFF;
        }
        let wait = jitter(backoff);
        // Said when the stream is lost or the controller's answer changes,
        // not at every retry while it stays the same.
        let news = {
            let l = inputs.link.lock().unwrap_or_else(|e| e.into_inner());
            l.connected || l.last_error.as_deref() != Some(&error)
        };
        if news {
            tracing::warn!(task = "report", error = %error, retry_in_ms = wait.as_millis() as u64, "no stream to the controller; the agent goes on without it");
        } else {
            tracing::debug!(task = "report", error = %error, retry_in_ms = wait.as_millis() as u64, "no stream to the controller; the agent goes on without it");
        }
        update(&inputs, |l| {
            if l.connected || l.last_error.as_deref() != Some(&error) {
                l.since = gpu_model::util::now();
            }
            l.connected = false;
            l.last_error = Some(error.clone());
            l.dropped_events = dropped;
        });
        tokio::time::sleep(wait).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
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
    let mut l = inputs.link.lock().unwrap();
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

fn event_message(e: EventRecord) -> pb::agent_message::Body {
    pb::agent_message::Body::HealthEvent(pb::HealthEvent {
        gpu_uuid: e.uuid,
        xid: e.xid.unwrap_or(0),
        reason: e.reason,
        advice: e.advice.unwrap_or_default(),
        unhealthy: e.unhealthy,
        at_unix_ms: e.at_unix_ms,
    })
}

/// One stream: connect, Hello, snapshot, then changes until it breaks.
async fn stream_once(
    cfg: &ReportConfig,
    inputs: &mut Inputs,
    dropped: &mut u64,
) -> Result<(), ReportError> {
    let endpoint = cfg.endpoint.clone();
    let token = read_token(cfg)?;
    let ca = std::fs::read(&cfg.ca_file).map_err(|source| ReportError::Ca {
        path: cfg.ca_file.display().to_string(),
        source,
    })?;
    let bad = |message: String| ReportError::Endpoint {
        endpoint: endpoint.clone(),
        message,
    };
    let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca));
    if let Some(name) = &cfg.server_name {
        tls = tls.domain_name(name.clone());
    }
    let channel = Endpoint::from_shared(endpoint.clone())
        .map_err(|e| bad(format!("not a URL: {}", gpu_model::util::error_words(&e))))?
        .tls_config(tls)
        .map_err(|e| bad(gpu_model::util::error_words(&e)))?
        .connect_timeout(CONNECT_TIMEOUT)
        .tcp_keepalive(Some(Duration::from_secs(60)))
        .connect()
        .await
        .map_err(|e| ReportError::Connect {
            endpoint: endpoint.clone(),
            message: gpu_model::util::error_words(&e),
        })?;
    let mut client = ReportClient::new(channel)
        .max_decoding_message_size(MAX_MESSAGE)
        .max_encoding_message_size(MAX_MESSAGE);

    // What waited while there was no stream.
    let mut waiting = Vec::new();
    loop {
        match inputs.events.try_recv() {
            Ok(e) => waiting.push(e),
            Err(broadcast::error::TryRecvError::Lagged(n)) => *dropped += n,
            Err(_) => break,
        }
    }
    let (tx, rx) = mpsc::channel::<pb::AgentMessage>(64);
    let mut seq = 0u64;
    let mut next = |body| {
        seq += 1;
        pb::AgentMessage {
            seq,
            body: Some(body),
        }
    };
    let mut sent = inputs.report.borrow_and_update().clone();
    let hello = pb::Hello {
        node_name: cfg.node_name.clone(),
        agent_version: env!("CARGO_PKG_VERSION").to_string(),
        boot_id: cfg.boot_id.clone(),
        agent_started_at: cfg.started_at,
        dropped_events: *dropped,
    };
    let closed = |_| ReportError::Ended {
        endpoint: endpoint.clone(),
        message: "the stream closed while sending".into(),
    };
    tx.send(next(pb::agent_message::Body::Hello(hello)))
        .await
        .map_err(closed)?;
    tx.send(next(pb::agent_message::Body::Snapshot((*sent).clone())))
        .await
        .map_err(closed)?;
    for e in waiting {
        tx.send(next(event_message(e))).await.map_err(closed)?;
    }
    let mut request = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
    let bearer = format!("Bearer {token}")
        .parse()
        .map_err(|_| bad("the service-account token is not a valid header value".into()))?;
    request.metadata_mut().insert("authorization", bearer);
    let mut inbound = client
        .attach(request)
        .await
        .map_err(|s| ReportError::Refused {
            endpoint: endpoint.clone(),
            code: s.code(),
            message: s.message().to_string(),
        })?
        .into_inner();
    tracing::info!(task = "report", endpoint = %endpoint, node = %cfg.node_name, "reporting to the controller");
    update(inputs, |l| {
        l.connected = true;
        l.since = gpu_model::util::now();
        l.last_error = None;
        l.connects += 1;
        l.dropped_events = *dropped;
    });
    loop {
        tokio::select! {
            r = inputs.report.changed() => {
                if r.is_err() {
                    // The supervisor is stopping.
                    return Ok(());
                }
                let now = inputs.report.borrow_and_update().clone();
                if let Some(c) = changes(&sent, &now) {
                    tx.send(next(pb::agent_message::Body::Change(c))).await.map_err(closed)?;
                }
                for r in repairs(&sent, &now) {
                    tx.send(next(pb::agent_message::Body::Repair(r))).await.map_err(closed)?;
                }
                sent = now;
            }
            e = inputs.events.recv() => match e {
                Ok(e) => tx.send(next(event_message(e))).await.map_err(closed)?,
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    *dropped += n;
                    tracing::warn!(task = "report", dropped = n, "health events dropped: the controller does not keep up");
                    update(inputs, |l| l.dropped_events = *dropped);
                }
                Err(broadcast::error::RecvError::Closed) => return Ok(()),
            },
            m = inbound.message() => match m {
                Ok(Some(msg)) => desired(inputs, msg),
                Ok(None) => return Ok(()),
                Err(s) => {
                    return Err(ReportError::Ended {
                        endpoint: endpoint.clone(),
                        message: format!("{:?}: {}", s.code(), s.message()),
                    })
                }
            },
        }
    }
}

/// The controller's wishes for the node, shown in `status`; the
/// supervisor acts on them (policy, MIG layout, the driver rollout's
/// go-ahead). A drain request is not acted on, and the agent says so.
fn desired(inputs: &Inputs, msg: pb::ControllerMessage) {
    let d = match msg.body {
        Some(pb::controller_message::Body::Desired(d)) => d,
        Some(pb::controller_message::Body::DraClaims(c)) => {
            tracing::debug!(
                task = "report",
                claims = c.claims.len(),
                "the controller's claims for this node"
            );
            inputs.dra_claims.send_replace(Some(Arc::new(c)));
            return;
        }
        None => return,
    };
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
