//! The container image (scripts/image, packaging/image/build.py) against
//! peers we did not write.
//!
//! - `build_py_*`: the builder, run on busybox-static (any ELF whose needs
//!   the image meets serves): the same bytes twice, a layer GNU tar lists as
//!   we mean it (the binaries and the glibc runtime from this machine's
//!   libc6 and libgcc-s1, with their versions and copyright files), digests
//!   that match, skopeo (Debian's, containers/image) reading and copying the
//!   archive; a binary needing a library or a loader the image lacks is
//!   refused, naming the binary and what is missing.
//! - `containerd_runs_the_image` (root: runc): the image scripts/image built
//!   (`target/image/gpu-agent-<version>.oci.tar`; this test does not build
//!   it and fails, saying so, when it is missing) imported by a real
//!   containerd 2.x of our own (Debian sid's, scripts/fetch-containerd2) with
//!   `ctr images import`, and run with Debian's runc: `gpu-agent --host-root
//!   /host inventory` over a host fixture bound read-only at `/host` gives
//!   what the binary gives run directly on the fixture, with and without a
//!   libnvidia-ml on the host (with one, the fake at the host's
//!   `/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1`, found by the default
//!   lookup and loaded by the image's glibc: the NVML backend answers); the
//!   image's own loader resolves every library gpu-agent and the fake need
//!   (`ld.so --list`); `gpu-controller --help` runs as uid 65532 on a
//!   read-only root, as the Helm chart runs it.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use sha2::{Digest, Sha256};

const REF_PREFIX: &str = "ghcr.io/gpu-agent/gpu-agent";
const RUNC: &str = "/usr/sbin/runc";
const NAMESPACE: &str = "gpu-agent-image-test";

fn reference() -> String {
    format!("{REF_PREFIX}:{}", env!("CARGO_PKG_VERSION"))
}

fn builder() -> PathBuf {
    repo().join("packaging/image/build.py")
}

fn sha256(bytes: &[u8]) -> String {
    let hex: String = Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("sha256:{hex}")
}

/// The glibc runtime build.py puts in the image: (path in the image, the
/// file on this machine it is taken from).
const RUNTIME: &[(&str, &str)] = &[
    (
        "lib/x86_64-linux-gnu/ld-linux-x86-64.so.2",
        "/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2",
    ),
    (
        "lib/x86_64-linux-gnu/libc.so.6",
        "/lib/x86_64-linux-gnu/libc.so.6",
    ),
    (
        "lib/x86_64-linux-gnu/libdl.so.2",
        "/lib/x86_64-linux-gnu/libdl.so.2",
    ),
    (
        "lib/x86_64-linux-gnu/libgcc_s.so.1",
        "/lib/x86_64-linux-gnu/libgcc_s.so.1",
    ),
    (
        "lib/x86_64-linux-gnu/libm.so.6",
        "/lib/x86_64-linux-gnu/libm.so.6",
    ),
    (
        "lib/x86_64-linux-gnu/libpthread.so.0",
        "/lib/x86_64-linux-gnu/libpthread.so.0",
    ),
    (
        "lib/x86_64-linux-gnu/librt.so.1",
        "/lib/x86_64-linux-gnu/librt.so.1",
    ),
];

/// `dpkg-query`'s version of an installed package.
fn package_version(package: &str) -> String {
    let (code, out, err) =
        run(Command::new("dpkg-query").args(["-W", "-f", "${Version}", package]));
    assert_eq!(code, 0, "dpkg-query {package}: {err}");
    out
}

/// Debian's busybox-static: a static ELF to build a test image from.
fn static_elf() -> PathBuf {
    for p in ["/usr/bin/busybox", "/bin/busybox"] {
        if let Ok(out) = Command::new("file").arg("-L").arg(p).output()
            && String::from_utf8_lossy(&out.stdout).contains("statically linked")
        {
            return PathBuf::from(p);
        }
    }
    panic!("no static busybox: install busybox-static (scripts/test does)");
}

