//! `/dev/nvidia*` device nodes and their `/dev/char/MAJ:MIN` links.
//!
//! Majors are read from `/proc/devices` (`nvidia-frontend`, or `nvidia` on
//! older drivers, for `nvidiactl`, `nvidia-modeset` and `nvidiaN`;
//! `nvidia-uvm`; `nvidia-caps`), never assumed. Minors: `nvidiactl` 255,
//! `nvidia-modeset` 254, `nvidiaN` the GPU's device minor, `nvidia-uvm` 0,
//! `nvidia-uvm-tools` 1.
//!
//! Modes and owners are the driver's, never ours, read as nvidia-modprobe
//! reads them:
//! - `/dev/nvidiactl`, `/dev/nvidiaN`, `/dev/nvidia-modeset`: mode, uid and
//!   gid from `/proc/driver/nvidia/params` (`DeviceFileMode`,
//!   `DeviceFileUID`, `DeviceFileGID`; the driver's defaults 0666 root:root
//!   where it publishes none). `ModifyDeviceFiles: 0` leaves them to the
//!   administrator: nothing is made or changed.
//! - `/dev/nvidia-uvm(-tools)`: 0666 root:root (the uvm module publishes no
//!   mode; nvidia-modprobe uses these).
//! - `/dev/nvidia-caps/nvidia-capN`: minor and mode from the capability's
//!   own file, `/proc/driver/nvidia/capabilities/mig/{config,monitor}` and
//!   `…/gpu<G>/mig/gi<I>[/ci<C>]/access` (named through
//!   `/proc/driver/nvidia-caps/mig-minors`). A real driver makes `config`
//!   0400 (only root may configure MIG) and `monitor` 0444; these are also
//!   the modes taken for a capability whose file the driver does not
//!   publish (0444 for a MIG device's access). `DeviceFileModify: 0` leaves
//!   the node to the administrator.
//!
//! The `/dev/char` links are what systemd's device cgroup rules look up
//! after `systemctl daemon-reload`; without them containers lose their GPUs
//! ("Failed to initialize NVML: Unknown Error").
//!
//! A node that is already right is left alone; a wrong one (not a character
//! device, other numbers, mode or owner) is replaced, and said.

use std::collections::BTreeMap;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};

use hostlib::procfiles::{self, CapabilityFile, DeviceFileParams};
use hostlib::{DriverState, HostError, HostRoot, SyscallError, Syscalls};

/// Where the driver publishes its device files' mode and owner.
pub const PROC_PARAMS: &str = "/proc/driver/nvidia/params";
/// Where the driver publishes each capability's device file.
pub const PROC_CAPABILITIES: &str = "/proc/driver/nvidia/capabilities";

/// One node to have.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node {
    /// Host path (`/dev/nvidia0`).
    pub path: String,
    pub major: u32,
    pub minor: u32,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// `false`: the driver leaves this node to the administrator
    /// (`ModifyDeviceFiles: 0`, `DeviceFileModify: 0`); it is checked, never
    /// made or changed.
    pub modify: bool,
}

