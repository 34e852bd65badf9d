//! The planner and applier against simnode's MIG state machine (the same
//! one the fake libnvidia-ml serves), through an in-memory [`MigControl`].

use std::collections::BTreeMap;
use std::sync::Mutex;

use gpu_model::inventory::Inventory;
use hostlib::HostRoot;
use hostlib::command::RecordingRunner;
use simnode::mig::state::{GpuMig, MigError as SimError};

use super::*;
use crate::config::MigPartedConfig;
use crate::test_support::sim_node;

/// simnode's MIG state behind the [`MigControl`] trait. A GPU reset is
/// seen as the fake NVML sees it: "1" written to the PCI function's sysfs
/// `reset` file under the host root. `fail_gi` makes creating GPU
/// instances of one profile on one GPU fail.
struct SimControl {
    gpus: Mutex<Vec<GpuMig>>,
    host: HostRoot,
    buses: Vec<String>,
    fail_gi: Mutex<Option<(String, u32)>>,
    ignore_reset: bool,
    /// NVML lists no MIG profiles while MIG is off (`NOT_SUPPORTED`).
    no_profiles_while_off: bool,
}

fn sim_err(gpu: &str, call: &'static str, e: SimError) -> MigError {
    MigError {
        gpu: gpu.to_string(),
        call,
        message: e.to_string(),
        kind: match e {
            SimError::InUse => ErrorKind::InUse,
            SimError::InsufficientResources => ErrorKind::Insufficient,
            SimError::NotSupported => ErrorKind::NotSupported,
            _ => ErrorKind::Other,
        },
    }
}

impl SimControl {
    fn new(node: &str, host: &HostRoot) -> Self {
        let desc = simnode::NodeDescription::load(node).unwrap();
        let state = simnode::mig::state::NodeMig::from_description(&desc).unwrap();
        SimControl {
            gpus: Mutex::new(state.gpus),
            host: host.clone(),
            buses: desc.gpus.iter().map(|g| g.bus_id.to_string()).collect(),
            fail_gi: Mutex::new(None),
            ignore_reset: false,
            no_profiles_while_off: false,
        }
    }

    fn with<T>(&self, gpu: &str, f: impl FnOnce(&mut GpuMig, usize) -> T) -> T {
        let mut g = self.gpus.lock().unwrap();
        let i = g.iter().position(|m| m.uuid == gpu).expect("a known GPU");
        f(&mut g[i], i)
    }

    fn reset_file(&self, i: usize) -> std::path::PathBuf {
        self.host
            .resolve(format!("/sys/bus/pci/devices/{}/reset", self.buses[i]))
            .unwrap()
    }
}

