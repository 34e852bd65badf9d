//! The agents' TLS, done here rather than by tonic: a check-in opens a
//! connection, makes one call and closes it, so what a check-in costs is
//! mostly its handshake. Sessions are resumed from TLS 1.3 tickets (sealed
//! by a key this process rotates; nothing is kept per agent), which spares
//! the certificate signature and the key exchange's half of the work of a
//! full handshake. Each handshake runs in its own task with a deadline, so
//! a slow client holds up no other, and at most [`HANDSHAKES`] run at once:
//! when a whole fleet comes at once (the agents' first check-ins, a burst
//! of health events everywhere), the others wait with their socket alone
//! (a few hundred bytes) instead of each holding a TLS session and, once
//! served, HTTP/2's buffers (some 50 KiB a connection): the controller's
//! memory stays what its nodes need, and the herd is served in turn.
//!
//! Knows nothing of the fleet: the layer of `lease` and `auth`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_stream::Stream;

/// Why the TLS setup cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{path}: no PEM certificate in it: {message}")]
    Certificate { path: String, message: String },
    #[error("{path}: no PEM private key in it: {message}")]
    Key { path: String, message: String },
    #[error("{path}: the key does not go with the certificate, or cannot be used: {message}")]
    Mismatch { path: String, message: String },
    #[error("cannot make the session ticket key: {0}")]
    Tickets(String),
}

/// TLS handshakes at once; more connections wait their turn.
pub const HANDSHAKES: usize = 64;
/// A connection waits this long at most for its turn, then is closed (the
/// agent tries again after its backoff).
pub const WAIT_AT_MOST: Duration = Duration::from_secs(30);

/// Handshakes so far, by kind (for `/fleet.json` and the scale bench).
#[derive(Debug, Default)]
pub struct TlsCounts {
    /// Full handshakes (a new agent, or a ticket too old or from another
    /// replica).
    pub full: AtomicU64,
    /// Sessions resumed from a ticket.
    pub resumed: AtomicU64,
    /// Handshakes that failed or ran past the deadline.
    pub failed: AtomicU64,
}

/// The server's TLS settings: the certificate and key (PEM, named by
/// `cert_path` and `key_path` in errors), HTTP/2 only, session tickets.
pub fn server_config(
    cert: &[u8],
    cert_path: &str,
    key: &[u8],
    key_path: &str,
) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert)
        .collect::<Result<_, _>>()
        .map_err(|e| TlsError::Certificate {
            path: cert_path.into(),
            message: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsError::Certificate {
            path: cert_path.into(),
            message: "no CERTIFICATE block".into(),
        });
    }
    let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| TlsError::Key {
        path: key_path.into(),
        message: e.to_string(),
    })?;
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| TlsError::Mismatch {
        path: key_path.into(),
        message: e.to_string(),
    })?
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .map_err(|e| TlsError::Mismatch {
        path: key_path.into(),
        message: e.to_string(),
    })?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    config.ticketer =
        rustls::crypto::ring::Ticketer::new().map_err(|e| TlsError::Tickets(e.to_string()))?;
    // One ticket a handshake: an agent resumes one session at a time.
    config.send_tls13_tickets = 1;
    Ok(Arc::new(config))
}

/// The connections of `conns` once their handshake is done, each within
/// `within` (those past it, or failing, are closed and counted).
pub fn incoming<S, IO>(
    conns: S,
    config: Arc<rustls::ServerConfig>,
    within: Duration,
    counts: Arc<TlsCounts>,
) -> impl Stream<Item = std::io::Result<TlsStream<IO>>> + Send + 'static
where
    S: Stream<Item = std::io::Result<IO>> + Send + 'static,
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let acceptor = TlsAcceptor::from(config);
    let turns = Arc::new(tokio::sync::Semaphore::new(HANDSHAKES));
    let (tx, rx) = tokio::sync::mpsc::channel(256);
    tokio::spawn(async move {
        tokio::pin!(conns);
        while let Some(conn) = tokio_stream::StreamExt::next(&mut conns).await {
            let io = match conn {
                Ok(io) => io,
                Err(e) => {
                    tracing::debug!(error = %e, "accepting a connection failed");
                    continue;
                }
            };
            let acceptor = acceptor.clone();
            let tx = tx.clone();
            let counts = counts.clone();
            let turns = turns.clone();
            // The task waits for its turn small: the handshake's state
            // (rustls' connection, about 4 KiB) is made only once it may
            // run. Spawned whole, 7,400 connections arriving at once held
            // 33 MiB while they waited (heaptrack, the scale bench).
            tokio::spawn(async move {
                let Ok(Ok(turn)) = tokio::time::timeout(WAIT_AT_MOST, turns.acquire_owned()).await
                else {
                    counts.failed.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!("a connection waited too long for its TLS handshake: closed");
                    return;
                };
                Box::pin(handshake(acceptor, io, within, counts, tx, turn)).await;
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// One connection's handshake, in its turn; the connection is passed on
/// once done.
async fn handshake<IO>(
    acceptor: TlsAcceptor,
    io: IO,
    within: Duration,
    counts: Arc<TlsCounts>,
    tx: tokio::sync::mpsc::Sender<std::io::Result<TlsStream<IO>>>,
    turn: tokio::sync::OwnedSemaphorePermit,
) where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let done = tokio::time::timeout(within, acceptor.accept(io)).await;
    drop(turn);
    match done {
        Ok(Ok(tls)) => {
            let resumed = tls.get_ref().1.handshake_kind() == Some(rustls::HandshakeKind::Resumed);
            let n = if resumed {
                &counts.resumed
            } else {
                &counts.full
            };
            n.fetch_add(1, Ordering::Relaxed);
            let _ = tx.send(Ok(tls)).await;
        }
        Ok(Err(e)) => {
            counts.failed.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(error = %e, "TLS handshake failed");
        }
        Err(_) => {
            counts.failed.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(
                within_ms = within.as_millis() as u64,
                "TLS handshake not done in time: closed"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_without_a_certificate_is_named() {
        let e = server_config(b"nothing here", "/etc/tls/tls.crt", b"", "/etc/tls/tls.key")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("/etc/tls/tls.crt: no PEM certificate"), "{e}");
    }
}
