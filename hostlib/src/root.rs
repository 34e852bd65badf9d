//! [`HostRoot`]: where the host's `/` is, as seen by this process.
//!
//! On bare metal the root is `/`; in a DaemonSet the host's `/` is mounted at
//! `/host`; in tests it is a temp dir. Every host path (`/sys/...`,
//! `/etc/containerd/config.toml`) is resolved through [`HostRoot::resolve`].
//!
//! Resolution walks the path one component at a time and follows symbolic
//! links itself, the way the host would see them:
//! - an absolute link target is read as a host path, i.e. re-anchored at the
//!   root (`/host/etc/alternatives/x -> /usr/bin/y` means `/host/usr/bin/y`),
//!   so it can never lead outside the root;
//! - a `..` (in the path asked for, or in a link target) that would climb
//!   above the root is refused with [`HostError::Escapes`] naming the path.
//!
//! With the root `/` there is nothing to escape from, and the kernel resolves
//! paths itself.
//!
//! Reads take a faster way first: `openat2(2)` from a descriptor of the root
//! with `RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS`, one call in which the
//! kernel refuses to leave the root (and cannot be raced there by a link
//! swapped in). Where it refuses or fails (an absolute link or a `..` on the
//! way, a missing file, a kernel without openat2), the walk above decides,
//! so results and errors are the walk's.
//!
//! Changes (writes, removals, new directories) are decided by the walk (its
//! errors are the answer: [`HostError::Escapes`] for a path that climbs
//! out) and then made through descriptors: the directory that holds the
//! file is opened with `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)`
//! from the root's descriptor (missing directories made one at a time with
//! `mkdirat` in their opened parent), and the file itself is created,
//! renamed or removed relative to that directory (`openat`, `renameat`,
//! `unlinkat`; never following a link in the last name). A link swapped in
//! after the walk is resolved by the kernel with the root as `/`, so
//! whatever it points at, the change lands inside the root. On a kernel
//! without openat2 (Linux before 5.6), or with [`HostRoot::walk_only`], the
//! directory is opened by the walk's path instead: the fallback.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::fs;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use nix::errno::Errno;
use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::Mode;

use crate::fsutil;

/// Set when `openat2` answered `ENOSYS`: this kernel has none, every change
/// takes the walk's way from then on.
static NO_OPENAT2: AtomicBool = AtomicBool::new(false);

/// Times `openat2` is asked again when it answers `EAGAIN` (a rename on
/// the system raced its checks).
const OPENAT2_RETRIES: usize = 16;

/// Symbolic links followed for one path before giving up (Linux's own limit).
const MAX_SYMLINK_HOPS: usize = 40;

/// Errors from reading or writing host paths. Each names the path it is about.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// A host path must be absolute (`/etc/...`), relative to the host's `/`.
    #[error("{path}: not an absolute host path")]
    NotAbsolute { path: PathBuf },
    /// The path (or a symbolic link on its way) climbs above the host root.
    #[error("{path}: escapes the host root {root}")]
    Escapes { path: PathBuf, root: PathBuf },
    /// Too many symbolic links while resolving the path.
    #[error("{path}: too many levels of symbolic links")]
    SymlinkLoop { path: PathBuf },
    /// An I/O error on the resolved path.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

impl HostError {
    /// Wraps an I/O error with the path it happened on.
    pub fn io(path: impl Into<PathBuf>, source: io::Error) -> Self {
        HostError::Io {
            path: path.into(),
            source,
        }
    }

    /// True when the error says the file does not exist.
    pub fn is_not_found(&self) -> bool {
        matches!(self, HostError::Io { source, .. } if source.kind() == io::ErrorKind::NotFound)
    }
}

/// The host's `/` as seen by this process.
#[derive(Debug, Clone)]
pub struct HostRoot {
    root: PathBuf,
    /// The root, opened (O_PATH) for `openat2`; `None` for `/`.
    dir: Option<std::sync::Arc<OwnedFd>>,
    /// Never use `openat2`, as on a kernel without it (see [`HostRoot::walk_only`]).
    walk_only: bool,
}

/// A host directory opened for changes in it (see [`HostRoot::dir`]).
#[derive(Debug)]
pub struct HostDir {
    fd: OwnedFd,
    path: PathBuf,
}

impl HostDir {
    /// The open directory, for calls relative to it (`openat`, `renameat`).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Where the walk found it (this process's path), for messages.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Renames the entry `from` of this directory to `to` in it
    /// (`renameat` on the open directory: nothing is resolved by path, so a
    /// directory swapped for a link meanwhile is not followed).
    pub fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        nix::fcntl::renameat(self.fd(), from, self.fd(), to).map_err(io::Error::from)
    }
}

impl PartialEq for HostRoot {
    fn eq(&self, other: &Self) -> bool {
        self.root == other.root
    }
}

impl Eq for HostRoot {}