impl MigControl for SimControl {
    fn mode(&self, gpu: &str) -> Result<Mode, MigError> {
        self.with(gpu, |m, i| {
            let f = self.reset_file(i);
            if std::fs::read_to_string(&f).is_ok_and(|s| s == "1") {
                std::fs::write(&f, "").unwrap();
                if !self.ignore_reset {
                    m.reset();
                }
            }
            Ok(Mode {
                current: m.current,
                pending: m.pending,
            })
        })
    }
    fn set_mode(&self, gpu: &str, on: bool) -> Result<(), MigError> {
        self.with(gpu, |m, _| m.set_mode(on, 1).map(|_| ()))
            .map_err(|e| sim_err(gpu, "set_mode", e))
    }
    fn gi_profiles(&self, gpu: &str) -> Result<Vec<GiProfile>, MigError> {
        if self.no_profiles_while_off && !self.with(gpu, |m, _| m.current) {
            return Err(sim_err(gpu, "gi_profiles", SimError::NotSupported));
        }
        Ok(self.with(gpu, |m, _| {
            m.facts()
                .profiles
                .iter()
                .map(GiProfile::from_table)
                .collect()
        }))
    }
    fn ci_profiles(&self, gpu: &str, gi: u32) -> Result<Vec<CiProfile>, MigError> {
        self.with(gpu, |m, _| m.ci_profiles(gi))
            .map(|v| {
                v.into_iter()
                    .map(|c| CiProfile {
                        id: c.index,
                        slices: c.slices,
                    })
                    .collect()
            })
            .map_err(|e| sim_err(gpu, "ci_profiles", e))
    }
    fn instances(&self, gpu: &str) -> Result<Vec<GpuInstance>, MigError> {
        Ok(self.with(gpu, |m, _| {
            m.gpu_instances
                .iter()
                .map(|g| GpuInstance {
                    id: g.id,
                    profile_id: g.profile_id,
                    placement: (g.start, g.size),
                    cis: g
                        .compute_instances
                        .iter()
                        .map(|c| ComputeInstance {
                            id: c.id,
                            profile_id: c.profile_id,
                        })
                        .collect(),
                })
                .collect()
        }))
    }
    fn create_gi(&self, gpu: &str, profile_id: u32, at: Placement) -> Result<u32, MigError> {
        if self.fail_gi.lock().unwrap().as_ref() == Some(&(gpu.to_string(), profile_id)) {
            return Err(sim_err(gpu, "create_gi", SimError::InsufficientResources));
        }
        self.with(gpu, |m, _| {
            m.create_gpu_instance(profile_id, Some(at.start))
        })
        .map_err(|e| sim_err(gpu, "create_gi", e))
    }
    fn create_ci(&self, gpu: &str, gi: u32, profile_id: u32) -> Result<u32, MigError> {
        self.with(gpu, |m, _| m.create_compute_instance(gi, profile_id, None))
            .map_err(|e| sim_err(gpu, "create_ci", e))
    }
    fn destroy_ci(&self, gpu: &str, gi: u32, ci: u32) -> Result<(), MigError> {
        self.with(gpu, |m, _| m.destroy_compute_instance(gi, ci))
            .map_err(|e| sim_err(gpu, "destroy_ci", e))
    }
    fn destroy_gi(&self, gpu: &str, gi: u32) -> Result<(), MigError> {
        self.with(gpu, |m, _| m.destroy_gpu_instance(gi))
            .map_err(|e| sim_err(gpu, "destroy_gi", e))
    }
    fn processes(&self, _gpu: &str) -> Result<Vec<u32>, MigError> {
        Ok(Vec::new())
    }
}

fn layouts(text: &str) -> MigPartedConfig {
    MigPartedConfig::from_yaml(text, "mig.yaml").unwrap()
}

struct Node {
    _dir: tempfile::TempDir,
    host: HostRoot,
    inv: Inventory,
    control: SimControl,
}

fn node(name: &str) -> Node {
    let (dir, host, backend) = sim_node(name);
    let inv = gpu_backend::discover::discover(&host, &backend);
    let control = SimControl::new(name, &host);
    Node {
        _dir: dir,
        host,
        inv,
        control,
    }
}

impl Node {
    fn plan(&self, config: &MigPartedConfig, layout: &str) -> Result<Plan, PlanError> {
        plan(&self.control, &self.inv, config, "mig.yaml", layout)
    }

    fn apply(
        &self,
        config: &MigPartedConfig,
        layout: &str,
        runner: &RecordingRunner,
        reboot: bool,
    ) -> Result<Applied, ApplyError> {
        let p = self.plan(config, layout).unwrap();
        let env = ApplyEnv {
            host: &self.host,
            runner,
            reboot,
        };
        apply(&self.control, &env, &p)
    }

    fn devices(&self, gpu: usize) -> Vec<String> {
        let g = self.control.gpus.lock().unwrap();
        let facts = g[gpu].facts();
        let mut v: Vec<String> = g[gpu]
            .mig_devices()
            .iter()
            .map(|d| {
                let name = facts.by_id(d.gi_profile_id).unwrap().name;
                if d.ci_slices == d.gi_slices {
                    name.to_string()
                } else {
                    format!("{}c.{name}", d.ci_slices)
                }
            })
            .collect();
        v.sort();
        v
    }
}

