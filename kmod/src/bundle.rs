//! Driver bundles: verify, unpack beside the installed ones, switch.
//!
//! A bundle is a gzip-compressed tar file whose **first** entry is
//! [`MANIFEST`] (JSON, see [`Manifest`]): the driver version, the kernel
//! releases its modules were built for, the module flavours it carries, and
//! every regular file with its sha256. Kernel modules live at
//! `modules/<kernel>/<flavour>/<name>.ko`.
//!
//! Installing checks the bundle's own sha256 (from the policy, the command
//! line or a `<bundle>.sha256` sidecar) **before** unpacking anything, then
//! unpacks into a staging directory while hashing every file, refusing
//! absolute paths, `..`, links that point out of the tree, hard links,
//! device files, duplicate entries and files the manifest does not list.
//! Only a bundle that checked out completely is renamed into place, as
//! `<drivers>/<version>-<kernel>/`; `current` and `previous` are symbolic
//! links swapped atomically (a new link renamed over the old), so the
//! previous driver stays for rollback.
//!
//! Every change is race-free: the drivers directory is opened in the host
//! root ([`HostRoot::dir`]: the walk decides, `openat2(RESOLVE_IN_ROOT)`
//! opens), and everything below it (staging, entries, the rename into
//! place, the links, removals) is made relative to that descriptor without
//! following a link (see `at.rs`), so a link swapped onto its path, or
//! inside the staging tree, cannot lead a write or a removal out.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsStr;
use std::fs::{self, File};
use std::io::{self, BufReader, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};

use crate::at;
use hostlib::root::{HostDir, remove_tree_at};
use hostlib::{HostError, HostRoot};
use nix::sys::stat::Mode;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The manifest's name inside a bundle; it must be the first entry.
pub const MANIFEST: &str = "gpu-agent-bundle.json";
/// Where bundles are unpacked on the host.
pub const DRIVERS_DIR: &str = "/var/lib/gpu-agent/drivers";
/// The manifest's format version this code reads.
pub const FORMAT: u32 = 1;
/// The largest manifest accepted (a driver has a few hundred files).
const MANIFEST_MAX: u64 = 4 << 20;
/// How many bytes of tar stream a bundle may unpack to per byte of its own:
/// driver files compress a few times over, deflate up to about a thousand
/// (a gzip bomb), which is refused before it fills the disk or memory.
pub const MAX_EXPANSION: u64 = 32;
/// Unpacked bytes every bundle may have whatever its size (tar's headers
/// and padding for a small one).
const UNPACKED_FLOOR: u64 = 1 << 20;
/// The longest entry path a bundle may have, in bytes and in components
/// (a driver's are a few components of tens of bytes). The unpack walks
/// paths by descriptor, where no `PATH_MAX` would stop a deeper one, and
/// an unpacked driver must stay readable by its path.
pub const MAX_ENTRY_PATH: usize = 1024;
pub const MAX_ENTRY_DEPTH: usize = 64;

/// The most bytes of tar stream a bundle of `compressed` bytes may unpack
/// to (headers included, so every file written is smaller). The tar reader
/// keeps long names and extended headers in memory, so this bounds memory
/// as well as disk.
pub fn max_unpacked(compressed: u64) -> u64 {
    compressed
        .saturating_mul(MAX_EXPANSION)
        .saturating_add(UNPACKED_FLOOR)
}

/// Kernel module flavour.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Flavour {
    /// NVIDIA's open GPU kernel modules (Turing and newer).
    Open,
    /// The closed modules (every GPU, the only choice before Turing).
    Proprietary,
}

impl Flavour {
    pub fn name(self) -> &'static str {
        match self {
            Flavour::Open => "open",
            Flavour::Proprietary => "proprietary",
        }
    }
}

/// `gpu-agent-bundle.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Manifest {
    /// Always [`FORMAT`].
    pub format: u32,
    /// `550.127.08`.
    pub driver_version: String,
    /// Kernel releases (`uname -r`) the modules were built for.
    pub kernels: Vec<String>,
    /// Module flavours carried (`modules/<kernel>/<flavour>/`).
    pub flavours: Vec<Flavour>,
    /// Every regular file in the bundle but the manifest, by path.
    pub files: BTreeMap<String, FileEntry>,
}

/// One file of a bundle.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileEntry {
    /// Lowercase hex sha256 of the file's bytes.
    pub sha256: String,
}

