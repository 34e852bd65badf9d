//! CDI specs: what a container runtime injects for each GPU, MIG device and
//! `all`, so that no NVIDIA container toolkit is needed on the host.
//!
//! One spec of kind [`CDI_KIND`] (`nvidia.com/gpu`, the kind the device
//! plugin's CDI names use), written as JSON to the policy's spec directory
//! (`/var/run/cdi` by default) through [`hostlib::managed`]:
//! - each GPU by index (`0`) and UUID (`GPU-…`): its `/dev/nvidiaN`;
//! - each MIG device by `<gpu>:<slot>` and UUID (`MIG-…`): the parent's
//!   `/dev/nvidiaN` and the GPU-instance and compute-instance access nodes
//!   under `/dev/nvidia-caps` (minors from `/proc/driver/nvidia-caps/mig-minors`);
//! - `all`: every one of those nodes;
//! - for every device (the spec's own edits): the control nodes that exist,
//!   the driver's user-space libraries (files suffixed with the driver
//!   version in the dynamic linker's directories), GSP firmware, the
//!   driver's binaries and IPC sockets, all bind-mounted read-only at the
//!   host's path; and two `createContainer` hooks run by gpu-agent itself
//!   (`gpu-agent cdi-hook …`, see [`hook`]) that add the `libcuda.so` link
//!   and refresh the container's linker cache.
//!
//! Paths in a spec are the host's own (the runtime reads them on the host),
//! with links resolved, so `/lib` and `/usr/lib` on a merged-/usr host give
//! one mount, not two.

pub mod hook;
pub mod spec;

use hostlib::HostRoot;
use serde::Serialize;

/// The spec format, the kind, and the MIG access minors are the model's
/// (the device plugin, the driver stage and the workload check use them too).
pub use gpu_model::cdi::{
    CDI_KIND, ContainerEdits, Device, DeviceNode, Hook, Mount, SPEC_VERSION, Spec,
    mig_access_minors,
};
use gpu_model::inventory::Inventory;

/// The file gpu-agent writes in the spec directory (the model's, which the
/// DRA front end reads too).
pub use gpu_model::cdi::SPEC_FILE;

/// Options for bind mounts of driver files into containers.
const MOUNT_OPTIONS: &[&str] = &["ro", "nosuid", "nodev", "rbind", "rprivate"];

/// Directories the dynamic linker searches without being told (besides
/// those in `/etc/ld.so.conf`).
const DEFAULT_LIB_DIRS: &[&str] = &[
    "/lib/x86_64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu",
    "/lib/aarch64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/lib64",
    "/usr/lib64",
    "/lib",
    "/usr/lib",
];

/// The driver's programs a container may run.
const BINARIES: &[&str] = &[
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
];
const BIN_DIRS: &[&str] = &["/usr/bin", "/usr/sbin", "/bin", "/sbin", "/usr/local/bin"];

/// Sockets (and MPS's pipe directory) of the driver's daemons.
const IPC: &[&str] = &[
    "/run/nvidia-persistenced/socket",
    "/run/nvidia-fabricmanager/socket",
    "/tmp/nvidia-mps",
];

/// Control nodes and the module that creates each.
const CONTROL_NODES: &[(&str, &str)] = &[
    ("/dev/nvidiactl", "nvidia"),
    ("/dev/nvidia-uvm", "nvidia_uvm"),
    ("/dev/nvidia-uvm-tools", "nvidia_uvm"),
    ("/dev/nvidia-modeset", "nvidia_modeset"),
];