#[test]
fn the_built_in_balanced_layout_applies_once_and_then_changes_nothing() {
    let n = node("h100-sxm-8");
    let builtin = MigPartedConfig::builtin();
    let runner = RecordingRunner::default();
    let p = n.plan(&builtin, "all-balanced").unwrap();
    assert_eq!(p.changing().count(), 8);
    assert_eq!(
        p.summary(),
        "GPUs 0-7: MIG off → 3g.40gb, 2g.20gb, 1g.10gb x2"
    );
    assert_eq!(
        grouped(&[
            (0, "a".into()),
            (2, "b".into()),
            (1, "a".into()),
            (3, "a".into()),
            (5, "a".into())
        ]),
        "GPUs 0-1, 3, 5: a; GPU 2: b"
    );
    match n.apply(&builtin, "all-balanced", &runner, false).unwrap() {
        Applied::Done(what) => assert_eq!(what.len(), 8, "{what:?}"),
        other => panic!("{other:?}"),
    }
    for gpu in 0..8 {
        assert_eq!(n.devices(gpu), ["1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb"]);
    }
    let before = n.control.gpus.lock().unwrap().clone();
    let again = n.plan(&builtin, "all-balanced").unwrap();
    assert!(again.is_noop(), "{}", again.summary());
    assert_eq!(
        again.summary(),
        "layout \"all-balanced\" applied (8 GPU(s) as wanted)"
    );
    assert_eq!(*n.control.gpus.lock().unwrap(), before);
    // Back to all-disabled: MIG off everywhere (an H100 applies it at once).
    n.apply(&builtin, "all-disabled", &runner, false).unwrap();
    assert!(
        n.control
            .gpus
            .lock()
            .unwrap()
            .iter()
            .all(|g| !g.current && g.gpu_instances.is_empty())
    );
    assert!(runner.calls().is_empty());
}

#[test]
fn smaller_compute_instances_share_a_gpu_instance() {
    let n = node("h100-sxm-8");
    let c = layouts(
        "version: v1\nmig-configs:\n  shared:\n    - devices: [0]\n      mig-enabled: true\n      mig-devices: {\"1c.3g.40gb\": 3, \"3g.40gb\": 1}\n",
    );
    n.apply(&c, "shared", &RecordingRunner::default(), false)
        .unwrap();
    let g = n.control.gpus.lock().unwrap()[0].clone();
    let mut per_gi: Vec<usize> = g
        .gpu_instances
        .iter()
        .map(|i| i.compute_instances.len())
        .collect();
    per_gi.sort();
    assert_eq!(per_gi, [1, 3], "{g:#?}");
    assert!(n.plan(&c, "shared").unwrap().is_noop());
    // GPU 1 is not in the layout: untouched.
    assert!(!n.control.gpus.lock().unwrap()[1].current);
}

#[test]
fn an_ampere_gpu_is_reset_through_sysfs_and_a_refused_reset_means_a_reboot() {
    let n = node("a100-h100-mixed");
    let builtin = MigPartedConfig::builtin();
    let runner = RecordingRunner::default();
    n.apply(&builtin, "all-balanced", &runner, false).unwrap();
    let a100 = n
        .inv
        .gpus
        .iter()
        .position(|g| g.model.as_deref().is_some_and(|m| m.contains("A100")))
        .unwrap();
    assert_eq!(n.devices(a100), ["1g.5gb", "1g.5gb", "2g.10gb", "3g.20gb"]);

    // A reset that does not apply the mode.
    let mut n = node("a100-h100-mixed");
    n.control.ignore_reset = true;
    let err = n
        .apply(&builtin, "all-balanced", &runner, false)
        .unwrap_err();
    assert!(err.message.contains("MIG mode on is pending and a GPU reset did not apply it; only a reboot can; reboot the node, or let gpu-agent do it with spec.migManager.reboot: true"), "{err}");
    assert!(
        err.message.ends_with("the previous layout is back"),
        "{err}"
    );
    assert!(
        n.control
            .gpus
            .lock()
            .unwrap()
            .iter()
            .all(|g| g.gpu_instances.is_empty() && !g.pending)
    );
    // Allowed to reboot: it asks the host's systemd.
    match n.apply(&builtin, "all-balanced", &runner, true).unwrap() {
        Applied::Rebooting(why) => assert!(
            why.ends_with("rebooting the node (spec.migManager.reboot)"),
            "{why}"
        ),
        other => panic!("{other:?}"),
    }
    let root = n.host.path().display().to_string();
    assert_eq!(
        runner.calls(),
        vec![vec![
            "chroot".to_string(),
            root,
            "systemctl".into(),
            "reboot".into()
        ]]
    );
}

