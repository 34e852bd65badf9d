//! Host files gpu-agent changes: written atomically, the original kept once,
//! and put back byte for byte by [`ManagedFiles::restore`].
//!
//! The original of a file is saved (with a manifest entry, both written
//! atomically) before the file itself is first replaced, so a crash at any
//! point leaves the file either original or complete, and `restore` still
//! finds the original. One process at a time holds the lock
//! ([`HostFilesLock`]): the runtime, CDI and label writers, driver installs
//! and upgrades, uninstall.
//!
//! Every change goes through [`HostRoot`]'s descriptor-based calls, so a
//! symbolic link swapped in on the way cannot lead a write (or a restore,
//! or a removal) outside the host root.

use std::cell::RefCell;
use std::fmt;
use std::fs;
use std::io::{self, Read};
use std::os::fd::AsFd;
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::rc::{Rc, Weak};

use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::root::{HostError, HostRoot};
use crate::syscalls::{SyscallError, Syscalls};

/// Where originals and the manifest live, as host paths.
pub const BACKUP_DIR: &str = "/var/lib/gpu-agent/backup";
const MANIFEST: &str = "/var/lib/gpu-agent/backup/manifest.json";
/// The lock two agents (or two commands) take before changing host files.
pub const LOCK_FILE: &str = "/run/gpu-agent/host-files.lock";

/// What a managed file was before gpu-agent first changed it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "lowercase")]
pub enum Original {
    /// The file did not exist: restoring removes it.
    Absent,
    /// The file existed: its bytes are in `backup` (a name in [`BACKUP_DIR`]).
    Saved {
        backup: String,
        sha256: String,
        mode: u32,
        uid: u32,
        gid: u32,
    },
}

/// One managed file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// The host path (`/etc/containerd/config.toml`).
    pub path: String,
    pub original: Original,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Manifest {
    format: u32,
    entries: Vec<Entry>,
    /// Directories that did not exist before gpu-agent wrote into them (host
    /// paths, parents first): restoring removes them again when empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    created_dirs: Vec<String>,
}

/// Errors changing host files. Each names the file.
#[derive(Debug, thiserror::Error)]
pub enum ManagedError {
    #[error(transparent)]
    Host(#[from] HostError),
    #[error(
        "{path}: another gpu-agent is changing host files ({}); try again when it is done",
        holder_text(.holder)
    )]
    Locked {
        path: PathBuf,
        /// Who holds it, as it wrote in the lock file.
        holder: Option<Holder>,
    },
    #[error("{path}: the backup manifest is damaged: {message}")]
    Manifest { path: PathBuf, message: String },
    #[error("{path}: the saved original of {of} does not match its checksum; not restoring it")]
    BadBackup { path: PathBuf, of: String },
    #[error(transparent)]
    Syscall(#[from] SyscallError),
}

/// What restoring did to one file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Restored {
    /// Put back the original bytes.
    Rewritten(String),
    /// Removed a file gpu-agent had created.
    Removed(String),
}

/// Who holds the host-files lock, as the holder wrote it in the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holder {
    pub pid: u32,
    /// What it is doing (`driver upgrade 560.35.03`).
    pub what: String,
}

impl fmt::Display for Holder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pid {}: {}", self.pid, self.what)
    }
}

fn holder_text(h: &Option<Holder>) -> String {
    match h {
        Some(h) => format!("{h}, holds this lock"),
        None => "it holds this lock and has not written its pid yet".into(),
    }
}

/// The lock file held by this process: emptied before it is let go, so
/// that what it says is never a past holder's.
#[derive(Debug)]
struct Held {
    root: PathBuf,
    lock: Flock<fs::File>,
}

impl Drop for Held {
    fn drop(&mut self) {
        let _ = self.lock.set_len(0);
    }
}

thread_local! {
    /// The host-files locks this thread holds, by host root.
    static HELD: RefCell<Vec<Weak<Held>>> = const { RefCell::new(Vec::new()) };
}

/// The lock on a host's files ([`LOCK_FILE`], `flock`), which records the
/// holder's pid and what it does so that a second one can say who it
/// waits for. Taken again on the thread that holds it, it is the same lock
/// (a driver upgrade writing managed files does not wait for itself);
/// another thread or process waits or is refused. Not `Send`: it stays on
/// the thread that took it.
#[derive(Clone, Debug)]
pub struct HostFilesLock {
    held: Rc<Held>,
}