/// Errors generating a spec; each says what is missing on the host.
#[derive(Debug, thiserror::Error)]
pub enum CdiError {
    #[error(
        "no NVIDIA driver is loaded (/proc/driver/nvidia/version is missing): a CDI spec would have no driver libraries"
    )]
    NoDriver,
    #[error(transparent)]
    Driver(#[from] hostlib::driver::DriverError),
    #[error(transparent)]
    Host(#[from] hostlib::HostError),
    #[error(transparent)]
    Managed(#[from] hostlib::managed::ManagedError),
    #[error(
        "spec.cdi.hookPath: {0} does not exist on the host; the spec's hooks would fail every container start"
    )]
    NoHookProgram(String),
    #[error("cannot read this program ({path}) to install it for the CDI hooks: {source}")]
    SelfCopy {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// The driver's files on the host, found from its version.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DriverFiles {
    pub version: String,
    /// Libraries, host paths with links resolved.
    pub libraries: Vec<String>,
    pub firmware: Vec<String>,
    pub binaries: Vec<String>,
    pub ipc: Vec<String>,
    pub control_nodes: Vec<String>,
}

impl DriverFiles {
    /// Finds the files of driver `version` on `host`; `loaded_modules` say
    /// which control nodes should exist (one that is missing is a note).
    pub fn find(
        host: &HostRoot,
        version: &str,
        loaded_modules: &[String],
        notes: &mut Vec<String>,
    ) -> Result<Self, CdiError> {
        let suffix = format!(".so.{version}");
        let mut libraries = Vec::new();
        for dir in lib_dirs(host)? {
            for sub in ["", "/vdpau"] {
                let d = format!("{dir}{sub}");
                let Ok(names) = host.read_dir_names(&d) else {
                    continue;
                };
                for n in names {
                    if n.starts_with("lib") && n.ends_with(&suffix) {
                        push_unique(&mut libraries, canonical(host, &format!("{d}/{n}"))?);
                    }
                }
            }
        }
        let mut firmware = Vec::new();
        let fw = format!("/lib/firmware/nvidia/{version}");
        if let Ok(names) = host.read_dir_names(&fw) {
            for n in names.iter().filter(|n| n.ends_with(".bin")) {
                firmware.push(canonical(host, &format!("{fw}/{n}"))?);
            }
        }
        // The usual places, then the `bin` beside each library directory:
        // a driver installed under its own prefix (`/usr/local/nvidia/lib64`
        // on the real H100 host, and the GPU Operator's `/run/nvidia/driver`)
        // keeps its programs in `<prefix>/bin`.
        let mut bin_dirs: Vec<String> = BIN_DIRS.iter().map(|d| d.to_string()).collect();
        for l in &libraries {
            if let Some((dir, _)) = l.rsplit_once('/')
                && let Some((prefix, _)) = dir.rsplit_once('/')
            {
                push_unique(&mut bin_dirs, format!("{prefix}/bin"));
            }
        }
        let mut binaries = Vec::new();
        for b in BINARIES {
            if let Some(dir) = bin_dirs.iter().find(|d| host.exists(format!("{d}/{b}"))) {
                push_unique(&mut binaries, canonical(host, &format!("{dir}/{b}"))?);
            }
        }
        let mut ipc = Vec::new();
        for p in IPC.iter().filter(|p| host.exists(p)) {
            push_unique(&mut ipc, canonical(host, p)?);
        }
        let mut control_nodes = Vec::new();
        for (node, module) in CONTROL_NODES {
            if host.exists(node) {
                control_nodes.push(node.to_string());
            } else if loaded_modules.iter().any(|m| m == module) {
                notes.push(format!(
                    "{node} is missing although {module} is loaded: containers get it once the devnodes stage creates it"
                ));
            }
        }
        Ok(DriverFiles {
            version: version.to_string(),
            libraries,
            firmware,
            binaries,
            ipc,
            control_nodes,
        })
    }

    /// The directories holding the libraries, in order.
    pub fn library_dirs(&self) -> Vec<String> {
        let mut dirs = Vec::new();
        for l in &self.libraries {
            if let Some((dir, _)) = l.rsplit_once('/') {
                push_unique(&mut dirs, dir.to_string());
            }
        }
        dirs
    }
}

fn push_unique(v: &mut Vec<String>, s: String) {
    if !v.contains(&s) {
        v.push(s);
    }
}

fn canonical(host: &HostRoot, path: &str) -> Result<String, CdiError> {
    Ok(host.canonical(path)?.display().to_string())
}

/// The dynamic linker's directories: `/etc/ld.so.conf` (and what it
/// includes), then the defaults; only those that exist, links resolved,
/// each once.
pub fn lib_dirs(host: &HostRoot) -> Result<Vec<String>, CdiError> {
    let mut listed = Vec::new();
    read_ld_conf(host, "/etc/ld.so.conf", &mut listed, 0);
    listed.extend(DEFAULT_LIB_DIRS.iter().map(|d| d.to_string()));
    let mut dirs = Vec::new();
    for d in listed {
        if host.resolve(&d).is_ok_and(|p| p.is_dir()) {
            push_unique(&mut dirs, canonical(host, &d)?);
        }
    }
    Ok(dirs)
}

/// Reads one ld.so.conf file: directories, `include` lines with a `*`
/// pattern in the file name, comments. `hwcap` lines and anything else are
/// skipped, as the linker does.
fn read_ld_conf(host: &HostRoot, path: &str, out: &mut Vec<String>, depth: u32) {
    if depth > 8 {
        return;
    }
    let Ok(Some(text)) = host.read_optional(path) else {
        return;
    };
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        if let Some(pattern) = line.strip_prefix("include") {
            let pattern = pattern.trim();
            let pattern = if pattern.starts_with('/') {
                pattern.to_string()
            } else {
                // Relative includes are relative to the including file's directory.
                let base = path.rsplit_once('/').map_or("", |(d, _)| d);
                format!("{base}/{pattern}")
            };
            let (dir, file) = pattern.rsplit_once('/').unwrap_or(("", &pattern));
            let dir = if dir.is_empty() { "/" } else { dir };
            for name in host.read_dir_names(dir).unwrap_or_default() {
                if wildcard(file, &name) {
                    read_ld_conf(host, &format!("{dir}/{name}"), out, depth + 1);
                }
            }
        } else if line.starts_with('/') {
            out.push(line.trim_end_matches('/').to_string());
        }
    }
}

