//! Driver bundles: what is accepted, what is refused (and that a refused
//! bundle leaves nothing installed), and the current/previous links.

use std::fs;
use std::path::{Path, PathBuf};

use hostlib::HostRoot;
use kmod::bundle::{self, BundleError, Flavour, MANIFEST};
use sha2::{Digest, Sha256};

const KERNEL: &str = "6.1.0-27-amd64";

fn hex(b: &[u8]) -> String {
    Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

struct Raw<'a> {
    name: &'a str,
    kind: tar::EntryType,
    data: &'a [u8],
    link: Option<&'a str>,
}

fn file<'a>(name: &'a str, data: &'a [u8]) -> Raw<'a> {
    Raw {
        name,
        kind: tar::EntryType::Regular,
        data,
        link: None,
    }
}

/// A gzip'd tar with exactly these entries, names written as given (so
/// `..` and absolute paths can be made).
fn raw_bundle(entries: &[Raw<'_>]) -> Vec<u8> {
    let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    let mut t = tar::Builder::new(gz);
    for e in entries {
        let mut h = tar::Header::new_old();
        let name = e.name.as_bytes();
        h.as_old_mut().name[..name.len()].copy_from_slice(name);
        if let Some(l) = e.link {
            h.as_old_mut().linkname[..l.len()].copy_from_slice(l.as_bytes());
        }
        h.set_entry_type(e.kind);
        h.set_mode(0o4755);
        h.set_size(e.data.len() as u64);
        h.set_cksum();
        t.append(&h, e.data).unwrap();
    }
    t.into_inner().unwrap().finish().unwrap()
}

fn manifest(version: &str, files: &[(&str, &[u8])]) -> Vec<u8> {
    let files: serde_json::Map<String, serde_json::Value> = files
        .iter()
        .map(|(n, b)| (n.to_string(), serde_json::json!({ "sha256": hex(b) })))
        .collect();
    serde_json::to_vec(&serde_json::json!({
        "format": 1,
        "driverVersion": version,
        "kernels": [KERNEL],
        "flavours": ["open"],
        "files": files,
    }))
    .unwrap()
}

struct Env {
    _dir: tempfile::TempDir,
    host: HostRoot,
    out: PathBuf,
}

fn env() -> Env {
    let dir = tempfile::tempdir().unwrap();
    let host = HostRoot::new(dir.path().join("host")).unwrap_or_else(|_| {
        fs::create_dir_all(dir.path().join("host")).unwrap();
        HostRoot::new(dir.path().join("host")).unwrap()
    });
    let out = dir.path().join("bundles");
    fs::create_dir_all(&out).unwrap();
    Env {
        _dir: dir,
        host,
        out,
    }
}

impl Env {
    fn write(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let p = self.out.join(name);
        fs::write(&p, bytes).unwrap();
        fs::write(
            bundle::sidecar_path(&p),
            format!("{}  {name}\n", hex(bytes)),
        )
        .unwrap();
        p
    }

    fn install(&self, p: &Path) -> Result<bundle::Installed, BundleError> {
        let (sum, from) = bundle::expected_sha256(p, None)?;
        bundle::install(&self.host, p, (&sum, &from), KERNEL, Box::new(|_| {}))
    }

    /// Names under the drivers directory (hidden ones included).
    fn drivers(&self) -> Vec<String> {
        let Ok(rd) = fs::read_dir(self.host.resolve(bundle::DRIVERS_DIR).unwrap()) else {
            return Vec::new();
        };
        let mut v: Vec<String> = rd
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }
}

fn good(version: &str) -> Vec<u8> {
    let mut out = Vec::new();
    bundle::build(
        &mut out,
        version,
        &[KERNEL],
        &[Flavour::Open],
        &[
            (
                format!("modules/{KERNEL}/open/nvidia.ko"),
                b"nvidia module bytes".to_vec(),
                0o644,
            ),
            (
                format!("modules/{KERNEL}/open/nvidia-uvm.ko"),
                b"uvm".to_vec(),
                0o644,
            ),
            ("bin/nvidia-smi".into(), b"#!/bin/sh\n".to_vec(), 0o4755),
        ],
    )
    .unwrap();
    out
}

#[test]
fn a_good_bundle_is_unpacked_switched_and_listed() {
    let e = env();
    let p = e.write("a.tar.gz", &good("550.127.08"));
    let got = e.install(&p).unwrap();
    assert!(got.unpacked);
    assert_eq!(got.files, 3);
    assert_eq!(
        got.dir,
        format!("/var/lib/gpu-agent/drivers/550.127.08-{KERNEL}")
    );
    let dir = e.host.resolve(&got.dir).unwrap();
    assert_eq!(
        fs::read(dir.join(format!("modules/{KERNEL}/open/nvidia.ko"))).unwrap(),
        b"nvidia module bytes"
    );
    // setuid never survives unpacking.
    use std::os::unix::fs::PermissionsExt;
    let mode = fs::metadata(dir.join("bin/nvidia-smi"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o7777, 0o755);
    assert!(dir.join(MANIFEST).exists());
    // Unpacked, not yet current.
    assert_eq!(bundle::current(&e.host).unwrap(), None);
    let name = got.manifest.dir_name(KERNEL);
    assert_eq!(bundle::switch(&e.host, &name).unwrap(), None);
    assert_eq!(
        bundle::current(&e.host).unwrap().as_deref(),
        Some(name.as_str())
    );
    // The same bundle again: recognised, nothing unpacked.
    assert!(!e.install(&p).unwrap().unpacked);

    // A second version: current/previous swap, rollback, prune.
    let p2 = e.write("b.tar.gz", &good("560.35.03"));
    let b = e.install(&p2).unwrap().manifest.dir_name(KERNEL);
    assert_eq!(
        bundle::switch(&e.host, &b).unwrap().as_deref(),
        Some(name.as_str())
    );
    let list = bundle::list(&e.host).unwrap();
    assert_eq!(list.len(), 2);
    assert!(list.iter().any(|x| x.name == b && x.current));
    assert!(list.iter().any(|x| x.name == name && x.previous));
    assert_eq!(bundle::rollback(&e.host).unwrap(), name);
    assert_eq!(
        bundle::current(&e.host).unwrap().as_deref(),
        Some(name.as_str())
    );
    assert_eq!(
        bundle::previous(&e.host).unwrap().as_deref(),
        Some(b.as_str())
    );
    let p3 = e.write("c.tar.gz", &good("570.86.10"));
    let c = e.install(&p3).unwrap().manifest.dir_name(KERNEL);
    bundle::switch(&e.host, &c).unwrap();
    // b is neither current nor previous now.
    assert_eq!(bundle::prune(&e.host).unwrap(), vec![b.clone()]);
    // Remove: never the current one; the previous one takes its link along.
    let err = bundle::remove(&e.host, &c).unwrap_err().to_string();
    assert!(
        err.ends_with("the current driver; upgrade or roll back first"),
        "{err}"
    );
    assert_eq!(
        bundle::previous(&e.host).unwrap().as_deref(),
        Some(name.as_str())
    );
    bundle::remove(&e.host, &name).unwrap();
    assert_eq!(bundle::previous(&e.host).unwrap(), None);
    assert_eq!(e.drivers(), vec![c.clone(), "current".to_string()]);
    let err = bundle::remove(&e.host, "nope").unwrap_err().to_string();
    assert!(err.contains("not an unpacked driver"), "{err}");
    // set_links puts both links back as they were.
    let a = e.install(&p).unwrap().manifest.dir_name(KERNEL);
    assert_eq!(a, name);
    bundle::set_links(&e.host, &c, Some(&name)).unwrap();
    assert_eq!(
        bundle::previous(&e.host).unwrap().as_deref(),
        Some(name.as_str())
    );
    bundle::set_links(&e.host, &name, None).unwrap();
    assert_eq!(
        bundle::current(&e.host).unwrap().as_deref(),
        Some(name.as_str())
    );
    assert_eq!(bundle::previous(&e.host).unwrap(), None);
    assert_eq!(
        bundle::module_dir(&name, KERNEL, Flavour::Open),
        format!("/var/lib/gpu-agent/drivers/550.127.08-{KERNEL}/modules/{KERNEL}/open")
    );
}

#[test]
fn a_wrong_checksum_unpacks_nothing() {
    let e = env();
    let p = e.write("a.tar.gz", &good("550.127.08"));
    let zero = "0".repeat(64);
    let err =
        bundle::install(&e.host, &p, (&zero, "the policy"), KERNEL, Box::new(|_| {})).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("a.tar.gz: sha256 is "), "{msg}");
    assert!(
        msg.contains(&format!(
            "expected {zero} (from the policy); nothing was unpacked"
        )),
        "{msg}"
    );
    assert!(e.drivers().is_empty(), "{:?}", e.drivers());
    // No sidecar and no sum given: said, not guessed.
    fs::remove_file(bundle::sidecar_path(&p)).unwrap();
    let err = bundle::expected_sha256(&p, None).unwrap_err().to_string();
    assert!(err.contains("no sha256 to check it against"), "{err}");
    assert!(err.contains("a.tar.gz.sha256"), "{err}");
    // A sidecar that is not a sum.
    fs::write(bundle::sidecar_path(&p), "not-a-sum  a.tar.gz\n").unwrap();
    let err = bundle::expected_sha256(&p, None).unwrap_err().to_string();
    assert!(err.contains("\"not-a-sum\" is not a sha256"), "{err}");
}

/// Each bad bundle is refused with a message naming the entry, and leaves
/// nothing installed (no version directory, no staging directory).
#[test]
fn unsafe_or_inconsistent_bundles_are_refused_and_leave_nothing() {
    let ko = b"module".as_slice();
    let m = manifest("550.127.08", &[("modules/x/nvidia.ko", ko)]);
    let m_empty = manifest("550.127.08", &[]);
    let m_lib = manifest("550.127.08", &[("lib/x", ko)]);
    let cases: Vec<(&str, Vec<Raw<'_>>, &str)> = vec![
        (
            "dotdot",
            vec![file(MANIFEST, &m_empty), file("../evil", ko)],
            "entry \"../evil\": path climbs out with `..`",
        ),
        (
            "absolute",
            vec![file(MANIFEST, &m_empty), file("/etc/evil", ko)],
            "entry \"/etc/evil\": absolute path",
        ),
        (
            "link out",
            vec![
                file(MANIFEST, &m_empty),
                Raw {
                    name: "lib/escape",
                    kind: tar::EntryType::Symlink,
                    data: b"",
                    link: Some("../../etc"),
                },
            ],
            "entry \"lib/escape\": symbolic link to ../../etc points out of the bundle",
        ),
        (
            "absolute link",
            vec![
                file(MANIFEST, &m_empty),
                Raw {
                    name: "lib/abs",
                    kind: tar::EntryType::Symlink,
                    data: b"",
                    link: Some("/etc/shadow"),
                },
            ],
            "points out of the bundle",
        ),
        (
            "write through a link",
            vec![
                file(MANIFEST, &m_lib),
                Raw {
                    name: "lib",
                    kind: tar::EntryType::Symlink,
                    data: b"",
                    link: Some("bin"),
                },
                file("lib/x", ko),
            ],
            "entry \"lib/x\": lies under the symbolic link \"lib\"",
        ),
        (
            "hard link",
            vec![
                file(MANIFEST, &m_empty),
                Raw {
                    name: "hl",
                    kind: tar::EntryType::Link,
                    data: b"",
                    link: Some("gpu-agent-bundle.json"),
                },
            ],
            "entry \"hl\": hard links are not allowed",
        ),
        (
            "device",
            vec![
                file(MANIFEST, &m_empty),
                Raw {
                    name: "dev/nvidia0",
                    kind: tar::EntryType::Char,
                    data: b"",
                    link: None,
                },
            ],
            "entry \"dev/nvidia0\": device files are not allowed",
        ),
        (
            "duplicate",
            vec![
                file(MANIFEST, &m),
                file("modules/x/nvidia.ko", ko),
                file("./modules/x/nvidia.ko", ko),
            ],
            "entry \"./modules/x/nvidia.ko\": appears twice",
        ),
        (
            "unlisted",
            vec![file(MANIFEST, &m), file("modules/x/nvidia.ko", ko), file("extra", ko)],
            "entry \"extra\": not listed in the manifest",
        ),
        (
            "tampered",
            vec![file(MANIFEST, &m), file("modules/x/nvidia.ko", b"other bytes")],
            "entry \"modules/x/nvidia.ko\": sha256 is ",
        ),
        (
            "missing file",
            vec![file(MANIFEST, &m)],
            "lists \"modules/x/nvidia.ko\", which the bundle does not carry",
        ),
        (
            "manifest not first",
            vec![file("modules/x/nvidia.ko", ko), file(MANIFEST, &m)],
            "must be the first entry, found \"modules/x/nvidia.ko\"",
        ),
        (
            "manifest typo",
            vec![file(
                MANIFEST,
                br#"{"format":1,"driverVersion":"550.127.08","kernel":["6.1.0-27-amd64"],"flavours":["open"],"files":{}}"#,
            )],
            "unknown field `kernel`",
        ),
        (
            "bad version",
            vec![file(
                MANIFEST,
                br#"{"format":1,"driverVersion":"latest","kernels":["6.1.0-27-amd64"],"flavours":["open"],"files":{}}"#,
            )],
            "driverVersion: \"latest\" is not a driver version",
        ),
        (
            "other kernel",
            vec![file(
                MANIFEST,
                br#"{"format":1,"driverVersion":"550.127.08","kernels":["5.15.0-1-aws"],"flavours":["open"],"files":{}}"#,
            )],
            "built for kernel(s) 5.15.0-1-aws, the running kernel is 6.1.0-27-amd64",
        ),
    ];
    for (what, entries, want) in cases {
        let e = env();
        let p = e.write("bad.tar.gz", &raw_bundle(&entries));
        let err = e.install(&p).expect_err(what).to_string();
        assert!(err.contains(want), "{what}: {err}");
        assert!(
            err.contains("bad.tar.gz"),
            "{what}: names the bundle: {err}"
        );
        let left: Vec<String> = e.drivers().into_iter().filter(|n| !n.is_empty()).collect();
        assert!(left.is_empty(), "{what}: left {left:?}");
    }
}

#[test]
fn a_truncated_bundle_is_a_read_error_and_leaves_nothing() {
    let e = env();
    let mut bytes = good("550.127.08");
    bytes.truncate(bytes.len() / 2);
    let p = e.write("cut.tar.gz", &bytes);
    let err = e.install(&p).unwrap_err().to_string();
    assert!(err.contains("cut.tar.gz"), "{err}");
    assert!(e.drivers().is_empty(), "{:?}", e.drivers());
}
