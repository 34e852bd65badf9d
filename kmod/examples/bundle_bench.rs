//! Bundle verify + unpack throughput against `sha256sum` + `tar xzf` of the
//! same file on the same machine (issue 5's target: at least 0.8x).
//!
//! `cargo run --release -p kmod --example bundle_bench [-- <MiB>]`
//!
//! The bundle holds driver-like files (default 192 MiB in all: a big
//! `nvidia.ko`-sized file, smaller modules and libraries) whose bytes mix
//! machine code-like noise with repeated tables, so gzip gets roughly the
//! ratio it gets on a real driver. Each side runs 5 times into a fresh
//! directory; the best time of each is compared.

use std::process::Command;
use std::time::{Duration, Instant};

use hostlib::HostRoot;
use kmod::bundle::{self, Flavour};

const KERNEL: &str = "6.1.0-bench-amd64";

/// Deterministic bytes: runs of xorshift noise between repeated records.
fn content(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        for _ in 0..64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            out.extend_from_slice(&x.to_le_bytes()[..6]);
        }
        out.extend_from_slice(b"NVRM: symbol table entry 0000 nvidia_gpu_ops rm_ioctl\0\0\0\0");
        out.extend_from_slice(&[0u8; 200]);
    }
    out.truncate(len);
    out
}

fn best(runs: &[Duration]) -> Duration {
    *runs.iter().min().unwrap()
}

fn main() {
    let mib: usize = std::env::args()
        .nth(1)
        .map(|a| a.parse().expect("size in MiB"))
        .unwrap_or(192);
    let work = tempfile::tempdir().unwrap();
    let sizes = [
        ("nvidia.ko", mib * 55 / 100),
        ("nvidia-uvm.ko", mib * 15 / 100),
        ("nvidia-modeset.ko", mib * 5 / 100),
        ("libcuda.so.550.127.08", mib * 20 / 100),
        ("nvidia-smi", mib * 5 / 100),
    ];
    let files: Vec<(String, Vec<u8>, u32)> = sizes
        .iter()
        .enumerate()
        .map(|(i, (n, m))| {
            let path = if n.ends_with(".ko") {
                format!("modules/{KERNEL}/open/{n}")
            } else {
                format!("lib/{n}")
            };
            (path, content(m << 20, i as u64 + 7), 0o644)
        })
        .collect();
    let total: usize = files.iter().map(|f| f.1.len()).sum();
    let bundle_path = work.path().join("driver.tar.gz");
    let mut f = std::fs::File::create(&bundle_path).unwrap();
    bundle::build(&mut f, "550.127.08", &[KERNEL], &[Flavour::Open], &files).unwrap();
    drop(f);
    let packed = std::fs::metadata(&bundle_path).unwrap().len();
    let sum = bundle::sha256_file(&bundle_path, &mut |_| {}).unwrap();
    println!(
        "bundle: {} files, {:.0} MiB unpacked, {:.0} MiB packed",
        files.len() + 1,
        total as f64 / 1048576.0,
        packed as f64 / 1048576.0
    );

    let mut ours = Vec::new();
    let mut theirs = Vec::new();
    for i in 0..5 {
        let host = work.path().join(format!("host{i}"));
        std::fs::create_dir_all(&host).unwrap();
        let root = HostRoot::new(&host).unwrap();
        let t = Instant::now();
        let got = bundle::install(
            &root,
            &bundle_path,
            (&sum, "bench"),
            KERNEL,
            Box::new(|_| {}),
        )
        .unwrap();
        ours.push(t.elapsed());
        assert!(got.unpacked && got.files == files.len());
        std::fs::remove_dir_all(&host).unwrap();

        let dest = work.path().join(format!("tar{i}"));
        std::fs::create_dir_all(&dest).unwrap();
        let t = Instant::now();
        run(Command::new("sha256sum").arg(&bundle_path));
        run(Command::new("tar")
            .arg("xzf")
            .arg(&bundle_path)
            .arg("-C")
            .arg(&dest));
        // tar leaves the data in the page cache; ours fsyncs every file:
        // sync makes the two pipelines comparable.
        run(&mut Command::new("sync"));
        theirs.push(t.elapsed());
        std::fs::remove_dir_all(&dest).unwrap();
    }
    let (o, t) = (best(&ours), best(&theirs));
    let mbps = |d: Duration| packed as f64 / 1048576.0 / d.as_secs_f64();
    println!(
        "gpu-agent verify + unpack (fsync'd): best {:.3} s ({:.0} MiB/s of bundle)",
        o.as_secs_f64(),
        mbps(o)
    );
    println!(
        "sha256sum + tar xzf + sync:         best {:.3} s ({:.0} MiB/s of bundle)",
        t.as_secs_f64(),
        mbps(t)
    );
    println!(
        "ratio (their time / ours): {:.2}x (target >= 0.8x)",
        t.as_secs_f64() / o.as_secs_f64()
    );
}

fn run(c: &mut Command) {
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "{c:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
