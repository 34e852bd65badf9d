//! Module loading/unloading and device nodes over temp host roots, with the
//! exact system calls recorded (and, as root, real nodes made with mknod).

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

use hostlib::{Call, DriverState, HostRoot, RecordingSyscalls};
use kmod::devnodes::{self, Outcome};
use kmod::modules::{self, LoadOutcome, ModuleError};
use nix::errno::Errno;

const KERNEL: &str = "6.1.0-27-amd64";
const DIR: &str = "/lib/modules/6.1.0-27-amd64/kernel/drivers/video";

/// A host with a module dir holding `.ko` files built for `built_for`, and
/// `/proc/modules` listing `loaded` lines.
fn host(built_for: &str, loaded: &str) -> (tempfile::TempDir, HostRoot) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    fs::create_dir_all(p.join("proc/sys/kernel")).unwrap();
    fs::write(p.join("proc/sys/kernel/osrelease"), format!("{KERNEL}\n")).unwrap();
    fs::write(p.join("proc/modules"), loaded).unwrap();
    let mods = p.join(DIR.trim_start_matches('/'));
    fs::create_dir_all(&mods).unwrap();
    for (_, file) in modules::LOAD_ORDER {
        // What matters of a .ko here: its .modinfo strings.
        let mut bytes = b"\x7fELF....license=Dual MIT/GPL\0".to_vec();
        bytes.extend(format!("vermagic={built_for} SMP preempt mod_unload modversions \0").bytes());
        fs::write(mods.join(file), bytes).unwrap();
    }
    let root = HostRoot::new(p).unwrap();
    (dir, root)
}

fn real(root: &HostRoot, file: &str) -> PathBuf {
    root.resolve(format!("{DIR}/{file}")).unwrap()
}

fn params() -> BTreeMap<String, BTreeMap<String, String>> {
    let mut p = BTreeMap::new();
    p.insert(
        "nvidia".to_string(),
        BTreeMap::from([
            ("NVreg_EnableGpuFirmware".to_string(), "1".to_string()),
            (
                "NVreg_OpenRmEnableUnsupportedGpus".to_string(),
                "1".to_string(),
            ),
        ]),
    );
    p.insert(
        "nvidia_uvm".to_string(),
        BTreeMap::from([("uvm_disable_hmm".to_string(), "1".to_string())]),
    );
    p
}

#[test]
fn modules_load_in_dependency_order_with_their_parameters() {
    let (_d, root) = host(KERNEL, "ext4 1003520 1 - Live 0x0\n");
    let sys = RecordingSyscalls::new();
    let specs = modules::plan(DIR, false, true, &params());
    let done = modules::load(&root, &sys, &specs).unwrap();
    assert_eq!(
        sys.calls(),
        vec![
            Call::FinitModule {
                path: real(&root, "nvidia.ko"),
                params: "NVreg_EnableGpuFirmware=1 NVreg_OpenRmEnableUnsupportedGpus=1".into()
            },
            Call::FinitModule {
                path: real(&root, "nvidia-uvm.ko"),
                params: "uvm_disable_hmm=1".into()
            },
            Call::FinitModule {
                path: real(&root, "nvidia-modeset.ko"),
                params: String::new()
            },
            Call::FinitModule {
                path: real(&root, "nvidia-peermem.ko"),
                params: String::new()
            },
        ]
    );
    assert_eq!(done.len(), 4);
}

#[test]
fn loaded_with_the_same_parameters_is_a_no_op_and_with_others_an_error() {
    let loaded = "nvidia_uvm 1527808 0 - Live 0x0\nnvidia 56524800 1 nvidia_uvm, Live 0x0\n";
    let (d, root) = host(KERNEL, loaded);
    let sysfs = d.path().join("sys/module/nvidia/parameters");
    fs::create_dir_all(&sysfs).unwrap();
    fs::write(sysfs.join("NVreg_EnableGpuFirmware"), "1\n").unwrap();
    fs::write(sysfs.join("NVreg_OpenRmEnableUnsupportedGpus"), "1\n").unwrap();
    let sys = RecordingSyscalls::new();
    let specs = modules::plan(DIR, false, false, &params());
    let done = modules::load(&root, &sys, &specs).unwrap();
    assert_eq!(
        done[..2],
        [
            LoadOutcome::AlreadyLoaded {
                module: "nvidia".into()
            },
            LoadOutcome::AlreadyLoaded {
                module: "nvidia_uvm".into()
            }
        ]
    );
    // Only nvidia_modeset was missing.
    assert_eq!(
        sys.calls(),
        vec![Call::FinitModule {
            path: real(&root, "nvidia-modeset.ko"),
            params: String::new()
        }]
    );
    fs::write(sysfs.join("NVreg_EnableGpuFirmware"), "0\n").unwrap();
    let sys = RecordingSyscalls::new();
    let err = modules::load(&root, &sys, &specs).unwrap_err();
    assert_eq!(
        err.to_string(),
        "nvidia is loaded with NVreg_EnableGpuFirmware=0, the policy asks for NVreg_EnableGpuFirmware=1; unload it first (gpu-agent driver unload) or let the policy reload it"
    );
    assert!(
        sys.calls().is_empty(),
        "nothing may be loaded after a refusal"
    );
}