/// `build.py` with `agent` and `controller` into `out`: (exit code, stdout, stderr).
fn build(agent: &Path, controller: &Path, out: &Path) -> (i32, String, String) {
    run(Command::new("python3")
        .arg(builder())
        .arg("--agent")
        .arg(agent)
        .arg("--controller")
        .arg(controller)
        .args(["--version", env!("CARGO_PKG_VERSION"), "--ref"])
        .arg(reference())
        .arg("--out")
        .arg(out)
        .env_remove("SOURCE_DATE_EPOCH"))
}

fn archive_in(out: &Path) -> PathBuf {
    out.join(format!("gpu-agent-{}.oci.tar", env!("CARGO_PKG_VERSION")))
}

fn blob(layout: &Path, digest: &str) -> Vec<u8> {
    let hex = digest.strip_prefix("sha256:").unwrap();
    let bytes = fs::read(layout.join("blobs/sha256").join(hex)).unwrap();
    assert_eq!(
        sha256(&bytes),
        digest,
        "blob {hex} does not hash to its name"
    );
    bytes
}

fn skopeo(args: &[&str]) -> String {
    let out = Command::new("skopeo")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("skopeo: {e} (install Debian's skopeo; scripts/test does)"));
    assert!(
        out.status.success(),
        "skopeo {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn build_py_writes_the_same_image_twice_as_peers_read_it() {
    let elf = static_elf();
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    let (code, facts, err) = build(&elf, &elf, a.path());
    assert_eq!(code, 0, "{err}");
    let facts = json(&facts);
    let (code, _, err) = build(&elf, &elf, b.path());
    assert_eq!(code, 0, "{err}");
    let archive = fs::read(archive_in(a.path())).unwrap();
    assert!(
        archive == fs::read(archive_in(b.path())).unwrap(),
        "two builds of the same inputs differ"
    );
    assert_eq!(facts["archive_bytes"], archive.len());

    // The layout, every blob checked against its digest.
    let layout = a.path().join("oci");
    assert_eq!(
        json(&fs::read_to_string(layout.join("oci-layout")).unwrap()),
        serde_json::json!({"imageLayoutVersion": "1.0.0"})
    );
    let index = json(&fs::read_to_string(layout.join("index.json")).unwrap());
    let desc = &index["manifests"][0];
    assert_eq!(desc["annotations"]["io.containerd.image.name"], reference());
    assert_eq!(
        desc["annotations"]["org.opencontainers.image.ref.name"],
        reference()
    );
    let manifest_bytes = blob(&layout, desc["digest"].as_str().unwrap());
    assert_eq!(desc["size"], manifest_bytes.len());
    let manifest = json(std::str::from_utf8(&manifest_bytes).unwrap());
    let config = json(
        std::str::from_utf8(&blob(
            &layout,
            manifest["config"]["digest"].as_str().unwrap(),
        ))
        .unwrap(),
    );
    assert_eq!(config["architecture"], "amd64");
    assert_eq!(config["os"], "linux");
    assert_eq!(
        config["config"]["Entrypoint"],
        serde_json::json!(["/usr/bin/gpu-agent"])
    );
    let layer_desc = &manifest["layers"][0];
    assert_eq!(
        layer_desc["mediaType"],
        "application/vnd.oci.image.layer.v1.tar+gzip"
    );
    let layer_path = layout
        .join("blobs/sha256")
        .join(&layer_desc["digest"].as_str().unwrap()[7..]);
    blob(&layout, layer_desc["digest"].as_str().unwrap());

    // The diff_id is the digest of the layer as gzip(1) unpacks it.
    let gunzip = Command::new("gzip")
        .arg("-dc")
        .arg(&layer_path)
        .output()
        .unwrap();
    assert!(gunzip.status.success());
    assert_eq!(
        config["rootfs"]["diff_ids"],
        serde_json::json!([sha256(&gunzip.stdout)])
    );

    // What GNU tar lists in the layer: owners 0/0, modes, the epoch.
    let list = Command::new("tar")
        .args(["--numeric-owner", "--full-time", "-tvzf"])
        .arg(&layer_path)
        .env("TZ", "UTC")
        .output()
        .unwrap();
    assert!(list.status.success());
    let listing: Vec<Vec<String>> = String::from_utf8(list.stdout)
        .unwrap()
        .lines()
        .map(|l| l.split_whitespace().map(str::to_string).collect())
        .collect();
    let size = |p: &str| fs::metadata(p).unwrap().len().to_string();
    let elf_size = size(elf.to_str().unwrap());
    let dir = |p: &'static str| ("drwxr-xr-x".to_string(), "0".to_string(), p.to_string());
    let file = |mode: &str, size: String, p: &str| (mode.to_string(), size, p.to_string());
    let mut expected = vec![dir("lib/"), dir("lib/x86_64-linux-gnu/")];
    expected.extend(
        RUNTIME
            .iter()
            .map(|(image, host)| file("-rwxr-xr-x", size(host), image)),
    );
    expected.extend([
        dir("lib64/"),
        file("lrwxrwxrwx", "0".into(), "lib64/ld-linux-x86-64.so.2"),
        file("drwxrwxrwt", "0".into(), "tmp/"),
        dir("usr/"),
        dir("usr/bin/"),
        file("-rwxr-xr-x", elf_size.clone(), "usr/bin/gpu-agent"),
        file("-rwxr-xr-x", elf_size, "usr/bin/gpu-controller"),
        dir("usr/share/"),
        dir("usr/share/doc/"),
        dir("usr/share/doc/gpu-agent/"),
        file(
            "-rw-r--r--",
            // Its contents are checked below.
            listing
                .iter()
                .find(|e| e[5] == "usr/share/doc/gpu-agent/runtime-packages")
                .map_or_else(String::new, |e| e[2].clone()),
            "usr/share/doc/gpu-agent/runtime-packages",
        ),
        dir("usr/share/doc/libc6/"),
        file(
            "-rw-r--r--",
            size("/usr/share/doc/libc6/copyright"),
            "usr/share/doc/libc6/copyright",
        ),
        dir("usr/share/doc/libgcc-s1/"),
        file(
            "-rw-r--r--",
            size("/usr/share/doc/libgcc-s1/copyright"),
            "usr/share/doc/libgcc-s1/copyright",
        ),
    ]);
    assert_eq!(listing.len(), expected.len(), "{listing:#?}");
    for (entry, (mode, size, path)) in listing.iter().zip(&expected) {
        assert_eq!(
            entry[..6],
            [mode, "0/0", size, "1970-01-01", "00:00:00", path],
            "{listing:#?}"
        );
    }
    let loader = listing
        .iter()
        .find(|e| e[5] == "lib64/ld-linux-x86-64.so.2")
        .unwrap();
    assert_eq!(
        loader[6..],
        ["->", "/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"],
        "{loader:?}"
    );

    // The packages the runtime came from, with this machine's versions, in
    // the image (with their copyright files, checked by size above) and in
    // build.py's facts.
    let unpack = tempfile::tempdir().unwrap();
    let status = Command::new("tar")
        .arg("-xzf")
        .arg(&layer_path)
        .arg("-C")
        .arg(unpack.path())
        .status()
        .unwrap();
    assert!(status.success());
    let (libc6, libgcc) = (package_version("libc6"), package_version("libgcc-s1"));
    let recorded = fs::read_to_string(
        unpack
            .path()
            .join("usr/share/doc/gpu-agent/runtime-packages"),
    )
    .unwrap();
    assert!(
        recorded.contains(&format!("\nlibc6 {libc6} amd64 (source glibc {libc6})\n")),
        "{recorded}"
    );
    assert!(
        recorded.contains(&format!("\nlibgcc-s1 {libgcc} amd64 (source gcc-")),
        "{recorded}"
    );
    assert_eq!(facts["runtime_packages"][0]["package"], "libc6");
    assert_eq!(facts["runtime_packages"][0]["version"], libc6.as_str());
    assert_eq!(facts["runtime_packages"][1]["package"], "libgcc-s1");
    assert_eq!(facts["runtime_packages"][1]["version"], libgcc.as_str());
    for (image, host) in RUNTIME {
        assert!(
            fs::read(unpack.path().join(image)).unwrap() == fs::read(host).unwrap(),
            "{image} is not this machine's {host}"
        );
    }

    // skopeo reads the archive (the manifest we wrote, byte for byte) and
    // copies it out, checking every digest on the way.
    let spec = format!("oci-archive:{}", archive_in(a.path()).display());
    assert_eq!(
        skopeo(&["inspect", "--raw", &spec]).as_bytes(),
        &manifest_bytes[..]
    );
    let inspected = json(&skopeo(&["inspect", &spec]));
    assert_eq!(inspected["Digest"], desc["digest"]);
    assert_eq!(
        inspected["Layers"],
        serde_json::json!([layer_desc["digest"]])
    );
    let copy = tempfile::tempdir().unwrap();
    skopeo(&[
        "copy",
        "--quiet",
        &spec,
        &format!("oci:{}:copy", copy.path().display()),
    ]);
    let copied = copy
        .path()
        .join("blobs/sha256")
        .join(&layer_desc["digest"].as_str().unwrap()[7..]);
    assert!(copied.exists(), "skopeo's copy has no {}", copied.display());
}

