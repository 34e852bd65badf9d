//! The fleet page: `GET /` is a small page that shows the fleet (nodes,
//! GPUs, health with the last events and their advice, driver versions, MIG
//! layouts, upgrade progress) from `GET /fleet.json`, which is the same as
//! JSON; `GET /healthz` answers `ok`; `GET /readyz` answers 200 while this
//! replica leads, else 503, saying why in words. HTTP/1 only, GET only; a connection
//! that sends no request head within 10 s is closed.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};

use crate::fleet::Fleet;
use crate::lease::Standing;
use crate::tls::TlsCounts;

/// The page (its script renders `/fleet.json`).
pub const PAGE: &str = include_str!("page.html");

fn answer(status: StatusCode, kind: &str, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(hyper::header::CONTENT_TYPE, kind.parse().unwrap());
    r.headers_mut()
        .insert(hyper::header::CACHE_CONTROL, "no-store".parse().unwrap());
    r
}

/// One request; `standing` and `lease` (`namespace/name`) say whether
/// this replica leads, and why not; `tls`, its agents' TLS handshakes.
pub fn handle(
    fleet: &Fleet,
    standing: &Standing,
    lease: &str,
    tls: &TlsCounts,
    req: &Request<impl hyper::body::Body>,
) -> Response<Full<Bytes>> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = answer(StatusCode::METHOD_NOT_ALLOWED, "text/plain", "GET only\n");
        r.headers_mut()
            .insert(hyper::header::ALLOW, "GET, HEAD".parse().unwrap());
        return r;
    }
    match req.uri().path() {
        "/" => answer(StatusCode::OK, "text/html; charset=utf-8", PAGE),
        "/fleet.json" => {
            let mut view = fleet.view();
            // Handshakes since this replica started: resumed ones are the
            // cheap ones (an agent's ticket), full ones new agents or
            // tickets from another replica.
            view["summary"]["tlsHandshakes"] = serde_json::json!({
                "full": tls.full.load(Ordering::Relaxed),
                "resumed": tls.resumed.load(Ordering::Relaxed),
                "failed": tls.failed.load(Ordering::Relaxed),
            });
            answer(StatusCode::OK, "application/json", view.to_string())
        }
        "/healthz" => answer(StatusCode::OK, "text/plain", "ok\n"),
        // Ready = leading, and why not in words.
        "/readyz" => answer(
            if standing.leads() {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            },
            "text/plain",
            format!("{}\n", standing.words(lease)),
        ),
        _ => answer(StatusCode::NOT_FOUND, "text/plain", "not found\n"),
    }
}

/// Serves the page on `listener` until the task is dropped.
pub async fn serve(
    listener: tokio::net::TcpListener,
    fleet: Arc<Fleet>,
    standing: tokio::sync::watch::Receiver<Standing>,
    lease: String,
    tls: Arc<TlsCounts>,
) {
    loop {
        let Ok((stream, peer)) = listener.accept().await else {
            continue;
        };
        let fleet = fleet.clone();
        let standing = standing.clone();
        let lease = lease.clone();
        let tls = tls.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                let r = handle(&fleet, &standing.borrow(), &lease, &tls, &req);
                async move { Ok::<_, Infallible>(r) }
            });
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(Duration::from_secs(10))
                .serve_connection(TokioIo::new(stream), svc)
                .await
            {
                tracing::debug!(peer = %peer, error = %e, "fleet page connection ended");
            }
        });
    }
}