impl Manifest {
    fn check(&self, path: &Path) -> Result<(), BundleError> {
        let bad = |field: &str, message: String| BundleError::Manifest {
            bundle: path.to_path_buf(),
            message: format!("{field}: {message}"),
        };
        if self.format != FORMAT {
            return Err(bad(
                "format",
                format!(
                    "{} is not a format this gpu-agent reads ({FORMAT})",
                    self.format
                ),
            ));
        }
        if !is_version(&self.driver_version) {
            return Err(bad(
                "driverVersion",
                format!(
                    "{:?} is not a driver version like 550.127.08",
                    self.driver_version
                ),
            ));
        }
        if self.kernels.is_empty() {
            return Err(bad(
                "kernels",
                "empty: name the kernel releases the modules were built for".into(),
            ));
        }
        if let Some(k) = self.kernels.iter().find(|k| !is_name(k)) {
            return Err(bad("kernels", format!("{k:?} is not a kernel release")));
        }
        if self.flavours.is_empty() {
            return Err(bad(
                "flavours",
                "empty: name open, proprietary or both".into(),
            ));
        }
        for (name, f) in &self.files {
            if let Err(why) = relative(Path::new(name)) {
                return Err(bad(&format!("files.{name}"), why));
            }
            if f.sha256.len() != 64
                || !f
                    .sha256
                    .bytes()
                    .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
            {
                return Err(bad(
                    &format!("files.{name}.sha256"),
                    format!("{:?} is not 64 lowercase hex digits", f.sha256),
                ));
            }
        }
        Ok(())
    }

    /// The installed directory's name: `<version>-<kernel>`.
    pub fn dir_name(&self, kernel: &str) -> String {
        format!("{}-{kernel}", self.driver_version)
    }
}

fn is_version(v: &str) -> bool {
    v.split('.').count() >= 2
        && v.split('.')
            .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
}

fn is_name(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_' | b'+'))
}

/// Errors; each names the bundle, the entry or the installed directory.
#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    #[error("{bundle}: {source}")]
    Read {
        bundle: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "{bundle}: sha256 is {actual}, expected {expected} (from {from}); nothing was unpacked"
    )]
    Checksum {
        bundle: PathBuf,
        expected: String,
        actual: String,
        from: String,
    },
    #[error(
        "{bundle}: no sha256 to check it against: give one (--sha256, spec.driver.bundleSha256) or put `<sha256>  <name>` in {sidecar}"
    )]
    NoChecksum { bundle: PathBuf, sidecar: PathBuf },
    #[error("{sidecar}: {message}")]
    Sidecar { sidecar: PathBuf, message: String },
    #[error("{bundle}: manifest {MANIFEST}: {message}")]
    Manifest { bundle: PathBuf, message: String },
    #[error("{bundle}: entry {entry:?}: {message}; nothing was installed")]
    Entry {
        bundle: PathBuf,
        entry: String,
        message: String,
    },
    #[error(
        "{bundle}: built for kernel(s) {}, the running kernel is {running}; nothing was installed",
        .kernels.join(", ")
    )]
    Kernel {
        bundle: PathBuf,
        kernels: Vec<String>,
        running: String,
    },
    #[error(
        "{bundle}: unpacks to more than {limit} bytes ({MAX_EXPANSION} times its size): refused as a gzip bomb; nothing was installed"
    )]
    TooLarge { bundle: PathBuf, limit: u64 },
    #[error("{dir}: {message}")]
    Installed { dir: String, message: String },
    #[error("{path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    Host(#[from] HostError),
}

/// `Ok(())` when `p` is a plain relative path with no `..`, else why not.
fn relative(p: &Path) -> Result<(), String> {
    if p.as_os_str().is_empty() {
        return Err("empty path".into());
    }
    for c in p.components() {
        match c {
            Component::Normal(_) | Component::CurDir => {}
            Component::ParentDir => return Err("path climbs out with `..`".into()),
            Component::RootDir | Component::Prefix(_) => {
                return Err("absolute path".into());
            }
        }
    }
    Ok(())
}

/// `p` without `.` components, as a string (`./a/./b` → `a/b`).
fn clean(p: &Path) -> String {
    p.components()
        .filter_map(|c| match c {
            Component::Normal(n) => Some(n.to_string_lossy().into_owned()),
            _ => None,
        })
        .collect::<Vec<_>>()
        .join("/")
}

/// True when a link at `link` (a clean relative path) with `target` stays
/// inside the tree.
fn link_stays_inside(link: &str, target: &Path) -> bool {
    if target.is_absolute() {
        return false;
    }
    let mut depth: i64 = link.split('/').count() as i64 - 1;
    for c in target.components() {
        match c {
            Component::ParentDir => depth -= 1,
            Component::Normal(_) => depth += 1,
            Component::CurDir => {}
            Component::RootDir | Component::Prefix(_) => return false,
        }
        if depth < 0 {
            return false;
        }
    }
    true
}

