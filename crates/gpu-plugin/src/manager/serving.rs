//! One running plugin server: its socket's listener served until it is told
//! to drain, then to cut its connections ([`Cut`]: reads see EOF, writes
//! fail), then aborted.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_stream::StreamExt;
use tonic::transport::server::Connected;

use crate::server::PluginService;

/// How long a stopped plugin server's clients have to read the end of
/// their streams and let their calls finish; then its connections are cut.
pub const STOP_GRACE: Duration = Duration::from_secs(2);
/// How long after the cut the server's task may still take; then it is
/// aborted. A stop takes at most `STOP_GRACE + CUT_GRACE`.
pub const CUT_GRACE: Duration = Duration::from_secs(1);

/// One plugin server (one socket) and what stops it.
pub(super) struct Server {
    pub(super) socket: PathBuf,
    pub(super) resource: String,
    /// True: stop accepting, end the `ListAndWatch` streams, shut down
    /// gracefully.
    pub(super) draining: watch::Sender<bool>,
    /// True: every connection is cut (dropped: the same).
    pub(super) cut: watch::Sender<bool>,
    pub(super) task: JoinHandle<()>,
}

impl Server {
    pub(super) fn start(
        listener: tokio::net::UnixListener,
        svc: PluginService,
        draining: watch::Sender<bool>,
        mut drain_rx: watch::Receiver<bool>,
        socket: PathBuf,
        resource: String,
    ) -> Server {
        let (cut, cut_rx) = watch::channel(false);
        let incoming =
            gpu_grpc::incoming(listener).map(move |c| c.map(|io| Cut::new(io, cut_rx.clone())));
        let name = resource.clone();
        let path = socket.clone();
        let task = tokio::spawn(async move {
            if let Err(e) = crate::server::transport()
                .add_service(crate::server::grpc_service(svc))
                .serve_with_incoming_shutdown(incoming, async move {
                    // Err: the sender is gone, and the server with it.
                    let _ = drain_rx.wait_for(|d| *d).await;
                })
                .await
            {
                tracing::error!(stage = "plugin", resource = %name, socket = %path.display(), error = %e, "device-plugin server failed");
            }
        });
        Server {
            socket,
            resource,
            draining,
            cut,
            task,
        }
    }

    /// Stops serving, within `STOP_GRACE + CUT_GRACE`: streams end at once,
    /// connections still open after `STOP_GRACE` are cut, a task still
    /// running `CUT_GRACE` after that is aborted.
    pub(super) async fn stop(self) {
        let Server {
            socket,
            resource,
            draining,
            cut,
            mut task,
        } = self;
        let started = Instant::now();
        let _ = draining.send(true);
        let how = if tokio::time::timeout(STOP_GRACE, &mut task).await.is_ok() {
            "gracefully"
        } else {
            tracing::warn!(stage = "plugin", resource = %resource, socket = %socket.display(), grace = ?STOP_GRACE, "plugin server's clients did not finish; cutting its connections");
            let _ = cut.send(true);
            if tokio::time::timeout(CUT_GRACE, &mut task).await.is_ok() {
                "connections cut"
            } else {
                task.abort();
                "aborted"
            }
        };
        tracing::info!(
            stage = "plugin",
            resource = %resource,
            socket = %socket.display(),
            how,
            elapsed_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
            "plugin server for {} stopped",
            socket.display()
        );
    }
}

/// A plugin server's connection, cut (reads see EOF, writes fail) once its
/// server's `cut` is true or dropped: the end of a client that does not let
/// a graceful shutdown finish (never reads, never finishes a request).
struct Cut<T> {
    io: T,
    /// Resolves on the cut; None once it has.
    until: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
}

impl<T> Cut<T> {
    fn new(io: T, mut cut: watch::Receiver<bool>) -> Self {
        Cut {
            io,
            until: Some(Box::pin(async move {
                let _ = cut.wait_for(|c| *c).await;
            })),
        }
    }

    /// True once cut; otherwise `cx` is woken at the cut.
    fn is_cut(&mut self, cx: &mut Context<'_>) -> bool {
        let Some(until) = self.until.as_mut() else {
            return true;
        };
        if until.as_mut().poll(cx).is_pending() {
            return false;
        }
        self.until = None;
        true
    }
}

fn cut_error() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::BrokenPipe,
        "connection cut: the plugin server stopped",
    )
}

impl<T: AsyncRead + Unpin> AsyncRead for Cut<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.is_cut(cx) {
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Cut<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        if self.is_cut(cx) {
            return Poll::Ready(Err(cut_error()));
        }
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        if self.is_cut(cx) {
            return Poll::Ready(Err(cut_error()));
        }
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if self.is_cut(cx) {
            return Poll::Ready(Err(cut_error()));
        }
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if self.is_cut(cx) {
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl<T: Connected> Connected for Cut<T> {
    type ConnectInfo = T::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}
