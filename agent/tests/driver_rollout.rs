//! The agent's side of the cluster's driver rollout, at the library level
//! on a copy of the 8x H100 host fixture (driver 550.127.08 loaded) with a
//! bundle of 560.35.03 named by the policy, and recording syscalls:
//!
//! - under the cluster's policy without the go-ahead, the bundle is
//!   unpacked but no module is touched, and the node reports
//!   `upgrade-required` for 560.35.03;
//! - with the go-ahead for that version the upgrade runs (the modules are
//!   unloaded: the recorded `delete_module` calls); this bundle's modules
//!   are not real, so it fails, says so and reports `upgrade-failed`;
//! - a failed version is not tried again without a new go-ahead;
//! - with a policy file of its own (no rollout), the node upgrades at once.

mod common;

use gpu_agent::backend::sim::SimulatedBackend;
use gpu_agent::caps::HeldCaps;
use gpu_agent::driver::{UpgradeGate, UpgradeStatus};
use gpu_agent::policy::Policy;
use gpu_agent::stages::{self, Context, Stage, StageState};
use hostlib::{HostRoot, RecordingSyscalls};
use kmod::bundle::Flavour;

const KERNEL: &str = "6.1.0-27-amd64";
const NEW: &str = "560.35.03";

struct Node {
    _dir: tempfile::TempDir,
    host: HostRoot,
    backend: SimulatedBackend,
    policy: Policy,
}

fn node() -> Node {
    let dir = common::copy_host_fixture("h100-sxm-8");
    std::fs::create_dir_all(dir.path().join("proc/sys/kernel")).unwrap();
    std::fs::write(
        dir.path().join("proc/sys/kernel/osrelease"),
        format!("{KERNEL}\n"),
    )
    .unwrap();
    // A bundle of the new version whose modules are not real ones.
    let files: Vec<(String, Vec<u8>, u32)> = ["nvidia", "nvidia-uvm", "nvidia-modeset"]
        .iter()
        .map(|m| {
            (
                format!("modules/{KERNEL}/open/{m}.ko"),
                format!("not a module: {m}").into_bytes(),
                0o644,
            )
        })
        .collect();
    let mut tgz = Vec::new();
    kmod::bundle::build(&mut tgz, NEW, &[KERNEL], &[Flavour::Open], &files).unwrap();
    std::fs::create_dir_all(dir.path().join("opt/drivers")).unwrap();
    std::fs::write(dir.path().join("opt/drivers/560.tar.gz"), &tgz).unwrap();
    let sha: String = sha2::Digest::finalize(sha2::Digest::chain_update(
        <sha2::Sha256 as sha2::Digest>::new(),
        &tgz,
    ))
    .iter()
    .map(|b| format!("{b:02x}"))
    .collect();
    let policy = Policy::from_yaml(
        &format!(
            "spec:\n  driver:\n    bundle: /opt/drivers/560.tar.gz\n    bundleSha256: {sha}\n    upgradeTimeoutSeconds: 1\n  toolkit:\n    enabled: false\n  cdi:\n    enabled: false\n  devicePlugin:\n    enabled: false\n"
        ),
        "test policy",
    )
    .unwrap();
    let host = HostRoot::new(dir.path()).unwrap();
    let backend = SimulatedBackend::new(simnode::NodeDescription::load("h100-sxm-8").unwrap());
    Node {
        _dir: dir,
        host,
        backend,
        policy,
    }
}