/// Lowercase hex sha256 of a file, reporting bytes read.
pub fn sha256_file(path: &Path, progress: &mut dyn FnMut(u64)) -> Result<String, BundleError> {
    let read = |source| BundleError::Read {
        bundle: path.to_path_buf(),
        source,
    };
    let mut f = File::open(path).map_err(read)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = f.read(&mut buf).map_err(read)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        total += n as u64;
        progress(total);
    }
    Ok(hex(&h.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `<bundle>.sha256`.
pub fn sidecar_path(bundle: &Path) -> PathBuf {
    let mut s = bundle.as_os_str().to_owned();
    s.push(".sha256");
    PathBuf::from(s)
}

/// Writes `<bundle>.sha256` as `sha256sum` does (`<hex>  <file name>`), for
/// a bundle whose sha256 is `sum`; returns the sidecar's path.
pub fn write_sidecar(bundle: &Path, sum: &str) -> Result<PathBuf, BundleError> {
    let base = bundle
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    let sidecar = sidecar_path(bundle);
    std::fs::write(&sidecar, format!("{sum}  {base}\n")).map_err(|source| BundleError::Write {
        path: sidecar.clone(),
        source,
    })?;
    Ok(sidecar)
}

/// The expected sha256: `given` (policy or command line) or the sidecar's
/// (`sha256sum` format: `<hex>  <name>`). Returns it and where it came from.
pub fn expected_sha256(
    bundle: &Path,
    given: Option<&str>,
) -> Result<(String, String), BundleError> {
    let valid = |s: &str| s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit());
    if let Some(g) = given {
        if !valid(g) {
            return Err(BundleError::Sidecar {
                sidecar: PathBuf::from("--sha256"),
                message: format!("{g:?} is not 64 hex digits"),
            });
        }
        return Ok((g.to_ascii_lowercase(), "the given sha256".into()));
    }
    let sidecar = sidecar_path(bundle);
    let text = match fs::read_to_string(&sidecar) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(BundleError::NoChecksum {
                bundle: bundle.to_path_buf(),
                sidecar,
            });
        }
        Err(e) => {
            return Err(BundleError::Sidecar {
                sidecar,
                message: e.to_string(),
            });
        }
    };
    let first = text.split_whitespace().next().unwrap_or("");
    if !valid(first) {
        return Err(BundleError::Sidecar {
            sidecar,
            message: format!("{first:?} is not a sha256 (64 hex digits)"),
        });
    }
    Ok((first.to_ascii_lowercase(), sidecar.display().to_string()))
}

/// Where an unpack stands, for a progress line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    /// Checking the bundle's sha256: bytes read of total.
    Verifying { done: u64, total: u64 },
    /// Unpacking: compressed bytes read of total.
    Unpacking { done: u64, total: u64 },
}

/// What [`install`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Installed {
    /// Host path of the unpacked driver (`/var/lib/gpu-agent/drivers/550.127.08-6.1.0-27-amd64`).
    pub dir: String,
    pub manifest: Manifest,
    /// False when the same bundle was already unpacked there.
    pub unpacked: bool,
    /// Files and bytes written.
    pub files: usize,
    pub bytes: u64,
}

/// A reader that counts what passes through it.
struct Counting<R> {
    inner: R,
    count: u64,
    total: u64,
    report: u64,
    progress: Box<dyn FnMut(Progress)>,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.count += n as u64;
        if self.count >= self.report || n == 0 {
            (self.progress)(Progress::Unpacking {
                done: self.count,
                total: self.total,
            });
            self.report = self.count + (4 << 20);
        }
        Ok(n)
    }
}

/// A reader that refuses to give more than `limit` bytes (the unpacked
/// stream of a bundle, see [`max_unpacked`]).
struct Limited<R> {
    inner: R,
    left: u64,
    exceeded: bool,
}

impl<R: Read> Read for Limited<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        // One byte past the limit tells "exactly at it" from "over it".
        let want = buf
            .len()
            .min(usize::try_from(self.left.saturating_add(1)).unwrap_or(usize::MAX));
        let n = self.inner.read(&mut buf[..want])?;
        if n as u64 > self.left {
            self.exceeded = true;
            return Err(io::Error::other("the bundle unpacks to more than allowed"));
        }
        self.left -= n as u64;
        Ok(n)
    }
}

