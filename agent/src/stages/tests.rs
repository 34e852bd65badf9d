use super::pass::gate;
use super::*;
use crate::backend::GpuBackend;
use crate::caps::Capability;
use crate::caps::HeldCaps;
use crate::policy::Policy;
use crate::test_support::sim_node;
use hostlib::HostRoot;

fn pass(policy: &Policy, caps: &HeldCaps) -> Pass {
    let (_dir, sys, backend) = sim_node("h100-sxm-8");
    inspect(&sys, &backend, policy, caps, true)
}

/// One pass that only looks (nothing applied) over a node's files;
/// `simulated: false` treats them as a real host's (capabilities count).
fn inspect(
    sys: &HostRoot,
    backend: &dyn GpuBackend,
    policy: &Policy,
    caps: &HeldCaps,
    simulated: bool,
) -> Pass {
    let recording = hostlib::RecordingSyscalls::new();
    run_pass(&Context {
        simulated,
        ..looking(sys, backend, policy, caps, &recording, None)
    })
}

/// A context that only looks (nothing applied) at a simulated node's
/// files, with the running agent's log memory when `logged` is given.
fn looking<'a>(
    sys: &'a HostRoot,
    backend: &'a dyn GpuBackend,
    policy: &'a Policy,
    caps: &'a HeldCaps,
    syscalls: &'a hostlib::RecordingSyscalls,
    logged: Option<&'a LogMemory>,
) -> Context<'a> {
    Context {
        policy,
        caps,
        sys,
        backend,
        host: sys,
        apply: None,
        syscalls,
        simulated: true,
        drain: None,
        serve_first: false,
        changes: Default::default(),
        mig_hold: None,
        upgrade: Default::default(),
        logged,
    }
}

#[test]
fn serve_first_leaves_what_registration_does_not_need_for_after_it() {
    let policies = [
        Policy::default(),
        Policy::from_yaml(
            "spec:\n  devicePlugin:\n    deviceListStrategy: [envvar, cdi-cri]\n",
            "p",
        )
        .unwrap(),
        Policy::from_yaml("spec:\n  cdi: {enabled: false}\n", "p").unwrap(),
    ];
    let (_dir, sys, backend) = sim_node("h100-sxm-8");
    let caps = HeldCaps::from_caps(&[]);
    let recording = hostlib::RecordingSyscalls::new();
    let ctx = |policy| Context {
        policy,
        caps: &caps,
        sys: &sys,
        backend: &backend,
        host: &sys,
        apply: None,
        syscalls: &recording,
        simulated: true,
        drain: None,
        serve_first: true,
        changes: Default::default(),
        mig_hold: None,
        upgrade: Default::default(),
        logged: None,
    };
    // Also when the plugin hands out CDI names: Allocate waits for the spec.
    for policy in &policies[..2] {
        let mut p = run_pass(&ctx(policy));
        // What registration needs ran: the GPUs, the driver, the plan.
        assert_eq!(state_of(&p, Stage::Discover).state, StageState::Done);
        assert_eq!(state_of(&p, Stage::Driver).state, StageState::Done);
        let plugin = state_of(&p, Stage::Plugin);
        assert_eq!(plugin.state, StageState::Ready);
        assert_eq!(plugin.detail, "nvidia.com/gpu: 8 device(s)");
        assert_eq!(p.plugin.as_ref().unwrap().resources[0].devices.len(), 8);
        // The rest says it runs after, and readiness waits for it.
        assert_eq!(p.deferred, AFTER_REGISTRATION);
        for stage in AFTER_REGISTRATION {
            let st = state_of(&p, stage);
            assert_eq!(
                (st.state, st.detail.as_str()),
                (StageState::Ready, DEFERRED_DETAIL),
                "{stage:?}"
            );
        }
        assert!(!ready(&p.stages));
        let inv = p.inventory.clone().unwrap();
        run_deferred(&ctx(policy), &p.deferred, &inv, &mut p.stages);
        let order: Vec<Stage> = p.stages.iter().map(|s| s.stage).collect();
        assert_eq!(order, Stage::ALL);
        assert!(
            state_of(&p, Stage::Devnodes)
                .detail
                .starts_with("simulated node: would make 14 of 14 device node(s)"),
            "{}",
            state_of(&p, Stage::Devnodes).detail
        );
        let cdi = state_of(&p, Stage::Cdi);
        assert!(cdi.detail.starts_with("would write"), "{}", cdi.detail);
        assert_eq!(state_of(&p, Stage::Runtime).state, StageState::Waiting);
        for stage in AFTER_REGISTRATION {
            assert_ne!(state_of(&p, stage).detail, DEFERRED_DETAIL, "{stage:?}");
        }
    }
    // A stage the policy turns off is not deferred: it says so at once.
    let p = run_pass(&ctx(&policies[2]));
    assert!(!p.deferred.contains(&Stage::Cdi));
    assert_eq!(state_of(&p, Stage::Cdi).state, StageState::Disabled);
    // Without serve_first nothing is deferred.
    let p = pass(&Policy::default(), &caps);
    assert!(p.deferred.is_empty());
    assert!(p.stages.iter().all(|s| s.detail != DEFERRED_DETAIL));
}