impl HostRoot {
    /// A host root at `root`, which must be an existing directory.
    pub fn new(root: impl Into<PathBuf>) -> Result<Self, HostError> {
        let root = root.into();
        let meta = fs::metadata(&root).map_err(|e| HostError::io(&root, e))?;
        if !meta.is_dir() {
            return Err(HostError::io(
                &root,
                io::Error::new(io::ErrorKind::NotADirectory, "host root is not a directory"),
            ));
        }
        // Canonicalise once so that `..` checks compare like with like.
        let root = fs::canonicalize(&root).map_err(|e| HostError::io(&root, e))?;
        let dir = if root == Path::new("/") {
            None
        } else {
            nix::fcntl::open(
                &root,
                nix::fcntl::OFlag::O_PATH
                    | nix::fcntl::OFlag::O_DIRECTORY
                    | nix::fcntl::OFlag::O_CLOEXEC,
                nix::sys::stat::Mode::empty(),
            )
            .ok()
            .map(std::sync::Arc::new)
        };
        Ok(HostRoot {
            root,
            dir,
            walk_only: false,
        })
    }

    /// This root as on a kernel without `openat2`: reads and changes take
    /// the walk's path (the fallback), for tests and comparisons.
    pub fn walk_only(mut self) -> Self {
        self.walk_only = true;
        self
    }

    /// The root's descriptor when changes go through `openat2`.
    fn kernel_root(&self) -> Option<&OwnedFd> {
        if self.walk_only || NO_OPENAT2.load(Ordering::Relaxed) {
            return None;
        }
        self.dir.as_deref()
    }

