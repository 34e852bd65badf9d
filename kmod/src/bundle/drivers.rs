//! The drivers directory on the host: the unpacked drivers, listed, read and
//! removed, and the `current` and `previous` links switched atomically.

use std::ffi::OsStr;
use std::os::fd::BorrowedFd;
use std::path::PathBuf;

use hostlib::root::{HostDir, remove_tree_at};
use hostlib::{HostError, HostRoot};
use serde::Serialize;

use super::manifest::MANIFEST_MAX;
use super::{BundleError, Flavour, MANIFEST, Manifest};
use crate::at;

/// Where bundles are unpacked on the host.
pub const DRIVERS_DIR: &str = "/var/lib/gpu-agent/drivers";

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
pub(super) struct Drivers {
    dir: HostDir,
}

impl Drivers {
    /// [`DRIVERS_DIR`], made when it is not there.
    pub(super) fn create(host: &HostRoot) -> Result<Self, BundleError> {
        Ok(Drivers {
            dir: host.dir(DRIVERS_DIR, true)?,
        })
    }

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

    pub(super) fn fd(&self) -> BorrowedFd<'_> {
        self.dir.fd()
    }

    /// Where `name` in it is (this process's path), for messages.
    pub(super) fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub(super) fn sync(&self) -> Result<(), BundleError> {
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