/// One pass with `gate`: the driver stage's words, what the node reports
/// and the privileged calls made.
fn pass(n: &Node, gate: UpgradeGate) -> (StageState, String, Option<UpgradeStatus>, Vec<String>) {
    let rec = RecordingSyscalls::new();
    // Every capability: the recording syscalls stand in for the kernel.
    let caps = HeldCaps::from_caps(&caps::all().into_iter().collect::<Vec<_>>());
    let ctx = Context {
        policy: &n.policy,
        caps: &caps,
        sys: &n.host,
        backend: &n.backend,
        host: &n.host,
        apply: Some(&hostlib::command::SystemRunner),
        syscalls: &rec,
        simulated: false,
        drain: None,
        serve_first: false,
        changes: Default::default(),
        mig_hold: None,
        upgrade: gate,
        logged: None,
    };
    let p = stages::run_pass(&ctx);
    let s = p.stages.iter().find(|s| s.stage == Stage::Driver).unwrap();
    let calls = rec
        .calls()
        .iter()
        .filter(|c| matches!(c.name(), "delete_module" | "finit_module"))
        .map(|c| format!("{c:?}"))
        .collect();
    (s.state, s.detail.clone(), ctx.upgrade.out.take(), calls)
}

#[test]
fn the_cluster_rollout_holds_the_upgrade_until_the_go_ahead() {
    let n = node();
    let gated = |go: Option<&str>, failed: Option<(&str, &str)>| UpgradeGate {
        gated: true,
        go_ahead: go.map(str::to_string),
        failed: failed.map(|(v, w)| (v.to_string(), w.to_string())),
        out: Default::default(),
    };

    // Held: nothing loaded or unloaded, the node says what it wants.
    let (state, detail, out, calls) = pass(&n, gated(None, None));
    assert_eq!(state, StageState::Done, "{detail}");
    assert_eq!(
        detail,
        "driver 550.127.08 loaded; 560.35.03 wanted: waiting for gpu-controller's go-ahead (the cluster rolls upgrades out a few nodes at a time)"
    );
    assert!(calls.is_empty(), "{calls:?}");
    assert_eq!(
        out,
        Some(UpgradeStatus {
            state: "upgrade-required".into(),
            driver_version: NEW.into(),
            detail: "driver 550.127.08 loaded".into(),
        })
    );
    // The bundle was unpacked beside the others, ready for the go-ahead.
    assert!(
        n.host
            .path()
            .join(format!("var/lib/gpu-agent/drivers/{NEW}-{KERNEL}"))
            .is_dir()
    );
    // A go-ahead for another version opens nothing.
    let (_, _, out, calls) = pass(&n, gated(Some("570.1.1"), None));
    assert!(calls.is_empty(), "{calls:?}");
    assert_eq!(out.unwrap().state, "upgrade-required");

    // The go-ahead for 560.35.03: the upgrade runs (modules unloaded in
    // reverse order); these modules do not load, so it fails and says so.
    let (state, detail, out, calls) = pass(&n, gated(Some(NEW), None));
    assert_eq!(state, StageState::Failed, "{detail}");
    assert!(
        calls
            .iter()
            .any(|c| c.contains("DeleteModule") && c.contains("\"nvidia\"")),
        "{calls:?}"
    );
    let out = out.unwrap();
    assert_eq!(out.state, "upgrade-failed");
    assert_eq!(out.driver_version, NEW);
    assert!(out.detail.contains("560.35.03"), "{}", out.detail);
    assert_eq!(out.detail, detail);
    eprintln!("failed upgrade: {detail}");

    // Not tried again without a new go-ahead: the failure is what it says.
    let (_, detail, out, calls) = pass(&n, gated(None, Some((NEW, "nvidia.ko did not load"))));
    assert!(calls.is_empty(), "{calls:?}");
    assert_eq!(
        out,
        Some(UpgradeStatus {
            state: "upgrade-failed".into(),
            driver_version: NEW.into(),
            detail: "nvidia.ko did not load".into(),
        })
    );
    assert!(
        detail.contains("gpu-controller holds the node cordoned"),
        "{detail}"
    );
}

#[test]
fn a_node_on_its_own_upgrades_at_once_and_reports_nothing() {
    let n = node();
    let (_, _, out, calls) = pass(&n, UpgradeGate::default());
    assert!(!calls.is_empty(), "the upgrade was not tried");
    assert_eq!(out, None, "no rollout, no upgrade state");
}