/// Errors; each names the node, the file or the missing major.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("no {0} major in /proc/devices: the module that registers it is not loaded")]
    NoMajor(&'static str),
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    DriverFile { path: String, message: String },
    #[error(transparent)]
    Syscall(#[from] SyscallError),
    #[error(transparent)]
    Host(#[from] HostError),
    #[error(transparent)]
    Driver(#[from] hostlib::driver::DriverError),
}

fn resolved(host: &HostRoot, p: &str) -> String {
    host.resolve(p)
        .map(|r| r.display().to_string())
        .unwrap_or_else(|_| p.to_string())
}

/// `/proc/driver/nvidia/params`' device-file settings; the driver's
/// defaults where it has no such file.
pub fn device_file_params(host: &HostRoot) -> Result<DeviceFileParams, NodeError> {
    match host.read_optional(PROC_PARAMS)? {
        None => Ok(DeviceFileParams::default()),
        Some(text) => procfiles::parse_params(&text).map_err(|message| NodeError::DriverFile {
            path: resolved(host, PROC_PARAMS),
            message,
        }),
    }
}

/// The capability file of a `mig-minors` name: `config` and `monitor` live
/// under `mig/`, a GPU's under `gpu<G>/mig/` (`gpu0/gi1/access` →
/// `gpu0/mig/gi1/access`).
pub fn capability_proc_path(name: &str) -> String {
    let rel = match name {
        "config" | "monitor" => format!("mig/{name}"),
        _ => match name.split_once('/') {
            Some((gpu, rest)) => format!("{gpu}/mig/{rest}"),
            None => name.to_string(),
        },
    };
    format!("{PROC_CAPABILITIES}/{rel}")
}

/// A capability's device file as the driver publishes it; `None` where the
/// driver has no file for it. A file that is there but cannot be read is an
/// error naming it.
pub fn capability(host: &HostRoot, name: &str) -> Result<Option<CapabilityFile>, NodeError> {
    let path = capability_proc_path(name);
    match host.read_optional(&path)? {
        None => Ok(None),
        Some(text) => procfiles::parse_capability(&text)
            .map(Some)
            .map_err(|message| NodeError::DriverFile {
                path: resolved(host, &path),
                message,
            }),
    }
}

/// The mode a real driver gives a capability it publishes no file for.
fn default_capability_mode(name: &str) -> u32 {
    if name == "config" { 0o400 } else { 0o444 }
}

/// The nodes the loaded driver needs: control nodes for the modules that
/// are loaded, one per GPU, and the MIG `config`/`monitor` capabilities plus
/// `extra_caps` (the access nodes of existing MIG devices, by minor).
pub fn plan(
    host: &HostRoot,
    driver: &DriverState,
    extra_caps: &[u32],
) -> Result<Vec<Node>, NodeError> {
    let loaded = |m: &str| driver.module_loaded(m) == Some(true);
    let mut nodes = Vec::new();
    if !loaded("nvidia") {
        return Ok(nodes);
    }
    let fe = driver
        .frontend_major()
        .ok_or(NodeError::NoMajor("nvidia-frontend (or nvidia)"))?;
    let params = device_file_params(host)?;
    let nv = |path: String, minor| Node {
        path,
        major: fe,
        minor,
        mode: params.mode,
        uid: params.uid,
        gid: params.gid,
        modify: params.modify,
    };
    nodes.push(nv("/dev/nvidiactl".into(), 255));
    if loaded("nvidia_modeset") {
        nodes.push(nv("/dev/nvidia-modeset".into(), 254));
    }
    for g in &driver.gpus {
        if let Some(minor) = g.minor {
            nodes.push(nv(format!("/dev/nvidia{minor}"), minor));
        }
    }
    if loaded("nvidia_uvm") {
        let uvm = *driver
            .char_majors
            .get("nvidia-uvm")
            .ok_or(NodeError::NoMajor("nvidia-uvm"))?;
        for (path, minor) in [("/dev/nvidia-uvm", 0), ("/dev/nvidia-uvm-tools", 1)] {
            nodes.push(Node {
                path: path.into(),
                major: uvm,
                minor,
                mode: 0o666,
                uid: 0,
                gid: 0,
                modify: true,
            });
        }
    }
    if let Some(caps) = driver.char_majors.get("nvidia-caps").copied()
        && let Some(mig_minors) = hostlib::driver::read_mig_minors(host)?
    {
        let by_minor: BTreeMap<u32, &str> =
            mig_minors.iter().map(|(k, v)| (*v, k.as_str())).collect();
        let mut names: Vec<&str> = ["config", "monitor"]
            .into_iter()
            .filter(|k| mig_minors.contains_key(*k))
            .collect();
        names.extend(extra_caps.iter().filter_map(|m| by_minor.get(m).copied()));
        let mut planned = BTreeMap::new();
        for name in names {
            let node = match capability(host, name)? {
                Some(c) => (c.minor, c.mode, c.modify),
                None => (mig_minors[name], default_capability_mode(name), true),
            };
            planned.insert(node.0, node);
        }
        for (minor, mode, modify) in planned.into_values() {
            nodes.push(Node {
                path: format!("/dev/nvidia-caps/nvidia-cap{minor}"),
                major: caps,
                minor,
                mode,
                uid: 0,
                gid: 0,
                modify,
            });
        }
    }
    Ok(nodes)
}

/// What was done for one node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    Created(String),
    Replaced {
        path: String,
        was: String,
    },
    Unchanged(String),
    /// The driver leaves it to the administrator; it is not right, and was
    /// not touched (`is` says what is there).
    LeftToAdmin {
        path: String,
        is: String,
    },
}

fn describe(meta: &std::fs::Metadata) -> String {
    let ft = meta.file_type();
    if ft.is_char_device() {
        let rdev = meta.rdev();
        format!(
            "char {}:{} mode {:o} owner {}:{}",
            nix::sys::stat::major(rdev),
            nix::sys::stat::minor(rdev),
            meta.permissions().mode() & 0o7777,
            meta.uid(),
            meta.gid()
        )
    } else if ft.is_dir() {
        "a directory".into()
    } else if ft.is_symlink() {
        "a symbolic link".into()
    } else {
        "not a device".into()
    }
}

/// Right: a character device with the numbers; and, for a node the driver
/// lets us manage, its mode and owner too (one the administrator keeps is
/// theirs to set).
fn matches(m: &std::fs::Metadata, n: &Node) -> bool {
    m.file_type().is_char_device()
        && nix::sys::stat::major(m.rdev()) == u64::from(n.major)
        && nix::sys::stat::minor(m.rdev()) == u64::from(n.minor)
        && (!n.modify
            || (m.permissions().mode() & 0o7777 == n.mode && m.uid() == n.uid && m.gid() == n.gid))
}

/// True when `n` exists on the host as it should (type, numbers, mode).
pub fn is_right(host: &HostRoot, n: &Node) -> bool {
    host.resolve_no_follow(&n.path)
        .ok()
        .and_then(|p| std::fs::symlink_metadata(p).ok())
        .is_some_and(|m| matches(&m, n))
}

/// Makes every node right and links `/dev/char/MAJ:MIN` to it.
pub fn ensure(
    host: &HostRoot,
    sys: &dyn Syscalls,
    nodes: &[Node],
) -> Result<Vec<Outcome>, NodeError> {
    let mut out = Vec::new();
    for n in nodes {
        let real = host.resolve_no_follow(&n.path)?;
        let io = |source| NodeError::Io {
            path: n.path.clone(),
            source,
        };
        let existing = std::fs::symlink_metadata(&real).ok();
        let right = existing.as_ref().is_some_and(|m| matches(m, n));
        if right {
            out.push(Outcome::Unchanged(n.path.clone()));
        } else if !n.modify {
            let is = existing
                .as_ref()
                .map(describe)
                .unwrap_or_else(|| "missing".into());
            // Said by the caller (the agent's stage logs it once while it
            // holds; `driver nodes` prints it).
            out.push(Outcome::LeftToAdmin {
                path: n.path.clone(),
                is,
            });
            continue;
        } else {
            if let Some(parent) = real.parent() {
                std::fs::create_dir_all(parent).map_err(io)?;
            }
            let was = match &existing {
                Some(m) if m.is_dir() => {
                    return Err(NodeError::Io {
                        path: n.path.clone(),
                        source: std::io::Error::other("a directory is in the way; not removed"),
                    });
                }
                Some(m) => {
                    let was = describe(m);
                    std::fs::remove_file(&real).map_err(io)?;
                    Some(was)
                }
                None => None,
            };
            sys.mknod_char(&real, n.mode, n.major, n.minor)?;
            // mknod is subject to the umask: set the exact bits.
            sys.chmod(&real, n.mode)?;
            // A node made by root is root's; another owner only when the
            // driver names one.
            if (n.uid, n.gid) != (0, 0) {
                sys.chown(&real, Some(n.uid), Some(n.gid))?;
            }
            match was {
                Some(was) => {
                    tracing::warn!(stage = "devnodes", node = %n.path, was = %was, mode = format!("{:o}", n.mode), "replaced a wrong device node");
                    out.push(Outcome::Replaced {
                        path: n.path.clone(),
                        was,
                    });
                }
                None => {
                    tracing::info!(stage = "devnodes", node = %n.path, major = n.major, minor = n.minor, "created");
                    out.push(Outcome::Created(n.path.clone()));
                }
            }
        }
        link_char(host, n)?;
    }
    Ok(out)
}

/// `/dev/char/MAJ:MIN` → the node, relative (`../nvidia0`), replaced when it
/// points elsewhere.
fn link_char(host: &HostRoot, n: &Node) -> Result<(), NodeError> {
    let link = format!("/dev/char/{}:{}", n.major, n.minor);
    let target = format!(
        "..{}",
        n.path.strip_prefix("/dev").unwrap_or(n.path.as_str())
    );
    let real = host.resolve_no_follow(&link)?;
    let io = |source| NodeError::Io {
        path: link.clone(),
        source,
    };
    match std::fs::read_link(&real) {
        Ok(t) if t.as_os_str() == target.as_str() => return Ok(()),
        Ok(_) => std::fs::remove_file(&real).map_err(io)?,
        Err(_) if real.exists() => return Ok(()), // a real node there: not ours to touch
        Err(_) => {}
    }
    if let Some(parent) = real.parent() {
        std::fs::create_dir_all(parent).map_err(io)?;
    }
    std::os::unix::fs::symlink(&target, &real).map_err(io)?;
    Ok(())
}