/// The ELF's DT_NEEDED libraries, as binutils' readelf reads them.
fn needed(elf: &Path) -> Vec<String> {
    let (code, out, err) = run(Command::new("readelf").arg("-dW").arg(elf));
    assert_eq!(code, 0, "readelf -d {}: {err}", elf.display());
    out.lines()
        .filter(|l| l.contains("(NEEDED)"))
        .filter_map(|l| {
            Some(
                l.split_once("Shared library: [")?
                    .1
                    .trim_end_matches(']')
                    .to_string(),
            )
        })
        .collect()
}

#[test]
fn build_py_refuses_a_binary_whose_loader_or_library_the_image_lacks() {
    let out = tempfile::tempdir().unwrap();
    let have: Vec<&str> = RUNTIME
        .iter()
        .map(|(image, _)| image.rsplit('/').next().unwrap())
        .collect();

    // Debian's python3 needs libraries beyond glibc's (libz, libexpat): the
    // first of them that the image lacks is named, with the binary.
    let python = fs::canonicalize("/usr/bin/python3").unwrap();
    let missing = needed(&python)
        .into_iter()
        .find(|lib| !have.contains(&lib.as_str()))
        .expect("python3 needs only glibc's libraries: pick another binary");
    let (code, _, err) = build(&python, &static_elf(), out.path());
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains(&format!(
            "{}: needs {missing} (DT_NEEDED), which the image does not have",
            python.display()
        )),
        "{err}"
    );
    assert!(!archive_in(out.path()).exists());

    // The test build of gpu-agent (dynamic: glibc and libgcc_s, all in the
    // image) with its interpreter renamed to one the image does not have.
    let agent = fs::read(env!("CARGO_BIN_EXE_gpu-agent")).unwrap();
    assert!(
        needed(Path::new(env!("CARGO_BIN_EXE_gpu-agent")))
            .iter()
            .all(|lib| have.contains(&lib.as_str())),
        "gpu-agent needs a library the image lacks"
    );
    let interp = b"/lib64/ld-linux-x86-64.so.2\0";
    let at = agent
        .windows(interp.len())
        .position(|w| w == interp)
        .expect("gpu-agent has no PT_INTERP /lib64/ld-linux-x86-64.so.2");
    let mut renamed = agent;
    renamed[at + interp.len() - 2] = b'3';
    let odd = out.path().join("gpu-agent-odd-loader");
    fs::write(&odd, renamed).unwrap();
    let (code, _, err) = build(&odd, &static_elf(), out.path());
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains(&format!(
            "{}: its ELF interpreter (PT_INTERP) /lib64/ld-linux-x86-64.so.3 is not in the image",
            odd.display()
        )),
        "{err}"
    );
    assert!(!archive_in(out.path()).exists());

    let text = out.path().join("not-elf");
    fs::write(&text, "#!/bin/sh\n").unwrap();
    let (code, _, err) = build(&static_elf(), &text, out.path());
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains(&format!("{}: not an ELF executable", text.display())),
        "{err}"
    );
}