#[test]
fn a_failure_midway_puts_every_changed_gpu_back() {
    let n = node("h100-sxm-8");
    let builtin = MigPartedConfig::builtin();
    let runner = RecordingRunner::default();
    n.apply(&builtin, "all-1g.10gb", &runner, false).unwrap();
    let before = n.control.gpus.lock().unwrap().clone();
    let placements = |g: &[GpuMig]| -> Vec<Vec<(u32, u32, u32, usize)>> {
        g.iter()
            .map(|m| {
                m.gpu_instances
                    .iter()
                    .map(|i| (i.profile_id, i.start, i.size, i.compute_instances.len()))
                    .collect()
            })
            .collect()
    };
    // GPU 7 refuses every 3g.40gb (profile id 9): GPUs 0-6 are done by then.
    let last = n.inv.gpus[7].uuid.clone().unwrap();
    *n.control.fail_gi.lock().unwrap() = Some((last, 9));
    let err = n
        .apply(&builtin, "all-balanced", &runner, false)
        .unwrap_err();
    assert!(err.message.starts_with("GPU 7 (GPU-"), "{err}");
    assert!(
        err.message.contains("NVML refused every placement tried"),
        "{err}"
    );
    assert!(
        err.message.ends_with("the previous layout is back"),
        "{err}"
    );
    let after = n.control.gpus.lock().unwrap().clone();
    assert_eq!(placements(&after), placements(&before));
    assert!(after.iter().all(|g| g.current));
}

#[test]
fn layouts_that_do_not_fit_are_refused_before_anything_changes() {
    let n = node("h100-sxm-8");
    let c = layouts(
        "version: v1\nmig-configs:\n  a:\n    - devices: all\n      mig-enabled: true\n      mig-devices: {\"1g.10gb\": 8}\n  b:\n    - devices: [0]\n      mig-enabled: true\n      mig-devices: {\"1g.5gb\": 1}\n  c:\n    - devices: [9]\n      mig-enabled: false\n  d:\n    - devices: all\n      mig-enabled: false\n    - devices: [1]\n      mig-enabled: false\n  e:\n    - devices: [0]\n      mig-enabled: true\n      mig-devices: {\"4g.40gb\": 1, \"3g.40gb\": 1, \"1g.10gb\": 1}\n",
    );
    let before = n.control.gpus.lock().unwrap().clone();
    for (layout, want) in [
        (
            "a",
            "mig.yaml: mig-configs.a[0].mig-devices: GPU 0 (NVIDIA H100 80GB HBM3): 8 instances of 1g.10gb do not fit (at most 7)",
        ),
        (
            "b",
            "mig.yaml: mig-configs.b[0].mig-devices.1g.5gb: GPU 0 (NVIDIA H100 80GB HBM3) has no MIG profile 1g.5gb (it has: ",
        ),
        (
            "d",
            "mig.yaml: mig-configs.d[1]: GPU 1 is also selected by mig-configs.d[0]; each GPU may be selected once",
        ),
        (
            "e",
            "mig.yaml: mig-configs.e[0].mig-devices: GPU 0 (NVIDIA H100 80GB HBM3): 4g.40gb, 3g.40gb, 1g.10gb do not fit together (no placement leaves them apart)",
        ),
    ] {
        let e = n.plan(&c, layout).unwrap_err().to_string();
        assert!(e.starts_with(want), "{layout}: {e}");
    }
    assert_eq!(*n.control.gpus.lock().unwrap(), before);
}