/// Verifies `bundle` (a path on this machine) against `expected` sha256 and
/// unpacks it under the host's [`DRIVERS_DIR`] for the running `kernel`.
/// Does not switch `current`; see [`switch`].
pub fn install(
    host: &HostRoot,
    bundle: &Path,
    expected: (&str, &str),
    kernel: &str,
    mut progress: Box<dyn FnMut(Progress)>,
) -> Result<Installed, BundleError> {
    let total = fs::metadata(bundle)
        .map_err(|source| BundleError::Read {
            bundle: bundle.to_path_buf(),
            source,
        })?
        .len();
    let actual = sha256_file(bundle, &mut |done| {
        progress(Progress::Verifying { done, total })
    })?;
    if actual != expected.0 {
        return Err(BundleError::Checksum {
            bundle: bundle.to_path_buf(),
            expected: expected.0.to_string(),
            actual,
            from: expected.1.to_string(),
        });
    }
    // Opened in the host root: a link swapped onto its path (or a parent's)
    // cannot lead the unpack out; everything below is relative to it.
    let drivers = Drivers {
        dir: host.dir(DRIVERS_DIR, true)?,
    };
    let file = File::open(bundle).map_err(|source| BundleError::Read {
        bundle: bundle.to_path_buf(),
        source,
    })?;
    let counting = Counting {
        inner: BufReader::with_capacity(1 << 20, file),
        count: 0,
        total,
        report: 0,
        progress,
    };
    let limit = max_unpacked(total);
    let mut archive = tar::Archive::new(Limited {
        inner: flate2::read::GzDecoder::new(counting),
        left: limit,
        exceeded: false,
    });
    let mut u = Unpacker {
        bundle: bundle.to_path_buf(),
        kernel: kernel.to_string(),
        drivers,
        staging: None,
        manifest: None,
        seen: BTreeSet::new(),
        links: BTreeSet::new(),
        files: 0,
        bytes: 0,
        limit,
    };
    let mut result = u.run(&mut archive);
    let limited = archive.into_inner();
    if limited.exceeded && result.is_err() {
        result = Err(BundleError::TooLarge {
            bundle: bundle.to_path_buf(),
            limit,
        });
    }
    // The gzip trailer may be left unread: say the whole file was read.
    let mut counting = limited.inner.into_inner();
    (counting.progress)(Progress::Unpacking { done: total, total });
    // An already-unpacked bundle stops before staging; only a refused one leaves it.
    if let Some(staging) = u.staging.take()
        && result.is_err()
    {
        drop(staging.fd);
        let _ = remove_tree_at(u.drivers.fd(), OsStr::new(&staging.name));
    }
    let unpacked = result?;
    let manifest = u.manifest.take().expect("run sets the manifest");
    let name = manifest.dir_name(kernel);
    Ok(Installed {
        dir: format!("{DRIVERS_DIR}/{name}"),
        manifest,
        unpacked,
        files: u.files,
        bytes: u.bytes,
    })
}

/// The staging directory of an unpack, `.<version>-<kernel>.partial` in
/// the drivers directory, opened.
struct Staging {
    name: String,
    fd: OwnedFd,
}

struct Unpacker {
    bundle: PathBuf,
    kernel: String,
    drivers: Drivers,
    staging: Option<Staging>,
    manifest: Option<Manifest>,
    seen: BTreeSet<String>,
    /// Symbolic links unpacked so far: nothing may be written through one.
    links: BTreeSet<String>,
    files: usize,
    bytes: u64,
    /// The most bytes the bundle may unpack to.
    limit: u64,
}

impl Unpacker {
    fn entry_err(&self, entry: &str, message: impl Into<String>) -> BundleError {
        BundleError::Entry {
            bundle: self.bundle.clone(),
            entry: entry.to_string(),
            message: message.into(),
        }
    }

    fn read_err(&self, source: io::Error) -> BundleError {
        BundleError::Read {
            bundle: self.bundle.clone(),
            source,
        }
    }

    /// Where `rel` in the staging directory is, for messages.
    fn staged(&self, rel: &str) -> PathBuf {
        let staging = self.staging.as_ref().expect("set with the manifest");
        let dir = self.drivers.path(&staging.name);
        if rel.is_empty() { dir } else { dir.join(rel) }
    }

