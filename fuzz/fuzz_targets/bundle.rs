//! Driver bundles (gzip'd tar, manifest first): a bundle is unpacked into
//! the drivers directory or refused with an error naming the bundle, and
//! whatever it holds (`..`, absolute paths, links out, hard links, device
//! files, giant or endless entries, a gzip bomb) nothing is written outside
//! the drivers directory, no link in it points out, nothing is left staged
//! after a refusal, and what is written stays within a bound of the
//! bundle's own size. Never a panic.
//!
//! The first byte: bit 0 clear, the rest is a tar stream the target gzips;
//! set, the rest is the bundle's bytes as they are (gzip and all).
#![no_main]

use std::io::Write;
use std::path::{Component, Path};

use gpu_agent_fuzz::{Host, bytes_under, files_under};
use kmod::bundle::{self, DRIVERS_DIR};
use libfuzzer_sys::fuzz_target;
use sha2::{Digest, Sha256};

const KERNEL: &str = "6.1.0-fuzz";

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let bytes = if mode & 1 == 0 {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(rest).expect("gzip to memory");
        gz.finish().expect("gzip to memory")
    } else {
        rest.to_vec()
    };
    let host = Host::new();
    let bundle_path = host.dir.path().join("bundle.tar.gz");
    std::fs::write(&bundle_path, &bytes).expect("write the bundle");
    let sha: String = Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let result = bundle::install(
        &host.root,
        &bundle_path,
        (&sha, "fuzz"),
        KERNEL,
        Box::new(|_| {}),
    );
    let drivers = host.dir.path().join(DRIVERS_DIR.trim_start_matches('/'));
    let inside = DRIVERS_DIR.trim_start_matches('/');
    for f in files_under(host.dir.path()) {
        assert!(
            f == "bundle.tar.gz" || inside.starts_with(&f) || f.starts_with(&format!("{inside}/")),
            "{f} was written outside the drivers directory"
        );
    }
    let written = bytes_under(&drivers);
    let bound = bundle::max_unpacked(bytes.len() as u64);
    assert!(
        written <= bound,
        "{written} bytes unpacked from a {}-byte bundle (bound {bound})",
        bytes.len()
    );
    match result {
        Ok(installed) => {
            let dir = host.dir.path().join(installed.dir.trim_start_matches('/'));
            for f in files_under(&dir) {
                let p = dir.join(&f);
                if let Ok(target) = std::fs::read_link(&p) {
                    assert!(
                        stays_inside(&f, &target),
                        "{f} links out to {}",
                        target.display()
                    );
                }
            }
        }
        Err(e) => {
            let shown = e.to_string();
            assert!(
                shown.contains(&bundle_path.display().to_string()) || shown.contains(DRIVERS_DIR),
                "error names neither the bundle nor the drivers directory: {shown}"
            );
            for f in files_under(&drivers) {
                assert!(!f.ends_with(".partial"), "a refused bundle left {f} staged");
            }
        }
    }
});

/// True when `target`, a link at `link` (relative to the unpacked dir),
/// resolves inside that dir.
fn stays_inside(link: &str, target: &Path) -> bool {
    let mut depth = link.split('/').count() as i64 - 1;
    for c in target.components() {
        match c {
            Component::ParentDir => depth -= 1,
            Component::Normal(_) => depth += 1,
            Component::CurDir => {}
            _ => return false,
        }
        if depth < 0 {
            return false;
        }
    }
    true
}