#[test]
fn a_module_for_another_kernel_is_refused_naming_both() {
    let (_d, root) = host("6.1.0-25-amd64", "");
    let sys = RecordingSyscalls::new();
    let err = modules::load(
        &root,
        &sys,
        &modules::plan(DIR, false, false, &BTreeMap::new()),
    )
    .unwrap_err();
    assert!(matches!(err, ModuleError::Vermagic { .. }));
    assert_eq!(
        err.to_string(),
        format!(
            "nvidia was built for kernel 6.1.0-25-amd64, the running kernel is {KERNEL}: it cannot be loaded ({DIR}/nvidia.ko)"
        )
    );
    assert!(sys.calls().is_empty());
}

#[test]
fn a_failed_load_names_module_file_and_errno() {
    let (_d, root) = host(KERNEL, "");
    let sys = RecordingSyscalls::new();
    sys.fail_next("finit_module", Errno::ENOEXEC);
    let err = modules::load(
        &root,
        &sys,
        &modules::plan(DIR, false, false, &BTreeMap::new()),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.starts_with(&format!(
            "loading nvidia from {DIR}/nvidia.ko: finit_module"
        )),
        "{err}"
    );
    assert!(err.contains("ENOEXEC"), "{err}");
    // EEXIST (loaded meanwhile) is success.
    let sys = RecordingSyscalls::new();
    sys.fail_next("finit_module", Errno::EEXIST);
    assert!(
        modules::load(
            &root,
            &sys,
            &modules::plan(DIR, false, false, &BTreeMap::new())
        )
        .is_ok()
    );
}

const STACK: &str = "nvidia_modeset 1527808 0 - Live 0x0\nnvidia_uvm 1527808 0 - Live 0x0\nnvidia 56524800 2 nvidia_uvm,nvidia_modeset, Live 0x0\n";

fn names(n: &[&str]) -> Vec<String> {
    n.iter().map(|s| s.to_string()).collect()
}

/// A process `comm` (pid `pid`) with /dev/nvidia0 (and /dev/null) open.
fn holder(root: &std::path::Path, pid: u32, comm: &str) {
    let fd = root.join(format!("proc/{pid}/fd"));
    fs::create_dir_all(&fd).unwrap();
    symlink("/dev/nvidia0", fd.join("7")).unwrap();
    symlink("/dev/null", fd.join("0")).unwrap();
    fs::write(root.join(format!("proc/{pid}/comm")), format!("{comm}\n")).unwrap();
}

fn unload_all(root: &HostRoot, sys: &RecordingSyscalls) -> Result<Vec<String>, ModuleError> {
    modules::unload(
        root,
        sys,
        &names(&["nvidia", "nvidia_uvm", "nvidia_modeset"]),
    )
}

#[test]
fn unload_goes_in_reverse_order() {
    let (_d, root) = host(KERNEL, STACK);
    let sys = RecordingSyscalls::new();
    let done = modules::unload(
        &root,
        &sys,
        &names(&["nvidia", "nvidia_uvm", "nvidia_modeset"]),
    )
    .unwrap();
    assert_eq!(done, ["nvidia_modeset", "nvidia_uvm", "nvidia"]);
    assert_eq!(
        sys.calls(),
        ["nvidia_modeset", "nvidia_uvm", "nvidia"]
            .iter()
            .map(|n| Call::DeleteModule {
                name: n.to_string()
            })
            .collect::<Vec<_>>()
    );
}

