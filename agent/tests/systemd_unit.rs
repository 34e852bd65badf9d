//! gpu-agent's own unit and package under a real systemd as PID 1 (the
//! harness of agent/tests/common/systemd.rs): the .deb that `cargo deb -p
//! gpu-agent --locked` writes is installed into a booted Debian bookworm
//! root, started by its maintainer scripts, and shown to do what
//! systemd/gpu-agent.service promises: READY=1 and STATUS= (Type=notify),
//! journal fields, a reload by SIGHUP in the same process, a watchdog
//! restart of a hung agent; then `dpkg --purge` leaves the root as it was
//! before the package came, file for file.
//!
//! The node is simulated (GPU_AGENT_SIMULATE=a10g-1 in /etc/default/gpu-agent:
//! NVML and sysfs simulated, no device nodes made). The root has no
//! containerd, so the toolkit is off in the policy: with it on, the runtime
//! stage waits for a containerd ("no containerd on this host"), READY=1 is
//! never sent and `systemctl start` (and with it `dpkg -i`) waits up to
//! TimeoutStartSec. Installing Debian's containerd in the root would test the
//! runtime stage too, at the cost of a bigger root; that is left to the
//! sandbox-node tests.
//!
//! Ignored: needs root, debootstrap (scripts/systemd-root) and the .deb.
//!   cargo deb -p gpu-agent --locked && scripts/systemd-root &&
//!   cargo test --workspace --test systemd_unit -- --ignored --nocapture

mod common;

use common::systemd::{Booted, poll};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const UNIT: &str = "gpu-agent.service";

/// The package `cargo deb -p gpu-agent --locked` writes.
fn deb() -> PathBuf {
    let deb = common::repo().join(format!(
        "target/debian/gpu-agent_{}-1_amd64.deb",
        env!("CARGO_PKG_VERSION")
    ));
    assert!(
        deb.exists(),
        "{} is missing: run `cargo deb -p gpu-agent --locked` first",
        deb.display()
    );
    deb
}

/// The policy the test installs: every default but the toolkit (see the
/// module's comment: no containerd in the root).
const POLICY: &str = "# systemd_unit test: no containerd in this root, so the toolkit is off.\nspec:\n  toolkit:\n    enabled: false\n";

/// The service's environment: a simulated A10G node; debug for gpu-agent's
/// own events, so that the SIGHUP reconcile's "reconciled" event (a debug
/// event in the `reconcile` span, trigger=SIGHUP) reaches the journal.
const DEFAULT: &str =
    "# systemd_unit test\nGPU_AGENT_SIMULATE=a10g-1\nGPU_AGENT_LOG=info,gpu_agent=debug\n";

/// What the tree comparison leaves out, and why. Everything else in the
/// booted root (the overlay, and /run, a tmpfs) is compared: type, mode,
/// owner, and the content of files or the target of links.
const EXCLUDED: &[(&str, &str)] = &[
    ("/proc", "the kernel's"),
    ("/sys", "the kernel's"),
    ("/dev", "a tmpfs of the boot script's device nodes"),
    (
        "/tmp",
        "a tmpfs: the harness copies the .deb there; the unit has PrivateTmp=yes",
    ),
    (
        "/run/systemd",
        "systemd's runtime state (jobs, units, notify sockets) and the test's runtime drop-in",
    ),
    ("/var/log/journal", "the journal grows"),
    ("/var/lib/dpkg", "dpkg's database"),
    ("/var/log/dpkg.log", "dpkg's log"),
    ("/var/cache", "caches (ldconfig's, debconf's)"),
    (
        "/var/lib/systemd",
        "systemd's state (deb-systemd-helper's records, timestamps, random seed)",
    ),
];

