//! Host files gpu-agent changes: written atomically, the original kept once,
//! and put back byte for byte by [`ManagedFiles::restore`].
//!
//! The original of a file is saved (with a manifest entry, both written
//! atomically) before the file itself is first replaced, so a crash at any
//! point leaves the file either original or complete, and `restore` still
//! finds the original. One process at a time holds the lock.

use std::fs;
use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::PathBuf;

use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::fsutil;
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
        "{path}: another gpu-agent is changing host files (it holds this lock); try again when it is done"
    )]
    Locked { path: PathBuf },
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

/// The managed files of a host, locked for this process while it lives.
#[derive(Debug)]
pub struct ManagedFiles<'h> {
    host: &'h HostRoot,
    /// Owners are given back through the one door for privileged calls.
    sys: &'h dyn Syscalls,
    _lock: Flock<fs::File>,
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

impl<'h> ManagedFiles<'h> {
    /// Takes the lock: waits for another holder when `wait`, else fails
    /// with [`ManagedError::Locked`].
    pub fn lock(
        host: &'h HostRoot,
        sys: &'h dyn Syscalls,
        wait: bool,
    ) -> Result<Self, ManagedError> {
        let path = host.resolve(LOCK_FILE)?;
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir).map_err(|e| HostError::io(dir, e))?;
        }
        let file = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| HostError::io(&path, e))?;
        let arg = if wait {
            FlockArg::LockExclusive
        } else {
            FlockArg::LockExclusiveNonblock
        };
        let lock = Flock::lock(file, arg).map_err(|(_, errno)| {
            if errno == nix::errno::Errno::EWOULDBLOCK {
                ManagedError::Locked { path: path.clone() }
            } else {
                HostError::io(&path, io::Error::from(errno)).into()
            }
        })?;
        Ok(ManagedFiles {
            host,
            sys,
            _lock: lock,
        })
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
        let real = self.host.resolve(path)?;
        match fs::read(&real) {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(HostError::io(real, e).into()),
        }
    }

    /// Writes `contents` to the host file `path` unless it already holds
    /// exactly that; returns whether it changed. The first change keeps the
    /// original. A new file gets `mode`; an existing one keeps its mode and owner.
    pub fn write(&self, path: &str, contents: &[u8], mode: u32) -> Result<bool, ManagedError> {
        let real = self.host.resolve(path)?;
        let meta = match fs::metadata(&real) {
            Ok(m) => Some(m),
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => return Err(HostError::io(&real, e).into()),
        };
        let current = self.current(path)?;
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
        let written = self.host.write_atomic(path, contents, mode)?;
        if let Some(m) = &meta {
            self.keep_owner(&written, m.uid(), m.gid())?;
        }
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
        let real = self.host.resolve(path)?;
        fs::create_dir_all(&real).map_err(|e| HostError::io(&real, e))?;
        Ok(())
    }

    /// Gives a rewritten file (now owned by us) back to its owner, when that differs.
    fn keep_owner(&self, path: &std::path::Path, uid: u32, gid: u32) -> Result<(), ManagedError> {
        let now = fs::metadata(path).map_err(|e| HostError::io(path, e))?;
        if (now.uid(), now.gid()) != (uid, gid) {
            self.sys.chown(path, Some(uid), Some(gid))?;
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
                    let real = self.host.resolve(&e.path)?;
                    match fs::remove_file(&real) {
                        Ok(()) => done.push(Restored::Removed(e.path.clone())),
                        Err(err) if err.kind() == io::ErrorKind::NotFound => {}
                        Err(err) => return Err(HostError::io(real, err).into()),
                    }
                }
                Original::Saved {
                    backup,
                    sha256,
                    mode,
                    uid,
                    gid,
                } => {
                    let backup_path = self.host.resolve(format!("{BACKUP_DIR}/{backup}"))?;
                    let bytes =
                        fs::read(&backup_path).map_err(|err| HostError::io(&backup_path, err))?;
                    if &sha256_hex(&bytes) != sha256 {
                        return Err(ManagedError::BadBackup {
                            path: backup_path,
                            of: e.path.clone(),
                        });
                    }
                    let real = self.host.resolve(&e.path)?;
                    if fs::read(&real).ok().as_deref() != Some(&bytes[..]) {
                        fsutil::write_atomic(&real, &bytes, *mode)
                            .map_err(|err| HostError::io(&real, err))?;
                        self.keep_owner(&real, *uid, *gid)?;
                        done.push(Restored::Rewritten(e.path.clone()));
                    }
                }
            }
        }
        // Forget the originals only once every file is back.
        for e in &manifest.entries {
            if let Original::Saved { backup, .. } = &e.original {
                let p = self.host.resolve(format!("{BACKUP_DIR}/{backup}"))?;
                let _ = fs::remove_file(p);
            }
        }
        let real = self.host.resolve(MANIFEST)?;
        match fs::remove_file(&real) {
            Ok(()) => {}
            Err(err) if err.kind() == io::ErrorKind::NotFound => {}
            Err(err) => return Err(HostError::io(real, err).into()),
        }
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
    let real = host.resolve(path)?;
    match fs::remove_dir(&real) {
        Ok(()) => Ok(true),
        Err(err)
            if matches!(
                err.kind(),
                io::ErrorKind::NotFound | io::ErrorKind::DirectoryNotEmpty
            ) =>
        {
            Ok(false)
        }
        Err(err) => Err(HostError::io(real, err)),
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
    fn a_second_holder_is_told_so() {
        let (_d, h) = host();
        let _first = ManagedFiles::lock(&h, &LinuxSyscalls, false).unwrap();
        let err = ManagedFiles::lock(&h, &LinuxSyscalls, false).unwrap_err();
        assert!(matches!(err, ManagedError::Locked { .. }), "{err}");
        assert!(
            err.to_string()
                .contains("host-files.lock: another gpu-agent"),
            "{err}"
        );
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
