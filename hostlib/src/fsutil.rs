//! Atomic file writes: a temp file in the same directory, fsync, rename,
//! fsync of the directory. A reader (or a crash) sees the old file or the
//! whole new one, never a part.
//!
//! Every step after the directory is opened is made relative to that
//! directory's descriptor (`openat`, `renameat`, `unlinkat`), so nothing
//! resolves a path again once the directory is open: a symbolic link
//! swapped in on the way cannot move the write elsewhere. [`crate::HostRoot`]
//! opens the directory so that it cannot lie outside the host root.

use std::ffi::{OsStr, OsString};
use std::fs;
use std::io::{self, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use nix::fcntl::OFlag;
use nix::sys::stat::Mode;
use nix::unistd::UnlinkatFlags;

/// Temp files of one process get numbers of their own: two threads writing
/// the same file never share one.
static TEMP_SEQ: AtomicU64 = AtomicU64::new(0);

/// What went wrong in [`write_atomic_at`]: the write itself, or the
/// caller's step before the rename (which is given back unchanged).
#[derive(Debug)]
pub enum AtomicError<E> {
    Io(io::Error),
    Then(E),
}

impl From<AtomicError<io::Error>> for io::Error {
    fn from(e: AtomicError<io::Error>) -> Self {
        match e {
            AtomicError::Io(e) | AtomicError::Then(e) => e,
        }
    }
}

/// Opens the directory `dir` (by its path) for [`write_atomic_at`] and the
/// other calls relative to it.
pub fn open_dir(dir: &Path) -> io::Result<OwnedFd> {
    Ok(nix::fcntl::open(
        dir,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?)
}

/// Writes `contents` to `path` atomically with permission bits `mode`.
///
/// The temp file is `.<name>.gpu-agent-tmp.<pid>.<n>` beside the target, so
/// the rename never crosses a filesystem. On error the temp file is removed
/// and the target is untouched.
pub fn write_atomic(path: &Path, contents: &[u8], mode: u32) -> io::Result<()> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no file name"))?;
    let dir = open_dir(dir)?;
    Ok(write_atomic_at(dir.as_fd(), name, contents, mode, |_| {
        Ok::<(), io::Error>(())
    })?)
}

/// Writes `contents` to the file `name` in the open directory `dir`
/// atomically with permission bits `mode`. `then` sees the complete temp
/// file before it is renamed over `name` (to give it an owner, say).
///
/// The temp file is made new (`O_EXCL`, never through a link), written,
/// given `mode` exactly (not masked by the umask), passed to `then`,
/// fsynced and renamed within `dir`; then `dir` is fsynced. On error the
/// temp file is removed and `name` is untouched.
pub fn write_atomic_at<E>(
    dir: BorrowedFd<'_>,
    name: &OsStr,
    contents: &[u8],
    mode: u32,
    then: impl FnOnce(&fs::File) -> Result<(), E>,
) -> Result<(), AtomicError<E>> {
    if name.is_empty() || name.as_bytes().contains(&b'/') || name == "." || name == ".." {
        return Err(AtomicError::Io(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a file name",
        )));
    }
    let mut tmp = OsString::from(".");
    tmp.push(name);
    tmp.push(format!(
        ".gpu-agent-tmp.{}.{}",
        std::process::id(),
        TEMP_SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    let tmp = tmp.as_os_str();
    // Left by a process of the same pid that died: never anyone's file.
    let _ = nix::unistd::unlinkat(dir, tmp, UnlinkatFlags::NoRemoveDir);
    let result = (|| {
        let fd = nix::fcntl::openat(
            dir,
            tmp,
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::from_bits_truncate(mode & 0o777),
        )
        .map_err(|e| AtomicError::Io(e.into()))?;
        let mut f = fs::File::from(fd);
        let io = AtomicError::Io;
        f.write_all(contents).map_err(io)?;
        // The mode given to open() is masked by the umask; set it exactly.
        f.set_permissions(fs::Permissions::from_mode(mode))
            .map_err(io)?;
        then(&f).map_err(AtomicError::Then)?;
        f.sync_all().map_err(io)?;
        drop(f);
        nix::fcntl::renameat(dir, tmp, dir, name).map_err(|e| AtomicError::Io(e.into()))?;
        remove_stale_temps(dir, name);
        nix::unistd::fsync(dir).map_err(|e| AtomicError::Io(e.into()))
    })();
    if result.is_err() {
        let _ = nix::unistd::unlinkat(dir, tmp, UnlinkatFlags::NoRemoveDir);
    }
    result
}

/// Removes the temp files of `name` that writers killed before their
/// rename left in `dir` (a partial copy of a 200 MB program, say): those of
/// other processes that are gone. Called once `name` is whole again, so
/// nothing they held is lost; a live writer's temp file is left alone.
fn remove_stale_temps(dir: BorrowedFd<'_>, name: &OsStr) {
    let mut prefix = b".".to_vec();
    prefix.extend_from_slice(name.as_bytes());
    prefix.extend_from_slice(b".gpu-agent-tmp.");
    let me = std::process::id();
    // The directory's entries through its descriptor (std lists by path).
    let Ok(entries) = fs::read_dir(format!("/proc/self/fd/{}", dir.as_raw_fd())) else {
        return;
    };
    for entry in entries.flatten() {
        let file = entry.file_name();
        let Some(rest) = file.as_bytes().strip_prefix(prefix.as_slice()) else {
            continue;
        };
        // `<pid>.<n>`, or `<pid>` as older versions named them.
        let pid = rest.split(|b| *b == b'.').next().unwrap_or_default();
        let Some(pid) = std::str::from_utf8(pid)
            .ok()
            .and_then(|p| p.parse::<i32>().ok())
            .filter(|p| *p > 0)
        else {
            continue;
        };
        let gone = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None)
            == Err(nix::errno::Errno::ESRCH);
        if pid as u32 != me && gone {
            let _ = nix::unistd::unlinkat(dir, file.as_os_str(), UnlinkatFlags::NoRemoveDir);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_whole_file_and_leaves_no_temp() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        fs::write(&p, "old contents that are longer").unwrap();
        write_atomic(&p, b"new", 0o644).unwrap();
        assert_eq!(fs::read_to_string(&p).unwrap(), "new");
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("f")]);
    }

    #[test]
    fn a_write_removes_temp_files_that_dead_writers_left() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        // A process that is gone, and one that lives (init).
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        for left in [
            format!(".f.gpu-agent-tmp.{dead}.0"),
            format!(".f.gpu-agent-tmp.{dead}"),
            ".f.gpu-agent-tmp.1.0".to_string(),
            format!(".g.gpu-agent-tmp.{dead}.0"),
        ] {
            fs::write(dir.path().join(left), "part").unwrap();
        }
        write_atomic(&p, b"new", 0o644).unwrap();
        let mut names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(
            names,
            [
                ".f.gpu-agent-tmp.1.0".to_string(),
                format!(".g.gpu-agent-tmp.{dead}.0"),
                "f".to_string()
            ]
        );
    }

    #[test]
    fn failure_leaves_target_untouched() {
        let dir = tempfile::tempdir().unwrap();
        // The target is a non-empty directory: rename fails.
        let p = dir.path().join("d");
        fs::create_dir(&p).unwrap();
        fs::write(p.join("inner"), "x").unwrap();
        assert!(write_atomic(&p, b"new", 0o644).is_err());
        assert_eq!(fs::read_to_string(p.join("inner")).unwrap(), "x");
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn a_failing_step_before_the_rename_leaves_the_target_and_no_temp() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("f"), "old").unwrap();
        let d = open_dir(dir.path()).unwrap();
        let err = write_atomic_at(d.as_fd(), OsStr::new("f"), b"new", 0o600, |f| {
            // The complete temp file, with its exact mode.
            assert_eq!(f.metadata().unwrap().len(), 3);
            assert_eq!(f.metadata().unwrap().permissions().mode() & 0o777, 0o600);
            Err("refused")
        })
        .unwrap_err();
        assert!(matches!(err, AtomicError::Then("refused")));
        assert_eq!(fs::read_to_string(dir.path().join("f")).unwrap(), "old");
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
        // A name with a slash is refused: it would be resolved again.
        assert!(matches!(
            write_atomic_at(d.as_fd(), OsStr::new("a/b"), b"x", 0o644, |_| Ok::<(), ()>(
                ()
            )),
            Err(AtomicError::Io(_))
        ));
    }
}