/// A GPU index the node does not have is skipped, as mig-parted skips it
/// (one layout serves nodes of several sizes), and said in the summary;
/// the GPUs it has get their layout.
#[test]
fn indices_the_node_does_not_have_are_skipped_as_mig_parted_does() {
    let n = node("h100-sxm-8");
    let c = layouts(
        "version: v1\nmig-configs:\n  c:\n    - devices: [7, 9, 12]\n      mig-enabled: true\n      mig-devices: {\"3g.40gb\": 2}\n",
    );
    let plan = n.plan(&c, "c").unwrap();
    assert_eq!(plan.absent, [9, 12]);
    assert_eq!(plan.gpus.len(), 1);
    assert_eq!(plan.gpus[0].index, 7);
    assert!(
        plan.summary()
            .ends_with("; GPU(s) 9, 12 named by the layout are not on this node (skipped)"),
        "{}",
        plan.summary()
    );
}

/// The GPU Operator's default layouts (its ConfigMap's `config.yaml`,
/// unchanged from ../shared/upstream).
fn operators_layouts() -> MigPartedConfig {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/upstream/gpu-operator/state-mig-manager_0400_configmap.yaml"
    );
    let Ok(text) = std::fs::read_to_string(path) else {
        panic!("{path}: upstream's files are not there (CI has ../shared beside the checkout)");
    };
    let cm: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text).unwrap();
    MigPartedConfig::from_yaml(cm["data"]["config.yaml"].as_str().unwrap(), "config.yaml").unwrap()
}

/// A node of `count` GPUs with PCI device ID `device`, `memory_mib` of
/// memory each, MIG-capable with MIG off.
fn node_of(name: &str, device: u16, memory_mib: u64, ampere: bool, count: usize) -> Node {
    let dir = tempfile::tempdir().unwrap();
    let mut yaml = format!(
        "name: {count}x {name}\ndriver:\n  version: 580.95.05\n  cudaVersion: \"13.0\"\ngpus:\n"
    );
    for i in 0..count {
        yaml.push_str(&format!(
            "  - busId: \"0000:{:02x}:00.0\"\n    name: NVIDIA {name}\n    uuid: GPU-5e1f0000-0000-4000-8000-{device:04x}{i:08x}\n    deviceId: \"{device:#06x}\"\n    memoryMib: {memory_mib}\n    computeCapability: \"{}\"\n    mig: {{ capable: true, enabled: false }}\n",
            0x10 + i,
            if ampere { "8.0" } else { "9.0" }
        ));
    }
    let file = dir.path().join("node.yaml");
    std::fs::write(&file, yaml).unwrap();
    node(file.to_str().unwrap())
}

/// A node of two GPUs of a model in simnode's table, with the memory that
/// picks the model where a device ID has two tables.
fn model_node(m: &simnode::mig::GpuMigFacts, device: u16) -> Node {
    node_of(
        m.model,
        device,
        m.full().memory_mib + 400,
        m.mode_change_needs_reset,
        2,
    )
}

/// What a plan asks of each GPU.
fn wanted(p: &Plan) -> Vec<(u32, String)> {
    p.gpus
        .iter()
        .map(|g| (g.index, g.wanted.describe()))
        .collect()
}

