//! A real kernel: Debian's kernel boots under QEMU with an initramfs holding
//! a static gpu-agent, busybox and bundles of our own test modules
//! (`tests/vm/modules`: a char device named `nvidia-frontend` with a
//! parameter, and modules depending on it). The guest (`tests/vm/init`) runs
//! `gpu-agent driver install|load|unload|upgrade|list` and prints what its
//! own /proc, /sys and /dev show; this test checks that.
//!
//! `scripts/vm-prepare` builds what the VM needs into `target/vm`;
//! `scripts/test` runs it and then this test (`--ignored`), or says why the
//! VM test is skipped.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn vm_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/vm")
}

/// Boots the VM with `accel`; the serial console's text, or `None` when it
/// did not reach the end marker within `limit`.
fn boot(accel: &str, limit: Duration) -> (Option<String>, Duration) {
    let dir = vm_dir();
    let kernel = std::fs::read_to_string(dir.join("kernel"))
        .expect("target/vm/kernel is missing: run scripts/vm-prepare first (scripts/test does)");
    let start = Instant::now();
    let mut child = Command::new("qemu-system-x86_64")
        .args(["-accel", accel, "-m", "512", "-smp", "1", "-nodefaults"])
        .args([
            "-display",
            "none",
            "-serial",
            "stdio",
            "-no-reboot",
            "-net",
            "none",
        ])
        .arg("-kernel")
        .arg(dir.join(format!("vmlinuz-{}", kernel.trim())))
        .arg("-initrd")
        .arg(dir.join("initramfs.cpio.gz"))
        .args(["-append", "console=ttyS0 panic=-1 quiet"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("qemu-system-x86_64 could not be started");
    let mut stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = stdout.read_to_end(&mut buf);
        buf
    });
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return (None, start.elapsed());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let took = start.elapsed();
    let text = String::from_utf8_lossy(&reader.join().unwrap()).replace('\r', "");
    let done = text.contains("=== end");
    if !done {
        let mut err = String::new();
        let _ = child.stderr.take().unwrap().read_to_string(&mut err);
        eprintln!("VM with {accel} ended early:\n{text}\n{err}");
    }
    (done.then_some(text), took)
}

/// The guest's output split at `=== name` lines; repeated names numbered
/// in order (`modules`, `modules#2`, …).
fn sections(text: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut name = String::from("preamble");
    let mut body = String::new();
    let mut seen: BTreeMap<String, u32> = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("=== ") {
            out.insert(std::mem::take(&mut name), std::mem::take(&mut body));
            let base = rest.split(' ').take(2).collect::<Vec<_>>().join(" ");
            let base = if base.starts_with("step ") {
                base
            } else {
                rest.split(' ').next().unwrap().to_string()
            };
            let n = seen.entry(base.clone()).or_default();
            *n += 1;
            name = if *n == 1 { base } else { format!("{base}#{n}") };
        } else {
            body.push_str(line);
            body.push('\n');
        }
    }
    out.insert(name, body);
    out
}

/// What follows `prefix` on the lines that start with it.
fn after<'a>(body: &'a str, prefix: &str) -> Vec<&'a str> {
    body.lines()
        .filter_map(|l| l.strip_prefix(prefix))
        .collect()
}

fn module_names(proc_modules: &str) -> Vec<&str> {
    proc_modules
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .collect()
}

