//! Making a bundle (for tests, benchmarks and packaging).

use std::io::{self, Write};

use sha2::{Digest, Sha256};

use super::checksum::hex;
use super::{FORMAT, FileEntry, Flavour, MANIFEST, Manifest};

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