/// Every layout name of the GPU Operator's default ConfigMap, on a
/// simulated node of every GPU the name is for (a GPU its file plans MIG
/// devices on: an entry selects it and the GPU has the profiles), plans
/// with gpu-agent's built-in layouts as with the operator's file: the
/// same MIG devices on the same GPUs. One difference is kept, and said in
/// README: `all-1g.24gb` on an HGX GB200 under its early driver, whose
/// `1g.24gb` is its seven-instance `1g`: the operator's file asks four (its
/// entry is written for the H100 NVL's and GH200's four `1g.24gb`); the
/// built-in `all-<profile>` is as many as fit, seven.
#[test]
fn every_operator_layout_plans_as_the_operators_file_does_on_every_gpu_it_is_for() {
    let op = operators_layouts();
    let builtin = MigPartedConfig::builtin();
    assert_eq!(op.mig_configs.len(), 81);
    let mut covered: BTreeMap<String, Vec<&str>> = BTreeMap::new();
    let mut differ: Vec<String> = Vec::new();
    for m in simnode::mig::MODELS {
        for &device in m.device_ids {
            let n = model_node(m, device);
            assert_eq!(n.control.gpus.lock().unwrap()[0].facts().model, m.model);
            for name in op.mig_configs.keys() {
                let Ok(want) = n.plan(&op, name) else {
                    continue;
                };
                if want.gpus.is_empty() {
                    continue;
                }
                let have = n
                    .plan(&builtin, name)
                    .unwrap_or_else(|e| panic!("{name} on the {} ({device:#06x}): {e}", m.model));
                if wanted(&have) != wanted(&want) {
                    differ.push(format!(
                        "{name} on the {}: operator {:?}, built-in {:?}",
                        m.model,
                        wanted(&want),
                        wanted(&have)
                    ));
                }
                assert_eq!(have.absent, want.absent);
                // From the built-in file itself, not derived at run time.
                assert!(
                    have.derived.is_empty(),
                    "{name} on the {}: {}",
                    m.model,
                    have.summary()
                );
                covered.entry(name.clone()).or_default().push(m.model);
            }
        }
    }
    let uncovered: Vec<&String> = op
        .mig_configs
        .keys()
        .filter(|n| !covered.contains_key(*n))
        .collect();
    assert!(uncovered.is_empty(), "no simulated GPU for {uncovered:?}");
    assert_eq!(
        differ,
        [
            "all-1g.24gb on the GB200 189GB (early HGX driver): operator [(0, \"1g.24gb x4\"), (1, \"1g.24gb x4\")], built-in [(0, \"1g.24gb x7\"), (1, \"1g.24gb x7\")]"
        ]
    );
    // The names the issue found missing, on the GPUs they are for.
    for (name, model) in [
        ("all-1g.23gb", "B200 180GB"),
        ("all-7g.180gb", "B200 180GB"),
        (
            "all-1g.24gb.gfx",
            "RTX PRO 6000 Blackwell Server Edition 96GB",
        ),
        (
            "all-2g.48gb.me.all",
            "RTX PRO 6000 Blackwell Server Edition 96GB",
        ),
        (
            "all-1g.24gb-me",
            "RTX PRO 6000 Blackwell Server Edition 96GB",
        ),
        ("all-3g.93gb", "GB200 186GB"),
        ("all-7g.189gb", "GB200 189GB (early HGX driver)"),
        ("all-1g.36gb", "GH200 144GB HBM3e"),
        ("all-7g.278gb", "GB300 288GB"),
        ("all-balanced", "H100 96GB (GH200, H100 96GB), H20 96GB"),
    ] {
        assert!(
            covered[name].contains(&model),
            "{name}: {:?}",
            covered[name]
        );
    }
}

