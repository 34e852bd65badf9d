use super::*;

fn setting(policy: &Policy, host_is_system: bool) -> Setting<'_> {
    Setting {
        policy,
        host_is_system,
        cluster: ClusterPolicy::NoController,
    }
}

#[test]
fn the_units_bounding_set_is_the_table() {
    let unit = include_str!("../../../systemd/gpu-agent.service");
    let line = unit
        .lines()
        .find_map(|l| l.strip_prefix("CapabilityBoundingSet="))
        .expect("the unit sets CapabilityBoundingSet");
    let mut in_unit: Vec<&str> = line.split_whitespace().collect();
    in_unit.sort_unstable();
    let mut table: Vec<String> = GRANTS
        .iter()
        .map(|g| format!("{:?}", g.cap))
        .chain(["CAP_SETPCAP".to_string()])
        .collect();
    table.sort_unstable();
    assert_eq!(
        in_unit, table,
        "systemd/gpu-agent.service and GRANTS differ"
    );
}

#[test]
fn missing_names_the_capability() {
    let held = HeldCaps::from_caps(&[Capability::CAP_MKNOD]);
    assert!(held.has(Capability::CAP_MKNOD));
    assert_eq!(
        held.missing(&[Capability::CAP_MKNOD, Capability::CAP_SYS_MODULE]),
        vec!["CAP_SYS_MODULE".to_string()]
    );
    assert_eq!(
        held.blocked_detail(&["CAP_SYS_MODULE".into()]),
        "missing CAP_SYS_MODULE"
    );
}

#[test]
fn reads_this_process() {
    // Whatever this process holds, reading works and names look right.
    let held = HeldCaps::read();
    assert!(held.names().iter().all(|n| n.starts_with("CAP_")));
}

#[test]
fn every_stage_need_is_in_the_table_for_that_stage() {
    for stage in Stage::ALL {
        for cap in stage.needs() {
            assert!(
                GRANTS
                    .iter()
                    .any(|g| g.cap == *cap && g.uses.iter().any(|u| u.stage == stage)),
                "{} needs {cap} but GRANTS gives it no use by {}",
                stage.name(),
                stage.name()
            );
        }
    }
    let caps: BTreeSet<u8> = GRANTS.iter().map(|g| g.cap.index()).collect();
    assert_eq!(caps.len(), GRANTS.len(), "one row per capability");
    assert!(GRANTS.iter().all(|g| !g.uses.is_empty()));
}

#[test]
fn the_default_policy_on_a_host_root_of_slash() {
    let p = Policy::default();
    let w = wanted(&setting(&p, true));
    let names: Vec<String> = w.iter().map(|(c, _)| c.to_string()).collect();
    assert!(names.contains(&"CAP_SYS_MODULE".to_string()), "{names:?}");
    assert!(names.contains(&"CAP_MKNOD".to_string()));
    assert!(
        !names.contains(&"CAP_SYS_CHROOT".to_string()),
        "nothing is chrooted on /: {names:?}"
    );
    assert!(!names.contains(&"CAP_SETPCAP".to_string()));
    assert!(!names.contains(&"CAP_NET_ADMIN".to_string()));
    assert!(
        why_not_wanted(Capability::CAP_SYS_CHROOT, &setting(&p, true))
            .unwrap()
            .starts_with("runtime does not need it (the host root is /"),
        "a fact of the host is not a stage disabled"
    );
    // Under a DaemonSet's /host the runtime is restarted through chroot.
    let w = wanted(&setting(&p, false));
    let (_, uses) = w
        .iter()
        .find(|(c, _)| *c == Capability::CAP_SYS_CHROOT)
        .unwrap();
    assert!(uses.iter().any(|u| u.stage == Stage::Runtime));
}

