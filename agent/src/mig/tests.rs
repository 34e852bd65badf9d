//! The planner and applier against simnode's MIG state machine (the same
//! one the fake libnvidia-ml serves), through an in-memory [`MigControl`].

use std::sync::Mutex;

use hostlib::command::RecordingRunner;
use simnode::mig::state::{GpuMig, MigError as SimError};

use super::*;
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
    let inv = crate::inventory::discover(&host, &backend);
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

/// The GPU Operator's default layouts ConfigMap (its `config.yaml`,
/// unchanged from ../shared/upstream) on an 8x H100 node: every layout
/// plans (the H100's entries apply, other models' are skipped) but those
/// for every GPU with a profile the H100 80GB lacks, which mig-parted
/// fails there too; its `all-1g.10gb` is seven 1g.10gb on every GPU.
#[test]
fn the_operators_default_layouts_plan_on_an_h100_node() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../shared/upstream/gpu-operator/state-mig-manager_0400_configmap.yaml"
    );
    let Ok(text) = std::fs::read_to_string(path) else {
        panic!("{path}: upstream's files are not there (CI has ../shared beside the checkout)");
    };
    let cm: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text).unwrap();
    let c = MigPartedConfig::from_yaml(cm["data"]["config.yaml"].as_str().unwrap(), "config.yaml")
        .unwrap();
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