/// A containerd 2.x with no CRI (ctr runs the containers), on a socket, root
/// and state of its own. When dropped: tasks left by a failed case deleted,
/// the daemon stopped, the mounts under its dir lazily unmounted, and the
/// directories it made outside (the shims' socket dir, its namespace's
/// cgroup) removed when empty.
struct Containerd {
    dir: tempfile::TempDir,
    child: Child,
    socket: PathBuf,
    ctr: PathBuf,
    made: Vec<PathBuf>,
}

impl Containerd {
    fn start() -> Containerd {
        let bin = containerd_2();
        let bindir = bin.parent().unwrap().to_path_buf();
        let dir = tempfile::Builder::new()
            .prefix("gpu-agent-image-")
            .tempdir()
            .unwrap();
        let d = dir.path();
        fs::create_dir_all(d.join("opt")).unwrap();
        let config = format!(
            r#"version = 3
disabled_plugins = ['io.containerd.grpc.v1.cri', 'io.containerd.cri.v1.runtime', 'io.containerd.cri.v1.images', 'io.containerd.nri.v1.nri']

[plugins.'io.containerd.internal.v1.opt']
  path = '{d}/opt'
"#,
            d = d.display()
        );
        fs::write(d.join("config.toml"), config).unwrap();
        let socket = d.join("containerd.sock");
        let made = [
            "/run/containerd/s".into(),
            "/run/containerd".into(),
            Path::new("/sys/fs/cgroup").join(NAMESPACE),
        ]
        .into_iter()
        .filter(|p: &PathBuf| !p.exists())
        .collect();
        // The shim is found on PATH: containerd 2's own, next to it.
        let path = format!(
            "{}:{}",
            bindir.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let child = Command::new(&bin)
            .arg("--config")
            .arg(d.join("config.toml"))
            .arg("--address")
            .arg(&socket)
            .arg("--root")
            .arg(d.join("root"))
            .arg("--state")
            .arg(d.join("state"))
            .env("PATH", path)
            .stdout(Stdio::null())
            .stderr(fs::File::create(d.join("containerd.log")).unwrap())
            .spawn()
            .unwrap();
        let mut c = Containerd {
            dir,
            child,
            socket,
            ctr: bindir.join("ctr"),
            made,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !c.socket.exists() {
            if let Some(status) = c.child.try_wait().unwrap() {
                panic!("containerd exited ({status}):\n{}", c.log());
            }
            assert!(
                Instant::now() < deadline,
                "no socket after 30 s:\n{}",
                c.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        c
    }

    fn log(&self) -> String {
        fs::read_to_string(self.dir.path().join("containerd.log")).unwrap_or_default()
    }

    fn ctr_cmd(&self) -> Command {
        let mut c = Command::new(&self.ctr);
        c.arg("--address").arg(&self.socket).args(["-n", NAMESPACE]);
        c
    }

    /// `ctr <args>`: stdout, or a panic with ctr's and containerd's words.
    fn ctr(&self, args: &[&str]) -> String {
        let (code, out, err) = run(self.ctr_cmd().args(args));
        assert_eq!(code, 0, "ctr {args:?}: {out}{err}\n{}", self.log());
        out
    }

    /// `ctr run --rm` of the image with `opts` and `args`: (exit code,
    /// stdout, stderr).
    fn run_image(&self, id: &str, opts: &[&str], args: &[&str]) -> (i32, String, String) {
        run(self
            .ctr_cmd()
            .args(["run", "--rm", "--runc-binary", RUNC])
            .args(opts)
            .arg(reference())
            .arg(id)
            .args(args))
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        if let Ok(out) = self.ctr_cmd().args(["tasks", "ls", "-q"]).output() {
            for id in String::from_utf8_lossy(&out.stdout).lines() {
                let _ = self
                    .ctr_cmd()
                    .args(["tasks", "delete", "--force", id])
                    .output();
                let _ = self.ctr_cmd().args(["containers", "delete", id]).output();
            }
        }
        let _ = sigterm(&mut self.child);
        let info = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let mut mounts: Vec<PathBuf> = info
            .lines()
            .filter_map(|l| l.split(' ').nth(4))
            .map(PathBuf::from)
            .filter(|p| p.starts_with(self.dir.path()))
            .collect();
        mounts.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        for m in mounts {
            let _ = nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH);
        }
        for d in &self.made {
            let _ = fs::remove_dir(d);
        }
    }
}

/// The archive scripts/image wrote.
fn built_image() -> PathBuf {
    let archive = repo().join(format!(
        "target/image/gpu-agent-{}.oci.tar",
        env!("CARGO_PKG_VERSION")
    ));
    assert!(
        archive.exists(),
        "{} is missing: build the image with scripts/image (scripts/test does before this test)",
        archive.display()
    );
    archive
}

fn bind_ro(src: &Path, dst: &str) -> String {
    format!("type=bind,src={},dst={dst},options=rbind:ro", src.display())
}

#[test]
#[ignore = "needs root: containerd 2.x runs the image's containers with runc"]
fn containerd_runs_the_image() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "containerd and runc need root"
    );
    assert!(
        Path::new(RUNC).exists(),
        "{RUNC} is missing (Debian's runc)"
    );
    let archive = built_image();
    let c = Containerd::start();
    c.ctr(&["images", "import", archive.to_str().unwrap()]);
    let images = c.ctr(&["images", "ls", "-q"]);
    assert_eq!(images.lines().collect::<Vec<_>>(), [reference().as_str()]);

    // Without a command ctr runs the image's entrypoint, gpu-agent, which
    // wants a subcommand. (With one, ctr's command replaces the entrypoint:
    // the commands below name the binary, found on the image's PATH.)
    let (code, out, err) = c.run_image("entrypoint", &["--read-only"], &[]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains("Usage: gpu-agent"), "{out}{err}");

    // The inventory of the H100 fixture, as JSON and as a table, the same
    // from the image as from the binary run directly on the fixture.
    let fixture = host_fixture("h100-sxm-8");
    let host = bind_ro(&fixture, "/host");
    for (i, output) in ["json", "table"].into_iter().enumerate() {
        let (code, inside, err) = c.run_image(
            &format!("inventory-{i}"),
            &["--read-only", "--mount", &host],
            &[
                "gpu-agent",
                "--host-root",
                "/host",
                "inventory",
                "-o",
                output,
            ],
        );
        assert_eq!(
            code,
            0,
            "inventory -o {output} in the image: {err}\n{}",
            c.log()
        );
        let (code, direct, err) = run(at(&fixture).args(["inventory", "-o", output]));
        assert_eq!(code, 0, "{err}");
        assert_eq!(
            inside, direct,
            "inventory -o {output}: image and binary differ"
        );
        if output == "json" {
            let inv = json(&inside);
            let gpus = inv["gpus"].as_array().unwrap();
            assert_eq!(gpus.len(), 8, "{inv:#}");
            assert!(
                gpus.iter().all(|g| g["pci"]["address"]
                    .as_str()
                    .is_some_and(|a| a.starts_with("0000:"))
                    && g["pci"]["driver"] == "nvidia"),
                "{inv:#}"
            );
        }
    }

    // A host with a libnvidia-ml (the fake, in the host's multiarch library
    // directory, where the agent looks under --host-root when no --nvml-lib
    // is given): the agent in the image loads it with the image's glibc and
    // the NVML backend answers, the same as the binary run directly on the
    // same fixture.
    let with_nvml = copy_host_fixture("h100-sxm-8");
    let libdir = with_nvml.path().join("usr/lib/x86_64-linux-gnu");
    fs::create_dir_all(&libdir).unwrap();
    let (_lib_dir, fake) = fake_nvml();
    let fake = fs::canonicalize(&fake).unwrap();
    fs::copy(&fake, libdir.join("libnvidia-ml.so.1")).unwrap();
    let nvml_host = bind_ro(with_nvml.path(), "/host");
    let (code, inside, err) = c.run_image(
        "inventory-nvml",
        &[
            "--read-only",
            "--mount",
            &nvml_host,
            "--env",
            "FAKE_NVML_NODE=h100-sxm-8",
        ],
        &[
            "gpu-agent",
            "--host-root",
            "/host",
            "inventory",
            "-o",
            "json",
        ],
    );
    assert_eq!(
        code,
        0,
        "inventory with a host libnvidia-ml: {err}\n{}",
        c.log()
    );
    let inv = json(&inside);
    assert_eq!(
        inv["backend"],
        serde_json::json!({"name": "nvml", "driver_version": "550.127.08", "error": null}),
        "{inv:#}"
    );
    let gpus = inv["gpus"].as_array().unwrap();
    assert_eq!(gpus.len(), 8, "{inv:#}");
    assert!(
        gpus.iter().all(|g| g["model"] == "NVIDIA H100 80GB HBM3"
            && g["uuid"].as_str().is_some_and(|u| u.starts_with("GPU-"))
            && g["telemetry"]["temperature_c"].is_number()),
        "{inv:#}"
    );
    let (code, direct, err) = run(at(with_nvml.path())
        .args(["inventory", "-o", "json"])
        .env("FAKE_NVML_NODE", "h100-sxm-8"));
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        inv,
        json(&direct),
        "inventory with NVML: image and binary differ"
    );