/// For every model of simnode's table, the layouts derived from its
/// profiles are the built-in file's: the same GPU gets the same MIG
/// devices whichever way it is planned, and the file names no more. (A
/// device ID with two tables, one GPU's under two drivers, has the first's
/// entries and the second's where the first has none.)
#[test]
fn the_derived_layouts_are_the_built_in_ones_for_every_model() {
    let builtin = MigPartedConfig::builtin();
    let mut devices: Vec<u16> = simnode::mig::MODELS
        .iter()
        .flat_map(|m| m.device_ids.iter().copied())
        .collect();
    devices.sort_unstable();
    devices.dedup();
    for device in devices {
        let tables: Vec<(&str, Vec<GiProfile>)> = simnode::mig::MODELS
            .iter()
            .filter(|m| m.device_ids.contains(&device))
            .map(|m| {
                (
                    m.model,
                    m.profiles.iter().map(GiProfile::from_table).collect(),
                )
            })
            .collect();
        let pci = format!("0x{device:04X}10DE");
        for (name, entries) in &builtin.mig_configs {
            let kind = derive::Generic::parse(name).unwrap();
            let listed = entries.iter().find(|e| {
                e.device_filter
                    .as_ref()
                    .is_none_or(|f| f.items().contains(&pci.as_str()))
            });
            let derived = tables
                .iter()
                .find_map(|(_, p)| derive::entry(&kind, p).ok());
            match (listed, derived) {
                (Some(e), Some(d)) => {
                    assert_eq!(e.mig_enabled, d.mig_enabled, "{name} on {pci}");
                    assert_eq!(e.mig_devices, d.mig_devices, "{name} on {pci}");
                }
                (None, None) => {}
                (e, d) => panic!(
                    "{name} on {pci} ({:?}): file {e:?}, derived {d:?}",
                    tables[0].0
                ),
            }
        }
    }
}

/// A MIG-capable GPU the built-in layouts do not name (its PCI device ID
/// is in no entry) gets every generic layout from the profiles NVML lists
/// for it; a user's file is planned as written (the GPU is not selected).
#[test]
fn a_gpu_the_built_in_layouts_do_not_name_gets_them_from_its_own_profiles() {
    // Unknown to the table: simnode's NVML answers with the H100 80GB's
    // profiles, gpu-agent knows nothing of it but what NVML says.
    let n = node_of("Future GPU 80GB", 0x3fff, 81559, false, 2);
    let builtin = MigPartedConfig::builtin();
    let p = n.plan(&builtin, "all-1g.10gb").unwrap();
    assert_eq!(p.derived, [0, 1]);
    assert_eq!(
        p.summary(),
        "GPUs 0-1: MIG off → 1g.10gb x7; GPU(s) 0, 1: layout derived from their MIG profiles as NVML lists them (not in the built-in layouts)"
    );
    let p = n.plan(&builtin, "all-disabled").unwrap();
    assert!(p.derived.is_empty() && p.is_noop(), "{}", p.summary());
    let err = n.plan(&builtin, "all-1g.5gb").unwrap_err().to_string();
    assert!(
        err.starts_with("mig.yaml: mig-configs.all-1g.5gb (derived from GPU 0's MIG profiles): GPU 0 (NVIDIA Future GPU 80GB) has no MIG profile 1g.5gb (it has: 1g.10gb, "),
        "{err}"
    );
    let err = n.plan(&builtin, "custom").unwrap_err().to_string();
    assert!(err.contains("no layout named \"custom\""), "{err}");
    // Applied and checked through NVML like any layout.
    let runner = RecordingRunner::default();
    n.apply(&builtin, "all-balanced", &runner, false).unwrap();
    for gpu in 0..2 {
        assert_eq!(n.devices(gpu), ["1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb"]);
    }
    assert!(n.plan(&builtin, "all-balanced").unwrap().is_noop());
    // A user's layout is planned as written: its entry names the H100's ID.
    let mine = layouts(
        "version: v1\nmig-configs:\n  all-1g.10gb:\n    - device-filter: \"0x233010DE\"\n      devices: all\n      mig-enabled: true\n      mig-devices: {\"1g.10gb\": 7}\n",
    );
    let p = n.plan(&mine, "all-1g.10gb").unwrap();
    assert!(p.gpus.is_empty() && p.derived.is_empty());
}