fn state_of(p: &Pass, stage: Stage) -> &StageStatus {
    p.stages.iter().find(|s| s.stage == stage).unwrap()
}

#[test]
fn discover_and_plugin_run_and_nothing_unbuilt_claims_done() {
    let p = pass(&Policy::default(), &HeldCaps::from_caps(&[]));
    assert!(p.ok());
    assert_eq!(p.stages.len(), Stage::ALL.len());
    let d = state_of(&p, Stage::Discover);
    assert_eq!(d.state, StageState::Done);
    assert_eq!(
        d.detail,
        "8 GPU(s): 8x NVIDIA H100 80GB HBM3; driver 550.127.08"
    );
    assert_eq!(p.inventory.as_ref().unwrap().gpus.len(), 8);
    let plugin = state_of(&p, Stage::Plugin);
    assert_eq!(plugin.state, StageState::Ready);
    assert_eq!(plugin.detail, "nvidia.com/gpu: 8 device(s)");
    assert_eq!(p.plugin.as_ref().unwrap().resources[0].devices.len(), 8);
    for s in &p.stages {
        if !s.stage.implemented() {
            assert_eq!(s.state, StageState::NotImplemented, "{:?}", s.stage);
        }
    }
    // A simulated node: the driver is observed, nothing is loaded or made.
    let d = state_of(&p, Stage::Driver);
    assert_eq!(d.state, StageState::Done);
    assert_eq!(
        d.detail,
        "driver 550.127.08 (open) loaded (simulated node: no module touched)"
    );
    let n = state_of(&p, Stage::Devnodes);
    assert_eq!(n.state, StageState::Ready);
    assert!(
            n.detail.starts_with("simulated node: would make 14 of 14 device node(s): /dev/nvidiactl, /dev/nvidia-modeset, /dev/nvidia0,"),
            "{}",
            n.detail
        );
    // On a real node the driver stage needs CAP_SYS_MODULE; the
    // host-driver mode loads nothing and needs none.
    let policy = Policy::default();
    assert_eq!(
        Stage::Driver.needs_under(&policy, false),
        &[Capability::CAP_SYS_MODULE]
    );
    assert!(Stage::Driver.needs_under(&policy, true).is_empty());
    let host_driver = Policy::from_yaml("spec:\n  driver: {enabled: false}\n", "p").unwrap();
    assert!(Stage::Driver.needs_under(&host_driver, false).is_empty());
    assert_eq!(
        Stage::Devnodes.needs_under(&host_driver, false),
        &[Capability::CAP_MKNOD]
    );
}

#[test]
fn policy_turns_stages_off_with_the_reason() {
    let policy = Policy::from_yaml(
        "spec:\n  driver: {enabled: false}\n  toolkit: {enabled: false}\n",
        "p",
    )
    .unwrap();
    let p = pass(&policy, &HeldCaps::from_caps(&[]));
    // The host-driver mode: the driver is recorded, no module touched.
    let d = state_of(&p, Stage::Driver);
    assert_eq!(d.state, StageState::Done);
    assert_eq!(
        d.detail,
        "host driver 550.127.08 (open) loaded; modules not managed (spec.driver.enabled is false)"
    );
    assert_eq!(state_of(&p, Stage::Runtime).state, StageState::Disabled);
}

