//! The agent's gRPC servers on Unix sockets (the device plugin's, and any
//! later one): every accepted connection goes through [`authority`], so
//! clients that send the socket path as `:authority` are served too.

pub mod authority;

use tokio::net::{UnixListener, UnixStream};
use tokio_stream::{Stream, StreamExt};
use tonic::transport::server::Connected;

pub use authority::AuthorityFix;

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