impl HostFilesLock {
    /// Takes the lock for `what` (`driver install 560.35.03`): when another
    /// holds it, waits (logging who) when `wait`, else fails with
    /// [`ManagedError::Locked`] naming the holder.
    pub fn take(host: &HostRoot, what: &str, wait: bool) -> Result<Self, ManagedError> {
        let mine = HELD.with(|h| {
            let mut h = h.borrow_mut();
            h.retain(|w| w.strong_count() > 0);
            h.iter()
                .filter_map(Weak::upgrade)
                .find(|held| held.root == host.path())
        });
        if let Some(held) = mine {
            tracing::debug!(what, "the host-files lock is already this thread's");
            return Ok(HostFilesLock { held });
        }
        let file = host.open_or_create(LOCK_FILE, 0o644)?;
        let path = host.resolve(LOCK_FILE)?;
        let io_err = |errno: nix::errno::Errno| -> ManagedError {
            HostError::io(&path, io::Error::from(errno)).into()
        };
        let lock = match try_lock_soon(file) {
            Ok(l) => l,
            Err(Busy::Held(file, holder)) => {
                if !wait {
                    return Err(ManagedError::Locked { path, holder });
                }
                let (pid, doing) = holder
                    .as_ref()
                    .map_or((0, "unknown"), |h| (h.pid, h.what.as_str()));
                tracing::info!(
                    lock = %path.display(),
                    holder_pid = pid,
                    holder = doing,
                    what,
                    "waiting for the host-files lock: another process is changing host files"
                );
                Flock::lock(file, FlockArg::LockExclusive).map_err(|(_, e)| io_err(e))?
            }
            Err(Busy::Failed(errno)) => return Err(io_err(errno)),
        };
        // Readable whatever the umask: says who holds it.
        lock.set_permissions(fs::Permissions::from_mode(0o644))
            .map_err(|e| HostError::io(&path, e))?;
        let held = Rc::new(Held {
            root: host.path().to_path_buf(),
            lock,
        });
        let this = HostFilesLock { held };
        this.doing(what).map_err(|e| HostError::io(&path, e))?;
        HELD.with(|h| h.borrow_mut().push(Rc::downgrade(&this.held)));
        Ok(this)
    }

    /// Says in the lock file what the holder does now (`driver upgrade
    /// 560.35.03` once the install is done). The file is the lock itself
    /// (`flock` holds its inode), so it is rewritten in place, one short
    /// write; a reader may find it empty for a moment, never another's words.
    pub fn doing(&self, what: &str) -> io::Result<()> {
        let line = format!("{} {}\n", std::process::id(), what.replace('\n', " "));
        let f: &fs::File = &self.held.lock;
        f.set_len(0)?;
        f.write_all_at(line.as_bytes(), 0)
    }

    /// Who holds the lock on `host` now (`None`: nobody, or a holder that
    /// has not written itself yet).
    pub fn holder(host: &HostRoot) -> Option<Holder> {
        let file = host.open(LOCK_FILE).ok()?;
        match Flock::lock(file, FlockArg::LockSharedNonblock) {
            Err((file, nix::errno::Errno::EWOULDBLOCK)) => read_holder(&file),
            _ => None,
        }
    }
}

/// Why [`try_lock_soon`] did not get the lock.
enum Busy {
    /// Another holds it (named, once it has written its line).
    Held(fs::File, Option<Holder>),
    Failed(nix::errno::Errno),
}

/// Takes the lock without blocking. Found held by a holder that has not
/// named itself, it looks again for a little while (up to 200 ms): a holder
/// writes its line right after taking the lock and empties it right before
/// letting go, so either the line appears or the lock comes free, and
/// neither moment is reported as "held by nobody knows who".
fn try_lock_soon(mut file: fs::File) -> Result<Flock<fs::File>, Busy> {
    let mut attempt = 0;
    loop {
        attempt += 1;
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => return Ok(lock),
            Err((f, nix::errno::Errno::EWOULDBLOCK)) => {
                let holder = read_holder(&f);
                if holder.is_some() || attempt > 20 {
                    return Err(Busy::Held(f, holder));
                }
                file = f;
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            Err((_, errno)) => return Err(Busy::Failed(errno)),
        }
    }
}

