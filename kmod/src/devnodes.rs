//! `/dev/nvidia*` device nodes and their `/dev/char/MAJ:MIN` links.
//!
//! Majors are read from `/proc/devices` (`nvidia-frontend`, or `nvidia` on
//! older drivers, for `nvidiactl`, `nvidia-modeset` and `nvidiaN`;
//! `nvidia-uvm`; `nvidia-caps`), never assumed. Minors: `nvidiactl` 255,
//! `nvidia-modeset` 254, `nvidiaN` the GPU's device minor, `nvidia-uvm` 0,
//! `nvidia-uvm-tools` 1, `nvidia-caps/nvidia-capN` from
//! `/proc/driver/nvidia-caps/mig-minors`. Modes as NVIDIA's driver makes
//! them: 0666, and 0444 for the MIG capability nodes (read access is the
//! capability). The `/dev/char` links are what systemd's device cgroup
//! rules look up after `systemctl daemon-reload`; without them containers
//! lose their GPUs ("Failed to initialize NVML: Unknown Error").
//!
//! A node that is already right is left alone; a wrong one (not a character
//! device, other numbers or mode) is replaced, and said.

use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};

use hostlib::{DriverState, HostError, HostRoot, SyscallError, Syscalls};

/// One node to have.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node {
    /// Host path (`/dev/nvidia0`).
    pub path: String,
    pub major: u32,
    pub minor: u32,
    pub mode: u32,
}

/// Errors; each names the node or the missing major.
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
    #[error(transparent)]
    Syscall(#[from] SyscallError),
    #[error(transparent)]
    Host(#[from] HostError),
    #[error(transparent)]
    Driver(#[from] hostlib::driver::DriverError),
}

/// The nodes the loaded driver needs: control nodes for the modules that
/// are loaded, one per GPU, and the MIG `config`/`monitor` capabilities plus
/// `extra_caps` (the access nodes of existing MIG devices).
pub fn plan(
    host: &HostRoot,
    driver: &DriverState,
    extra_caps: &[u32],
) -> Result<Vec<Node>, NodeError> {
    let loaded = |m: &str| driver.modules.iter().any(|l| l.name == m);
    let mut nodes = Vec::new();
    if !loaded("nvidia") {
        return Ok(nodes);
    }
    let fe = driver
        .frontend_major()
        .ok_or(NodeError::NoMajor("nvidia-frontend (or nvidia)"))?;
    let node = |path: String, major, minor, mode| Node {
        path,
        major,
        minor,
        mode,
    };
    nodes.push(node("/dev/nvidiactl".into(), fe, 255, 0o666));
    if loaded("nvidia_modeset") {
        nodes.push(node("/dev/nvidia-modeset".into(), fe, 254, 0o666));
    }
    for g in &driver.gpus {
        if let Some(minor) = g.minor {
            nodes.push(node(format!("/dev/nvidia{minor}"), fe, minor, 0o666));
        }
    }
    if loaded("nvidia_uvm") {
        let uvm = *driver
            .char_majors
            .get("nvidia-uvm")
            .ok_or(NodeError::NoMajor("nvidia-uvm"))?;
        nodes.push(node("/dev/nvidia-uvm".into(), uvm, 0, 0o666));
        nodes.push(node("/dev/nvidia-uvm-tools".into(), uvm, 1, 0o666));
    }
    if let Some(caps) = driver.char_majors.get("nvidia-caps").copied()
        && let Some(mig_minors) = hostlib::driver::read_mig_minors(host)?
    {
        let mut minors: Vec<u32> = ["config", "monitor"]
            .iter()
            .filter_map(|k| mig_minors.get(*k).copied())
            .collect();
        minors.extend(extra_caps);
        minors.sort_unstable();
        minors.dedup();
        for m in minors {
            nodes.push(node(
                format!("/dev/nvidia-caps/nvidia-cap{m}"),
                caps,
                m,
                0o444,
            ));
        }
    }
    Ok(nodes)
}

/// What was done for one node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    Created(String),
    Replaced { path: String, was: String },
    Unchanged(String),
}

fn describe(meta: &std::fs::Metadata) -> String {
    let ft = meta.file_type();
    if ft.is_char_device() {
        let rdev = meta.rdev();
        format!(
            "char {}:{} mode {:o}",
            nix::sys::stat::major(rdev),
            nix::sys::stat::minor(rdev),
            meta.permissions().mode() & 0o7777
        )
    } else if ft.is_dir() {
        "a directory".into()
    } else if ft.is_symlink() {
        "a symbolic link".into()
    } else {
        "not a device".into()
    }
}

fn matches(m: &std::fs::Metadata, n: &Node) -> bool {
    m.file_type().is_char_device()
        && nix::sys::stat::major(m.rdev()) == u64::from(n.major)
        && nix::sys::stat::minor(m.rdev()) == u64::from(n.minor)
        && m.permissions().mode() & 0o7777 == n.mode
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
            match was {
                Some(was) => {
                    tracing::warn!(stage = "devnodes", node = %n.path, was = %was, "replaced a wrong device node");
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
