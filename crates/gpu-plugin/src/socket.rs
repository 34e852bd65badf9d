//! The device plugin's sockets, private from the moment their name
//! appears. The kubelet runs as root and connects as root, so 0600 is all
//! it needs; no other user may connect (connecting takes write permission
//! on the socket file).
//!
//! Race-free: the mode is set on the socket before `bind` makes its file.
//! Linux gives the file the socket inode's mode less the umask
//! (`unix_bind`), so `fchmod` on the unbound socket decides it; there is
//! no moment where the name exists with a wider mode, and no process-wide
//! umask is changed under other threads.

use std::os::fd::AsRawFd;
use std::path::Path;

use nix::sys::socket::{AddressFamily, Backlog, SockFlag, SockType, UnixAddr};
use nix::sys::stat::Mode;

/// The mode of every plugin socket.
pub const SOCKET_MODE: u32 = 0o600;

/// Binds and listens on `path` (which must not exist) with mode
/// [`SOCKET_MODE`].
pub fn bind_private(path: &Path) -> std::io::Result<tokio::net::UnixListener> {
    let fd = nix::sys::socket::socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )?;
    nix::sys::stat::fchmod(&fd, Mode::from_bits_truncate(SOCKET_MODE))?;
    nix::sys::socket::bind(fd.as_raw_fd(), &UnixAddr::new(path)?)?;
    nix::sys::socket::listen(&fd, Backlog::new(1024)?)?;
    tokio::net::UnixListener::from_std(std::os::unix::net::UnixListener::from(fd))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};

    #[tokio::test]
    async fn the_socket_is_made_0600_and_accepts() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nvidia-gpu.sock");
        let listener = bind_private(&path).unwrap();
        let meta = std::fs::metadata(&path).unwrap();
        assert!(meta.file_type().is_socket());
        assert_eq!(meta.permissions().mode() & 0o7777, 0o600);
        let client = tokio::net::UnixStream::connect(&path);
        let (accepted, connected) = tokio::join!(listener.accept(), client);
        accepted.unwrap();
        connected.unwrap();
        // A name already there is not replaced.
        assert!(bind_private(&path).is_err());
    }
}
