//! The report service agents check in with. A check-in (`CheckIn`, one
//! unary call): a bearer token checked first (TokenReview, cached by the
//! token's hash), then its Hello must name the node the token is bound to;
//! the fleet takes what it brings and answers (`fleet/check_in.rs`).
//!
//! The held stream of earlier agents (`Attach`) is still served: a bearer
//! token, then a Hello for the node the token is bound to, then a
//! snapshot, then changes, health events and repairs in sequence. A stream
//! that breaks the rules (a message too large, out of sequence, a change
//! before its snapshot, a flood) is cut off with a status saying why; the
//! controller and every other stream go on.

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_agent_proto::report::v1 as pb;
use gpu_agent_proto::report::v1::report_server::{Report, ReportServer};
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

use crate::auth::{AuthError, Authenticator};
use crate::fleet::Fleet;

/// HTTP/2 streams one connection may hold open (an agent holds one).
pub const STREAMS_PER_CONNECTION: u32 = 4;

/// A connection counted against the cap while it lives.
#[derive(Debug)]
pub struct Capped {
    io: tokio::net::TcpStream,
    _slot: tokio::sync::OwnedSemaphorePermit,
}

/// The listener's connections, at most `max` at once: one past the cap is
/// closed as it comes (logged at the 1st, 2nd, 4th, ... refusal), so a
/// flood of idle connections cannot take the controller's memory.
pub fn capped(
    listener: tokio::net::TcpListener,
    max: usize,
) -> impl Stream<Item = std::io::Result<Capped>> + Send + 'static {
    let slots = Arc::new(tokio::sync::Semaphore::new(max));
    let mut refused = 0u64;
    tokio_stream::StreamExt::filter_map(
        tokio_stream::wrappers::TcpListenerStream::new(listener),
        move |conn| match conn {
            Err(e) => Some(Err(e)),
            Ok(io) => match slots.clone().try_acquire_owned() {
                Ok(slot) => Some(Ok(Capped { io, _slot: slot })),
                Err(_) => {
                    refused += 1;
                    if refused.is_power_of_two() {
                        let peer = io
                            .peer_addr()
                            .map_or_else(|_| "?".to_string(), |a| a.to_string());
                        tracing::warn!(
                            peer = %peer,
                            max,
                            refused,
                            "connection closed: already holding the most connections allowed (--max-connections)"
                        );
                    }
                    None
                }
            },
        },
    )
}

impl tonic::transport::server::Connected for Capped {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

impl tokio::io::AsyncRead for Capped {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for Capped {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
    fn poll_flush(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// Agents check in at least this often by default (`--check-in-interval`).
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(30);
/// Check-ins a second one replica takes at most, by default: past it the
/// interval grows (`--check-in-rate`).
pub const DEFAULT_RATE: u32 = 500;

/// The largest message taken from an agent.
pub const MAX_MESSAGE: usize = 4 << 20;
/// The Hello must come within this time.
const HELLO_WITHIN: Duration = Duration::from_secs(10);
/// A stream may send this many messages per second on average, with bursts
/// up to [`BURST`].
const RATE: f64 = 50.0;
const BURST: f64 = 2000.0;

/// The service.
pub struct ReportService {
    fleet: Arc<Fleet>,
    auth: Arc<dyn Authenticator>,
    /// Whether this replica leads (only the leader serves agents).
    leader: tokio::sync::watch::Receiver<bool>,
    /// Why it does not, and the Lease's `namespace/name`.
    standing: Option<(tokio::sync::watch::Receiver<crate::lease::Standing>, String)>,
    /// The check-ins' pace: every `interval`, stretched so that this
    /// replica takes at most `rate` check-ins a second.
    interval: Duration,
    rate: u32,
    /// With sharding: this replica's shards, and its identity.
    shards: Option<(
        tokio::sync::watch::Receiver<crate::shards::ShardMap>,
        String,
    )>,
}

impl std::fmt::Debug for ReportService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReportService").finish_non_exhaustive()
    }
}

impl ReportService {
    pub fn new(
        fleet: Arc<Fleet>,
        auth: Arc<dyn Authenticator>,
        leader: tokio::sync::watch::Receiver<bool>,
    ) -> Self {
        ReportService {
            fleet,
            auth,
            leader,
            standing: None,
            interval: DEFAULT_INTERVAL,
            rate: DEFAULT_RATE,
            shards: None,
        }
    }

    /// Nodes are served by the holder of their shard: this replica
    /// (`identity`) serves those of `shards`' `mine` whether it leads or
    /// not, and sends the agents of the others to their holder.
    pub fn with_shards(
        mut self,
        shards: tokio::sync::watch::Receiver<crate::shards::ShardMap>,
        identity: &str,
    ) -> Self {
        self.shards = Some((shards, identity.to_string()));
        self
    }

