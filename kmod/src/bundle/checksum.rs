//! A bundle's own sha256: computed, and expected from the policy, the
//! command line or a `<bundle>.sha256` sidecar (`sha256sum` format).

use std::fs::{self, File};
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::BundleError;

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

pub(super) fn hex(bytes: &[u8]) -> String {
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