    /// Ok(true): unpacked and renamed into place; Ok(false): already there.
    fn run<R: Read>(&mut self, archive: &mut tar::Archive<R>) -> Result<bool, BundleError> {
        let entries = archive.entries().map_err(|e| self.read_err(e))?;
        for entry in entries {
            let mut entry = entry.map_err(|e| self.read_err(e))?;
            let raw = entry.path().map_err(|e| self.read_err(e))?.into_owned();
            let shown = raw.display().to_string();
            relative(&raw).map_err(|why| self.entry_err(&shown, why))?;
            let name = clean(&raw);
            let kind = entry.header().entry_type();
            if self.manifest.is_none() {
                if name != MANIFEST || !kind.is_file() {
                    return Err(BundleError::Manifest {
                        bundle: self.bundle.clone(),
                        message: format!("must be the first entry, found {shown:?}"),
                    });
                }
                if !self.read_manifest(&mut entry)? {
                    return Ok(false);
                }
                continue;
            }
            if name.is_empty() && kind.is_dir() {
                continue; // "./"
            }
            if !self.seen.insert(name.clone()) {
                return Err(self.entry_err(&shown, "appears twice"));
            }
            if let Some(l) = self
                .links
                .iter()
                .find(|l| name.starts_with(&format!("{l}/")))
            {
                return Err(self.entry_err(&shown, format!("lies under the symbolic link {l:?}")));
            }
            if name.len() > MAX_ENTRY_PATH || name.split('/').count() > MAX_ENTRY_DEPTH {
                return Err(self.entry_err(
                    &shown,
                    format!(
                        "path longer than {MAX_ENTRY_PATH} bytes or deeper than {MAX_ENTRY_DEPTH} components"
                    ),
                ));
            }
            if entry.size() > self.limit {
                // Refused before a byte of it is written.
                return Err(self.entry_err(
                    &shown,
                    format!(
                        "{} bytes, more than the {} this bundle may unpack to ({MAX_EXPANSION} times its size)",
                        entry.size(),
                        self.limit
                    ),
                ));
            }
            // Its directory, made one component at a time in the staging
            // directory, never through a link (an entry of this bundle or not).
            let (parent, last) = at::split(&name);
            let staging = self.staging.as_ref().expect("set with the manifest");
            let dir = at::open_path(staging.fd.as_fd(), parent, true).map_err(|(at, source)| {
                BundleError::Write {
                    path: self.staged(&at),
                    source,
                }
            })?;
            let last = OsStr::new(last);
            let dest = self.staged(&name);
            match kind {
                tar::EntryType::Regular | tar::EntryType::Continuous => {
                    self.unpack_file(&mut entry, &name, dir.as_fd(), last, &dest)?;
                }
                tar::EntryType::Directory => {
                    at::make_dir(dir.as_fd(), last).map_err(|source| BundleError::Write {
                        path: dest.clone(),
                        source,
                    })?;
                }
                tar::EntryType::Symlink => {
                    let target = entry
                        .link_name()
                        .map_err(|e| self.read_err(e))?
                        .ok_or_else(|| self.entry_err(&shown, "symbolic link without a target"))?
                        .into_owned();
                    if !link_stays_inside(&name, &target) {
                        return Err(self.entry_err(
                            &shown,
                            format!(
                                "symbolic link to {} points out of the bundle",
                                target.display()
                            ),
                        ));
                    }
                    nix::unistd::symlinkat(&target, dir.as_fd(), last).map_err(|e| {
                        BundleError::Write {
                            path: dest.clone(),
                            source: e.into(),
                        }
                    })?;
                    self.links.insert(name);
                }
                tar::EntryType::Link => {
                    return Err(self.entry_err(&shown, "hard links are not allowed"));
                }
                tar::EntryType::Char | tar::EntryType::Block | tar::EntryType::Fifo => {
                    return Err(self.entry_err(&shown, "device files are not allowed"));
                }
                other => {
                    return Err(
                        self.entry_err(&shown, format!("entry type {other:?} is not allowed"))
                    );
                }
            }
        }
        let Some(manifest) = &self.manifest else {
            return Err(BundleError::Manifest {
                bundle: self.bundle.clone(),
                message: "missing: the bundle is empty".into(),
            });
        };
        if let Some(missing) = manifest.files.keys().find(|f| !self.seen.contains(*f)) {
            return Err(BundleError::Manifest {
                bundle: self.bundle.clone(),
                message: format!("lists {missing:?}, which the bundle does not carry"),
            });
        }
        let staging = self.staging.as_ref().expect("set with the manifest");
        let dest = manifest.dir_name(&self.kernel);
        at::sync(staging.fd.as_fd()).map_err(|source| BundleError::Write {
            path: self.staged(""),
            source,
        })?;
        let fd = self.drivers.fd();
        nix::fcntl::renameat(fd, staging.name.as_str(), fd, dest.as_str()).map_err(|e| {
            BundleError::Write {
                path: self.drivers.path(&dest),
                source: e.into(),
            }
        })?;
        // Renamed into place: nothing left to clean up on an error now.
        self.staging = None;
        self.drivers.sync()?;
        Ok(true)
    }