/// `*` matches any run of characters; everything else matches itself.
fn wildcard(pattern: &str, name: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == name,
        Some((head, rest)) => {
            let Some(tail) = name.strip_prefix(head) else {
                return false;
            };
            (0..=tail.len()).any(|i| tail.is_char_boundary(i) && wildcard(rest, &tail[i..]))
        }
    }
}

/// What generating a spec needs besides the inventory.
#[derive(Clone, Debug)]
pub struct Options {
    /// The program the spec's hooks run: gpu-agent, as a host path.
    pub hook_path: String,
}

/// A spec and what the operator should know about it.
#[derive(Clone, Debug)]
pub struct Generated {
    pub spec: Spec,
    pub driver: DriverFiles,
    pub notes: Vec<String>,
}

impl Generated {
    /// The spec as written to disk: pretty JSON with a final newline.
    pub fn to_json(&self) -> String {
        let mut s = serde_json::to_string_pretty(&self.spec).expect("a spec always serialises");
        s.push('\n');
        s
    }
}

/// The spec's host path in `spec_dir`.
pub fn spec_path(spec_dir: &str) -> String {
    format!("{}/{SPEC_FILE}", spec_dir.trim_end_matches('/'))
}

/// True when the spec on the host is this one (nothing to write).
pub fn up_to_date(host: &HostRoot, spec_dir: &str, g: &Generated) -> Result<bool, CdiError> {
    Ok(host.read_optional(spec_path(spec_dir))?.as_deref() == Some(g.to_json().as_str()))
}