#[test]
fn unload_refuses_while_in_use_naming_holders_and_processes() {
    // nvidia_drm (not ours to unload here) holds nvidia_modeset; a process has /dev/nvidia0 open.
    let stack = format!(
        "nvidia_drm 98304 1 - Live 0x0\n{}",
        STACK.replace(
            "nvidia_modeset 1527808 0 -",
            "nvidia_modeset 1527808 1 nvidia_drm,"
        )
    );
    let (d, root) = host(KERNEL, &stack);
    holder(d.path(), 4242, "python3");
    let sys = RecordingSyscalls::new();
    let err = unload_all(&root, &sys).unwrap_err();
    assert_eq!(
        err.to_string(),
        "nvidia_modeset is in use by module(s) nvidia_drm (1 process(es) have NVIDIA devices open: python3 (pid 4242, /dev/nvidia0)); stop them first"
    );
    assert!(sys.calls().is_empty());
    // The kernel's own refusal (a process holds it) reads the same way.
    let (_d, root) = host(KERNEL, STACK);
    let sys = RecordingSyscalls::new();
    sys.fail_next("delete_module", Errno::EWOULDBLOCK);
    let err = modules::unload(
        &root,
        &sys,
        &names(&["nvidia", "nvidia_uvm", "nvidia_modeset"]),
    )
    .unwrap_err();
    assert!(
        matches!(err, ModuleError::InUse { ref module, .. } if module == "nvidia_modeset"),
        "{err}"
    );
}

#[test]
fn unload_refuses_before_unloading_anything_when_the_base_module_is_held() {
    // nvidia counts 3 users: its two modules and an open /dev/nvidia0. The
    // free nvidia_modeset and nvidia_uvm must not be unloaded first (the
    // VM test caught exactly that).
    let (d, root) = host(
        KERNEL,
        &STACK.replace("nvidia 56524800 2 ", "nvidia 56524800 3 "),
    );
    holder(d.path(), 77, "sleep");
    let sys = RecordingSyscalls::new();
    let err = unload_all(&root, &sys).unwrap_err();
    assert_eq!(
        err.to_string(),
        "nvidia is in use (1 process(es) have NVIDIA devices open: sleep (pid 77, /dev/nvidia0)); stop them first"
    );
    assert!(sys.calls().is_empty(), "{:?}", sys.calls());
}

/// The simulated 2x H100 MIG node's /proc and /sys, read by the real discovery.
fn mig_node() -> (tempfile::TempDir, HostRoot, DriverState) {
    let dir = tempfile::tempdir().unwrap();
    simnode::NodeDescription::load("h100-mig-2")
        .unwrap()
        .materialize(dir.path())
        .unwrap();
    // A fresh host: no /dev yet.
    fs::remove_dir_all(dir.path().join("dev")).unwrap();
    let root = HostRoot::new(dir.path()).unwrap();
    let state = DriverState::read(&root);
    (dir, root, state)
}

#[test]
fn device_nodes_use_the_majors_from_proc_devices() {
    let (_d, root, state) = mig_node();
    let caps = [
        simnode::mig_cap_minor(0, 0, None),
        simnode::mig_cap_minor(0, 0, Some(0)),
    ];
    let nodes = devnodes::plan(&root, &state, &caps).unwrap();
    let got: Vec<(String, u32, u32, u32)> = nodes
        .iter()
        .map(|n| (n.path.clone(), n.major, n.minor, n.mode))
        .collect();
    assert_eq!(
        got,
        vec![
            ("/dev/nvidiactl".into(), 195, 255, 0o666),
            ("/dev/nvidia-modeset".into(), 195, 254, 0o666),
            ("/dev/nvidia0".into(), 195, 0, 0o666),
            ("/dev/nvidia1".into(), 195, 1, 0o666),
            ("/dev/nvidia-uvm".into(), 234, 0, 0o666),
            ("/dev/nvidia-uvm-tools".into(), 234, 1, 0o666),
            // MIG config: only root (the driver's capability file says 0400).
            ("/dev/nvidia-caps/nvidia-cap1".into(), 237, 1, 0o400),
            ("/dev/nvidia-caps/nvidia-cap2".into(), 237, 2, 0o444),
            ("/dev/nvidia-caps/nvidia-cap3".into(), 237, 3, 0o444),
            ("/dev/nvidia-caps/nvidia-cap4".into(), 237, 4, 0o444),
        ]
    );
    let sys = RecordingSyscalls::new();
    let out = devnodes::ensure(&root, &sys, &nodes[..3]).unwrap();
    assert!(out.iter().all(|o| matches!(o, Outcome::Created(_))));
    let path = |p: &str| root.resolve(p).unwrap();
    assert_eq!(
        sys.calls(),
        vec![
            Call::MknodChar {
                path: path("/dev/nvidiactl"),
                mode: 0o666,
                major: 195,
                minor: 255
            },
            Call::Chmod {
                path: path("/dev/nvidiactl"),
                mode: 0o666
            },
            Call::MknodChar {
                path: path("/dev/nvidia-modeset"),
                mode: 0o666,
                major: 195,
                minor: 254
            },
            Call::Chmod {
                path: path("/dev/nvidia-modeset"),
                mode: 0o666
            },
            Call::MknodChar {
                path: path("/dev/nvidia0"),
                mode: 0o666,
                major: 195,
                minor: 0
            },
            Call::Chmod {
                path: path("/dev/nvidia0"),
                mode: 0o666
            },
        ]
    );
    assert_eq!(
        fs::read_link(path("/dev/char").join("195:0")).unwrap(),
        Path::new("../nvidia0")
    );
    assert_eq!(
        fs::read_link(path("/dev/char").join("195:255")).unwrap(),
        Path::new("../nvidiactl")
    );
}

