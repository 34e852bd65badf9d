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
//! root ([`HostRoot::dir`](hostlib::HostRoot::dir): the walk decides,
//! `openat2(RESOLVE_IN_ROOT)` opens), and everything below it (staging, entries, the rename into
//! place, the links, removals) is made relative to that descriptor without
//! following a link (see `at.rs`), so a link swapped onto its path, or
//! inside the staging tree, cannot lead a write or a removal out.

mod checksum;
mod drivers;
mod error;
mod limits;
mod manifest;
mod pack;
mod paths;
mod unpack;

pub use checksum::{expected_sha256, sha256_file, sidecar_path, write_sidecar};
pub use drivers::{
    DRIVERS_DIR, Entry, current, list, module_dir, previous, prune, read_installed, remove,
    rollback, set_links, switch,
};
pub use error::BundleError;
pub use limits::{MAX_ENTRY_DEPTH, MAX_ENTRY_PATH, MAX_EXPANSION, max_unpacked};
pub use manifest::{FORMAT, FileEntry, Flavour, MANIFEST, Manifest};
pub use pack::build;
pub use unpack::{Installed, Progress, install};
