//! gRPC over Unix sockets, for every front end of the agent that speaks it
//! (the device plugin, pod resources for the metrics, the CRI for the
//! workload check):
//! - the agent's servers (the device plugin's, and any later one): every
//!   accepted connection goes through [`authority`], so clients that send
//!   the socket path as `:authority` are served too ([`incoming`]);
//! - the agent as a client: [`connect`] dials a socket within [`DIAL_TIMEOUT`].

pub mod authority;

use std::path::Path;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::{UnixListener, UnixStream};
use tokio_stream::{Stream, StreamExt};
use tonic::transport::server::Connected;
use tonic::transport::{Channel, Endpoint};

pub use authority::AuthorityFix;

/// How long a dial or a registration may take.
pub const DIAL_TIMEOUT: Duration = Duration::from_secs(5);

/// A gRPC channel to the server listening on the Unix socket `path`.
pub async fn connect(path: &Path) -> Result<Channel, tonic::transport::Error> {
    let path = path.to_path_buf();
    // The URI is required by the API but unused: the connector dials the socket.
    Endpoint::from_static("http://[::1]:50051")
        .connect_timeout(DIAL_TIMEOUT)
        .timeout(DIAL_TIMEOUT)
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move { UnixStream::connect(path).await.map(TokioIo::new) }
        }))
        .await
}

impl Connected for AuthorityFix<UnixStream> {
    type ConnectInfo = <UnixStream as Connected>::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.get_ref().connect_info()
    }
}

/// The connections `listener` accepts, ready for tonic's
/// `serve_with_incoming*`.
pub fn incoming(
    listener: UnixListener,
) -> impl Stream<Item = std::io::Result<AuthorityFix<UnixStream>>> {
    tokio_stream::wrappers::UnixListenerStream::new(listener).map(|c| c.map(AuthorityFix::new))
}
