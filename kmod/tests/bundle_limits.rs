//! Bundles that unpack to far more than their size (a gzip bomb, an entry
//! whose header claims gigabytes, a GNU long name of megabytes) are refused
//! with an error naming the bundle, before they fill the disk or memory,
//! and leave nothing behind. Found while writing the `bundle` fuzz target
//! (fuzz/fuzz_targets/bundle.rs, which checks this bound on every input):
//! before, nothing bounded an unpack, so a 64 KiB bundle (its gzip-bomb
//! seed) wrote 64 MiB, and tar held a GNU long name whole in memory.

use std::io::Write;
use std::path::Path;

use hostlib::HostRoot;
use kmod::bundle::{self, BundleError, MANIFEST};
use sha2::{Digest, Sha256};

const KERNEL: &str = "6.1.0-27-amd64";

fn hex(b: &[u8]) -> String {
    Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

fn manifest(files: &[(&str, &str)]) -> Vec<u8> {
    let files: serde_json::Map<String, serde_json::Value> = files
        .iter()
        .map(|(n, sha)| (n.to_string(), serde_json::json!({ "sha256": sha })))
        .collect();
    serde_json::to_vec(&serde_json::json!({
        "format": 1,
        "driverVersion": "550.127.08",
        "kernels": [KERNEL],
        "flavours": ["open"],
        "files": files,
    }))
    .unwrap()
}

fn header(name: &str, kind: tar::EntryType, size: u64) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_path(name).unwrap();
    h.set_entry_type(kind);
    h.set_mode(0o644);
    h.set_size(size);
    h.set_cksum();
    h
}

/// Bytes written under `dir`.
fn bytes_under(dir: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let t = e.file_type().unwrap();
            if t.is_dir() {
                stack.push(e.path());
            } else if t.is_file() {
                total += e.metadata().unwrap().len();
            }
        }
    }
    total
}

fn install(bytes: &[u8]) -> (tempfile::TempDir, Result<bundle::Installed, BundleError>) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("host")).unwrap();
    let host = HostRoot::new(dir.path().join("host")).unwrap();
    let path = dir.path().join("bundle.tar.gz");
    std::fs::write(&path, bytes).unwrap();
    let sha = hex(bytes);
    let r = bundle::install(&host, &path, (&sha, "test"), KERNEL, Box::new(|_| {}));
    (dir, r)
}

/// A gzip'd tar: the manifest, then `rest` (raw tar bytes, headers and data).
fn gzip_tar(manifest: &[u8], rest: impl FnOnce(&mut dyn Write)) -> Vec<u8> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(header(MANIFEST, tar::EntryType::Regular, manifest.len() as u64).as_bytes())
        .unwrap();
    gz.write_all(manifest).unwrap();
    gz.write_all(&vec![0u8; (512 - manifest.len() % 512) % 512])
        .unwrap();
    rest(&mut gz);
    gz.finish().unwrap()
}

fn assert_refused_leaving_nothing(dir: &Path, r: Result<bundle::Installed, BundleError>) -> String {
    let e = r.expect_err("refused");
    let shown = e.to_string();
    assert!(shown.contains("bundle.tar.gz"), "names the bundle: {shown}");
    let drivers = dir.join("host/var/lib/gpu-agent/drivers");
    assert_eq!(bytes_under(&drivers), 0, "nothing is left unpacked");
    shown
}

#[test]
fn a_gzip_bomb_is_refused_before_it_fills_the_disk() {
    // 64 MiB of zeros in a listed file: about 64 KiB gzip'd.
    let size = 64u64 << 20;
    let m = manifest(&[("zeros", &"0".repeat(64))]);
    let bytes = gzip_tar(&m, |w| {
        w.write_all(header("zeros", tar::EntryType::Regular, size).as_bytes())
            .unwrap();
        let chunk = vec![0u8; 1 << 20];
        for _ in 0..64 {
            w.write_all(&chunk).unwrap();
        }
        w.write_all(&[0u8; 1024]).unwrap();
    });
    assert!(
        (bytes.len() as u64) < size / 500,
        "a bomb: {} bytes",
        bytes.len()
    );
    let (dir, r) = install(&bytes);
    let shown = assert_refused_leaving_nothing(dir.path(), r);
    assert!(shown.contains("\"zeros\""), "names the entry: {shown}");
    assert!(shown.contains("32 times its size"), "says why: {shown}");
}

#[test]
fn a_stream_that_unpacks_past_the_bound_across_entries_is_refused() {
    // Many listed files, each under the bound alone, together over it.
    let names: Vec<String> = (0..40).map(|i| format!("f{i}")).collect();
    let sha = hex(&vec![0u8; 1 << 20]);
    let listed: Vec<(&str, &str)> = names.iter().map(|n| (n.as_str(), sha.as_str())).collect();
    let m = manifest(&listed);
    let bytes = gzip_tar(&m, |w| {
        for n in &names {
            w.write_all(header(n, tar::EntryType::Regular, 1 << 20).as_bytes())
                .unwrap();
            w.write_all(&vec![0u8; 1 << 20]).unwrap();
        }
        w.write_all(&[0u8; 1024]).unwrap();
    });
    let (dir, r) = install(&bytes);
    let shown = assert_refused_leaving_nothing(dir.path(), r);
    assert!(shown.contains("gzip bomb"), "says why: {shown}");
}

#[test]
fn a_gnu_long_name_of_megabytes_is_refused_as_a_bomb() {
    // tar keeps a long name in memory whole: the bound keeps it small.
    let m = manifest(&[]);
    let long = 16u64 << 20;
    let bytes = gzip_tar(&m, |w| {
        w.write_all(header("././@LongLink", tar::EntryType::GNULongName, long).as_bytes())
            .unwrap();
        let chunk = vec![b'a'; 1 << 20];
        for _ in 0..16 {
            w.write_all(&chunk).unwrap();
        }
        w.write_all(header("x", tar::EntryType::Regular, 0).as_bytes())
            .unwrap();
        w.write_all(&[0u8; 1024]).unwrap();
    });
    let (dir, r) = install(&bytes);
    let shown = assert_refused_leaving_nothing(dir.path(), r);
    assert!(shown.contains("gzip bomb"), "says why: {shown}");
}

#[test]
fn an_entry_claiming_gigabytes_is_refused_naming_it() {
    let m = manifest(&[("big", &"0".repeat(64))]);
    let bytes = gzip_tar(&m, |w| {
        w.write_all(header("big", tar::EntryType::Regular, 8 << 30).as_bytes())
            .unwrap();
        w.write_all(&[b'x'; 512]).unwrap();
    });
    let (dir, r) = install(&bytes);
    let shown = assert_refused_leaving_nothing(dir.path(), r);
    assert!(
        shown.contains("\"big\"") && shown.contains("8589934592 bytes"),
        "{shown}"
    );
}

#[test]
fn the_bound_is_far_above_what_a_real_bundle_unpacks_to() {
    assert_eq!(bundle::max_unpacked(0), 1 << 20);
    assert_eq!(
        bundle::max_unpacked(300 << 20),
        (300u64 << 20) * 32 + (1 << 20)
    );
    assert_eq!(bundle::max_unpacked(u64::MAX), u64::MAX);
}