    /// `openat2(root, rel, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)`: links
    /// on the way (absolute ones, `..`) are resolved with the root as `/`.
    fn open_in_root(root: &OwnedFd, rel: &Path, flags: OFlag) -> nix::Result<OwnedFd> {
        let rel = if rel.as_os_str().is_empty() {
            Path::new(".")
        } else {
            rel
        };
        let how = OpenHow::new()
            .flags(flags | OFlag::O_CLOEXEC)
            .resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS);
        // EAGAIN: a rename elsewhere raced the kernel's `..` checks; it
        // asks to be called again. A few times, then it is the answer.
        let mut r = nix::fcntl::openat2(root, rel, how);
        for _ in 0..OPENAT2_RETRIES {
            if !matches!(r, Err(Errno::EAGAIN)) {
                break;
            }
            std::thread::yield_now();
            r = nix::fcntl::openat2(root, rel, how);
        }
        if matches!(r, Err(Errno::ENOSYS)) && !NO_OPENAT2.swap(true, Ordering::Relaxed) {
            tracing::info!("this kernel has no openat2: host paths are opened by the walk's path");
        }
        r
    }

    /// Opens the directory at `real` (a path the walk gave: under the
    /// root), making it and its missing parents when `create`.
    fn open_real_dir(&self, real: &Path, create: bool) -> Result<OwnedFd, HostError> {
        let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY;
        if let Some(root) = self.kernel_root() {
            let rel = real
                .strip_prefix(&self.root)
                .expect("the walk keeps every path under the root");
            match Self::open_in_root(root, rel, flags) {
                Ok(fd) => return Ok(fd),
                Err(Errno::ENOSYS) => {}
                Err(Errno::ENOENT) if create => {
                    return self.make_dirs_in_root(root, rel, flags);
                }
                Err(e) => return Err(HostError::io(real, e.into())),
            }
        }
        if create {
            fs::create_dir_all(real).map_err(|e| HostError::io(real, e))?;
        }
        fsutil::open_dir(real).map_err(|e| HostError::io(real, e))
    }

    /// Makes the missing directories of `rel` one at a time: each with
    /// `mkdirat` in its parent, opened in the root (so never outside it).
    fn make_dirs_in_root(
        &self,
        root: &OwnedFd,
        rel: &Path,
        flags: OFlag,
    ) -> Result<OwnedFd, HostError> {
        let mut prefix = PathBuf::new();
        let mut cur = Self::open_in_root(root, &prefix, flags)
            .map_err(|e| HostError::io(&self.root, e.into()))?;
        for c in rel.components() {
            prefix.push(c);
            let shown = || self.root.join(&prefix);
            cur = match Self::open_in_root(root, &prefix, flags) {
                Ok(fd) => fd,
                Err(Errno::ENOENT) => {
                    match nix::sys::stat::mkdirat(
                        &cur,
                        c.as_os_str(),
                        Mode::from_bits_truncate(0o777),
                    ) {
                        Ok(()) | Err(Errno::EEXIST) => {}
                        Err(e) => return Err(HostError::io(shown(), e.into())),
                    }
                    Self::open_in_root(root, &prefix, flags)
                        .map_err(|e| HostError::io(shown(), e.into()))?
                }
                Err(e) => return Err(HostError::io(shown(), e.into())),
            };
        }
        Ok(cur)
    }

    /// The directory that holds `host_path`, opened for a change, with the
    /// last name and the path the walk resolved (for messages).
    fn parent_of(
        &self,
        host_path: &Path,
        follow_last: bool,
        create: bool,
    ) -> Result<(HostDir, OsString, PathBuf), HostError> {
        let real = self.resolve_inner(host_path, follow_last)?;
        // The root itself has no parent to change it in (above it is not ours).
        let (Some(dir), Some(name), false) = (real.parent(), real.file_name(), real == self.root)
        else {
            return Err(HostError::io(
                host_path,
                io::Error::new(io::ErrorKind::InvalidInput, "not a file in a directory"),
            ));
        };
        let fd = self.open_real_dir(dir, create)?;
        let dir = HostDir {
            fd,
            path: dir.to_path_buf(),
        };
        Ok((dir, name.to_os_string(), real))
    }

    /// Opens the host directory `host_path` for changes in it (made, with
    /// its parents, when `create`); see the module docs.
    pub fn dir(&self, host_path: impl AsRef<Path>, create: bool) -> Result<HostDir, HostError> {
        let real = self.resolve(host_path)?;
        let fd = self.open_real_dir(&real, create)?;
        Ok(HostDir { fd, path: real })
    }

    /// Opens `host_path` beneath the root in one `openat2` call, or `None`
    /// when the kernel did not (the caller walks; see the module docs).
    fn open_beneath(&self, host_path: &Path, flags: nix::fcntl::OFlag) -> Option<fs::File> {
        use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
        if self.walk_only {
            return None;
        }
        let dir = self.dir.as_ref()?;
        let rel = host_path.strip_prefix("/").ok()?;
        if rel.as_os_str().is_empty() {
            return None;
        }
        let how = OpenHow::new()
            .flags(flags | OFlag::O_CLOEXEC)
            .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_MAGICLINKS);
        match nix::fcntl::openat2(dir.as_ref(), rel, how) {
            Ok(fd) => Some(fs::File::from(fd)),
            Err(Errno::ENOSYS) => {
                NO_OPENAT2.store(true, Ordering::Relaxed);
                None
            }
            Err(_) => None,
        }
    }

    /// The real `/`: bare metal.
    pub fn system() -> Self {
        HostRoot {
            root: PathBuf::from("/"),
            dir: None,
            walk_only: false,
        }
    }

    /// Where the host's `/` is in this process's view.
    pub fn path(&self) -> &Path {
        &self.root
    }

    /// True when this is the process's own `/`.
    pub fn is_system(&self) -> bool {
        self.root == Path::new("/")
    }

    /// Resolves a host path to the path this process opens, following
    /// symbolic links inside the root (see the module docs).
    pub fn resolve(&self, host_path: impl AsRef<Path>) -> Result<PathBuf, HostError> {
        self.resolve_inner(host_path.as_ref(), true)
    }

    /// Like [`resolve`](Self::resolve), but a symbolic link in the last
    /// component is not followed (for `readlink`, `lstat`, replacing a link).
    pub fn resolve_no_follow(&self, host_path: impl AsRef<Path>) -> Result<PathBuf, HostError> {
        self.resolve_inner(host_path.as_ref(), false)
    }

    fn resolve_inner(&self, host_path: &Path, follow_last: bool) -> Result<PathBuf, HostError> {
        if !host_path.is_absolute() {
            return Err(HostError::NotAbsolute {
                path: host_path.to_path_buf(),
            });
        }
        if self.is_system() {
            return Ok(host_path.to_path_buf());
        }
        let escapes = || HostError::Escapes {
            path: host_path.to_path_buf(),
            root: self.root.clone(),
        };
        let mut pending: VecDeque<OsString> = VecDeque::new();
        push_components(&mut pending, host_path).map_err(|_| escapes())?;
        let mut done: Vec<OsString> = Vec::new();
        let mut hops = 0;
        while let Some(name) = pending.pop_front() {
            if name == ".." {
                if done.pop().is_none() {
                    return Err(escapes());
                }
                continue;
            }
            let mut candidate = self.root.clone();
            candidate.extend(&done);
            candidate.push(&name);
            let is_last = pending.is_empty();
            let is_link = fs::symlink_metadata(&candidate)
                .map(|m| m.file_type().is_symlink())
                .unwrap_or(false);
            if !is_link || (is_last && !follow_last) {
                done.push(name);
                continue;
            }
            hops += 1;
            if hops > MAX_SYMLINK_HOPS {
                return Err(HostError::SymlinkLoop {
                    path: host_path.to_path_buf(),
                });
            }
            let target = fs::read_link(&candidate).map_err(|e| HostError::io(&candidate, e))?;
            if target.is_absolute() {
                done.clear();
            }
            push_components(&mut pending, &target).map_err(|_| escapes())?;
        }
        let mut out = self.root.clone();
        out.extend(&done);
        Ok(out)
    }

    /// The host's own path for `host_path` with every link followed: what
    /// the host itself (a runtime mounting it, say) would call that file.
    pub fn canonical(&self, host_path: impl AsRef<Path>) -> Result<PathBuf, HostError> {
        let real = self.resolve(host_path)?;
        if self.is_system() {
            return fs::canonicalize(&real).map_err(|e| HostError::io(real, e));
        }
        let inside = real
            .strip_prefix(&self.root)
            .expect("resolve keeps every path under the root");
        Ok(Path::new("/").join(inside))
    }

    /// Reads a host file to a string.
    pub fn read_to_string(&self, host_path: impl AsRef<Path>) -> Result<String, HostError> {
        let host_path = host_path.as_ref();
        if let Some(mut f) = self.open_beneath(host_path, nix::fcntl::OFlag::O_RDONLY) {
            let mut s = String::new();
            if io::Read::read_to_string(&mut f, &mut s).is_ok() {
                return Ok(s);
            }
        }
        let path = self.resolve(host_path)?;
        fs::read_to_string(&path).map_err(|e| HostError::io(path, e))
    }

    /// Reads a host file, or `None` when it does not exist.
    pub fn read_optional(&self, host_path: impl AsRef<Path>) -> Result<Option<String>, HostError> {
        match self.read_to_string(host_path) {
            Ok(s) => Ok(Some(s)),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Opens a host file for reading.
    pub fn open(&self, host_path: impl AsRef<Path>) -> Result<fs::File, HostError> {
        let host_path = host_path.as_ref();
        if let Some(f) = self.open_beneath(host_path, nix::fcntl::OFlag::O_RDONLY) {
            return Ok(f);
        }
        let path = self.resolve(host_path)?;
        fs::File::open(&path).map_err(|e| HostError::io(path, e))
    }

    /// The target of a host symbolic link, as written in the link.
    pub fn read_link(&self, host_path: impl AsRef<Path>) -> Result<PathBuf, HostError> {
        let host_path = host_path.as_ref();
        let flags = nix::fcntl::OFlag::O_PATH | nix::fcntl::OFlag::O_NOFOLLOW;
        if let Some(link) = self.open_beneath(host_path, flags)
            && let Ok(target) = nix::fcntl::readlinkat(&link, "")
        {
            return Ok(PathBuf::from(target));
        }
        let path = self.resolve_no_follow(host_path)?;
        fs::read_link(&path).map_err(|e| HostError::io(path, e))
    }

    /// The names in a host directory, sorted.
    pub fn read_dir_names(&self, host_path: impl AsRef<Path>) -> Result<Vec<String>, HostError> {
        let path = self.resolve(host_path)?;
        let entries = fs::read_dir(&path).map_err(|e| HostError::io(&path, e))?;
        let mut names = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|e| HostError::io(&path, e))?;
            names.push(entry.file_name().to_string_lossy().into_owned());
        }
        names.sort();
        Ok(names)
    }

    /// True when the host path exists (following links).
    pub fn exists(&self, host_path: impl AsRef<Path>) -> bool {
        let host_path = host_path.as_ref();
        if self
            .open_beneath(host_path, nix::fcntl::OFlag::O_PATH)
            .is_some()
        {
            return true;
        }
        self.resolve(host_path).map(|p| p.exists()).unwrap_or(false)
    }

    /// Sets the file's modification time to now: a sign of life that
    /// writes no data (no fsync).
    pub fn touch(&self, host_path: impl AsRef<Path>) -> Result<(), HostError> {
        let (dir, name, real) = self.parent_of(host_path.as_ref(), true, false)?;
        nix::fcntl::openat(
            dir.fd(),
            name.as_os_str(),
            OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(io::Error::from)
        .and_then(|fd| fs::File::from(fd).set_modified(std::time::SystemTime::now()))
        .map_err(|e| HostError::io(&real, e))
    }

    /// Writes a host file atomically (see [`fsutil::write_atomic_at`]),
    /// creating its parent directories; returns the path it resolved to.
    pub fn write_atomic(
        &self,
        host_path: impl AsRef<Path>,
        contents: &[u8],
        mode: u32,
    ) -> Result<PathBuf, HostError> {
        self.write_atomic_then(host_path, contents, mode, |_, _| Ok::<(), HostError>(()))
    }

    /// Like [`write_atomic`](Self::write_atomic); `then` sees the complete
    /// new file (and the resolved path, for messages) before it replaces
    /// the old one: to give it an owner, say.
    pub fn write_atomic_then<E: From<HostError>>(
        &self,
        host_path: impl AsRef<Path>,
        contents: &[u8],
        mode: u32,
        then: impl FnOnce(&fs::File, &Path) -> Result<(), E>,
    ) -> Result<PathBuf, E> {
        let (dir, name, real) = self.parent_of(host_path.as_ref(), true, true)?;
        match fsutil::write_atomic_at(dir.fd(), &name, contents, mode, |f| then(f, &real)) {
            Ok(()) => Ok(real),
            Err(fsutil::AtomicError::Io(e)) => Err(HostError::io(real, e).into()),
            Err(fsutil::AtomicError::Then(e)) => Err(e),
        }
    }

    /// Opens the host file `host_path` for writing, creating it (with
    /// `mode`, umask applied) and its parents when missing; never through
    /// a link in its last name. Not truncated: for lock files.
    pub fn open_or_create(
        &self,
        host_path: impl AsRef<Path>,
        mode: u32,
    ) -> Result<fs::File, HostError> {
        let (dir, name, real) = self.parent_of(host_path.as_ref(), true, true)?;
        nix::fcntl::openat(
            dir.fd(),
            name.as_os_str(),
            OFlag::O_RDWR | OFlag::O_CREAT | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::from_bits_truncate(mode),
        )
        .map(fs::File::from)
        .map_err(|e| HostError::io(real, e.into()))
    }

    /// Removes the host file `host_path` (a link in its last name is
    /// followed, as [`resolve`](Self::resolve) does); false when there was none.
    pub fn remove_file(&self, host_path: impl AsRef<Path>) -> Result<bool, HostError> {
        self.unlink(host_path.as_ref(), nix::unistd::UnlinkatFlags::NoRemoveDir)
    }

    /// Removes the empty host directory `host_path`; false when there was
    /// none (one that is not empty is an error, `DirectoryNotEmpty`).
    pub fn remove_dir(&self, host_path: impl AsRef<Path>) -> Result<bool, HostError> {
        self.unlink(host_path.as_ref(), nix::unistd::UnlinkatFlags::RemoveDir)
    }

    fn unlink(&self, host_path: &Path, how: nix::unistd::UnlinkatFlags) -> Result<bool, HostError> {
        let (dir, name, real) = match self.parent_of(host_path, true, false) {
            Ok(found) => found,
            Err(e) if e.is_not_found() => return Ok(false),
            Err(e) => return Err(e),
        };
        match nix::unistd::unlinkat(dir.fd(), name.as_os_str(), how) {
            Ok(()) => Ok(true),
            Err(Errno::ENOENT) => Ok(false),
            Err(e) => Err(HostError::io(real, e.into())),
        }
    }

    /// Removes the host file or directory `host_path`, a directory with
    /// everything in it (see [`remove_tree_at`]: links inside are removed,
    /// never followed); false when there was none. A link in the last name
    /// is followed, as [`remove_file`](Self::remove_file) does.
    pub fn remove_all(&self, host_path: impl AsRef<Path>) -> Result<bool, HostError> {
        let (dir, name, real) = match self.parent_of(host_path.as_ref(), true, false) {
            Ok(found) => found,
            Err(e) if e.is_not_found() => return Ok(false),
            Err(e) => return Err(e),
        };
        match remove_tree_at(dir.fd(), &name) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(HostError::io(real, e)),
        }
    }

    /// Makes the host directory `host_path` and its missing parents; returns
    /// the path it resolved to.
    pub fn create_dir_all(&self, host_path: impl AsRef<Path>) -> Result<PathBuf, HostError> {
        Ok(self.dir(host_path, true)?.path)
    }
}