    /// Reads and checks the manifest; false when this bundle is already unpacked.
    fn read_manifest<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
    ) -> Result<bool, BundleError> {
        if entry.size() > MANIFEST_MAX {
            return Err(BundleError::Manifest {
                bundle: self.bundle.clone(),
                message: format!(
                    "{} bytes, more than the {MANIFEST_MAX} allowed",
                    entry.size()
                ),
            });
        }
        let mut text = Vec::new();
        entry.read_to_end(&mut text).map_err(|e| self.read_err(e))?;
        let de = &mut serde_json::Deserializer::from_slice(&text);
        let manifest: Manifest =
            serde_path_to_error::deserialize(de).map_err(|e| BundleError::Manifest {
                bundle: self.bundle.clone(),
                message: if e.path().to_string() == "." {
                    e.inner().to_string()
                } else {
                    format!("{}: {}", e.path(), e.inner())
                },
            })?;
        manifest.check(&self.bundle)?;
        if !manifest.kernels.contains(&self.kernel) {
            return Err(BundleError::Kernel {
                bundle: self.bundle.clone(),
                kernels: manifest.kernels.clone(),
                running: self.kernel.clone(),
            });
        }
        let name = manifest.dir_name(&self.kernel);
        let fd = self.drivers.fd();
        let there = at::kind(fd, OsStr::new(&name)).map_err(|source| BundleError::Write {
            path: self.drivers.path(&name),
            source,
        })?;
        if there.is_some() {
            let same = at::read_file(fd, &format!("{name}/{MANIFEST}"), MANIFEST_MAX)
                .is_ok_and(|t| t == text);
            self.manifest = Some(manifest);
            if same {
                return Ok(false);
            }
            return Err(BundleError::Installed {
                dir: format!("{DRIVERS_DIR}/{name}"),
                message: "another bundle of this version and kernel is installed here; remove it (gpu-agent driver remove) first".into(),
            });
        }
        let staging = format!(".{name}.partial");
        let werr = |source| BundleError::Write {
            path: self.drivers.path(&staging),
            source,
        };
        // Left by an install that was killed: never used, safe to drop.
        match remove_tree_at(fd, OsStr::new(&staging)) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(werr(e)),
            _ => {}
        }
        nix::sys::stat::mkdirat(fd, staging.as_str(), Mode::from_bits_truncate(0o755))
            .map_err(|e| werr(e.into()))?;
        let sfd = at::open_dir(fd, OsStr::new(&staging)).map_err(werr)?;
        // Set before anything is written in it, so an error removes it.
        self.staging = Some(Staging {
            name: staging,
            fd: sfd,
        });
        let sfd = self
            .staging
            .as_ref()
            .map(|s| s.fd.as_fd())
            .expect("just set");
        write_new(
            sfd,
            OsStr::new(MANIFEST),
            &self.staged(MANIFEST),
            &mut text.as_slice(),
            0o644,
        )?;
        self.manifest = Some(manifest);
        Ok(true)
    }

    /// Unpacks the file `name` of the bundle as `last` in `dir` (`dest`
    /// for messages), checking its sha256.
    fn unpack_file<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        name: &str,
        dir: BorrowedFd<'_>,
        last: &OsStr,
        dest: &Path,
    ) -> Result<(), BundleError> {
        let manifest = self.manifest.as_ref().expect("read first");
        let Some(want) = manifest.files.get(name).map(|f| f.sha256.clone()) else {
            return Err(self.entry_err(name, "not listed in the manifest"));
        };
        // Never setuid/setgid/sticky, never writable by others.
        let mode = entry.header().mode().unwrap_or(0o644) & 0o755;
        let mut hashing = HashingReader {
            inner: entry,
            hash: Sha256::new(),
        };
        let n = write_new(dir, last, dest, &mut hashing, mode).map_err(|e| match e {
            BundleError::Read { source, .. } => self.read_err(source),
            other => other,
        })?;
        let got = hex(&hashing.hash.finalize());
        if got != want {
            return Err(self.entry_err(name, format!("sha256 is {got}, the manifest says {want}")));
        }
        self.files += 1;
        self.bytes += n;
        Ok(())
    }
}

struct HashingReader<R> {
    inner: R,
    hash: Sha256,
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hash.update(&buf[..n]);
        Ok(n)
    }
}

/// Creates `name` in `dir` (never over an existing file, never through a
/// link), copies `from` into it, sets `mode`, fsyncs. `path`: where it
/// is, for messages.
fn write_new(
    dir: BorrowedFd<'_>,
    name: &OsStr,
    path: &Path,
    from: &mut dyn Read,
    mode: u32,
) -> Result<u64, BundleError> {
    let werr = |source| BundleError::Write {
        path: path.to_path_buf(),
        source,
    };
    let mut f = at::create_new(dir, name).map_err(werr)?;
    let mut buf = vec![0u8; 256 << 10];
    let mut n = 0u64;
    loop {
        let got = from.read(&mut buf).map_err(|source| BundleError::Read {
            bundle: path.to_path_buf(),
            source,
        })?;
        if got == 0 {
            break;
        }
        f.write_all(&buf[..got]).map_err(werr)?;
        n += got as u64;
    }
    f.set_permissions(fs::Permissions::from_mode(mode))
        .map_err(werr)?;
    f.sync_all().map_err(werr)?;
    Ok(n)
}

/// One unpacked driver under [`DRIVERS_DIR`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Entry {
    /// Directory name (`550.127.08-6.1.0-27-amd64`).
    pub name: String,
    pub manifest: Manifest,
    pub current: bool,
    pub previous: bool,
}