    /// Whether this replica serves `node` now: `Ok(None)` yes,
    /// `Ok(Some(address))` its shard's holder does, `Err`: nobody can now.
    fn serves(&self, node: &str) -> Result<Option<String>, Status> {
        let Some((shards, me)) = &self.shards else {
            if !*self.leader.borrow() {
                return Err(Status::unavailable(self.not_leading()));
            }
            return Ok(None);
        };
        let map = shards.borrow();
        if map.owns(node) {
            return Ok(None);
        }
        let shard = crate::shards::shard_of(node, map.count.max(1));
        match map.holder_of(node) {
            Some(h) if &h.identity != me && !h.address.is_empty() => Ok(Some(h.address.clone())),
            _ => Err(Status::unavailable(format!(
                "node {node}'s shard {shard} has no gpu-controller replica holding it now ({}): check in again",
                map.words()
            ))),
        }
    }

    /// Agents check in every `interval`, or less often where this replica
    /// would otherwise take more than `rate` check-ins a second.
    pub fn with_pace(mut self, interval: Duration, rate: u32) -> Self {
        self.interval = interval;
        self.rate = rate.max(1);
        self
    }

    /// The interval told to agents now.
    fn pace(&self) -> Duration {
        let nodes = self.fleet.len() as u64;
        self.interval
            .max(Duration::from_secs(nodes.div_ceil(u64::from(self.rate))))
    }

    /// Who the token is, as a status for the agent.
    async fn who<T>(&self, req: &Request<T>, what: &str) -> Result<crate::auth::Identity, Status> {
        let peer = req
            .remote_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|| "?".into());
        let token = bearer(req).map_err(|e| Status::unauthenticated(e.to_string()))?;
        self.auth.authenticate(&token).await.map_err(|e| {
            tracing::warn!(peer, call = what, error = %e, "agent refused");
            match e {
                AuthError::Review(_) => Status::unavailable(e.to_string()),
                _ => Status::unauthenticated(e.to_string()),
            }
        })
    }

    /// Agents turned away are told why this replica does not lead.
    pub fn with_standing(
        mut self,
        standing: tokio::sync::watch::Receiver<crate::lease::Standing>,
        lease: String,
    ) -> Self {
        self.standing = Some((standing, lease));
        self
    }

    /// Why this replica does not serve agents, in words.
    fn not_leading(&self) -> String {
        let why = match &self.standing {
            Some((s, lease)) => s.borrow().words(lease),
            None => "standing by (another holds the Lease)".into(),
        };
        format!("this gpu-controller replica does not lead: {why}: connect again")
    }

    /// The tonic service, with the message size limits.
    pub fn server(self) -> ReportServer<Self> {
        ReportServer::new(self)
            .max_decoding_message_size(MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE)
    }
}

fn bearer<T>(req: &Request<T>) -> Result<String, AuthError> {
    let value = req
        .metadata()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .ok_or(AuthError::NoToken)?;
    value
        .strip_prefix("Bearer ")
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty())
        .ok_or(AuthError::NoToken)
}

type Down = Pin<Box<dyn Stream<Item = Result<pb::ControllerMessage, Status>> + Send>>;

#[tonic::async_trait]
impl Report for ReportService {
    type AttachStream = Down;

    async fn check_in(
        &self,
        req: Request<pb::CheckInRequest>,
    ) -> Result<Response<pb::CheckInAnswer>, Status> {
        let who = self.who(&req, "CheckIn").await?;
        let msg = req.into_inner();
        let Some(hello) = &msg.hello else {
            return Err(Status::invalid_argument("a check-in without its Hello"));
        };
        if hello.node_name != who.node_name {
            tracing::warn!(claimed = %hello.node_name, bound = %who.node_name, "check-in refused: wrong node");
            return Err(Status::permission_denied(format!(
                "this token's pod runs on node {}, not on {}: an agent reports only for its own node",
                who.node_name, hello.node_name
            )));
        }
        if msg.snapshot.is_some() && msg.change.is_some() {
            return Err(Status::invalid_argument(
                "a check-in with both a snapshot and a change",
            ));
        }
        let node = who.node_name;
        if let Some(redirect) = self.serves(&node)? {
            return Ok(Response::new(pb::CheckInAnswer {
                redirect,
                ..Default::default()
            }));
        }
        Ok(Response::new(self.fleet.check_in(&node, msg, self.pace())))
    }

