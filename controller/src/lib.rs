//! gpu-controller: the cluster half of gpu-agent. Agents stream their
//! node's state to it ([`server`]); it keeps the fleet in memory ([`fleet`])
//! and writes what follows into Kubernetes ([`writer`]): GPU feature
//! discovery's labels, the GPU node conditions and the health taint
//! ([`model::node`]). It is the only part of gpu-agent that holds API
//! credentials.
//!
//! The modules are in layers; a module uses only the layers below it
//! (`controller/tests/layers.rs` checks it, `docs/architecture.md` draws
//! it). Bottom to top:
//!
//! 1. [`error`]: errors in words.
//! 2. [`model`]: plain data and pure functions (a node's labels, conditions
//!    and taint; Events; the driver rollout's states, policy and plan; the
//!    policy text each agent is sent).
//! 3. [`fleet`]: the store, what the controller knows of each node.
//!    Beside it, [`lease`], [`shards`], [`auth`] and [`tls`]: the
//!    replicas' election, the nodes' shards among the replicas, the agents'
//!    token review and their TLS, which know nothing of the fleet.
//! 4. The workers, each a task or a server over the fleet and the API;
//!    none uses another: [`server`], [`writer`], [`drift`], [`upgrade`],
//!    [`cluster_policy`], [`config_maps`], [`mig_label`],
//!    [`dra_claims`], [`dra_slices`], [`events`], [`page`], [`uninstall`].
//! 5. This file: [`run`] starts them and wires them together (channels,
//!    the fleet, the leadership watch).

// 1. errors
pub mod error;
// 2. the model
pub mod model;
// 3. the fleet store; the election and the token review beside it
pub mod auth;
pub mod fleet;
pub mod lease;
pub mod shards;
pub mod tls;
// 4. the workers
pub mod cluster_policy;
pub mod config_maps;
pub mod dra_claims;
pub mod dra_slices;
pub mod drift;
pub mod events;
pub mod mig_label;
pub mod page;
pub mod server;
pub mod uninstall;
pub mod upgrade;
pub mod writer;

pub use error::{ControllerError, error_chain};
// Where it was before the model was gathered under `model` (the fuzz
// targets and the tests use `gpu_controller::node`).
pub use model::node;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// How long a stopping controller takes at most, from SIGTERM to its
/// exit (the Lease given up, every agent's connection closed).
const STOP_WITHIN: Duration = Duration::from_secs(4);
/// Of which giving the Lease up may take this long.
const RELEASE_WITHIN: Duration = Duration::from_secs(2);

/// What `gpu-controller` was asked for.
#[derive(Debug)]
pub struct Options {
    pub listen: SocketAddr,
    pub tls_cert: PathBuf,
    pub tls_key: PathBuf,
    /// The agents' service account (`namespace`, `name`).
    pub agent_account: (String, String),
    pub taint: model::node::TaintPolicy,
    pub grace: Duration,
    /// The fleet page and `/fleet.json` (plain HTTP), if any.
    pub http_listen: Option<SocketAddr>,
    /// Leader election among replicas (`None`: this one always leads).
    pub election: Option<lease::Election>,
    /// The ClusterPolicy to use when there are several.
    pub cluster_policy: String,
    /// Where the ConfigMaps the ClusterPolicy names are (`None`: the
    /// client's namespace: in a pod, its own).
    pub config_map_namespace: Option<String>,
    /// Agent connections held at once; more are closed as they come.
    pub max_connections: usize,
    /// A TLS handshake must be done within this; slower clients are closed.
    pub handshake_within: Duration,
    /// How long a node's agent has, from its upgrade go-ahead, to report
    /// the new driver validated before the node is `upgrade-failed`
    /// (`None`: no limit).
    pub upgrade_validation_timeout: Option<Duration>,
    /// Publish the ResourceSlices of nodes whose agent's DRA plugin is
    /// registered, and the DeviceClasses (issue 31).
    pub dra_slices: bool,
    /// Agents check in at least this often ([`server::DEFAULT_INTERVAL`]).
    pub check_in_interval: Duration,
    /// Check-ins a second this replica takes at most; past it the interval
    /// grows ([`server::DEFAULT_RATE`]).
    pub check_in_rate: u32,
    /// Spread the nodes over the replicas (needs `election`: its
    /// namespace and identity).
    pub shards: Option<Sharding>,
}