/// The drivers directory, opened in the host root ([`HostRoot::dir`]): a
/// link swapped onto its path, or a parent's, is resolved with the root
/// as `/`. Links are read, switched and removed, drivers listed, read and
/// removed relative to it (see [`at`]), never by path again.
#[derive(Debug)]
struct Drivers {
    dir: HostDir,
}

impl Drivers {
    /// [`DRIVERS_DIR`] as it is; `None` when there is none.
    fn open(host: &HostRoot) -> Result<Option<Self>, BundleError> {
        match host.dir(DRIVERS_DIR, false) {
            Ok(dir) => Ok(Some(Drivers { dir })),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// [`DRIVERS_DIR`], which must be there (its absence an error naming it).
    fn existing(host: &HostRoot) -> Result<Self, BundleError> {
        Ok(Drivers {
            dir: host.dir(DRIVERS_DIR, false)?,
        })
    }

    fn fd(&self) -> BorrowedFd<'_> {
        self.dir.fd()
    }

    /// Where `name` in it is (this process's path), for messages.
    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn sync(&self) -> Result<(), BundleError> {
        at::sync(self.fd()).map_err(|source| BundleError::Write {
            path: self.dir.path().to_path_buf(),
            source,
        })
    }

    /// The target of the link `which` (`current`, `previous`), if any.
    fn link(&self, which: &str) -> Result<Option<String>, BundleError> {
        at::read_link(self.fd(), OsStr::new(which))
            .map(|t| t.map(|t| t.to_string_lossy().into_owned()))
            .map_err(|e| HostError::io(self.path(which), e).into())
    }

    /// Points `which` at `name`: a new link renamed over the old one, so a
    /// reader sees the old or the new, never none.
    fn set_link(&self, which: &str, name: &str) -> Result<(), BundleError> {
        let tmp = format!(".{which}.new");
        at::replace_link(
            self.fd(),
            OsStr::new(&tmp),
            OsStr::new(which),
            OsStr::new(name),
        )
        .map_err(|source| BundleError::Write {
            path: self.path(which),
            source,
        })
    }

    fn remove_link(&self, which: &str) -> Result<(), BundleError> {
        at::remove_file(self.fd(), OsStr::new(which))
            .map(|_| ())
            .map_err(|source| BundleError::Write {
                path: self.path(which),
                source,
            })
    }

    /// The manifest of the unpacked driver `name`.
    fn manifest(&self, name: &str) -> Result<Manifest, BundleError> {
        let dir = format!("{DRIVERS_DIR}/{name}");
        if !at::is_component(name) {
            return Err(BundleError::Installed {
                dir,
                message: "not the name of an unpacked driver".into(),
            });
        }
        let text = at::read_file(self.fd(), &format!("{name}/{MANIFEST}"), MANIFEST_MAX)
            .map_err(|e| HostError::io(self.path(name).join(MANIFEST), e))?;
        serde_json::from_slice(&text).map_err(|e| BundleError::Installed {
            dir,
            message: format!("{MANIFEST}: {e}"),
        })
    }

    fn entries(&self) -> Result<Vec<Entry>, BundleError> {
        let names = at::names(self.fd()).map_err(|e| HostError::io(self.dir.path(), e))?;
        let current = self.link("current")?;
        let previous = self.link("previous")?;
        let mut out = Vec::new();
        for name in names {
            if name.starts_with('.') || name == "current" || name == "previous" {
                continue;
            }
            let manifest = self.manifest(&name)?;
            out.push(Entry {
                current: current.as_deref() == Some(name.as_str()),
                previous: previous.as_deref() == Some(name.as_str()),
                name,
                manifest,
            });
        }
        Ok(out)
    }
}

fn link_target(host: &HostRoot, which: &str) -> Result<Option<String>, BundleError> {
    match Drivers::open(host)? {
        Some(d) => d.link(which),
        None => Ok(None),
    }
}

/// The manifest of an unpacked driver directory.
pub fn read_installed(host: &HostRoot, name: &str) -> Result<Manifest, BundleError> {
    Drivers::existing(host)?.manifest(name)
}

/// Every unpacked driver, with which is `current` and `previous`.
pub fn list(host: &HostRoot) -> Result<Vec<Entry>, BundleError> {
    match Drivers::open(host)? {
        Some(d) => d.entries(),
        None => Ok(Vec::new()),
    }
}

/// The `current` driver's directory name, if any.
pub fn current(host: &HostRoot) -> Result<Option<String>, BundleError> {
    link_target(host, "current")
}

/// The `previous` driver's directory name, if any.
pub fn previous(host: &HostRoot) -> Result<Option<String>, BundleError> {
    link_target(host, "previous")
}

/// Makes `name` current; the old current becomes previous. Returns the old current.
pub fn switch(host: &HostRoot, name: &str) -> Result<Option<String>, BundleError> {
    let d = Drivers::existing(host)?;
    d.manifest(name)?;
    let old = d.link("current")?;
    if old.as_deref() == Some(name) {
        return Ok(old);
    }
    if let Some(old) = &old {
        d.set_link("previous", old)?;
    }
    d.set_link("current", name)?;
    d.sync()?;
    tracing::info!(stage = "driver", current = %name, previous = old.as_deref().unwrap_or("none"), "switched the current driver");
    Ok(old)
}

/// Puts `current` and `previous` back as they were (after a failed upgrade).
pub fn set_links(
    host: &HostRoot,
    current: &str,
    previous: Option<&str>,
) -> Result<(), BundleError> {
    let d = Drivers::existing(host)?;
    d.manifest(current)?;
    match previous {
        Some(p) => d.set_link("previous", p)?,
        None => d.remove_link("previous")?,
    }
    d.set_link("current", current)?;
    d.sync()
}

/// Swaps `current` and `previous`. Returns the new current.
pub fn rollback(host: &HostRoot) -> Result<String, BundleError> {
    let Some(prev) = previous(host)? else {
        return Err(BundleError::Installed {
            dir: DRIVERS_DIR.into(),
            message: "no previous driver to roll back to".into(),
        });
    };
    switch(host, &prev)?;
    Ok(prev)
}

/// Deletes unpacked driver `name` (never the current one); a `previous`
/// link to it goes too.
pub fn remove(host: &HostRoot, name: &str) -> Result<(), BundleError> {
    let not_unpacked = || BundleError::Installed {
        dir: format!("{DRIVERS_DIR}/{name}"),
        message: "not an unpacked driver (see `gpu-agent driver list`)".into(),
    };
    let d = Drivers::open(host)?.ok_or_else(not_unpacked)?;
    let all = d.entries()?;
    let Some(entry) = all.iter().find(|x| x.name == name) else {
        return Err(not_unpacked());
    };
    if entry.current {
        return Err(BundleError::Installed {
            dir: format!("{DRIVERS_DIR}/{name}"),
            message: "the current driver; upgrade or roll back first".into(),
        });
    }
    remove_tree_at(d.fd(), OsStr::new(name)).map_err(|source| BundleError::Write {
        path: d.path(name),
        source,
    })?;
    if entry.previous {
        d.remove_link("previous")?;
    }
    d.sync()?;
    tracing::info!(stage = "driver", removed = %name, "removed an unpacked driver");
    Ok(())
}

/// Removes unpacked drivers that are neither current nor previous. Returns their names.
pub fn prune(host: &HostRoot) -> Result<Vec<String>, BundleError> {
    let mut removed = Vec::new();
    for e in list(host)? {
        if e.current || e.previous {
            continue;
        }
        remove(host, &e.name)?;
        removed.push(e.name);
    }
    Ok(removed)
}

/// The directory holding `kernel`'s modules of `flavour` in unpacked driver
/// `name` (a host path).
pub fn module_dir(name: &str, kernel: &str, flavour: Flavour) -> String {
    format!("{DRIVERS_DIR}/{name}/modules/{kernel}/{}", flavour.name())
}

/// Builds a bundle (for tests, benchmarks and packaging): the manifest
/// first, then `files` (path, bytes, mode) in order.
pub fn build(
    out: &mut dyn Write,
    version: &str,
    kernels: &[&str],
    flavours: &[Flavour],
    files: &[(String, Vec<u8>, u32)],
) -> io::Result<()> {
    let manifest = Manifest {
        format: FORMAT,
        driver_version: version.into(),
        kernels: kernels.iter().map(|k| k.to_string()).collect(),
        flavours: flavours.to_vec(),
        files: files
            .iter()
            .map(|(p, b, _)| {
                (
                    p.clone(),
                    FileEntry {
                        sha256: hex(&Sha256::digest(b)),
                    },
                )
            })
            .collect(),
    };
    let json = serde_json::to_vec_pretty(&manifest).map_err(io::Error::other)?;
    let gz = flate2::write::GzEncoder::new(out, flate2::Compression::default());
    let mut tar = tar::Builder::new(gz);
    let mut append = |path: &str, bytes: &[u8], mode: u32| {
        let mut h = tar::Header::new_gnu();
        h.set_size(bytes.len() as u64);
        h.set_mode(mode);
        h.set_entry_type(tar::EntryType::Regular);
        h.set_mtime(0);
        tar.append_data(&mut h, path, bytes)
    };
    append(MANIFEST, &json, 0o644)?;
    for (p, b, mode) in files {
        append(p, b, *mode)?;
    }
    tar.into_inner()?.finish()?;
    Ok(())
}