#[test]
#[ignore = "boots a VM: run by scripts/test after scripts/vm-prepare"]
fn driver_commands_in_a_real_kernel() {
    // KVM only where it works (nested KVM can hang early in boot): a short
    // probe, then software emulation.
    let kvm = Path::new("/dev/kvm").exists();
    let (mut text, mut took) = (None, Duration::ZERO);
    let mut accel = "tcg";
    if kvm {
        (text, took) = boot("kvm", Duration::from_secs(20));
        if text.is_some() {
            accel = "kvm";
        } else {
            eprintln!("KVM did not boot the guest within 20 s; using TCG");
        }
    }
    if text.is_none() {
        (text, took) = boot("tcg", Duration::from_secs(240));
    }
    let text = text.expect("the VM did not reach the end of its script under TCG in 240 s");
    eprintln!(
        "VM ({accel}): boot to verdict {:.1} s\n{text}",
        took.as_secs_f64()
    );
    let s = sections(&text);
    let get = |k: &str| {
        s.get(k)
            .unwrap_or_else(|| panic!("no section {k:?} in the guest's output"))
            .as_str()
    };

    // Install: the bundle's sha256 (sidecar) checked, unpacked, made current.
    let install = get("step install");
    assert!(install.contains("unpacked 3 file(s)"), "{install}");
    assert!(
        install.contains("550.127.08-") && install.contains("is now the current driver"),
        "{install}"
    );
    assert!(install.ends_with("rc=0\n"), "{install}");

    // Load: in dependency order, with the policy's parameter.
    let load = get("step load");
    assert_eq!(
        after(load, "loaded "),
        ["nvidia (NVreg_TestLevel=7)", "nvidia_uvm", "nvidia_modeset"],
        "{load}"
    );
    assert!(load.ends_with("rc=0\n"), "{load}");
    let modules = get("modules");
    let mut names = module_names(modules);
    names.sort();
    assert_eq!(
        names,
        ["nvidia", "nvidia_modeset", "nvidia_uvm"],
        "{modules}"
    );
    let nvidia = modules.lines().find(|l| l.starts_with("nvidia ")).unwrap();
    assert!(
        nvidia.contains("nvidia_modeset,nvidia_uvm"),
        "nvidia is used by the other two: {nvidia}"
    );
    assert_eq!(get("param").trim(), "7");
    assert_eq!(get("holders").split_whitespace().count(), 2);
    // The kernel's load order (its own log).
    let dmesg = get("dmesg");
    let first: Vec<&str> = dmesg
        .lines()
        .filter_map(|l| l.split("gpu-agent-test: ").nth(1))
        .take(3)
        .collect();
    assert!(first[0].starts_with("nvidia 550.127.08 loaded"), "{dmesg}");
    assert!(first[1].starts_with("nvidia_uvm loaded"), "{dmesg}");
    assert!(first[2].starts_with("nvidia_modeset loaded"), "{dmesg}");

    // Majors from the guest's /proc/devices; nodes with them.
    let majors: BTreeMap<&str, u32> = get("devices")
        .lines()
        .filter_map(|l| {
            let (maj, name) = l.trim().split_once(' ')?;
            Some((name, maj.parse().ok()?))
        })
        .collect();
    let fe = majors["nvidia-frontend"];
    let uvm = majors["nvidia-uvm"];
    let expect_nodes = |body: &str| {
        let nodes: BTreeMap<&str, (u32, u32, &str)> = body
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                let (maj, min) = f[f.len() - 2].split_once(':')?;
                Some((
                    f[0],
                    (
                        u32::from_str_radix(maj, 16).ok()?,
                        u32::from_str_radix(min, 16).ok()?,
                        f[f.len() - 1],
                    ),
                ))
            })
            .collect();
        assert!(
            body.lines().all(|l| l.contains("character special file")),
            "{body}"
        );
        let want: BTreeMap<&str, (u32, u32, &str)> = [
            ("/dev/nvidiactl", (fe, 255, "666")),
            ("/dev/nvidia-modeset", (fe, 254, "666")),
            ("/dev/nvidia0", (fe, 0, "666")),
            ("/dev/nvidia-uvm", (uvm, 0, "666")),
            ("/dev/nvidia-uvm-tools", (uvm, 1, "666")),
        ]
        .into_iter()
        .collect();
        assert_eq!(nodes, want, "{body}");
    };
    expect_nodes(get("nodes"));
    let links: Vec<&str> = get("links").lines().collect();
    for (mm, target) in [
        (format!("{fe}:255"), "../nvidiactl"),
        (format!("{fe}:254"), "../nvidia-modeset"),
        (format!("{fe}:0"), "../nvidia0"),
        (format!("{uvm}:0"), "../nvidia-uvm"),
        (format!("{uvm}:1"), "../nvidia-uvm-tools"),
    ] {
        let line = format!("/dev/char/{mm} -> {target}");
        assert!(links.contains(&line.as_str()), "{line} in {links:?}");
    }

    // Loading again: nothing to do.
    let again = get("step load-again");
    assert_eq!(
        again
            .matches("already loaded with these parameters")
            .count(),
        3,
        "{again}"
    );
    assert!(again.contains("5 already right"), "{again}");

    // A process holding /dev/nvidia0: unload refuses, names it, unloads nothing.
    let busy = get("step busy");
    assert!(busy.contains("nvidia is in use"), "{busy}");
    assert!(
        busy.contains("sleep (pid ") && busy.contains("/dev/nvidia0"),
        "{busy}"
    );
    assert!(busy.ends_with("rc=1\n"), "{busy}");
    let mut still = module_names(get("step busy-modules"));
    still.sort();
    assert_eq!(still, ["nvidia", "nvidia_modeset", "nvidia_uvm"]);

    // Upgrade to 560: new version loaded, nodes remade, previous kept.
    let up = get("step upgrade");
    assert!(up.contains("upgraded to 560.35.03-"), "{up}");
    assert!(up.contains("previous 550.127.08-"), "{up}");
    assert!(get("version#2").contains(" 560.35.03 "));
    expect_nodes(get("nodes#2"));

    // A bundle whose modules are not the version it claims: rolled back.
    let bad = get("step bad-upgrade");
    assert!(bad.contains("upgrade to 999.1.1-"), "{bad}");
    assert!(
        bad.contains("the loaded driver says 550.127.08, the bundle is 999.1.1"),
        "{bad}"
    );
    assert!(bad.contains("rolled back to 560.35.03-"), "{bad}");
    assert!(bad.ends_with("rc=1\n"), "{bad}");
    assert!(get("version#3").contains(" 560.35.03 "));
    assert_eq!(module_names(get("modules#3")).len(), 3);
    let list = get("step list");
    let row = |name: &str| {
        list.lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("{name} in {list}"))
    };
    assert!(row("560.35.03-").trim_end().ends_with("current"), "{list}");
    assert!(
        row("550.127.08-").trim_end().ends_with("previous"),
        "{list}"
    );

    // Unload: reverse order, nothing left.
    let unload = get("step unload");
    assert_eq!(
        after(unload, "unloaded "),
        ["nvidia_modeset", "nvidia_uvm", "nvidia"],
        "{unload}"
    );
    assert_eq!(get("modules#4").trim(), "");
    let exits: Vec<&str> = dmesg
        .lines()
        .filter_map(|l| l.split("gpu-agent-test: ").nth(1))
        .filter(|l| l.ends_with("unloaded"))
        .take(3)
        .collect();
    assert_eq!(
        exits,
        [
            "nvidia_modeset unloaded",
            "nvidia_uvm unloaded",
            "nvidia unloaded"
        ],
        "{dmesg}"
    );
    let timing = get("step timing");
    assert!(!timing.contains("failed"), "{timing}");
}