/// The nodes spread over the replicas through shard Leases.
#[derive(Clone, Debug)]
pub struct Sharding {
    /// How many shards (the same for every replica).
    pub count: u32,
    /// Where agents reach this replica (`https://<pod IP>:<port>`).
    pub advertise: String,
}

fn read(path: &std::path::Path) -> Result<Vec<u8>, ControllerError> {
    std::fs::read(path).map_err(|source| ControllerError::Read {
        path: path.display().to_string(),
        source,
    })
}

/// Serves agents until SIGTERM/SIGINT.
pub async fn run(opts: Options) -> Result<(), ControllerError> {
    let cert = read(&opts.tls_cert)?;
    let key = read(&opts.tls_key)?;
    let tls_config = tls::server_config(
        &cert,
        &opts.tls_cert.display().to_string(),
        &key,
        &opts.tls_key.display().to_string(),
    )
    .map_err(|e| ControllerError::Tls(e.to_string()))?;
    let config = kube::Config::infer()
        .await
        .map_err(|e| ControllerError::Kube(e.to_string()))?;
    let client =
        kube::Client::try_from(config.clone()).map_err(|e| ControllerError::Kube(e.to_string()))?;
    let (leader_tx, leader) = tokio::sync::watch::channel(opts.election.is_none());
    let (standing_tx, standing) = tokio::sync::watch::channel(match opts.election {
        Some(_) => lease::Standing::Starting,
        None => lease::Standing::Alone,
    });
    let lease_name = opts
        .election
        .as_ref()
        .map(lease::Election::lease)
        .unwrap_or_default();
    let (give_up, given_up) = tokio::sync::oneshot::channel::<()>();
    // Without an election the senders live as long as the controller: a
    // task whose leadership sender is gone stops.
    let mut always_leading = None;
    let election = match opts.election.clone() {
        Some(e) => Some(tokio::spawn(lease::run(
            lease::client(config.clone())?,
            e,
            leader_tx,
            standing_tx,
            given_up,
        ))),
        None => {
            always_leading = Some((leader_tx, standing_tx, given_up));
            None
        }
    };
    // The shards: this replica serves and writes the nodes of its own.
    let (shard_stop, shard_stopped) = tokio::sync::oneshot::channel::<()>();
    let sharding = match (&opts.shards, &opts.election) {
        (Some(sh), Some(e)) => {
            let mut cfg =
                shards::ShardConfig::new(&e.namespace, &e.identity, &sh.advertise, sh.count);
            // What this replica says of its shards for the ClusterPolicy's
            // status, carried in their Leases (cluster_policy::status_loop).
            let (said_tx, said_rx) = tokio::sync::watch::channel(Default::default());
            cfg.summaries = Some(said_rx);
            let (tx, rx) = tokio::sync::watch::channel(shards::ShardMap::default());
            tracing::info!(shards = cfg.count, advertise = %cfg.address, "nodes spread over the replicas by shard Leases");
            let task = tokio::spawn(shards::run(
                lease::client(config.clone())?,
                cfg,
                tx,
                shard_stopped,
            ));
            Some((rx, e.identity.clone(), task, said_tx))
        }
        (Some(_), None) => return Err(ControllerError::Sharding),
        (None, _) => None,
    };
    let (fleet, queue) = fleet::Fleet::new(opts.taint, opts.grace);
    let fleet = match &sharding {
        // The elected leader plans the driver rollout for every node; each
        // node's holder applies it (fleet/shared_rollout.rs).
        Some((rx, _, _, _)) => {
            let rx = rx.clone();
            fleet
                .with_owner(move |node| rx.borrow().owns(node))
                .with_rollout_leader(leader.clone())
        }
        None => fleet,
    };
    let (events_tx, events_rx) = tokio::sync::mpsc::channel(events::QUEUE);
    let fleet = fleet.with_events(events_tx);
    let (fleet, dra_nodes) = if opts.dra_slices {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        (fleet.with_dra_slices(tx), Some(rx))
    } else {
        (fleet, None)
    };
    let fleet = Arc::new(fleet);
    let events_written = Arc::new(std::sync::atomic::AtomicU64::new(0));
    tokio::spawn(events::run(
        client.clone(),
        events_rx,
        events_written.clone(),
    ));
    // Sharded, a replica writes the nodes of its shards, leading or not.
    let writes_leader = match &sharding {
        Some(_) => tokio::sync::watch::channel(true).1,
        None => leader.clone(),
    };
    let writer = Arc::new(writer::Writer::new(client.clone()).with_leader(writes_leader.clone()));
    if let Some((rx, _, _, _)) = &sharding {
        // Shards lost: their nodes' entries dropped (their new holder
        // rebuilds them); shards taken: once the grace has passed, their
        // nodes whose agent did not check in are not reporting.
        let (fleet, mut rx) = (fleet.clone(), rx.clone());
        tokio::spawn(async move {
            let mut had = std::collections::BTreeSet::new();
            while rx.changed().await.is_ok() {
                let mine = rx.borrow_and_update().mine.clone();
                // The map changes with the others' summaries too.
                if mine == had {
                    continue;
                }
                let dropped = fleet.forget_unowned();
                if dropped > 0 {
                    tracing::info!(nodes = dropped, "nodes of shards given up forgotten");
                }
                if mine.difference(&had).next().is_some() {
                    let fleet = fleet.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(fleet.grace).await;
                        fleet.mark_unconnected(
                            None,
                            "no check-in with the gpu-controller replica that took its shard over",
                        );
                    });
                }
                had = mine;
            }
        });
    }
    if sharding.is_none() {
        // Leadership lost: every stream closed, the fleet forgotten.
        let fleet = fleet.clone();
        let mut leader = leader.clone();
        tokio::spawn(async move {
            while leader.changed().await.is_ok() {
                if !*leader.borrow_and_update() {
                    tracing::warn!("no longer leading: closing every agent's stream");
                    fleet.reset();
                }
            }
        });
    }
    tokio::spawn(writer.run(fleet.clone(), queue));
    tokio::spawn(drift::run(
        client.clone(),
        fleet.clone(),
        writes_leader.clone(),
    ));
    if let Some(nodes) = dra_nodes {
        let publisher =
            Arc::new(dra_slices::Publisher::new(client.clone()).with_leader(writes_leader.clone()));
        tokio::spawn(publisher.run(fleet.clone(), nodes));
    }
    // The agents' TLS handshakes, counted (shown in /fleet.json).
    let tls_counts = Arc::new(tls::TlsCounts::default());
    if let Some(addr) = opts.http_listen {
        let listener =
            tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| ControllerError::Serve {
                    addr,
                    message: e.to_string(),
                })?;
        tracing::info!(listen = %listener.local_addr().unwrap_or(addr), "fleet page");
        tokio::spawn(page::serve(
            listener,
            fleet.clone(),
            standing.clone(),
            lease_name.clone(),
            tls_counts.clone(),
        ));
    }
    tokio::spawn(mig_label::run(client.clone(), fleet.clone()));
    // On every replica, leading or not: a new leader has the lists at once.
    tokio::spawn(dra_claims::run(client.clone(), fleet.clone()));
    let (chosen_tx, chosen) = tokio::sync::watch::channel(None);
    tokio::spawn(cluster_policy::run(
        client.clone(),
        fleet.clone(),
        opts.cluster_policy.clone(),
        chosen_tx,
    ));
    let namespace = opts
        .config_map_namespace
        .clone()
        .unwrap_or_else(|| client.default_namespace().to_string());
    tokio::spawn(config_maps::run(
        client.clone(),
        fleet.clone(),
        namespace,
        chosen,
    ));
    // Sharded too: the elected leader plans it, the nodes' holders apply it.
    tokio::spawn(upgrade::run(
        upgrade::Upgrader::new(client.clone())
            .with_validation_timeout(opts.upgrade_validation_timeout)
            .with_leader(leader.clone()),
        fleet.clone(),
        leader.clone(),
    ));
    // Sharded, the summaries are taken out: the status loop is their sender.
    let (sharding, summaries) = match sharding {
        Some((rx, me, task, said)) => {
            let s = cluster_policy::Sharded {
                map: rx.clone(),
                own: said,
            };
            (Some((rx, me, task)), Some(s))
        }
        None => (None, None),
    };
    tokio::spawn(cluster_policy::status_loop(
        client.clone(),
        fleet.clone(),
        leader.clone(),
        summaries,
    ));
    let auth = Arc::new(auth::TokenReviewer::new(
        client,
        gpu_agent_proto::report::v1::TOKEN_AUDIENCE,
        &opts.agent_account.0,
        &opts.agent_account.1,
    ));
    let service = server::ReportService::new(fleet.clone(), auth, leader)
        .with_standing(standing, lease_name)
        .with_pace(opts.check_in_interval, opts.check_in_rate);
    let service = match &sharding {
        Some((rx, me, _)) => service.with_shards(rx.clone(), me),
        None => service,
    }
    .server();
    {
        // Nodes whose agent stopped checking in: not reporting.
        let fleet = fleet.clone();
        let every = opts.check_in_interval;
        tokio::spawn(async move {
            loop {
                let next = fleet.sweep_check_ins();
                let wait = next
                    .map(|n| n.saturating_duration_since(std::time::Instant::now()))
                    .unwrap_or(every)
                    .max(Duration::from_secs(1));
                tokio::time::sleep(wait).await;
            }
        });
    }
    let serve_err = |e: tonic::transport::Error| ControllerError::Serve {
        addr: opts.listen,
        message: error_chain(&e),
    };
    let listener = tokio::net::TcpListener::bind(opts.listen)
        .await
        .map_err(|e| ControllerError::Serve {
            addr: opts.listen,
            message: e.to_string(),
        })?;
    let local = listener.local_addr().unwrap_or(opts.listen);
    tracing::info!(listen = %local, "gpu-controller serving agents");
    let incoming = tls::incoming(
        server::capped(listener, opts.max_connections),
        tls_config,
        opts.handshake_within,
        tls_counts,
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serve = tonic::transport::Server::builder()
        .tcp_keepalive(Some(Duration::from_secs(60)))
        // An agent holds one stream; a connection may not open more than a
        // few (each still needs its own token).
        .max_concurrent_streams(Some(server::STREAMS_PER_CONNECTION))
        // A peer that stops answering HTTP/2 pings is gone: closed.
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
        .add_service(service)
        .serve_with_incoming_shutdown(incoming, async {
            let _ = stopped.await;
        });
    tokio::pin!(serve);
    tokio::select! {
        r = &mut serve => r.map_err(serve_err)?,
        _ = shutdown() => {
            let began = std::time::Instant::now();
            tracing::info!("gpu-controller stopping");
            // First this replica stops leading and gives the Lease up, so
            // the stand-by takes over at its next look; stepping down
            // closes every agent's stream (they reconnect, through the
            // Service, to the new leader). With no election this replica
            // stops leading here.
            let _ = give_up.send(());
            // The shards too, so the other replicas take them at once.
            let _ = shard_stop.send(());
            if let Some((_, _, task)) = sharding {
                let _ = tokio::time::timeout(shards::STOP_WITHIN, task).await;
            }
            match election {
                Some(task) => {
                    let _ = tokio::time::timeout(RELEASE_WITHIN, task).await;
                }
                None => {
                    if let Some((leader, standing, _)) = &always_leading {
                        standing.send_replace(lease::Standing::Stopping);
                        leader.send_replace(false);
                    }
                    fleet.reset();
                }
            }
            // Then the connections are told to go (GOAWAY): with their
            // streams closed they go at once.
            let _ = stop.send(());
            let left = STOP_WITHIN.saturating_sub(began.elapsed());
            match tokio::time::timeout(left, &mut serve).await {
                Ok(r) => r.map_err(serve_err)?,
                Err(_) => tracing::info!(
                    "connections still open after {} s; closing them",
                    STOP_WITHIN.as_secs()
                ),
            }
            tracing::info!(ms = began.elapsed().as_millis() as u64, "gpu-controller stopped");
        }
    }
    Ok(())
}

async fn shutdown() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}
