//! `gpu-agent cdi-hook`: the `createContainer` hooks our CDI specs name.
//!
//! The runtime runs a hook on the host, after the container's root
//! filesystem is mounted and before the container's process starts, with
//! the container's OCI state (JSON) on stdin; its `bundle` holds
//! `config.json`, whose `root.path` is the root filesystem. Everything a
//! hook changes is inside that root, resolved through [`HostRoot`] so that
//! a link in the image can never lead a write out of it.
//!
//! - `create-symlinks --link TARGET::LINK …`: makes LINK point at TARGET.
//!   A LINK the image already has is left as it is.
//! - `update-ldcache --folder DIR …`: lists the driver's library directories
//!   in the image's `/etc/ld.so.conf.d/` and rebuilds its linker cache with
//!   the host's `ldconfig -r <root>` (ldconfig itself chroots into the root;
//!   no program from the image is run).

use std::path::{Path, PathBuf};

use hostlib::HostRoot;
use hostlib::command::{CommandError, CommandRunner};
use serde::Deserialize;

/// The drop-in listing the driver's library directories in a container.
pub const LD_CONF: &str = "/etc/ld.so.conf.d/00-gpu-agent-cdi.conf";

/// Where the host's ldconfig may be (Ubuntu's `ldconfig` is a wrapper
/// script around `ldconfig.real`).
const LDCONFIG: &[&str] = &[
    "/sbin/ldconfig.real",
    "/sbin/ldconfig",
    "/usr/sbin/ldconfig",
];