/// Writes the spec under the host-files lock (atomically, restorable like
/// every file gpu-agent changes) and, at the default hook path, installs a
/// copy of this program for the hooks. Returns the host paths that changed.
pub fn apply(
    host: &HostRoot,
    sys: &dyn hostlib::Syscalls,
    g: &Generated,
    cdi: &crate::spec::CdiSpec,
    wait_for_lock: bool,
) -> Result<Vec<String>, CdiError> {
    let files = hostlib::managed::ManagedFiles::lock(host, sys, wait_for_lock)?;
    let mut changed = Vec::new();
    if cdi.hook_path == crate::spec::INSTALLED_HOOK_PATH {
        // The running program itself, through /proc/self/exe: its file may
        // have been replaced since it started (a package upgrade before the
        // restart), and a path would then name another build or nothing.
        let me = std::path::Path::new("/proc/self/exe");
        // The same build already installed: nothing to read or write (a
        // byte-for-byte compare would read 7 MB twice at every start).
        if !same_build(me, &host.resolve(&cdi.hook_path)?) {
            let bytes = std::fs::read(me).map_err(|source| CdiError::SelfCopy {
                path: std::env::current_exe()
                    .map(|p| p.display().to_string())
                    .unwrap_or_else(|_| "/proc/self/exe".into()),
                source,
            })?;
            if files.write(&cdi.hook_path, &bytes, 0o755)? {
                changed.push(cdi.hook_path.clone());
            }
        }
    } else if !host.exists(&cdi.hook_path) {
        return Err(CdiError::NoHookProgram(cdi.hook_path.clone()));
    }
    let path = spec_path(&cdi.spec_dir);
    if files.write(&path, g.to_json().as_bytes(), 0o644)? {
        changed.push(path);
    }
    Ok(changed)
}

/// True when `installed` is an executable copy of the program `me`: the
/// same size and the same GNU build ID (read from the ELF notes alone).
/// Without build IDs it is false, and the caller compares bytes.
pub fn same_build(me: &std::path::Path, installed: &std::path::Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    let (Ok(a), Ok(b)) = (std::fs::metadata(me), std::fs::symlink_metadata(installed)) else {
        return false;
    };
    if !b.is_file() || a.len() != b.len() || b.permissions().mode() & 0o111 == 0 {
        return false;
    }
    matches!((build_id(me), build_id(installed)), (Some(x), Some(y)) if x == y)
}

/// The GNU build ID of an ELF file, reading only the parts it needs.
fn build_id(path: &std::path::Path) -> Option<Vec<u8>> {
    use object::Object;
    let file = std::fs::File::open(path).ok()?;
    let cache = object::ReadCache::new(file);
    let elf = object::read::elf::ElfFile64::<object::Endianness, _>::parse(&cache).ok()?;
    elf.build_id().ok().flatten().map(<[u8]>::to_vec)
}

impl Generated {
    /// `8 GPUs, 14 MIG devices, 12 libraries, …` for logs and status.
    pub fn summary(&self) -> String {
        let gpus = self
            .spec
            .devices
            .iter()
            .filter(|d| d.name.starts_with("GPU-"))
            .count();
        let migs = self
            .spec
            .devices
            .iter()
            .filter(|d| d.name.starts_with("MIG-"))
            .count();
        let d = &self.driver;
        let mut s = format!(
            "{gpus} GPU(s), {migs} MIG device(s) and `all` as {CDI_KIND}; driver {}: {} libraries, {} binaries, {} firmware files, {} IPC sockets, {} control nodes",
            d.version,
            d.libraries.len(),
            d.binaries.len(),
            d.firmware.len(),
            d.ipc.len(),
            d.control_nodes.len()
        );
        if !self.notes.is_empty() {
            s.push_str(&format!(" ({})", self.notes.join("; ")));
        }
        s
    }
}

fn node(path: String) -> DeviceNode {
    DeviceNode {
        path,
        host_path: None,
    }
}