#[test]
fn missing_capability_blocks_and_later_stages_wait() {
    let policy = Policy::default();
    let missing = vec!["CAP_SYS_MODULE".to_string()];
    let (state, detail) = gate(Stage::Driver, true, &policy, &missing, &[], false).unwrap();
    assert_eq!(state, StageState::Blocked);
    assert_eq!(detail, "missing CAP_SYS_MODULE");
    let earlier = vec![StageStatus {
        needs: missing.clone(),
        missing,
        ..StageStatus::new(Stage::Driver, state, detail)
    }];
    let (state, detail) = gate(Stage::Devnodes, true, &policy, &[], &earlier, false).unwrap();
    assert_eq!(state, StageState::Waiting);
    assert_eq!(detail, "waiting on driver");
    assert_eq!(
        gate(Stage::Runtime, true, &policy, &[], &earlier, false),
        None
    );
    // With a driver loaded, a blocked (or failed) driver stage holds
    // nothing back: devnodes, CDI and MIG work with the loaded driver.
    assert_eq!(
        gate(Stage::Devnodes, true, &policy, &[], &earlier, true),
        None
    );
    assert_eq!(gate(Stage::Mig, true, &policy, &[], &earlier, true), None);
}

/// A layout asked for whose stage cannot run (here: CAP_SYS_ADMIN not
/// held on a real node) is `pending`, the same at every pass: the
/// node's mig.config.state label went pending, then nothing, then
/// pending again, twice a minute.
#[test]
fn a_layout_that_cannot_be_applied_yet_stays_pending() {
    let (_dir, sys, backend) = sim_node("h100-mig-2");
    let policy =
        Policy::from_yaml("spec:\n  migManager:\n    default: all-1g.10gb\n", "p").unwrap();
    let caps = HeldCaps::from_caps(&[]);
    for _ in 0..2 {
        let p = inspect(&sys, &backend, &policy, &caps, false);
        assert_eq!(state_of(&p, Stage::Mig).state, StageState::Blocked);
        let m = p.mig.expect("a pending MIG state");
        assert_eq!(m.layout, "all-1g.10gb");
        assert_eq!(m.state, crate::mig::MigConfigState::Pending);
        assert!(m.detail.contains("CAP_SYS_ADMIN"), "{}", m.detail);
    }
}

/// A pinned driver version the node cannot reach (no bundle brings it)
/// fails the driver stage in words, and holds back none of the stages
/// that work with the loaded driver (they waited on it, for good).
#[test]
fn a_pinned_version_the_node_cannot_reach_holds_nothing_back() {
    let (_dir, sys, backend) = sim_node("h100-sxm-8");
    let policy = Policy::from_yaml(
        "spec:\n  driver:\n    version: 595.91.07\n  migManager:\n    default: all-disabled\n",
        "p",
    )
    .unwrap();
    let caps = HeldCaps::from_caps(&[
        Capability::CAP_SYS_MODULE,
        Capability::CAP_MKNOD,
        Capability::CAP_SYS_ADMIN,
    ]);
    let p = inspect(&sys, &backend, &policy, &caps, false);
    let d = state_of(&p, Stage::Driver);
    assert_eq!(d.state, StageState::Failed, "{}", d.detail);
    assert!(
        d.detail
            .contains("driver 550.127.08 is loaded, spec.driver.version asks for 595.91.07"),
        "{}",
        d.detail
    );
    for s in [Stage::Mig, Stage::Devnodes, Stage::Cdi] {
        let st = state_of(&p, s);
        assert!(
            !st.detail.starts_with("waiting on"),
            "{}: {:?} {}",
            s.name(),
            st.state,
            st.detail
        );
    }
}

#[test]
fn every_stage_after_only_names_earlier_stages() {
    for (i, s) in Stage::ALL.iter().enumerate() {
        for dep in s.after() {
            let j = Stage::ALL.iter().position(|x| x == dep).unwrap();
            assert!(j < i, "{} waits on later stage {}", s.name(), dep.name());
        }
    }
}

