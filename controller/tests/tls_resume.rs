//! The controller's TLS resumes sessions: a client that keeps its rustls
//! settings between connections (as the agent's report client does, one
//! connection per check-in) gets a ticket on the first and resumes from it
//! on the second, over real sockets; the controller counts one full
//! handshake and one resumed.

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use gpu_controller::tls::{TlsCounts, incoming, server_config};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_stream::StreamExt;

#[tokio::test]
async fn a_second_connection_resumes_the_first_ones_session() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = common::certs(dir.path());
    let config = server_config(
        &std::fs::read(&cert).unwrap(),
        "tls.crt",
        &std::fs::read(&key).unwrap(),
        "tls.key",
    )
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let counts = Arc::new(TlsCounts::default());
    let conns = incoming(
        tokio_stream::wrappers::TcpListenerStream::new(listener),
        config,
        Duration::from_secs(5),
        counts.clone(),
    );
    tokio::spawn(async move {
        tokio::pin!(conns);
        while let Some(Ok(mut tls)) = conns.next().await {
            tokio::spawn(async move {
                let _ = tls.write_all(b"x").await;
                let mut rest = Vec::new();
                let _ = tls.read_to_end(&mut rest).await;
            });
        }
    });
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(&std::fs::read(&ca).unwrap()) {
        roots.add(c.unwrap()).unwrap();
    }
    let mut client = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    client.alpn_protocols = vec![b"h2".to_vec()];
    let client = Arc::new(client);
    let mut kinds = Vec::new();
    for _ in 0..2 {
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        let mut tls = tokio_rustls::TlsConnector::from(client.clone())
            .connect(ServerName::try_from("localhost").unwrap(), tcp)
            .await
            .unwrap();
        // Reading takes the server's ticket, sent after the handshake.
        let mut b = [0u8; 1];
        tls.read_exact(&mut b).await.unwrap();
        kinds.push(tls.get_ref().1.handshake_kind());
        tls.shutdown().await.unwrap();
    }
    assert_eq!(
        kinds,
        vec![
            Some(rustls::HandshakeKind::Full),
            Some(rustls::HandshakeKind::Resumed)
        ]
    );
    assert_eq!(counts.full.load(Ordering::Relaxed), 1);
    assert_eq!(counts.resumed.load(Ordering::Relaxed), 1);
    assert_eq!(counts.failed.load(Ordering::Relaxed), 0);
}