/// With a controller, what the agent keeps follows the policy it will
/// run: the EKS file policy (driver off) keeps CAP_SYS_MODULE when the
/// cluster's last policy manages the driver, or when no cluster policy
/// is known yet; a cluster policy that also leaves the driver alone
/// lets it go, saying both.
#[test]
fn capabilities_follow_the_clusters_policy_too() {
    let mut eks = Policy::default();
    eks.driver.enabled = false;
    let cluster = Policy::default();
    let has = |s: &Setting<'_>| {
        wanted(s)
            .iter()
            .any(|(c, _)| *c == Capability::CAP_SYS_MODULE)
    };
    let with = |cluster| Setting {
        policy: &eks,
        host_is_system: false,
        cluster,
    };
    assert!(!has(&with(ClusterPolicy::NoController)));
    assert!(has(&with(ClusterPolicy::Remembered(&cluster))));
    assert_eq!(
        why_not_wanted(
            Capability::CAP_SYS_MODULE,
            &with(ClusterPolicy::Remembered(&cluster))
        ),
        None
    );
    assert!(has(&with(ClusterPolicy::Unknown)));
    let also_off = eks.clone();
    let s = with(ClusterPolicy::Remembered(&also_off));
    assert!(!has(&s));
    assert_eq!(
        why_not_wanted(Capability::CAP_SYS_MODULE, &s).unwrap(),
        "driver was disabled (spec.driver.enabled is false: the host's driver is used) and the cluster's last policy does not use it either"
    );
    // What any policy may ask for, where nothing is known: every
    // capability of the table but those a fact of the host rules out.
    let unknown = wanted(&with(ClusterPolicy::Unknown));
    for g in GRANTS {
        assert!(
            unknown.iter().any(|(c, _)| *c == g.cap),
            "{} not kept for an unknown cluster policy",
            g.cap
        );
    }
}

#[test]
fn a_disabled_driver_drops_sys_module_and_says_why() {
    let mut p = Policy::default();
    p.driver.enabled = false;
    let s = setting(&p, true);
    let has = |s: &Setting<'_>, cap| wanted(s).iter().any(|(c, _)| *c == cap);
    assert!(!has(&s, Capability::CAP_SYS_MODULE));
    assert!(has(&s, Capability::CAP_MKNOD));
    let because = why_not_wanted(Capability::CAP_SYS_MODULE, &s).unwrap();
    assert_eq!(
        because,
        "driver was disabled (spec.driver.enabled is false: the host's driver is used)"
    );
    assert_eq!(why_not_wanted(Capability::CAP_MKNOD, &s), None);
    // A capability two stages use is dropped only when both are off.
    p.mig_manager.enabled = false;
    let s = setting(&p, true);
    assert!(
        has(&s, Capability::CAP_SYS_ADMIN),
        "plugin still uses it (MPS)"
    );
    p.device_plugin.enabled = false;
    assert!(
        has(&setting(&p, true), Capability::CAP_SYS_ADMIN),
        "metrics still use it (GPM)"
    );
    p.dcgm_exporter.enabled = false;
    assert!(
        has(&setting(&p, true), Capability::CAP_SYS_ADMIN),
        "labels still use it (a GPU's whole PCI configuration space)"
    );
    p.gfd.enabled = false;
    p.dra.enabled = true;
    assert!(
        has(&setting(&p, true), Capability::CAP_SYS_ADMIN),
        "DRA claims with MPS sharing still use it"
    );
    p.dra.enabled = false;
    let s = setting(&p, true);
    assert_eq!(
        why_not_wanted(Capability::CAP_SYS_ADMIN, &s).unwrap(),
        "mig was disabled (spec.migManager.enabled is false) and plugin was disabled (spec.devicePlugin.enabled is false) and dra was disabled (spec.dra.enabled is false) and metrics was disabled (spec.dcgmExporter.enabled is false) and labels was disabled (spec.gfd.enabled is false)"
    );
    let held = HeldCaps::from_caps(&[]).with_dropped(
        [("CAP_SYS_MODULE".to_string(), because)]
            .into_iter()
            .collect(),
    );
    assert_eq!(
        held.blocked_detail(&["CAP_SYS_MODULE".into(), "CAP_MKNOD".into()]),
        "missing CAP_MKNOD; capability CAP_SYS_MODULE was dropped at start because driver was disabled (spec.driver.enabled is false: the host's driver is used); restart gpu-agent to enable it"
    );
}

#[test]
fn held_capabilities_are_described_with_their_stages() {
    let p = Policy::default();
    let held = HeldCaps::from_caps(&[
        Capability::CAP_DAC_OVERRIDE,
        Capability::CAP_NET_ADMIN,
        Capability::CAP_SYS_MODULE,
    ]);
    let d = describe(&held, &setting(&p, true));
    let by: BTreeMap<&str, &HeldCap> = d.iter().map(|h| (h.name.as_str(), h)).collect();
    assert_eq!(by["CAP_SYS_MODULE"].stages, vec!["driver"]);
    assert!(by["CAP_SYS_MODULE"].why.contains("finit_module"));
    assert!(
        by["CAP_DAC_OVERRIDE"]
            .stages
            .contains(&"runtime".to_string())
    );
    assert_eq!(
        by["CAP_DAC_OVERRIDE"].why,
        "write host files and directories of other owners (/etc, /var/lib)",
        "one reason said once"
    );
    assert!(by["CAP_NET_ADMIN"].stages.is_empty());
    assert_eq!(by["CAP_NET_ADMIN"].why, "no enabled stage uses it");
}
