//! Changes inside an open directory, made through descriptors.
//!
//! Driver bundles are unpacked, switched and removed relative to the
//! drivers directory as opened by [`hostlib::HostRoot::dir`] (in the host
//! root, whatever link is swapped onto its path). Below it nothing is
//! resolved by path again: a path is walked one component at a time, each
//! directory opened with `O_NOFOLLOW` from the one before, and the last
//! name is created, read, linked, renamed or removed relative to its
//! directory (`openat`, `mkdirat`, `symlinkat`, `renameat`, `unlinkat`),
//! never following a link. A link met on the way is an error (`ELOOP` or
//! `ENOTDIR`), never a way out.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::{Mode, SFlag};
use nix::unistd::UnlinkatFlags;

/// Mode of the directories an unpack makes (the umask applies, as to
/// `mkdir -p`).
const DIR_MODE: u32 = 0o755;

/// True when `name` is one plain component (no `/`, not `.` or `..`).
pub(crate) fn is_component(name: &str) -> bool {
    !name.is_empty() && !name.contains('/') && name != "." && name != ".."
}

/// Opens the directory `name` in `dir`, not through a link.
pub(crate) fn open_dir(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<OwnedFd> {
    Ok(nix::fcntl::openat(
        dir,
        name,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?)
}

/// Opens the directory `rel` (`a/b/c`, clean: no `.`, `..` or empty
/// components; empty for `dir` itself) under `dir` one component at a
/// time, making the missing ones when `create`. On error, the prefix of
/// `rel` it failed at.
pub(crate) fn open_path(
    dir: BorrowedFd<'_>,
    rel: &str,
    create: bool,
) -> Result<OwnedFd, (String, io::Error)> {
    let mut cur = open_dir(dir, OsStr::new(".")).map_err(|e| (String::new(), e))?;
    let mut done = 0;
    for c in rel.split('/').filter(|c| !c.is_empty()) {
        done += c.len() + usize::from(done > 0);
        let shown = || rel[..done].to_string();
        if !is_component(c) {
            let e = io::Error::new(io::ErrorKind::InvalidInput, "not a clean relative path");
            return Err((shown(), e));
        }
        if create {
            match nix::sys::stat::mkdirat(&cur, c, Mode::from_bits_truncate(DIR_MODE)) {
                Ok(()) | Err(Errno::EEXIST) => {}
                Err(e) => return Err((shown(), e.into())),
            }
        }
        cur = open_dir(cur.as_fd(), OsStr::new(c)).map_err(|e| (shown(), e))?;
    }
    Ok(cur)
}

/// `rel` split into its directory and last name (`a/b/c` → `a/b`, `c`).
pub(crate) fn split(rel: &str) -> (&str, &str) {
    match rel.rsplit_once('/') {
        Some((dir, name)) => (dir, name),
        None => ("", rel),
    }
}

/// What is at `name` in `dir` (a link is a link), `None` when nothing.
pub(crate) fn kind(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<Option<SFlag>> {
    match nix::sys::stat::fstatat(dir, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(st) => Ok(Some(SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT)),
        Err(Errno::ENOENT) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Makes the directory `name` in `dir`; one already there is fine, a file
/// or link there is not (`EEXIST`).
pub(crate) fn make_dir(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<()> {
    match nix::sys::stat::mkdirat(dir, name, Mode::from_bits_truncate(DIR_MODE)) {
        Ok(()) => Ok(()),
        Err(Errno::EEXIST) if kind(dir, name)? == Some(SFlag::S_IFDIR) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Creates the new file `name` in `dir` (never over anything there, never
/// through a link: `O_EXCL | O_NOFOLLOW`), readable by its owner alone
/// until filled. The caller copies into it, sets its mode and syncs it.
pub(crate) fn create_new(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<File> {
    Ok(File::from(nix::fcntl::openat(
        dir,
        name,
        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::from_bits_truncate(0o600),
    )?))
}

/// Opens the file `rel` under `dir` for reading, no link on the way or in
/// its last name.
pub(crate) fn open_file(dir: BorrowedFd<'_>, rel: &str) -> io::Result<File> {
    let (parent, name) = split(rel);
    let parent = open_path(dir, parent, false).map_err(|(_, e)| e)?;
    Ok(File::from(nix::fcntl::openat(
        &parent,
        name,
        OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?))
}

/// Reads the file `rel` under `dir`, at most `max` bytes (more is an error).
pub(crate) fn read_file(dir: BorrowedFd<'_>, rel: &str, max: u64) -> io::Result<Vec<u8>> {
    let mut out = Vec::new();
    open_file(dir, rel)?.take(max + 1).read_to_end(&mut out)?;
    if out.len() as u64 > max {
        return Err(io::Error::new(
            io::ErrorKind::FileTooLarge,
            format!("more than {max} bytes"),
        ));
    }
    Ok(out)
}

/// The target of the link `name` in `dir`; `None` when there is none.
pub(crate) fn read_link(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<Option<OsString>> {
    match nix::fcntl::readlinkat(dir, name) {
        Ok(t) => Ok(Some(t)),
        Err(Errno::ENOENT) => Ok(None),
        Err(Errno::EINVAL) => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "not a symbolic link",
        )),
        Err(e) => Err(e.into()),
    }
}

/// Points the link `name` in `dir` at `target`: a new link `tmp` made
/// beside it and renamed over it, so a reader sees the old link or the
/// new one, never none. A `tmp` left by a killed run is replaced.
pub(crate) fn replace_link(
    dir: BorrowedFd<'_>,
    tmp: &OsStr,
    name: &OsStr,
    target: &OsStr,
) -> io::Result<()> {
    match nix::unistd::unlinkat(dir, tmp, UnlinkatFlags::NoRemoveDir) {
        Ok(()) | Err(Errno::ENOENT) => {}
        Err(e) => return Err(e.into()),
    }
    nix::unistd::symlinkat(target, dir, tmp)?;
    if let Err(e) = nix::fcntl::renameat(dir, tmp, dir, name) {
        let _ = nix::unistd::unlinkat(dir, tmp, UnlinkatFlags::NoRemoveDir);
        return Err(e.into());
    }
    Ok(())
}

/// Removes the link (or file) `name` in `dir`; false when there was none.
pub(crate) fn remove_file(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<bool> {
    match nix::unistd::unlinkat(dir, name, UnlinkatFlags::NoRemoveDir) {
        Ok(()) => Ok(true),
        Err(Errno::ENOENT) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// The names in the directory `dir` (but `.` and `..`), sorted; those not
/// UTF-8 are skipped (no bundle makes one).
pub(crate) fn names(dir: BorrowedFd<'_>) -> io::Result<Vec<String>> {
    let mut d = nix::dir::Dir::openat(
        dir,
        ".",
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    let mut out = Vec::new();
    for entry in d.iter() {
        let entry = entry?;
        let n = entry.file_name().to_bytes();
        if n == b"." || n == b".." {
            continue;
        }
        if let Some(s) = OsStr::from_bytes(n).to_str() {
            out.push(s.to_string());
        }
    }
    out.sort();
    Ok(out)
}

/// fsync of the open directory.
pub(crate) fn sync(dir: BorrowedFd<'_>) -> io::Result<()> {
    Ok(nix::unistd::fsync(dir)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::os::unix::fs::symlink;

    fn open(p: &std::path::Path) -> OwnedFd {
        hostlib::fsutil::open_dir(p).unwrap()
    }

    #[test]
    fn paths_are_walked_without_following_links() {
        let d = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let fd = open(d.path());
        let made = open_path(fd.as_fd(), "a/b/c", true).unwrap();
        make_dir(made.as_fd(), OsStr::new("d")).unwrap();
        make_dir(made.as_fd(), OsStr::new("d")).unwrap();
        assert!(d.path().join("a/b/c/d").is_dir());
        symlink(outside.path(), d.path().join("a/out")).unwrap();
        // Through a link: refused, naming where, and nothing made outside.
        let (at, err) = open_path(fd.as_fd(), "a/out/x", true).unwrap_err();
        assert_eq!(at, "a/out");
        let code = err.raw_os_error();
        assert!(
            code == Some(Errno::ELOOP as i32) || code == Some(Errno::ENOTDIR as i32),
            "{err}"
        );
        assert_eq!(fs::read_dir(outside.path()).unwrap().count(), 0);
        let (at, _) = open_path(fd.as_fd(), "a/../../x", true).unwrap_err();
        assert_eq!(at, "a/..");
        // A file made new only, never through a link.
        drop(create_new(made.as_fd(), OsStr::new("f")).unwrap());
        assert!(create_new(made.as_fd(), OsStr::new("f")).is_err());
        symlink(outside.path().join("g"), d.path().join("a/b/c/g")).unwrap();
        assert!(create_new(made.as_fd(), OsStr::new("g")).is_err());
        assert!(!outside.path().join("g").exists());
        assert!(make_dir(made.as_fd(), OsStr::new("g")).is_err());
        fs::write(outside.path().join("secret"), "s").unwrap();
        assert!(read_file(fd.as_fd(), "a/out/secret", 10).is_err());
        assert_eq!(read_file(fd.as_fd(), "a/b/c/f", 10).unwrap(), b"");
        fs::write(d.path().join("a/big"), "0123456789x").unwrap();
        assert!(read_file(fd.as_fd(), "a/big", 10).is_err());
        assert_eq!(
            kind(fd.as_fd(), OsStr::new("a/out")).unwrap(),
            Some(SFlag::S_IFLNK)
        );
        assert_eq!(kind(fd.as_fd(), OsStr::new("nothing")).unwrap(), None);
        assert_eq!(names(made.as_fd()).unwrap(), ["d", "f", "g"]);
    }

    #[test]
    fn links_are_replaced_whole_and_removed() {
        let d = tempfile::tempdir().unwrap();
        let fd = open(d.path());
        let (tmp, cur) = (OsStr::new(".current.new"), OsStr::new("current"));
        assert_eq!(read_link(fd.as_fd(), cur).unwrap(), None);
        // A temp link a killed run left is replaced.
        symlink("stale", d.path().join(".current.new")).unwrap();
        replace_link(fd.as_fd(), tmp, cur, OsStr::new("550")).unwrap();
        replace_link(fd.as_fd(), tmp, cur, OsStr::new("560")).unwrap();
        assert_eq!(
            read_link(fd.as_fd(), cur).unwrap().as_deref(),
            Some(OsStr::new("560"))
        );
        assert_eq!(names(fd.as_fd()).unwrap(), ["current"]);
        fs::create_dir(d.path().join("dir")).unwrap();
        assert!(read_link(fd.as_fd(), OsStr::new("dir")).is_err());
        assert!(remove_file(fd.as_fd(), cur).unwrap());
        assert!(!remove_file(fd.as_fd(), cur).unwrap());
        sync(fd.as_fd()).unwrap();
    }

    #[test]
    fn names_are_single_components() {
        assert!(is_component("550.127.08-6.1.0"));
        for bad in ["", ".", "..", "a/b", "/a"] {
            assert!(!is_component(bad), "{bad}");
        }
        assert_eq!(split("a/b/c"), ("a/b", "c"));
        assert_eq!(split("c"), ("", "c"));
    }
}