    async fn attach(
        &self,
        req: Request<Streaming<pb::AgentMessage>>,
    ) -> Result<Response<Down>, Status> {
        let peer = req
            .remote_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|| "?".into());
        if self.shards.is_none() && !*self.leader.borrow() {
            return Err(Status::unavailable(self.not_leading()));
        }
        let who = self.who(&req, "Attach").await?;
        let mut up = req.into_inner();
        let first = tokio::time::timeout(HELLO_WITHIN, up.message())
            .await
            .map_err(|_| Status::invalid_argument("no Hello within 10 s"))??
            .ok_or_else(|| Status::invalid_argument("the stream ended before its Hello"))?;
        let hello = match first.body {
            Some(pb::agent_message::Body::Hello(h)) if first.seq == 1 => h,
            _ => {
                return Err(Status::invalid_argument(
                    "the first message must be Hello, seq 1",
                ));
            }
        };
        if hello.node_name != who.node_name {
            tracing::warn!(peer, claimed = %hello.node_name, bound = %who.node_name, "report stream refused: wrong node");
            return Err(Status::permission_denied(format!(
                "this token's pod runs on node {}, not on {}: an agent reports only for its own node",
                who.node_name, hello.node_name
            )));
        }
        let node = hello.node_name.clone();
        // With sharding, a stream (an agent that does not check in) is
        // held by its shard's holder only: it cannot follow a redirect.
        if let Some(at) = self.serves(&node)? {
            return Err(Status::unavailable(format!(
                "node {node} is served by the gpu-controller replica at {at}: connect again"
            )));
        }
        tracing::info!(node, peer, version = %hello.agent_version, dropped_events = hello.dropped_events, "agent connected");
        let (tx, rx) = mpsc::channel::<Result<pb::ControllerMessage, Status>>(8);
        // What is wanted of the node goes down first, then when it changes.
        let (id, mut kicked) = self.fleet.connect(hello, tx.clone());
        let fleet = self.fleet.clone();
        let leader = self.leader.clone();
        let not_leading = self.standing.clone();
        tokio::spawn(async move {
            let why = tokio::select! {
                r = follow(&fleet, &node, &mut up) => match r {
                    Ok(()) => "the agent closed the stream".to_string(),
                    Err(status) => {
                        tracing::warn!(node, error = %status.message(), "report stream cut off");
                        let why = status.message().to_string();
                        let _ = tx.send(Err(status)).await;
                        why
                    }
                },
                _ = &mut kicked => {
                    // Kicked: this replica stopped leading (every stream
                    // is closed), or a newer stream came.
                    let status = if *leader.borrow() {
                        Status::aborted("a newer stream from this node replaced this one")
                    } else {
                        let why = not_leading
                            .map(|(s, lease)| s.borrow().words(&lease))
                            .unwrap_or_else(|| "no longer leading".into());
                        Status::unavailable(format!(
                            "this gpu-controller replica does not lead: {why}: connect again"
                        ))
                    };
                    let _ = tx.send(Err(status)).await;
                    return;
                }
            };
            // The stream ends now for the agent; the grace is the fleet's.
            drop(tx);
            if fleet.disconnect(&node, id, &why) {
                let grace = fleet.grace;
                tokio::time::sleep(grace).await;
                fleet.expire(&node, &why);
            }
        });
        // Numbered as they go down.
        let mut seq = 0u64;
        let down = tokio_stream::StreamExt::map(
            tokio_stream::wrappers::ReceiverStream::new(rx),
            move |m| {
                m.map(|mut m| {
                    seq += 1;
                    m.seq = seq;
                    m
                })
            },
        );
        Ok(Response::new(Box::pin(down)))
    }
}

/// Takes a stream's messages after its Hello until it ends or breaks a rule.
async fn follow(
    fleet: &Fleet,
    node: &str,
    up: &mut Streaming<pb::AgentMessage>,
) -> Result<(), Status> {
    let mut expect = 2u64;
    let mut snapshot = false;
    let mut tokens = BURST;
    let mut refilled = Instant::now();
    while let Some(msg) = up.message().await? {
        let now = Instant::now();
        tokens = (tokens + now.duration_since(refilled).as_secs_f64() * RATE).min(BURST);
        refilled = now;
        if tokens < 1.0 {
            return Err(Status::resource_exhausted(format!(
                "more than {RATE} messages a second: cut off"
            )));
        }
        tokens -= 1.0;
        if msg.seq != expect {
            return Err(Status::invalid_argument(format!(
                "message seq {} where {expect} was due",
                msg.seq
            )));
        }
        expect += 1;
        let Some(body) = msg.body else {
            return Err(Status::invalid_argument("a message with no body"));
        };
        match &body {
            pb::agent_message::Body::Hello(_) => {
                return Err(Status::invalid_argument("a second Hello on one stream"));
            }
            pb::agent_message::Body::Snapshot(_) => snapshot = true,
            pb::agent_message::Body::Change(_) if !snapshot => {
                return Err(Status::invalid_argument("a change before the snapshot"));
            }
            _ => {}
        }
        fleet.apply(node, body);
    }
    Ok(())
}