/// Generates the spec for the node's GPUs. `host` is where the driver's
/// files and device nodes are looked up.
pub fn generate(inv: &Inventory, host: &HostRoot, opts: &Options) -> Result<Generated, CdiError> {
    let version = inv
        .driver
        .version
        .clone()
        .or_else(|| inv.backend.driver_version.clone())
        .ok_or(CdiError::NoDriver)?;
    let mut notes = Vec::new();
    let loaded: Vec<String> = inv.driver.modules.iter().map(|m| m.name.clone()).collect();
    let driver = DriverFiles::find(host, &version, &loaded, &mut notes)?;
    if driver.libraries.is_empty() {
        notes.push(format!(
            "no libraries of driver {version} (lib*.so.{version}) in the linker's directories: containers get device nodes but no CUDA"
        ));
    }
    let mig_minors = if inv.gpus.iter().any(|g| !g.mig_devices.is_empty()) {
        hostlib::driver::read_mig_minors(host)?
    } else {
        None
    };

    let mut devices = Vec::new();
    let mut all: Vec<DeviceNode> = Vec::new();
    let mut left_out = Vec::new();
    for g in &inv.gpus {
        let (Some(minor), Some(uuid)) = (g.minor, g.uuid.as_ref()) else {
            left_out.push(g.bus_id.to_string());
            continue;
        };
        let gpu_node = node(format!("/dev/nvidia{minor}"));
        let edits = ContainerEdits {
            device_nodes: vec![gpu_node.clone()],
            ..ContainerEdits::default()
        };
        // Without NVML there is no index: the GPU is named by UUID only.
        let Some(index) = g.index else {
            devices.push(Device {
                name: uuid.clone(),
                container_edits: edits,
            });
            all.push(gpu_node);
            continue;
        };
        for name in [index.to_string(), uuid.clone()] {
            devices.push(Device {
                name,
                container_edits: edits.clone(),
            });
        }
        all.push(gpu_node.clone());
        for m in &g.mig_devices {
            let caps = match &mig_minors {
                Some(minors) => mig_access_minors(minors, minor, m),
                None => Err("/proc/driver/nvidia-caps/mig-minors is missing".into()),
            };
            let caps = match caps {
                Ok(c) => c,
                Err(why) => {
                    notes.push(format!("MIG device {} left out: {why}", m.uuid));
                    continue;
                }
            };
            let mut nodes = vec![gpu_node.clone()];
            nodes.extend(
                caps.iter()
                    .map(|c| node(format!("/dev/nvidia-caps/nvidia-cap{c}"))),
            );
            for n in &nodes {
                if !all.contains(n) {
                    all.push(n.clone());
                }
            }
            let edits = ContainerEdits {
                device_nodes: nodes,
                ..ContainerEdits::default()
            };
            for name in [format!("{index}:{}", m.index), m.uuid.clone()] {
                devices.push(Device {
                    name,
                    container_edits: edits.clone(),
                });
            }
        }
    }
    if !left_out.is_empty() {
        notes.push(format!(
            "left out (no UUID or device minor in /proc/driver/nvidia/gpus): {}",
            left_out.join(", ")
        ));
    }
    if inv
        .gpus
        .iter()
        .any(|g| g.index.is_none() && g.uuid.is_some())
    {
        notes.push(format!(
            "GPUs without an NVML index are named by UUID only ({} did not describe them)",
            inv.backend.name
        ));
    }
    if !devices.is_empty() {
        devices.push(Device {
            name: "all".into(),
            container_edits: ContainerEdits {
                device_nodes: all,
                ..ContainerEdits::default()
            },
        });
    }
    let spec = Spec {
        cdi_version: SPEC_VERSION.into(),
        kind: CDI_KIND.into(),
        devices,
        container_edits: common_edits(&driver, opts),
    };
    Ok(Generated {
        spec,
        driver,
        notes,
    })
}