/// Where NVML lists no MIG profiles while MIG is off and the table does not
/// know the model, a derived layout waits for MIG to be on, in words; once
/// it is, the layout is derived.
#[test]
fn without_profiles_a_derived_layout_asks_for_mig_on_first() {
    let mut n = node_of("Future GPU 80GB", 0x3fff, 81559, false, 1);
    n.control.no_profiles_while_off = true;
    let builtin = MigPartedConfig::builtin();
    let err = n.plan(&builtin, "all-balanced").unwrap_err().to_string();
    assert!(
        err.ends_with("GPU 0 (NVIDIA Future GPU 80GB, PCI device 0x3fff) is not in gpu-agent's MIG table and NVML lists no MIG profiles while MIG is off; select all-enabled first, then all-balanced"),
        "{err}"
    );
    let runner = RecordingRunner::default();
    n.apply(&builtin, "all-enabled", &runner, false).unwrap();
    let p = n.plan(&builtin, "all-balanced").unwrap();
    assert_eq!(p.derived, [0]);
    assert_eq!(
        wanted(&p),
        [(0, "3g.40gb, 2g.20gb, 1g.10gb x2".to_string())]
    );
    // A known model is checked against NVIDIA's table meanwhile.
    let mut h = node("h100-sxm-8");
    h.control.no_profiles_while_off = true;
    let p = h.plan(&builtin, "all-balanced").unwrap();
    assert!(p.derived.is_empty());
    assert_eq!(p.changing().count(), 8);
}

/// One GPU, two drivers: an HGX GB200 under its early driver lists
/// `1g.24gb` … `7g.189gb` where the built-in entries for its device ID ask
/// the current driver's `1g.23gb` … `7g.186gb`. A built-in entry naming a
/// profile the GPU lacks gives way to the layout derived from what it has;
/// names whose profiles it has are the built-in entry's.
#[test]
fn a_driver_that_names_profiles_differently_gets_derived_layouts() {
    let early = node_of("GB200", 0x2941, 191_888, false, 1);
    let builtin = MigPartedConfig::builtin();
    let p = early.plan(&builtin, "all-balanced").unwrap();
    assert_eq!(p.derived, [0]);
    assert_eq!(
        wanted(&p),
        [(0, "3g.95gb, 2g.47gb, 1g.24gb x2".to_string())]
    );
    let p = early.plan(&builtin, "all-1g.47gb").unwrap();
    assert!(p.derived.is_empty());
    assert_eq!(wanted(&p), [(0, "1g.47gb x4".to_string())]);
    let err = early.plan(&builtin, "all-1g.23gb").unwrap_err().to_string();
    assert!(err.contains("has no MIG profile 1g.23gb"), "{err}");
    // The current driver's GB200: the built-in entries, nothing derived.
    let current = node_of("GB200", 0x2941, 189_471, false, 1);
    let p = current.plan(&builtin, "all-balanced").unwrap();
    assert!(p.derived.is_empty());
    assert_eq!(
        wanted(&p),
        [(0, "3g.93gb, 2g.47gb, 1g.23gb x2".to_string())]
    );
}

/// The GPU Operator's default layouts ConfigMap (its `config.yaml`,
/// unchanged from ../shared/upstream) on an 8x H100 node: every layout
/// plans (the H100's entries apply, other models' are skipped) but those
/// for every GPU with a profile the H100 80GB lacks, which mig-parted
/// fails there too; its `all-1g.10gb` is seven 1g.10gb on every GPU.
#[test]
fn the_operators_default_layouts_plan_on_an_h100_node() {
    let c = operators_layouts();
    let n = node("h100-sxm-8");
    let names: Vec<String> = c.mig_configs.keys().cloned().collect();
    assert!(names.len() >= 80, "{}", names.len());
    let mut refused = 0;
    for layout in &names {
        if let Err(e) = n.plan(&c, layout) {
            // A layout for every GPU (no device-filter) with a profile the
            // H100 80GB lacks fails, as mig-parted fails it there.
            let unfiltered = c.mig_configs[layout]
                .iter()
                .any(|e| e.device_filter.is_none());
            assert!(
                unfiltered && e.to_string().contains("has no MIG profile"),
                "{layout}: {e}"
            );
            refused += 1;
        }
    }
    assert!(
        refused < names.len(),
        "{refused} of {} refused",
        names.len()
    );
    let plan = n.plan(&c, "all-1g.10gb").unwrap();
    assert_eq!(plan.gpus.len(), 8);
    assert_eq!(plan.summary(), "GPUs 0-7: MIG off → 1g.10gb x7");
}