    // The image's own loader finds every library gpu-agent and the host's
    // libnvidia-ml need (the stubs libpthread, libdl and librt included: the
    // real libnvidia-ml names them), all from the image, none missing.
    for elf in [
        "/usr/bin/gpu-agent",
        "/host/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
        "/lib/x86_64-linux-gnu/libpthread.so.0",
        "/lib/x86_64-linux-gnu/libdl.so.2",
        "/lib/x86_64-linux-gnu/librt.so.1",
    ] {
        let (code, out, err) = c.run_image(
            "loader-list",
            &["--read-only", "--mount", &nvml_host],
            &["/lib64/ld-linux-x86-64.so.2", "--list", elf],
        );
        assert_eq!(code, 0, "ld.so --list {elf}: {out}{err}");
        assert!(!out.contains("not found"), "ld.so --list {elf}:\n{out}");
        for line in out.lines().filter(|l| l.contains("=>")) {
            assert!(
                line.contains("=> /lib/x86_64-linux-gnu/"),
                "ld.so --list {elf}: a library from outside the image's runtime:\n{out}"
            );
        }
    }

    // The controller, as the Helm chart runs it: uid 65532, read-only root.
    let (code, out, err) = c.run_image(
        "controller",
        &["--read-only", "--user", "65532:65532"],
        &["gpu-controller", "--help"],
    );
    assert_eq!(code, 0, "gpu-controller --help: {out}{err}\n{}", c.log());
    assert!(out.contains("Usage: gpu-controller"), "{out}");

    assert_eq!(
        c.ctr(&["containers", "ls", "-q"]),
        "",
        "containers left behind"
    );
}