#[test]
fn no_frontend_major_is_said_plainly() {
    let (d, root, _) = mig_node();
    fs::write(
        d.path().join("proc/devices"),
        "Character devices:\n  1 mem\n\nBlock devices:\n",
    )
    .unwrap();
    let state = DriverState::read(&root);
    let err = devnodes::plan(&root, &state, &[]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "no nvidia-frontend (or nvidia) major in /proc/devices: the module that registers it is not loaded"
    );
}

/// Real nodes (mknod works in any directory as root; opening them is not
/// needed): made once, left alone the second time, a wrong one replaced.
#[test]
#[ignore = "needs root (mknod); scripts/test runs it as root"]
fn real_nodes_are_made_once_and_wrong_ones_replaced() {
    let (_d, root, state) = mig_node();
    let nodes = devnodes::plan(&root, &state, &[]).unwrap();
    let sys = hostlib::LinuxSyscalls;
    let first = devnodes::ensure(&root, &sys, &nodes).unwrap();
    assert!(
        first.iter().all(|o| matches!(o, Outcome::Created(_))),
        "{first:?}"
    );
    let second = devnodes::ensure(&root, &sys, &nodes).unwrap();
    assert!(
        second.iter().all(|o| matches!(o, Outcome::Unchanged(_))),
        "{second:?}"
    );
    let n0 = root.resolve("/dev/nvidia0").unwrap();
    fs::remove_file(&n0).unwrap();
    fs::write(&n0, "a stray file").unwrap();
    let third = devnodes::ensure(&root, &sys, &nodes).unwrap();
    assert!(
        third.contains(&Outcome::Replaced {
            path: "/dev/nvidia0".into(),
            was: "not a device".into()
        }),
        "{third:?}"
    );
    use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
    let m = fs::metadata(&n0).unwrap();
    assert!(m.file_type().is_char_device());
    assert_eq!(
        (
            nix::sys::stat::major(m.rdev()),
            nix::sys::stat::minor(m.rdev())
        ),
        (195, 0)
    );
    assert_eq!(m.permissions().mode() & 0o777, 0o666);
}