/// What `f` logs at DEBUG and above, a line an event, the level first.
fn logs_of(f: impl FnOnce()) -> Vec<String> {
    use std::sync::{Arc, Mutex};
    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let buf = Buf::default();
    let writer = buf.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .without_time()
        .with_ansi(false)
        .with_target(false)
        .with_writer(move || writer.clone())
        .finish();
    tracing::subscriber::with_default(subscriber, f);
    let text = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
    text.lines().map(|l| l.trim_start().to_string()).collect()
}

/// The lines the default level (INFO) shows.
fn shown(lines: &[String]) -> Vec<&String> {
    lines.iter().filter(|l| !l.starts_with("DEBUG")).collect()
}

#[test]
fn a_pass_that_changes_nothing_logs_nothing_above_debug() {
    let (_dir, sys, backend) = sim_node("h100-sxm-8");
    // No containerd: the runtime stage waits, a WARN said once.
    let caps = HeldCaps::from_caps(&[]);
    let policy = Policy::default();
    let recording = hostlib::RecordingSyscalls::new();
    let memory = LogMemory::default();
    let ctx = || looking(&sys, &backend, &policy, &caps, &recording, Some(&memory));
    let first = logs_of(|| {
        run_pass(&ctx());
    });
    let found = first.iter().filter(|l| l.contains("found GPU")).count();
    assert_eq!(found, 8, "{first:#?}");
    assert!(
        first
            .iter()
            .any(|l| l.starts_with("WARN") && l.contains("state=\"waiting\"")),
        "{first:#?}"
    );
    for _ in 0..3 {
        let again = logs_of(|| {
            run_pass(&ctx());
        });
        assert!(shown(&again).is_empty(), "{:#?}", shown(&again));
        // Each stage's state is still there, at DEBUG.
        let states = again.iter().filter(|l| l.contains(" state=")).count();
        assert_eq!(states, Stage::ALL.len(), "{again:#?}");
    }
    // Without the running agent's memory (`status`, `run --once`),
    // a pass says everything.
    let once = logs_of(|| {
        run_pass(&Context {
            logged: None,
            ..ctx()
        });
    });
    assert_eq!(
        once.iter().filter(|l| l.contains("found GPU")).count(),
        8,
        "{once:#?}"
    );
    assert!(shown(&once).len() >= Stage::ALL.len(), "{once:#?}");
}

/// The labels' warnings (two GPU models here) are said once while they
/// hold, not at every reconcile; `gpu-agent labels` and a pass without
/// the agent's memory say them each time.
#[test]
fn a_lasting_label_warning_is_said_once() {
    let (_dir, sys, backend) = sim_node("a100-h100-mixed");
    let caps = HeldCaps::from_caps(&[]);
    let policy = Policy::default();
    let recording = hostlib::RecordingSyscalls::new();
    let memory = LogMemory::default();
    let ctx = |logged| looking(&sys, &backend, &policy, &caps, &recording, logged);
    let models = |lines: &[String]| {
        lines
            .iter()
            .filter(|l| l.starts_with("WARN") && l.contains("multiple GPU models"))
            .count()
    };
    let first = logs_of(|| {
        run_pass(&ctx(Some(&memory)));
    });
    assert_eq!(models(&first), 1, "{first:#?}");
    for _ in 0..3 {
        let again = logs_of(|| {
            run_pass(&ctx(Some(&memory)));
        });
        assert_eq!(models(&again), 0, "{again:#?}");
        assert!(shown(&again).is_empty(), "{:#?}", shown(&again));
    }
    let once = logs_of(|| {
        run_pass(&ctx(None));
    });
    assert!(models(&once) >= 1, "{once:#?}");
}