/// The holder line (`<pid> <what>`) of the lock file, read through the
/// descriptor the lock was tried on (never the path again: it could be
/// another file by then).
fn read_holder(file: &fs::File) -> Option<Holder> {
    let mut buf = [0u8; 4096];
    let n = file.read_at(&mut buf, 0).ok()?;
    let text = std::str::from_utf8(&buf[..n]).ok()?;
    let (pid, what) = text.trim_end().split_once(' ')?;
    Some(Holder {
        pid: pid.parse().ok()?,
        what: what.to_string(),
    })
}

/// What this process is, for the lock file when the caller does not say:
/// its command line.
fn this_process() -> String {
    let args: Vec<String> = std::env::args().collect();
    let mut text = match args.split_first() {
        Some((first, rest)) => {
            let name = Path::new(first)
                .file_name()
                .map_or(first.clone(), |n| n.to_string_lossy().into_owned());
            std::iter::once(name)
                .chain(rest.iter().cloned())
                .collect::<Vec<_>>()
                .join(" ")
        }
        None => "a process".into(),
    };
    if text.len() > 200 {
        let mut end = 200;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
}

/// The managed files of a host, locked for this process while it lives.
#[derive(Debug)]
pub struct ManagedFiles<'h> {
    host: &'h HostRoot,
    /// Owners are given back through the one door for privileged calls.
    sys: &'h dyn Syscalls,
    _lock: HostFilesLock,
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

impl<'h> ManagedFiles<'h> {
    /// Takes the lock (see [`HostFilesLock`]; the lock file says this
    /// process's command line): waits for another holder when `wait`, else
    /// fails with [`ManagedError::Locked`].
    pub fn lock(
        host: &'h HostRoot,
        sys: &'h dyn Syscalls,
        wait: bool,
    ) -> Result<Self, ManagedError> {
        let lock = HostFilesLock::take(host, &this_process(), wait)?;
        Ok(Self::with_lock(host, sys, lock))
    }

    /// The managed files under a lock the caller took.
    pub fn with_lock(host: &'h HostRoot, sys: &'h dyn Syscalls, lock: HostFilesLock) -> Self {
        ManagedFiles {
            host,
            sys,
            _lock: lock,
        }
    }

    fn manifest(&self) -> Result<Manifest, ManagedError> {
        let Some(text) = self.host.read_optional(MANIFEST)? else {
            return Ok(Manifest {
                format: 1,
                ..Manifest::default()
            });
        };
        serde_json::from_str(&text).map_err(|e| ManagedError::Manifest {
            path: self
                .host
                .resolve(MANIFEST)
                .unwrap_or_else(|_| MANIFEST.into()),
            message: e.to_string(),
        })
    }

    fn save_manifest(&self, m: &mut Manifest) -> Result<(), ManagedError> {
        // The first manifest makes gpu-agent's own directories: noted too.
        if !self.host.resolve(MANIFEST)?.exists() {
            self.note_new_dirs(m, MANIFEST)?;
        }
        let json = serde_json::to_vec_pretty(m).expect("manifest serialises");
        self.host.write_atomic(MANIFEST, &json, 0o600)?;
        Ok(())
    }

    /// The directories gpu-agent made (host paths, parents first).
    pub fn created_dirs(&self) -> Result<Vec<String>, ManagedError> {
        Ok(self.manifest()?.created_dirs)
    }

    /// Every file gpu-agent has changed and not restored.
    pub fn entries(&self) -> Result<Vec<Entry>, ManagedError> {
        Ok(self.manifest()?.entries)
    }

    /// The file's current bytes, or `None` when it does not exist.
    pub fn current(&self, path: &str) -> Result<Option<Vec<u8>>, ManagedError> {
        Ok(self.read(path)?.map(|(bytes, _)| bytes))
    }

    /// The file's bytes and metadata (one open file: both are the same
    /// file's), or `None` when it does not exist.
    fn read(&self, path: &str) -> Result<Option<(Vec<u8>, fs::Metadata)>, ManagedError> {
        let mut f = match self.host.open(path) {
            Ok(f) => f,
            Err(e) if e.is_not_found() => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let shown = || self.host.resolve(path).unwrap_or_else(|_| path.into());
        let meta = f.metadata().map_err(|e| HostError::io(shown(), e))?;
        let mut bytes = Vec::new();
        f.read_to_end(&mut bytes)
            .map_err(|e| HostError::io(shown(), e))?;
        Ok(Some((bytes, meta)))
    }

    /// Writes `contents` to the host file `path` unless it already holds
    /// exactly that; returns whether it changed. The first change keeps the
    /// original. A new file gets `mode`; an existing one keeps its mode and owner.
    pub fn write(&self, path: &str, contents: &[u8], mode: u32) -> Result<bool, ManagedError> {
        let (current, meta) = match self.read(path)? {
            Some((bytes, meta)) => (Some(bytes), Some(meta)),
            None => (None, None),
        };
        if current.as_deref() == Some(contents) {
            return Ok(false);
        }
        let mut manifest = self.manifest()?;
        let mut new_dirs = false;
        if !self.host.resolve(MANIFEST)?.exists() {
            // The backup directory is about to be made, before the manifest.
            new_dirs |= self.note_new_dirs(&mut manifest, MANIFEST)?;
        }
        new_dirs |= self.note_new_dirs(&mut manifest, path)?;
        if new_dirs {
            self.save_manifest(&mut manifest)?;
        }
        if !manifest.entries.iter().any(|e| e.path == path) {
            let original = match (&current, &meta) {
                (Some(bytes), Some(m)) => {
                    let sha = sha256_hex(bytes);
                    let backup = format!("{}.orig", sha256_hex(path.as_bytes()));
                    self.host
                        .write_atomic(format!("{BACKUP_DIR}/{backup}"), bytes, 0o600)?;
                    Original::Saved {
                        backup,
                        sha256: sha,
                        mode: m.permissions().mode() & 0o7777,
                        uid: m.uid(),
                        gid: m.gid(),
                    }
                }
                _ => Original::Absent,
            };
            manifest.format = 1;
            manifest.entries.push(Entry {
                path: path.to_string(),
                original,
            });
            // The original is safe before the file is touched.
            self.save_manifest(&mut manifest)?;
        }
        let mode = meta
            .as_ref()
            .map_or(mode, |m| m.permissions().mode() & 0o7777);
        let owner = meta.as_ref().map(|m| (m.uid(), m.gid()));
        self.host
            .write_atomic_then(path, contents, mode, |f, real| {
                self.keep_owner(f, real, owner)
            })?;
        tracing::info!(file = %path, "wrote host file");
        Ok(true)
    }

    /// Notes in `manifest` the parents of the host file `path` that do not
    /// exist yet (the write is about to make them); true if any was new.
    fn note_new_dirs(&self, manifest: &mut Manifest, path: &str) -> Result<bool, ManagedError> {
        let mut missing = Vec::new();
        let mut dir = std::path::Path::new(path).parent();
        while let Some(d) = dir {
            if d.as_os_str().is_empty() || d == std::path::Path::new("/") {
                break;
            }
            let real = self.host.resolve(d)?;
            if real.exists() {
                break;
            }
            missing.push(d.to_string_lossy().into_owned());
            dir = d.parent();
        }
        let mut added = false;
        for d in missing.into_iter().rev() {
            if !manifest.created_dirs.contains(&d) {
                manifest.created_dirs.push(d);
                added = true;
            }
        }
        Ok(added)
    }

    /// Makes the host directory `path` (and its parents), noting the ones
    /// it creates so that [`ManagedFiles::restore`] removes them again.
    pub fn create_dir(&self, path: &str) -> Result<(), ManagedError> {
        let mut manifest = self.manifest()?;
        // A name inside: its missing parents are the directory and up.
        let probe = format!("{}/-", path.trim_end_matches('/'));
        if self.note_new_dirs(&mut manifest, &probe)? {
            manifest.format = 1;
            self.save_manifest(&mut manifest)?;
        }
        self.host.create_dir_all(path)?;
        Ok(())
    }

    /// Gives the new file `f` (owned by us), about to replace `path`, the
    /// old one's owner when that differs.
    fn keep_owner(
        &self,
        f: &fs::File,
        path: &Path,
        owner: Option<(u32, u32)>,
    ) -> Result<(), ManagedError> {
        let Some((uid, gid)) = owner else {
            return Ok(());
        };
        let now = f.metadata().map_err(|e| HostError::io(path, e))?;
        if (now.uid(), now.gid()) != (uid, gid) {
            self.sys.fchown(f.as_fd(), path, Some(uid), Some(gid))?;
        }
        Ok(())
    }

    /// Puts every managed file back as it was (byte for byte, mode and
    /// owner) and removes the files gpu-agent created; then forgets them.
    pub fn restore(&self) -> Result<Vec<Restored>, ManagedError> {
        let manifest = self.manifest()?;
        let mut done = Vec::new();
        for e in manifest.entries.iter().rev() {
            match &e.original {
                Original::Absent => {
                    if self.host.remove_file(&e.path)? {
                        done.push(Restored::Removed(e.path.clone()));
                    }
                }
                Original::Saved {
                    backup,
                    sha256,
                    mode,
                    uid,
                    gid,
                } => {
                    let backup_host = format!("{BACKUP_DIR}/{backup}");
                    let Some(bytes) = self.current(&backup_host)? else {
                        return Err(HostError::io(
                            self.host.resolve(&backup_host)?,
                            io::Error::from(io::ErrorKind::NotFound),
                        )
                        .into());
                    };
                    if &sha256_hex(&bytes) != sha256 {
                        return Err(ManagedError::BadBackup {
                            path: self.host.resolve(&backup_host)?,
                            of: e.path.clone(),
                        });
                    }
                    let now = self.current(&e.path).ok().flatten();
                    if now.as_deref() != Some(&bytes[..]) {
                        self.host
                            .write_atomic_then(&e.path, &bytes, *mode, |f, real| {
                                self.keep_owner(f, real, Some((*uid, *gid)))
                            })?;
                        done.push(Restored::Rewritten(e.path.clone()));
                    }
                }
            }
        }
        // Forget the originals only once every file is back.
        for e in &manifest.entries {
            if let Original::Saved { backup, .. } = &e.original {
                let _ = self.host.remove_file(format!("{BACKUP_DIR}/{backup}"));
            }
        }
        self.host.remove_file(MANIFEST)?;
        // The directories gpu-agent made, deepest first, where they are
        // empty now (a file someone else put there keeps its directory).
        for d in manifest.created_dirs.iter().rev() {
            if remove_dir_if_empty(self.host, d)? {
                done.push(Restored::Removed(format!("{d}/")));
            }
        }
        Ok(done)
    }
}

/// Removes the host directory `path` when it is empty; true if it did
/// (gone already, or holding something: false).
pub fn remove_dir_if_empty(host: &HostRoot, path: &str) -> Result<bool, HostError> {
    match host.remove_dir(path) {
        Err(HostError::Io { source, .. })
            if source.kind() == io::ErrorKind::DirectoryNotEmpty
                || source.raw_os_error() == Some(libc::EEXIST) =>
        {
            Ok(false)
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::syscalls::{Call, LinuxSyscalls, RecordingSyscalls};

    fn host() -> (tempfile::TempDir, HostRoot) {
        let d = tempfile::tempdir().unwrap();
        let h = HostRoot::new(d.path()).unwrap();
        (d, h)
    }

    #[test]
    fn write_keeps_the_original_once_and_restore_puts_it_back() {
        let (d, h) = host();
        let cfg = d.path().join("etc/containerd/config.toml");
        fs::create_dir_all(cfg.parent().unwrap()).unwrap();
        let original = b"# mine\nversion = 2\n\n[plugins]\n";
        fs::write(&cfg, original).unwrap();
        fs::set_permissions(&cfg, fs::Permissions::from_mode(0o640)).unwrap();
        let m = ManagedFiles::lock(&h, &LinuxSyscalls, false).unwrap();
        assert!(
            m.write("/etc/containerd/config.toml", b"changed once", 0o644)
                .unwrap()
        );
        assert!(
            m.write("/etc/containerd/config.toml", b"changed twice", 0o644)
                .unwrap()
        );
        assert!(
            !m.write("/etc/containerd/config.toml", b"changed twice", 0o644)
                .unwrap()
        );
        assert!(
            m.write("/etc/containerd/conf.d/99-gpu-agent.toml", b"new", 0o644)
                .unwrap()
        );
        assert_eq!(
            fs::metadata(&cfg).unwrap().permissions().mode() & 0o777,
            0o640
        );
        assert_eq!(m.entries().unwrap().len(), 2);
        let restored = m.restore().unwrap();
        assert_eq!(
            restored,
            [
                Restored::Removed("/etc/containerd/conf.d/99-gpu-agent.toml".into()),
                Restored::Rewritten("/etc/containerd/config.toml".into()),
                // The directories it made, deepest first; /etc/containerd was there.
                Restored::Removed("/etc/containerd/conf.d/".into()),
                Restored::Removed("/var/lib/gpu-agent/backup/".into()),
                Restored::Removed("/var/lib/gpu-agent/".into()),
                Restored::Removed("/var/lib/".into()),
                Restored::Removed("/var/".into()),
            ]
        );
        assert!(d.path().join("etc/containerd").is_dir());
        assert!(!d.path().join("var").exists());
        assert_eq!(fs::read(&cfg).unwrap(), original);
        assert_eq!(
            fs::metadata(&cfg).unwrap().permissions().mode() & 0o777,
            0o640
        );
        assert!(
            !d.path()
                .join("etc/containerd/conf.d/99-gpu-agent.toml")
                .exists()
        );
        assert!(m.entries().unwrap().is_empty());
        // Nothing left to restore.
        assert!(m.restore().unwrap().is_empty());
    }

    #[test]
    fn owners_are_given_back_through_the_syscalls() {
        let (d, h) = host();
        fs::create_dir_all(d.path().join("etc")).unwrap();
        let f = d.path().join("etc/owned.conf");
        fs::write(&f, "original").unwrap();
        // Owned by someone else: needs root, which these machines are.
        std::os::unix::fs::chown(&f, Some(1000), Some(1000)).expect("tests run as root");
        let rec = RecordingSyscalls::new();
        let m = ManagedFiles::lock(&h, &rec, false).unwrap();
        m.write("/etc/owned.conf", b"changed", 0o644).unwrap();
        m.restore().unwrap();
        let chown = Call::Chown {
            path: h.resolve("/etc/owned.conf").unwrap(),
            uid: Some(1000),
            gid: Some(1000),
        };
        assert_eq!(rec.calls(), vec![chown.clone(), chown]);
        assert_eq!(fs::read(&f).unwrap(), b"original");
        drop(m);
        // Files we own need no chown.
        let rec = RecordingSyscalls::new();
        let m = ManagedFiles::lock(&h, &rec, false).unwrap();
        m.write("/etc/new.conf", b"x", 0o644).unwrap();
        m.write("/etc/new.conf", b"y", 0o644).unwrap();
        assert!(rec.calls().is_empty(), "{:?}", rec.calls());
        drop(m);
        // The real calls give the owner back (the recorder above only recorded).
        std::os::unix::fs::chown(&f, Some(1000), Some(1000)).unwrap();
        let m = ManagedFiles::lock(&h, &LinuxSyscalls, false).unwrap();
        m.write("/etc/owned.conf", b"again", 0o644).unwrap();
        assert_eq!(fs::metadata(&f).unwrap().uid(), 1000);
        m.restore().unwrap();
        assert_eq!(
            (fs::metadata(&f).unwrap().uid(), fs::read(&f).unwrap()),
            (1000, b"original".to_vec())
        );
    }

    #[test]
    fn a_second_holder_is_told_who_holds_the_lock() {
        let (_d, h) = host();
        let first = HostFilesLock::take(&h, "driver upgrade 560.35.03", false).unwrap();
        // Another thread is another holder (as another process would be).
        let err = std::thread::scope(|s| {
            s.spawn(|| ManagedFiles::lock(&h, &LinuxSyscalls, false).map(|_| ()))
                .join()
                .unwrap()
        })
        .unwrap_err();
        let pid = std::process::id();
        assert!(
            matches!(&err, ManagedError::Locked { holder: Some(Holder { pid: p, what }), .. }
                if *p == pid && what == "driver upgrade 560.35.03"),
            "{err:?}"
        );
        assert!(
            err.to_string().contains(&format!(
                "host-files.lock: another gpu-agent is changing host files (pid {pid}: driver upgrade 560.35.03, holds this lock)"
            )),
            "{err}"
        );
        assert_eq!(
            HostFilesLock::holder(&h),
            Some(Holder {
                pid,
                what: "driver upgrade 560.35.03".into()
            })
        );
        // The holder's own thread takes it again without waiting for itself.
        let again = ManagedFiles::lock(&h, &LinuxSyscalls, false).unwrap();
        drop(first);
        assert!(HostFilesLock::holder(&h).is_some(), "still held by `again`");
        drop(again);
        // Let go: nobody holds it, and the file no longer names anyone.
        assert_eq!(HostFilesLock::holder(&h), None);
        let path = h.resolve(LOCK_FILE).unwrap();
        assert_eq!(fs::read_to_string(&path).unwrap(), "");
        // A waiting taker takes it once the holder lets go.
        let first = HostFilesLock::take(&h, "runtime configure", false).unwrap();
        std::thread::scope(|s| {
            let waiter = s.spawn(|| {
                HostFilesLock::take(&h, "second", true).map(|_| std::time::Instant::now())
            });
            std::thread::sleep(std::time::Duration::from_millis(200));
            let released = std::time::Instant::now();
            drop(first);
            let taken = waiter.join().unwrap().unwrap();
            assert!(
                taken >= released,
                "the waiter took the lock while it was held"
            );
        });
    }

    /// A holder that has not named itself (just taken, or letting go) is
    /// waited for a little: a lock that comes free within that is taken; one
    /// held longer without a name is refused as held by nobody named.
    #[test]
    fn an_unnamed_holder_is_given_a_moment() {
        let (_d, h) = host();
        let held_unnamed = |for_ms: u64| {
            let (tx, rx) = std::sync::mpsc::channel();
            let path = h.resolve(LOCK_FILE).unwrap();
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            let t = std::thread::spawn(move || {
                let f = fs::OpenOptions::new()
                    .create(true)
                    .truncate(false)
                    .write(true)
                    .open(path)
                    .unwrap();
                let lock = Flock::lock(f, FlockArg::LockExclusive).unwrap();
                tx.send(()).unwrap();
                std::thread::sleep(std::time::Duration::from_millis(for_ms));
                drop(lock);
            });
            rx.recv().unwrap();
            t
        };
        let letting_go = held_unnamed(50);
        let taken = HostFilesLock::take(&h, "runtime configure", false);
        assert!(taken.is_ok(), "{:?}", taken.err());
        drop(taken);
        letting_go.join().unwrap();
        let silent = held_unnamed(2000);
        let err = HostFilesLock::take(&h, "runtime configure", false).unwrap_err();
        assert!(
            matches!(&err, ManagedError::Locked { holder: None, .. }),
            "{err:?}"
        );
        silent.join().unwrap();
    }

    #[test]
    fn damaged_backup_is_not_restored() {
        let (d, h) = host();
        fs::create_dir_all(d.path().join("etc")).unwrap();
        fs::write(d.path().join("etc/x.conf"), "a").unwrap();
        let m = ManagedFiles::lock(&h, &LinuxSyscalls, false).unwrap();
        m.write("/etc/x.conf", b"b", 0o644).unwrap();
        let backup = fs::read_dir(d.path().join("var/lib/gpu-agent/backup"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| p.extension().is_some_and(|e| e == "orig"))
            .unwrap();
        fs::write(&backup, "tampered").unwrap();
        let err = m.restore().unwrap_err();
        assert!(matches!(err, ManagedError::BadBackup { .. }), "{err}");
        assert_eq!(fs::read(d.path().join("etc/x.conf")).unwrap(), b"b");
    }

    #[test]
    fn read_only_target_is_a_clear_error_and_nothing_changes() {
        let (d, h) = host();
        let dir = d.path().join("etc/ro");
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("f"), "orig").unwrap();
        // A directory where the file should go cannot be replaced.
        fs::create_dir_all(d.path().join("etc/ro/g")).unwrap();
        fs::write(d.path().join("etc/ro/g/inner"), "x").unwrap();
        let m = ManagedFiles::lock(&h, &LinuxSyscalls, false).unwrap();
        let err = m.write("/etc/ro/g", b"new", 0o644).unwrap_err();
        assert!(err.to_string().contains("etc/ro/g"), "{err}");
        assert_eq!(fs::read(d.path().join("etc/ro/f")).unwrap(), b"orig");
    }
}