#[derive(Debug, thiserror::Error)]
pub enum HookError {
    #[error("the OCI state on stdin is not valid: {0}")]
    State(String),
    #[error("{path}: {message}")]
    Config { path: PathBuf, message: String },
    #[error("--link {0:?}: expected TARGET::LINK with an absolute LINK")]
    BadLink(String),
    #[error("--folder {0:?}: expected an absolute directory")]
    BadFolder(String),
    #[error("no ldconfig on the host (looked for {})", LDCONFIG.join(", "))]
    NoLdconfig,
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Host(#[from] hostlib::HostError),
    #[error(transparent)]
    Command(#[from] CommandError),
}

#[derive(Deserialize)]
struct State {
    bundle: PathBuf,
}

#[derive(Deserialize)]
struct Config {
    root: Root,
}

#[derive(Deserialize)]
struct Root {
    path: PathBuf,
}

/// The container's root filesystem, from the OCI state the runtime gives
/// the hook on stdin.
pub fn container_root(state_json: &str) -> Result<PathBuf, HookError> {
    let state: State =
        serde_json::from_str(state_json).map_err(|e| HookError::State(e.to_string()))?;
    let config_path = state.bundle.join("config.json");
    let text = std::fs::read_to_string(&config_path).map_err(|e| HookError::Io {
        path: config_path.clone(),
        source: e,
    })?;
    let config: Config = serde_json::from_str(&text).map_err(|e| HookError::Config {
        path: config_path.clone(),
        message: e.to_string(),
    })?;
    Ok(if config.root.path.is_absolute() {
        config.root.path
    } else {
        state.bundle.join(config.root.path)
    })
}

/// What one link did.
#[derive(Debug, PartialEq, Eq)]
pub enum LinkOutcome {
    Created,
    AlreadyThere,
    /// Something else has the name: the image's own file wins.
    Kept,
}

/// Makes each `TARGET::LINK` inside `root`.
pub fn create_symlinks(root: &Path, links: &[String]) -> Result<Vec<LinkOutcome>, HookError> {
    let rootfs = HostRoot::new(root)?;
    let mut out = Vec::new();
    for spec in links {
        let (target, link) = spec
            .split_once("::")
            .filter(|(t, l)| !t.is_empty() && l.starts_with('/'))
            .ok_or_else(|| HookError::BadLink(spec.clone()))?;
        let real = rootfs.resolve_no_follow(link)?;
        let io = |e| HookError::Io {
            path: real.clone(),
            source: e,
        };
        match std::fs::symlink_metadata(&real) {
            Ok(m) if m.file_type().is_symlink() => {
                let current = std::fs::read_link(&real).map_err(io)?;
                out.push(if current == Path::new(target) {
                    LinkOutcome::AlreadyThere
                } else {
                    LinkOutcome::Kept
                });
            }
            Ok(_) => out.push(LinkOutcome::Kept),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if let Some(parent) = real.parent() {
                    std::fs::create_dir_all(parent).map_err(io)?;
                }
                std::os::unix::fs::symlink(target, &real).map_err(io)?;
                out.push(LinkOutcome::Created);
            }
            Err(e) => return Err(io(e)),
        }
    }
    Ok(out)
}

/// The host's ldconfig (a path under `host`).
pub fn host_ldconfig(host: &HostRoot) -> Result<String, HookError> {
    LDCONFIG
        .iter()
        .find(|p| host.resolve(p).is_ok_and(|r| r.is_file()))
        .map(|p| host.resolve(p).map(|r| r.display().to_string()))
        .transpose()?
        .ok_or(HookError::NoLdconfig)
}

/// Lists `folders` in the container's linker config and rebuilds its cache.
pub fn update_ldcache(
    root: &Path,
    folders: &[String],
    ldconfig: &str,
    runner: &dyn CommandRunner,
) -> Result<(), HookError> {
    for f in folders {
        if !f.starts_with('/') {
            return Err(HookError::BadFolder(f.clone()));
        }
    }
    let rootfs = HostRoot::new(root)?;
    let mut conf = String::from("# Driver libraries injected by gpu-agent (CDI)\n");
    for f in folders {
        conf.push_str(f);
        conf.push('\n');
    }
    rootfs.write_atomic(LD_CONF, conf.as_bytes(), 0o644)?;
    // Folders on the command line are cached even when the image's
    // ld.so.conf does not include ld.so.conf.d.
    let mut argv = vec![
        ldconfig.to_string(),
        "-r".into(),
        rootfs.path().display().to_string(),
    ];
    argv.extend(folders.iter().cloned());
    runner.run(&argv)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use hostlib::command::RecordingRunner;
    use std::fs;

    fn bundle(dir: &Path, root: &str) {
        fs::write(
            dir.join("config.json"),
            format!(r#"{{"ociVersion":"1.2.0","root":{{"path":"{root}","readonly":false}}}}"#),
        )
        .unwrap();
    }

    #[test]
    fn root_comes_from_the_bundle_relative_or_absolute() {
        let dir = tempfile::tempdir().unwrap();
        bundle(dir.path(), "rootfs");
        let state = format!(
            r#"{{"ociVersion":"1.2.0","id":"c1","status":"creating","pid":42,"bundle":"{}"}}"#,
            dir.path().display()
        );
        assert_eq!(container_root(&state).unwrap(), dir.path().join("rootfs"));
        bundle(dir.path(), "/var/lib/x/rootfs");
        assert_eq!(
            container_root(&state).unwrap(),
            Path::new("/var/lib/x/rootfs")
        );
        let err = container_root("{}").unwrap_err().to_string();
        assert!(err.contains("missing field `bundle`"), "{err}");
    }

    #[test]
    fn links_are_made_inside_the_root_and_never_clobber() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        // The image links its lib dir out of the root: the link is followed inside it.
        fs::create_dir_all(root.join("usr/lib")).unwrap();
        std::os::unix::fs::symlink("/usr/lib", root.join("lib64")).unwrap();
        let links = vec![
            "libcuda.so.1::/lib64/libcuda.so".to_string(),
            "libcuda.so.1::/usr/lib/x86_64-linux-gnu/libcuda.so".to_string(),
        ];
        assert_eq!(
            create_symlinks(root, &links).unwrap(),
            vec![LinkOutcome::Created, LinkOutcome::Created]
        );
        assert_eq!(
            fs::read_link(root.join("usr/lib/libcuda.so")).unwrap(),
            Path::new("libcuda.so.1")
        );
        assert_eq!(
            create_symlinks(root, &links[..1]).unwrap(),
            vec![LinkOutcome::AlreadyThere]
        );
        fs::write(root.join("usr/lib/libnvidia-ml.so"), "image's own").unwrap();
        assert_eq!(
            create_symlinks(root, &["x::/usr/lib/libnvidia-ml.so".to_string()]).unwrap(),
            vec![LinkOutcome::Kept]
        );
        assert_eq!(
            fs::read(root.join("usr/lib/libnvidia-ml.so")).unwrap(),
            b"image's own"
        );
        assert!(matches!(
            create_symlinks(root, &["relative/link".to_string()]),
            Err(HookError::BadLink(_))
        ));
    }

    #[test]
    fn ldcache_lists_the_folders_and_runs_the_hosts_ldconfig_on_the_root() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let r = RecordingRunner::new();
        let folders = vec!["/usr/lib/x86_64-linux-gnu".to_string()];
        update_ldcache(root, &folders, "/sbin/ldconfig", &r).unwrap();
        assert_eq!(
            fs::read_to_string(root.join("etc/ld.so.conf.d/00-gpu-agent-cdi.conf")).unwrap(),
            "# Driver libraries injected by gpu-agent (CDI)\n/usr/lib/x86_64-linux-gnu\n"
        );
        let root_s = fs::canonicalize(root).unwrap().display().to_string();
        assert_eq!(
            r.calls(),
            vec![vec![
                "/sbin/ldconfig".to_string(),
                "-r".into(),
                root_s,
                "/usr/lib/x86_64-linux-gnu".into()
            ]]
        );
        assert!(matches!(
            update_ldcache(root, &["lib".to_string()], "/sbin/ldconfig", &r),
            Err(HookError::BadFolder(_))
        ));
    }
}
