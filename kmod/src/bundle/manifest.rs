//! The manifest a bundle opens with (`gpu-agent-bundle.json`): the driver
//! version, its kernels and module flavours, every file's sha256; and its checks.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::BundleError;
pub use super::paths::MANIFEST;
use super::paths::relative;

/// The manifest's format version this code reads.
pub const FORMAT: u32 = 1;
/// The largest manifest accepted (a driver has a few hundred files).
pub(super) const MANIFEST_MAX: u64 = 4 << 20;

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
    pub(super) fn check(&self, path: &Path) -> Result<(), BundleError> {
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