/// Directories nested deeper than this are not removed by [`remove_tree_at`]
/// (each level holds a descriptor open while its entries go).
pub const MAX_TREE_DEPTH: usize = 128;

/// Removes `name` in the open directory `dir`: a file or link is unlinked
/// (a link never followed), a directory emptied first, entry by entry,
/// each relative to its own opened (`O_NOFOLLOW`) directory. Nothing is
/// resolved by path, so a link swapped in anywhere below `dir` is removed,
/// never what it points at. `NotFound` when `name` is not there.
pub fn remove_tree_at(dir: BorrowedFd<'_>, name: &std::ffi::OsStr) -> io::Result<()> {
    remove_tree_depth(dir, name, 0)
}

fn remove_tree_depth(dir: BorrowedFd<'_>, name: &std::ffi::OsStr, depth: usize) -> io::Result<()> {
    use nix::unistd::{UnlinkatFlags, unlinkat};
    match unlinkat(dir, name, UnlinkatFlags::NoRemoveDir) {
        Ok(()) => return Ok(()),
        // A directory (Linux's answer).
        Err(Errno::EISDIR) => {}
        Err(e) => return Err(e.into()),
    }
    if depth >= MAX_TREE_DEPTH {
        return Err(io::Error::other(format!(
            "directories nested more than {MAX_TREE_DEPTH} deep"
        )));
    }
    let mut sub = nix::dir::Dir::openat(
        dir,
        name,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    let mut names = Vec::new();
    for entry in sub.iter() {
        let entry = entry?;
        let n = entry.file_name().to_bytes();
        if n != b"." && n != b".." {
            names.push(std::ffi::OsString::from(
                <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(n),
            ));
        }
    }
    for n in &names {
        match remove_tree_depth(sub.as_fd(), n, depth + 1) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            other => other?,
        }
    }
    drop(sub);
    unlinkat(dir, name, UnlinkatFlags::RemoveDir)?;
    Ok(())
}