/// What every device gets: control nodes, driver files, hooks.
fn common_edits(d: &DriverFiles, opts: &Options) -> ContainerEdits {
    let mount = |p: &String| Mount {
        host_path: p.clone(),
        container_path: p.clone(),
        options: MOUNT_OPTIONS.iter().map(|o| o.to_string()).collect(),
    };
    let mounts = d
        .libraries
        .iter()
        .chain(&d.firmware)
        .chain(&d.binaries)
        .chain(&d.ipc)
        .map(mount)
        .collect();
    let mut hooks = Vec::new();
    let hook = |args: Vec<String>| Hook {
        hook_name: "createContainer".into(),
        path: opts.hook_path.clone(),
        args: ["gpu-agent", "cdi-hook"]
            .iter()
            .map(|s| s.to_string())
            .chain(args)
            .collect(),
    };
    let libcuda = format!("libcuda.so.{}", d.version);
    if let Some(lib) = d.libraries.iter().find(|l| l.ends_with(&libcuda)) {
        // Programs that dlopen the development name (libcuda.so) find it;
        // the soname link (libcuda.so.1) is made by the linker-cache refresh.
        let dir = lib.rsplit_once('/').map_or("", |(d, _)| d);
        hooks.push(hook(vec![
            "create-symlinks".into(),
            "--link".into(),
            format!("libcuda.so.1::{dir}/libcuda.so"),
        ]));
    }
    let dirs = d.library_dirs();
    if !dirs.is_empty() {
        let mut args = vec!["update-ldcache".to_string()];
        for dir in dirs {
            args.push("--folder".into());
            args.push(dir);
        }
        hooks.push(hook(args));
    }
    ContainerEdits {
        // An image that also asks nvidia-container-runtime for GPUs must not
        // get a second set from it.
        env: vec!["NVIDIA_VISIBLE_DEVICES=void".into()],
        device_nodes: d.control_nodes.iter().cloned().map(node).collect(),
        mounts,
        hooks,
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn same_build_by_build_id_size_and_exec_bit() {
        use std::os::unix::fs::PermissionsExt;
        let me = std::env::current_exe().unwrap();
        assert!(build_id(&me).is_some(), "the linker writes GNU build IDs");
        let dir = tempfile::tempdir().unwrap();
        let copy = dir.path().join("gpu-agent");
        std::fs::copy(&me, &copy).unwrap();
        std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert!(same_build(&me, &copy));
        std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(
            !same_build(&me, &copy),
            "a copy that cannot run is replaced"
        );
        std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o755)).unwrap();
        let f = std::fs::OpenOptions::new()
            .append(true)
            .open(&copy)
            .unwrap();
        f.set_len(f.metadata().unwrap().len() - 1).unwrap();
        assert!(!same_build(&me, &copy), "another size is another build");
        std::fs::write(&copy, b"#!/bin/sh\n").unwrap();
        assert!(!same_build(&me, &copy));
        assert!(!same_build(&me, &dir.path().join("missing")));
    }
    use super::*;

    #[test]
    fn wildcards() {
        assert!(wildcard("*.conf", "x86_64-linux-gnu.conf"));
        assert!(wildcard("*", "anything"));
        assert!(wildcard("a*b*c", "aXXbYc"));
        assert!(!wildcard("*.conf", "x.conf.bak"));
        assert!(!wildcard("lib*.so", "libcuda.so.1"));
    }

    #[test]
    fn ld_conf_includes_relative_and_absolute() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path();
        std::fs::create_dir_all(p.join("etc/ld.so.conf.d")).unwrap();
        std::fs::create_dir_all(p.join("opt/nvidia/lib")).unwrap();
        std::fs::create_dir_all(p.join("usr/local/lib")).unwrap();
        std::fs::write(
            p.join("etc/ld.so.conf"),
            "include ld.so.conf.d/*.conf\n/usr/local/lib/ # trailing slash\nhwcap 0 nosegneg\n",
        )
        .unwrap();
        std::fs::write(p.join("etc/ld.so.conf.d/nvidia.conf"), "/opt/nvidia/lib\n").unwrap();
        std::fs::write(p.join("etc/ld.so.conf.d/skip.conf.bak"), "/nope\n").unwrap();
        let host = HostRoot::new(p).unwrap();
        assert_eq!(
            lib_dirs(&host).unwrap(),
            vec!["/opt/nvidia/lib".to_string(), "/usr/local/lib".into()]
        );
    }
}