/// One entry of the tree: `d 755 0:0`, `f 644 0:0 <sha256>`, `l 777 0:0 -> <target>`.
fn entry(path: &Path, meta: &std::fs::Metadata) -> String {
    use std::os::unix::fs::MetadataExt;
    let head = |t: &str| {
        format!(
            "{t} {:o} {}:{}",
            meta.mode() & 0o7777,
            meta.uid(),
            meta.gid()
        )
    };
    let ft = meta.file_type();
    if ft.is_symlink() {
        let target = std::fs::read_link(path).unwrap_or_default();
        format!("{} -> {}", head("l"), target.display())
    } else if ft.is_dir() {
        head("d")
    } else if ft.is_file() {
        let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let hex: String = Sha256::digest(&bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        format!("{} {hex}", head("f"))
    } else {
        // Sockets, FIFOs, device nodes: their type and mode.
        head("s")
    }
}

/// The booted root's tree as systemd sees it (through /proc/<pid>/root on
/// the host): path inside → [`entry`], without [`EXCLUDED`].
fn tree(b: &Booted) -> BTreeMap<String, String> {
    let root = PathBuf::from(format!("/proc/{}/root", b.pid));
    let mut out = BTreeMap::new();
    let mut todo = vec![String::from("/")];
    while let Some(dir) = todo.pop() {
        let real = root.join(dir.trim_start_matches('/'));
        let Ok(entries) = std::fs::read_dir(&real) else {
            continue;
        };
        for e in entries.flatten() {
            let inside = format!(
                "{}/{}",
                dir.trim_end_matches('/'),
                e.file_name().to_string_lossy()
            );
            if EXCLUDED.iter().any(|(x, _)| *x == inside) {
                continue;
            }
            let Ok(meta) = std::fs::symlink_metadata(e.path()) else {
                continue; // gone while we looked (a runtime file)
            };
            out.insert(inside.clone(), entry(&e.path(), &meta));
            if meta.is_dir() {
                todo.push(inside);
            }
        }
    }
    out
}

/// The differences of two trees, one a line: `+ path entry` (only in
/// `after`), `- path entry` (only in `before`), `~ path before => after`.
fn diff(before: &BTreeMap<String, String>, after: &BTreeMap<String, String>) -> Vec<String> {
    let mut out = Vec::new();
    for (p, e) in before {
        match after.get(p) {
            None => out.push(format!("- {p} {e}")),
            Some(a) if a != e => out.push(format!("~ {p} {e} => {a}")),
            Some(_) => {}
        }
    }
    for (p, a) in after {
        if !before.contains_key(p) {
            out.push(format!("+ {p} {a}"));
        }
    }
    out
}

/// MainPID and NRestarts of the unit.
fn main_pid(b: &Booted) -> (u32, u32) {
    (
        b.show(UNIT, "MainPID").parse().unwrap(),
        b.show(UNIT, "NRestarts").parse().unwrap(),
    )
}

fn active(b: &Booted) -> bool {
    b.sh(&format!("systemctl is-active {UNIT}")).1.trim() == "active"
}

/// The unit's journal messages (`-u`), in order.
fn messages(b: &Booted) -> Vec<String> {
    b.journal_json(&format!("-u {UNIT}"))
        .iter()
        .filter_map(|e| e["MESSAGE"].as_str().map(str::to_string))
        .collect()
}

/// From the main process's exec to READY=1, as systemd recorded it.
fn exec_to_ready(b: &Booted) -> Duration {
    let us = |p: &str| b.show(UNIT, p).parse::<u64>().unwrap();
    Duration::from_micros(
        us("ActiveEnterTimestampMonotonic") - us("ExecMainStartTimestampMonotonic"),
    )
}

#[test]
#[ignore = "needs root, debootstrap and the .deb (`cargo deb -p gpu-agent --locked`)"]
fn the_deb_runs_gpu_agent_under_systemd_and_purging_leaves_the_root_as_it_was() {
    let t0 = Instant::now();
    let deb = deb();
    let b = Booted::start();
    eprintln!("booted to `{}` in {:?}", b.state, b.boot_time);

    // The root before the package: what the purge must give back.
    let before = tree(&b);

    // The settings, as an admin writes them before installing: dpkg finds
    // files that it does not know at its two conffiles' paths and, with
    // --force-confold, keeps them (the package's versions go to
    // *.dpkg-dist) without asking. Written the other way round (install,
    // then edit, then restart), the postinst's start would run the agent
    // with the package's policy, whose toolkit waits for a containerd
    // this root does not have: `dpkg -i` would wait for READY=1 up to
    // TimeoutStartSec (10 min). The tree above was taken before these
    // files, so the purge must remove them too (they are conffiles).
    b.write("/etc/gpu-agent/policy.yaml", POLICY.as_bytes(), 0o644);
    b.write("/etc/default/gpu-agent", DEFAULT.as_bytes(), 0o644);

    // Install: dpkg -i runs the postinst, which enables the unit and starts
    // it; `systemctl start` of a Type=notify unit returns at READY=1.
    let inside = format!("/tmp/{}", deb.file_name().unwrap().to_str().unwrap());
    b.copy_in(&deb, &inside);
    let t = Instant::now();
    let dpkg = b.ok(&format!(
        "DEBIAN_FRONTEND=noninteractive dpkg -i --force-confold '{inside}' 2>&1"
    ));
    let install_time = t.elapsed();
    eprintln!("dpkg -i took {install_time:?}:\n{dpkg}");
    assert_eq!(
        b.ok("cat /etc/gpu-agent/policy.yaml /etc/default/gpu-agent"),
        format!("{POLICY}{DEFAULT}"),
        "dpkg replaced the settings written before it"
    );
    assert_eq!(
        b.ok(&format!("systemctl is-enabled {UNIT}")).trim(),
        "enabled"
    );

    // 1. Active, READY=1 sent, STATUS= names the GPU.
    assert!(active(&b), "{}", b.diagnostics());
    let install_ready = exec_to_ready(&b);
    eprintln!("install: exec to READY=1 {install_ready:?}");
    // A start of its own, timed: stop, then `systemctl start` (returns at
    // READY=1) on a host the agent configured before.
    b.ok(&format!("systemctl stop {UNIT}"));
    assert!(!active(&b));
    let t = Instant::now();
    b.ok(&format!("systemctl start {UNIT}"));
    let start_time = t.elapsed();
    assert!(active(&b), "{}", b.diagnostics());
    let start_ready = exec_to_ready(&b);
    eprintln!("systemctl start → active: {start_time:?} (exec to READY=1 {start_ready:?})");

    let status = b.show(UNIT, "StatusText");
    eprintln!("StatusText={status}");
    assert!(
        status.starts_with("ready:") || status.starts_with("host ready"),
        "{status}"
    );
    assert!(status.contains("1 GPU(s): 1x NVIDIA A10G"), "{status}");
    let show = b.ok(&format!(
        "systemctl show -p Type,WatchdogUSec,NRestarts,MainPID,NotifyAccess {UNIT}"
    ));
    eprintln!("{show}");
    let (pid, restarts) = main_pid(&b);
    assert!(pid > 1, "MainPID {pid}");
    assert_eq!(restarts, 0);
    assert_eq!(b.show(UNIT, "Type"), "notify");
    assert_eq!(b.show(UNIT, "WatchdogUSec"), "1min");

    // 2. The journal: the "found GPU" event with its fields, found by them.
    let found = poll("the found-GPU record", Duration::from_secs(10), || {
        b.journal_json(&format!("-u {UNIT} STAGE=discover"))
            .into_iter()
            .find(|e| e["MESSAGE"] == "found GPU")
    });
    let uuid = found["GPU_UUID"].as_str().unwrap_or_default().to_string();
    assert!(uuid.starts_with("GPU-"), "{found:#}");
    assert_eq!(found["STAGE"], "discover");
    assert_eq!(found["_SYSTEMD_UNIT"], UNIT);
    assert_eq!(found["SYSLOG_IDENTIFIER"], "gpu-agent");
    eprintln!("found GPU record: GPU_UUID={uuid} MODEL={}", found["MODEL"]);
    let by_uuid = b.journal_json(&format!("-u {UNIT} GPU_UUID={uuid}"));
    assert!(
        by_uuid.iter().any(|e| e["MESSAGE"] == "found GPU"),
        "{by_uuid:#?}"
    );

    // 5. `gpu-agent status` inside sees the running agent; `--ready` agrees
    // with STATUS=.
    let st = b.ok("gpu-agent status");
    eprintln!("gpu-agent status:\n{st}");
    assert!(
        st.starts_with(&format!(
            "gpu-agent status: from the running agent (pid {pid}, version {}",
            env!("CARGO_PKG_VERSION")
        )),
        "{st}"
    );
    assert!(st.contains("simulating 1x A10G"), "{st}");
    let (code, line, err) = b.sh("gpu-agent status --ready");
    let status = b.show(UNIT, "StatusText");
    eprintln!("gpu-agent status --ready: exit {code}: {line}{err}");
    assert_eq!(line.trim(), status, "status --ready and STATUS= differ");
    assert_eq!(code == 0, status.starts_with("ready:"), "{line}");

    // 3. Reload: SIGHUP to the same process, which reconciles again.
    assert!(
        b.journal_json(&format!("-u {UNIT} TRIGGER=SIGHUP"))
            .is_empty()
    );
    let t = Instant::now();
    b.ok(&format!("systemctl reload {UNIT}"));
    let reload_time = t.elapsed();
    eprintln!("systemctl reload took {reload_time:?}");
    let reconciled = poll(
        "the SIGHUP reconcile in the journal",
        Duration::from_secs(10),
        || {
            b.journal_json(&format!("-u {UNIT} TRIGGER=SIGHUP"))
                .into_iter()
                .find(|e| e["MESSAGE"] == "reconciled")
        },
    );
    assert_eq!(reconciled["SPAN_NAME"], "reconcile", "{reconciled:#}");
    assert_eq!(reconciled["_PID"], pid.to_string(), "{reconciled:#}");
    poll("active after the reload", Duration::from_secs(10), || {
        (active(&b) && b.show(UNIT, "StatusText") != "reloading").then_some(())
    });
    assert_eq!(main_pid(&b), (pid, restarts));
    let msgs = messages(&b);
    assert!(
        msgs.iter()
            .any(|m| m.starts_with("Reloading gpu-agent.service")),
        "{msgs:#?}"
    );
    assert!(
        msgs.iter()
            .any(|m| m.starts_with("Reloaded gpu-agent.service")),
        "{msgs:#?}"
    );

    // 4. Watchdog: a runtime drop-in shortens it (under /run/systemd, left
    // out of the tree); LimitCORE=0, as the host's core_pattern (`core` in
    // the cwd) is no concern of this root.
    b.write(
        "/run/systemd/system/gpu-agent.service.d/watchdog.conf",
        b"[Service]\nWatchdogSec=3s\nLimitCORE=0\n",
        0o644,
    );
    b.ok("systemctl daemon-reload");
    b.ok(&format!("systemctl restart {UNIT}"));
    assert_eq!(b.show(UNIT, "WatchdogUSec"), "3s");
    let (pid, restarts) = main_pid(&b);
    // Pings keep a live agent up past the watchdog's limit.
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(main_pid(&b), (pid, restarts));
    assert!(active(&b));
    let stopped = Instant::now();
    b.ok(&format!("kill -STOP {pid}"));
    let (new_pid, new_restarts) = poll("the watchdog restart", Duration::from_secs(40), || {
        let (p, n) = main_pid(&b);
        (n > restarts && p != 0 && p != pid).then_some((p, n))
    });
    let restarted_after = stopped.elapsed();
    poll("active again", Duration::from_secs(40), || {
        active(&b).then_some(())
    });
    let active_after = stopped.elapsed();
    eprintln!(
        "watchdog: new MainPID {new_pid} {restarted_after:?} after SIGSTOP, active {active_after:?} after (WatchdogSec=3s, RestartSec=5s)"
    );
    assert!(restarted_after >= Duration::from_secs(3));
    assert_eq!(new_restarts, restarts + 1);
    let msgs = messages(&b);
    assert!(
        msgs.iter()
            .any(|m| m.starts_with("gpu-agent.service: Watchdog timeout (limit 3s)")),
        "{msgs:#?}"
    );
    assert!(
        msgs.iter()
            .any(|m| m == "gpu-agent.service: Failed with result 'watchdog'."),
        "{msgs:#?}"
    );
    assert!(
        b.show(UNIT, "StatusText").starts_with("ready:")
            || b.show(UNIT, "StatusText").starts_with("host ready")
    );
    b.ok("rm -r /run/systemd/system/gpu-agent.service.d && systemctl daemon-reload");

    // 7. The installed unit, verified by this systemd.
    let (code, out, err) = b.sh(&format!(
        "systemd-analyze verify /lib/systemd/system/{UNIT}"
    ));
    eprintln!("systemd-analyze verify: exit {code}\n{out}{err}");
    assert!(code == 0 && out.is_empty() && err.is_empty(), "{out}{err}");

    // What the agent wrote beside the package's own files: shown, and not
    // nothing, so that the purge's clean tree below means something.
    let owned: Vec<String> = b
        .ok("dpkg-query -L gpu-agent")
        .lines()
        .map(str::to_string)
        .collect();
    let running = tree(&b);
    let agents: Vec<String> = diff(&before, &running)
        .into_iter()
        .filter(|l| {
            let path = l[2..].split(' ').next().unwrap();
            !owned.iter().any(|o| o == path)
        })
        .collect();
    eprintln!(
        "written while installed, beside the package's files ({}):\n{}",
        agents.len(),
        agents.join("\n")
    );
    assert!(
        agents.iter().any(|l| l.starts_with("+ /var/lib/gpu-agent")),
        "{agents:#?}"
    );

    // 6. Purge: stopped, the unit gone, and the tree as before the install.
    let purge = b.ok("dpkg --purge gpu-agent 2>&1");
    eprintln!("dpkg --purge:\n{purge}");
    let (_, state, _) = b.sh(&format!("systemctl is-active {UNIT}"));
    assert_eq!(state.trim(), "inactive");
    assert_eq!(b.show(UNIT, "LoadState"), "not-found");
    let after = tree(&b);
    let left = diff(&before, &after);
    eprintln!(
        "figures: dpkg -i {install_time:?} (exec to READY=1 {install_ready:?}); systemctl start {start_time:?} (exec to READY=1 {start_ready:?}); reload {reload_time:?}; watchdog restart {restarted_after:?}, active {active_after:?}; test so far {:?}",
        t0.elapsed()
    );
    assert!(
        left.is_empty(),
        "the tree after the purge differs from the one before the install:\n{}",
        left.join("\n")
    );

    let took = b.poweroff();
    eprintln!("powered off in {took:?}; whole test {:?}", t0.elapsed());
}