/// Queues the normal and `..` components of `path` at the front of `pending`
/// (in order). `.` and the root are dropped. Errors on prefixes (never on Linux).
fn push_components(pending: &mut VecDeque<OsString>, path: &Path) -> Result<(), ()> {
    let mut parts = Vec::new();
    for c in path.components() {
        match c {
            Component::RootDir | Component::CurDir => {}
            Component::ParentDir => parts.push(OsString::from("..")),
            Component::Normal(n) => parts.push(n.to_os_string()),
            Component::Prefix(_) => return Err(()),
        }
    }
    for p in parts.into_iter().rev() {
        pending.push_front(p);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn root() -> (tempfile::TempDir, HostRoot) {
        let dir = tempfile::tempdir().unwrap();
        let root = HostRoot::new(dir.path()).unwrap();
        (dir, root)
    }

    #[test]
    fn plain_paths_land_under_the_root() {
        let (_d, r) = root();
        assert_eq!(
            r.resolve("/etc/containerd/config.toml").unwrap(),
            r.path().join("etc/containerd/config.toml")
        );
    }

    #[test]
    fn relative_paths_are_refused() {
        let (_d, r) = root();
        let err = r.resolve("etc/passwd").unwrap_err();
        assert!(matches!(err, HostError::NotAbsolute { .. }));
        assert_eq!(err.to_string(), "etc/passwd: not an absolute host path");
    }

    #[test]
    fn dotdot_inside_the_root_is_fine_but_climbing_out_is_refused() {
        let (_d, r) = root();
        assert_eq!(r.resolve("/etc/../sys").unwrap(), r.path().join("sys"));
        let err = r.resolve("/etc/../../outside").unwrap_err();
        assert!(matches!(err, HostError::Escapes { .. }), "{err}");
        assert!(
            err.to_string()
                .starts_with("/etc/../../outside: escapes the host root")
        );
    }

    #[test]
    fn relative_links_are_followed_inside_the_root() {
        let (_d, r) = root();
        let p = r.path();
        fs::create_dir_all(p.join("sys/devices/pci0000:00/0000:00:01.0")).unwrap();
        fs::create_dir_all(p.join("sys/bus/pci/devices")).unwrap();
        symlink(
            "../../../devices/pci0000:00/0000:00:01.0",
            p.join("sys/bus/pci/devices/0000:00:01.0"),
        )
        .unwrap();
        assert_eq!(
            r.resolve("/sys/bus/pci/devices/0000:00:01.0/vendor")
                .unwrap(),
            p.join("sys/devices/pci0000:00/0000:00:01.0/vendor")
        );
    }

    #[test]
    fn absolute_links_are_read_as_host_paths() {
        let (_d, r) = root();
        let p = r.path();
        fs::create_dir_all(p.join("etc")).unwrap();
        // On the host this means the host's /etc/shadow, never this machine's.
        symlink("/etc/shadow", p.join("etc/evil")).unwrap();
        assert_eq!(r.resolve("/etc/evil").unwrap(), p.join("etc/shadow"));
    }

    #[test]
    fn canonical_paths_are_the_hosts_own() {
        let (_d, r) = root();
        let p = r.path();
        fs::create_dir_all(p.join("usr/lib/x86_64-linux-gnu")).unwrap();
        fs::write(p.join("usr/lib/x86_64-linux-gnu/libcuda.so.1"), "").unwrap();
        symlink("usr/lib", p.join("lib")).unwrap();
        assert_eq!(
            r.canonical("/lib/x86_64-linux-gnu/libcuda.so.1").unwrap(),
            Path::new("/usr/lib/x86_64-linux-gnu/libcuda.so.1")
        );
        assert_eq!(HostRoot::system().canonical("/").unwrap(), Path::new("/"));
    }

    #[test]
    fn links_that_climb_out_are_refused() {
        let (_d, r) = root();
        let p = r.path();
        fs::create_dir_all(p.join("etc")).unwrap();
        symlink("../../../../etc/passwd", p.join("etc/evil")).unwrap();
        let err = r.read_to_string("/etc/evil").unwrap_err();
        assert!(matches!(err, HostError::Escapes { .. }), "{err}");
        assert!(err.to_string().contains("/etc/evil"));
    }

    #[test]
    fn link_loops_are_reported() {
        let (_d, r) = root();
        let p = r.path();
        symlink("/b", p.join("a")).unwrap();
        symlink("/a", p.join("b")).unwrap();
        let err = r.resolve("/a/x").unwrap_err();
        assert!(matches!(err, HostError::SymlinkLoop { .. }), "{err}");
    }

    #[test]
    fn no_follow_keeps_the_last_link() {
        let (_d, r) = root();
        let p = r.path();
        symlink("/target", p.join("link")).unwrap();
        assert_eq!(r.resolve_no_follow("/link").unwrap(), p.join("link"));
        assert_eq!(r.read_link("/link").unwrap(), PathBuf::from("/target"));
        assert_eq!(r.resolve("/link").unwrap(), p.join("target"));
    }

    #[test]
    fn io_errors_name_the_path() {
        let (_d, r) = root();
        let err = r.read_to_string("/proc/driver/nvidia/version").unwrap_err();
        assert!(err.is_not_found());
        assert!(
            err.to_string()
                .contains("proc/driver/nvidia/version: No such file"),
            "{err}"
        );
        assert_eq!(r.read_optional("/proc/nothing").unwrap(), None);
    }

    #[test]
    fn system_root_passes_paths_through() {
        let r = HostRoot::system();
        assert!(r.is_system());
        assert_eq!(
            r.resolve("/etc/hostname").unwrap(),
            PathBuf::from("/etc/hostname")
        );
    }

    #[test]
    fn reads_through_openat2_agree_with_the_walk() {
        let (d, r) = root();
        let base = d.path();
        fs::create_dir_all(base.join("sys/devices/pci0/0000:18:00.0")).unwrap();
        fs::write(
            base.join("sys/devices/pci0/0000:18:00.0/vendor"),
            "0x10de\n",
        )
        .unwrap();
        fs::create_dir_all(base.join("sys/bus/pci/devices")).unwrap();
        symlink(
            "../../../devices/pci0/0000:18:00.0",
            base.join("sys/bus/pci/devices/0000:18:00.0"),
        )
        .unwrap();
        // Relative links inside the root: the kernel's one call.
        assert_eq!(
            r.read_to_string("/sys/bus/pci/devices/0000:18:00.0/vendor")
                .unwrap(),
            "0x10de\n"
        );
        assert!(r.exists("/sys/bus/pci/devices/0000:18:00.0/vendor"));
        assert_eq!(
            r.read_link("/sys/bus/pci/devices/0000:18:00.0").unwrap(),
            Path::new("../../../devices/pci0/0000:18:00.0")
        );
        assert!(
            r.read_link("/sys/devices/pci0/0000:18:00.0/vendor")
                .is_err()
        );
        // An absolute link: re-anchored at the root by the walk.
        symlink("/sys/devices/pci0", base.join("abs")).unwrap();
        assert_eq!(
            r.read_to_string("/abs/0000:18:00.0/vendor").unwrap(),
            "0x10de\n"
        );
        // A link that climbs out: refused, naming the path, as before.
        fs::write(d.path().parent().unwrap().join("outside-secret"), "x").ok();
        symlink("../../outside-secret", base.join("sys/leak")).unwrap();
        let err = r.read_to_string("/sys/leak").unwrap_err();
        assert!(matches!(err, HostError::Escapes { .. }), "{err}");
        assert!(!r.exists("/sys/leak"));
        assert!(r.open("/sys/leak").is_err());
        // Missing: the walk's error, naming the resolved path.
        let err = r
            .read_to_string("/sys/bus/pci/devices/0000:18:00.0/nope")
            .unwrap_err();
        assert!(err.is_not_found());
        assert!(
            err.to_string()
                .contains("sys/devices/pci0/0000:18:00.0/nope"),
            "{err}"
        );
    }

    #[test]
    fn write_atomic_creates_parents_and_sets_mode() {
        use std::os::unix::fs::PermissionsExt;
        let (_d, r) = root();
        let path = r
            .write_atomic("/run/gpu-agent/state.json", b"{}", 0o640)
            .unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"{}");
        assert_eq!(
            fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o640
        );
    }

    #[test]
    fn changes_land_where_the_walk_says_with_or_without_openat2() {
        for walk_only in [false, true] {
            let (d, r) = root();
            let r = if walk_only { r.walk_only() } else { r };
            let base = r.path().to_path_buf();
            fs::create_dir_all(base.join("usr/lib")).unwrap();
            // An absolute link on the way: re-anchored at the root.
            symlink("/usr/lib", base.join("lib")).unwrap();
            let real = r.write_atomic("/lib/new/dir/f.conf", b"x", 0o600).unwrap();
            assert_eq!(
                real,
                base.join("usr/lib/new/dir/f.conf"),
                "walk_only {walk_only}"
            );
            assert_eq!(fs::read(&real).unwrap(), b"x");
            // A link in the last name is followed (the file it names is written).
            symlink("f.conf", base.join("usr/lib/new/dir/alias")).unwrap();
            r.write_atomic("/lib/new/dir/alias", b"y", 0o600).unwrap();
            assert_eq!(fs::read(&real).unwrap(), b"y");
            assert!(
                fs::symlink_metadata(base.join("usr/lib/new/dir/alias"))
                    .unwrap()
                    .is_symlink()
            );
            r.touch("/lib/new/dir/f.conf").unwrap();
            assert_eq!(
                r.create_dir_all("/lib/made/here").unwrap(),
                base.join("usr/lib/made/here")
            );
            assert!(base.join("usr/lib/made/here").is_dir());
            let err = r.remove_dir("/lib/made").unwrap_err();
            assert!(
                err.to_string()
                    .contains("usr/lib/made: Directory not empty"),
                "{err}"
            );
            assert!(r.remove_dir("/lib/made/here").unwrap());
            assert!(!r.remove_dir("/lib/made/here").unwrap());
            assert!(r.remove_file("/lib/new/dir/f.conf").unwrap());
            assert!(!r.remove_file("/lib/new/dir/f.conf").unwrap());
            assert!(!r.remove_file("/nowhere/at/all").unwrap());
            // A file the lock takes: made once, opened again after.
            let f = r.open_or_create("/run/x.lock", 0o644).unwrap();
            drop(f);
            r.open_or_create("/run/x.lock", 0o644).unwrap();
            // Climbing out is refused, naming the path; nothing is made outside.
            let outside = d.path().parent().unwrap().to_path_buf();
            let before = fs::read_dir(&outside).unwrap().count();
            symlink("../../out", base.join("usr/up")).unwrap();
            for err in [
                r.write_atomic("/usr/up/f", b"x", 0o644).unwrap_err(),
                r.create_dir_all("/usr/up/d").unwrap_err(),
                r.remove_file("/usr/up/f").unwrap_err(),
                r.write_atomic("/../f", b"x", 0o644).unwrap_err(),
            ] {
                assert!(matches!(err, HostError::Escapes { .. }), "{err}");
            }
            assert_eq!(fs::read_dir(&outside).unwrap().count(), before);
            // The root itself is no file.
            assert!(r.write_atomic("/", b"x", 0o644).is_err());
        }
    }

    #[test]
    fn remove_all_takes_the_tree_and_never_what_links_in_it_name() {
        for walk_only in [false, true] {
            let (_d, r) = root();
            let r = if walk_only { r.walk_only() } else { r };
            let base = r.path().to_path_buf();
            let outside = tempfile::tempdir().unwrap();
            fs::write(outside.path().join("precious"), "x").unwrap();
            fs::create_dir_all(base.join("var/lib/a/b/c")).unwrap();
            fs::write(base.join("var/lib/a/b/c/f"), "f").unwrap();
            fs::write(base.join("var/lib/a/top"), "t").unwrap();
            // Links inside: to a directory outside, and to a file inside.
            symlink(outside.path(), base.join("var/lib/a/b/out")).unwrap();
            symlink("../top", base.join("var/lib/a/b/alias")).unwrap();
            fs::write(base.join("var/lib/keep"), "k").unwrap();
            assert!(r.remove_all("/var/lib/a").unwrap(), "walk_only {walk_only}");
            assert!(!base.join("var/lib/a").exists());
            assert_eq!(fs::read(base.join("var/lib/keep")).unwrap(), b"k");
            assert_eq!(fs::read(outside.path().join("precious")).unwrap(), b"x");
            assert!(!r.remove_all("/var/lib/a").unwrap());
            assert!(r.remove_all("/var/lib/keep").unwrap());
            // Climbing out is refused, naming the path; nothing removed outside.
            symlink("../../../..", base.join("var/up")).unwrap();
            let err = r.remove_all("/var/up/x").unwrap_err();
            assert!(matches!(err, HostError::Escapes { .. }), "{err}");
            assert!(err.to_string().contains("/var/up/x"), "{err}");
        }
    }

    #[test]
    fn remove_tree_at_is_bounded_in_depth() {
        let (_d, r) = root();
        let mut p = r.path().join("deep");
        for _ in 0..MAX_TREE_DEPTH + 1 {
            p.push("d");
        }
        fs::create_dir_all(&p).unwrap();
        let err = r.remove_all("/deep").unwrap_err().to_string();
        assert!(
            err.contains("deep: directories nested more than 128 deep"),
            "{err}"
        );
    }

    #[test]
    fn a_link_swapped_in_after_the_walk_is_resolved_inside_the_root() {
        // What the walk cannot see: the directory it resolved is replaced
        // by a link out before the change is made.
        let (_d, r) = root();
        let base = r.path().to_path_buf();
        let outside = tempfile::tempdir().unwrap();
        let out = fs::canonicalize(outside.path()).unwrap();
        fs::create_dir_all(base.join("etc/d")).unwrap();
        let real = r.resolve("/etc/d/sub/f").unwrap();
        fs::remove_dir(base.join("etc/d")).unwrap();
        symlink(&out, base.join("etc/d")).unwrap();
        // The link leads nowhere inside the root: refused, naming the path.
        let err = r.open_real_dir(real.parent().unwrap(), true).unwrap_err();
        assert!(err.to_string().contains("etc/d"), "{err}");
        // Where it leads somewhere inside the root, the change goes there.
        let inside = base.join(out.strip_prefix("/").unwrap());
        fs::create_dir_all(&inside).unwrap();
        let fd = r.open_real_dir(real.parent().unwrap(), true).unwrap();
        fsutil::write_atomic_at(fd.as_fd(), std::ffi::OsStr::new("f"), b"x", 0o644, |_| {
            Ok::<(), ()>(())
        })
        .unwrap();
        assert_eq!(fs::read(inside.join("sub/f")).unwrap(), b"x");
        assert_eq!(fs::read_dir(&out).unwrap().count(), 0, "nothing outside");
    }
}