/// The driver's params choose /dev/nvidia*'s mode and group (a site that
/// gives GPUs to the `video` group: NVreg_DeviceFileMode=0660,
/// NVreg_DeviceFileGID=44); nothing wider is made.
#[test]
fn nvidia_nodes_take_mode_and_owner_from_the_drivers_params() {
    let (d, root, state) = mig_node();
    fs::write(
        d.path().join("proc/driver/nvidia/params"),
        "ModifyDeviceFiles: 1\nDeviceFileUID: 0\nDeviceFileGID: 44\nDeviceFileMode: 432\n",
    )
    .unwrap();
    let nodes = devnodes::plan(&root, &state, &[]).unwrap();
    let ctl = nodes.iter().find(|n| n.path == "/dev/nvidiactl").unwrap();
    assert_eq!(
        (ctl.mode, ctl.uid, ctl.gid, ctl.modify),
        (0o660, 0, 44, true)
    );
    // uvm publishes no mode of its own: nvidia-modprobe's 0666.
    let uvm = nodes.iter().find(|n| n.path == "/dev/nvidia-uvm").unwrap();
    assert_eq!(uvm.mode, 0o666);
    let sys = RecordingSyscalls::new();
    devnodes::ensure(&root, &sys, &nodes[..1]).unwrap();
    let path = root.resolve("/dev/nvidiactl").unwrap();
    assert_eq!(
        sys.calls(),
        vec![
            Call::MknodChar {
                path: path.clone(),
                mode: 0o660,
                major: 195,
                minor: 255
            },
            Call::Chmod {
                path: path.clone(),
                mode: 0o660
            },
            Call::Chown {
                path,
                uid: Some(0),
                gid: Some(44)
            },
        ]
    );
}

/// `ModifyDeviceFiles: 0` and `DeviceFileModify: 0`: the administrator
/// keeps those nodes; gpu-agent makes and changes none of them, and says so.
#[test]
fn nodes_the_driver_leaves_to_the_administrator_are_not_touched() {
    let (d, root, state) = mig_node();
    fs::write(
        d.path().join("proc/driver/nvidia/params"),
        "ModifyDeviceFiles: 0\nDeviceFileMode: 438\n",
    )
    .unwrap();
    fs::write(
        d.path().join("proc/driver/nvidia/capabilities/mig/config"),
        "DeviceFileMinor: 1\nDeviceFileMode: 256\nDeviceFileModify: 0\n",
    )
    .unwrap();
    let nodes = devnodes::plan(&root, &state, &[]).unwrap();
    let sys = RecordingSyscalls::new();
    let out = devnodes::ensure(&root, &sys, &nodes).unwrap();
    let left: Vec<&str> = out
        .iter()
        .filter_map(|o| match o {
            Outcome::LeftToAdmin { path, is } => {
                assert_eq!(is, "missing");
                Some(path.as_str())
            }
            _ => None,
        })
        .collect();
    assert_eq!(
        left,
        [
            "/dev/nvidiactl",
            "/dev/nvidia-modeset",
            "/dev/nvidia0",
            "/dev/nvidia1",
            "/dev/nvidia-caps/nvidia-cap1"
        ]
    );
    // Only what the driver lets us make: uvm's two and the monitor capability.
    let made: Vec<String> = sys
        .calls()
        .iter()
        .filter_map(|c| match c {
            Call::MknodChar { path, .. } => Some(path.display().to_string()),
            _ => None,
        })
        .collect();
    assert_eq!(made.len(), 3, "{made:?}");
    assert!(made.iter().all(|p| p.ends_with("nvidia-uvm")
        || p.ends_with("nvidia-uvm-tools")
        || p.ends_with("nvidia-cap2")));
}

/// The real H100 host's capability files: MIG config 0400, monitor 0444,
/// the node minors the driver gave them.
#[test]
fn capability_nodes_of_the_real_host() {
    let fixture =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hosts/h100-pcie-vm");
    let root = HostRoot::new(&fixture).unwrap();
    let state = DriverState::read(&root);
    assert!(state.unreadable.is_empty(), "{:?}", state.unreadable);
    let nodes = devnodes::plan(&root, &state, &[]).unwrap();
    let got: Vec<(String, u32, u32, u32)> = nodes
        .iter()
        .map(|n| (n.path.clone(), n.major, n.minor, n.mode))
        .collect();
    assert_eq!(
        got,
        vec![
            ("/dev/nvidiactl".into(), 195, 255, 0o666),
            ("/dev/nvidia0".into(), 195, 0, 0o666),
            ("/dev/nvidia-uvm".into(), 238, 0, 0o666),
            ("/dev/nvidia-uvm-tools".into(), 238, 1, 0o666),
            ("/dev/nvidia-caps/nvidia-cap1".into(), 241, 1, 0o400),
            ("/dev/nvidia-caps/nvidia-cap2".into(), 241, 2, 0o444),
        ]
    );
    // No module can be unloaded on that kernel, and that is said.
    let err = modules::unload(&root, &RecordingSyscalls::new(), &["nvidia_uvm".into()])
        .unwrap_err()
        .to_string();
    assert!(err.contains("built without module unloading"), "{err}");
}