/// A device node the driver leaves to the administrator is warned
/// once while it stays so, again when it changes or comes back.
#[test]
fn a_node_left_to_the_administrator_is_said_once() {
    use kmod::devnodes::Outcome;
    let (_dir, sys, backend) = sim_node("h100-sxm-8");
    let caps = HeldCaps::from_caps(&[]);
    let policy = Policy::default();
    let recording = hostlib::RecordingSyscalls::new();
    let memory = LogMemory::default();
    let ctx = Context {
        simulated: false,
        ..looking(&sys, &backend, &policy, &caps, &recording, Some(&memory))
    };
    let left = |is: &str| {
        vec![
            Outcome::LeftToAdmin {
                path: "/dev/nvidia0".into(),
                is: is.into(),
            },
            Outcome::Unchanged("/dev/nvidiactl".into()),
        ]
    };
    let warned = |out: Vec<Outcome>| {
        logs_of(|| devnodes::tell_left_to_admin(&ctx, &out))
            .iter()
            .filter(|l| l.starts_with("WARN") && l.contains("left to the administrator"))
            .count()
    };
    assert_eq!(warned(left("missing")), 1);
    assert_eq!(warned(left("missing")), 0);
    assert_eq!(warned(left("missing")), 0);
    assert_eq!(warned(left("a regular file")), 1, "it changed");
    assert_eq!(
        warned(vec![Outcome::Unchanged("/dev/nvidia0".into())]),
        0,
        "made right by the administrator"
    );
    assert_eq!(warned(left("missing")), 1, "it came back");
}

#[test]
fn a_stage_is_news_when_its_state_or_words_change() {
    use StageState::*;
    let m = LogMemory::default();
    let s = Stage::Cdi;
    assert!(m.stage_is_news(s, Done, "wrote spec.json: 8 GPU(s)", true));
    // From the words of a change to those of finding it made: not news.
    assert!(!m.stage_is_news(s, Done, "spec.json is up to date: 8 GPU(s)", false));
    assert!(!m.stage_is_news(s, Done, "spec.json is up to date: 8 GPU(s)", false));
    // Other words without a change: news.
    assert!(m.stage_is_news(s, Done, "spec.json is up to date: 7 GPU(s)", false));
    // A change made, in the same words: news.
    assert!(m.stage_is_news(s, Done, "spec.json is up to date: 7 GPU(s)", true));
    // Another state: news; the same failure again: not; in other words: news.
    assert!(m.stage_is_news(s, Failed, "no space left", false));
    assert!(!m.stage_is_news(s, Failed, "no space left", false));
    assert!(m.stage_is_news(s, Failed, "read-only file system", false));
    // Each stage has its own memory.
    assert!(m.stage_is_news(Stage::Labels, Failed, "no space left", false));
}

#[test]
fn a_condition_is_news_when_it_begins_changes_or_ends() {
    let m = LogMemory::default();
    assert!(!m.news("k", None), "nothing held, nothing holds");
    assert!(m.news("k", Some("a")));
    assert!(!m.news("k", Some("a")));
    assert!(m.news("k", Some("b")));
    assert!(m.news("k", None));
    assert!(!m.news("k", None));
    assert!(m.news("k", Some("b")), "again after it was over");
    assert!(m.news("other", Some("b")));
}

#[test]
fn gpus_are_news_when_found_said_otherwise_or_gone() {
    let m = LogMemory::default();
    let said = |id: &str| GpuSaid {
        id: id.into(),
        model: "H100".into(),
    };
    let node = |gpus: &[(&str, &str)]| -> std::collections::BTreeMap<String, GpuSaid> {
        gpus.iter()
            .map(|(bus, id)| (bus.to_string(), said(id)))
            .collect()
    };
    let (new, gone) = m.gpus_found(node(&[
        ("0000:18:00.0", "GPU-a"),
        ("0000:2a:00.0", "GPU-b"),
    ]));
    assert_eq!((new.len(), gone.len()), (2, 0));
    let (new, gone) = m.gpus_found(node(&[
        ("0000:18:00.0", "GPU-a"),
        ("0000:2a:00.0", "GPU-b"),
    ]));
    assert!(new.is_empty() && gone.is_empty());
    // NVML gives a UUID where there was only the bus id; one GPU gone.
    let (new, gone) = m.gpus_found(node(&[("0000:18:00.0", "GPU-c")]));
    assert_eq!(new, ["0000:18:00.0"]);
    assert_eq!(gone, [("0000:2a:00.0".to_string(), said("GPU-b"))]);
}
