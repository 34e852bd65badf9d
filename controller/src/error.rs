//! The controller's errors in words: [`ControllerError`] (why it could
//! not run) and [`error_chain`] (an error and its causes on one line, as
//! every log line and status message says them). The bottom layer: it uses
//! no other module of the crate.

use std::net::SocketAddr;

/// The controller could not run.
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    #[error("{path}: cannot read: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// The agents' TLS cannot be set up (the certificate or key, named).
    #[error("{0}")]
    Tls(String),
    #[error(
        "--shards needs --lease-namespace (POD_NAMESPACE): the shard Leases are kept in that namespace"
    )]
    Sharding,
    #[error("no Kubernetes API to talk to (in-cluster config or KUBECONFIG): {0}")]
    Kube(String),
    #[error("cannot serve on {addr}: {message}")]
    Serve { addr: SocketAddr, message: String },
}

/// An error and its causes in words.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let words = c.to_string();
        if !text.contains(&words) {
            text.push_str(": ");
            text.push_str(&words);
        }
        cause = c.source();
    }
    text
}

/// An API error in words: the API server's status, or the client's error
/// and its causes.
pub fn api_words(err: &kube::Error) -> String {
    match err {
        kube::Error::Api(s) => format!(
            "the API server answered {} {}: {}",
            s.code, s.reason, s.message
        ),
        other => error_chain(other),
    }
}

/// A duration in words: `7 s`, `1.4 s`.
pub fn seconds(d: std::time::Duration) -> String {
    if d.subsec_millis() == 0 {
        format!("{} s", d.as_secs())
    } else {
        format!("{:.1} s", d.as_secs_f64())
    }
}
