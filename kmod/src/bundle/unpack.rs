//! Installing a bundle: its sha256 checked, then unpacked entry by entry
//! into a staging directory (every entry checked and hashed), then renamed into place.

use std::collections::BTreeSet;
use std::ffi::OsStr;
use std::fs::{self, File};
use std::io::{self, BufReader, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use hostlib::HostRoot;
use hostlib::root::remove_tree_at;
use nix::sys::stat::Mode;
use sha2::{Digest, Sha256};

use super::checksum::{hex, sha256_file};
use super::drivers::Drivers;
use super::manifest::MANIFEST_MAX;
use super::paths::{clean, link_stays_inside, relative};
use super::{
    BundleError, DRIVERS_DIR, MANIFEST, MAX_ENTRY_DEPTH, MAX_ENTRY_PATH, MAX_EXPANSION, Manifest,
    max_unpacked,
};
use crate::at;

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
    let drivers = Drivers::create(host)?;
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
