//! Loading and unloading the NVIDIA kernel modules.
//!
//! Load order is the dependency order (`nvidia` first: every other module
//! uses its symbols); unload is the reverse. A module already loaded with
//! the parameters asked for is left alone; with other parameters it is an
//! error that names the parameter and both values (the caller may unload
//! and load again instead, by policy). Unloading refuses while the module
//! is in use, naming the modules that hold it and the processes that have
//! `/dev/nvidia*` open.

use std::collections::BTreeMap;
use std::path::PathBuf;

use hostlib::{HostError, HostRoot, SyscallError, Syscalls};
use nix::errno::Errno;

/// The NVIDIA modules gpu-agent loads, in load order, with the file each
/// comes from (`nvidia-uvm.ko` holds module `nvidia_uvm`).
pub const LOAD_ORDER: &[(&str, &str)] = &[
    ("nvidia", "nvidia.ko"),
    ("nvidia_uvm", "nvidia-uvm.ko"),
    ("nvidia_modeset", "nvidia-modeset.ko"),
    ("nvidia_drm", "nvidia-drm.ko"),
    ("nvidia_peermem", "nvidia-peermem.ko"),
];

/// One module to load.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModuleSpec {
    /// The module's name as the kernel knows it (`nvidia_uvm`).
    pub name: String,
    /// The `.ko` file, a host path.
    pub file: String,
    /// Parameters (`NVreg_OpenRmEnableUnsupportedGpus=1`), in order.
    pub params: BTreeMap<String, String>,
}

impl ModuleSpec {
    /// The parameter string `finit_module` takes: `a=1 b=2`.
    pub fn param_string(&self) -> String {
        self.params
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// The modules to load from `dir` (a host path): `nvidia`, `nvidia_uvm`,
/// `nvidia_modeset` always, `nvidia_drm` and `nvidia_peermem` when asked;
/// parameters per module name.
pub fn plan(
    dir: &str,
    drm: bool,
    peermem: bool,
    params: &BTreeMap<String, BTreeMap<String, String>>,
) -> Vec<ModuleSpec> {
    LOAD_ORDER
        .iter()
        .filter(|(name, _)| match *name {
            "nvidia_drm" => drm,
            "nvidia_peermem" => peermem,
            _ => true,
        })
        .map(|(name, file)| ModuleSpec {
            name: name.to_string(),
            file: format!("{}/{file}", dir.trim_end_matches('/')),
            params: params.get(*name).cloned().unwrap_or_default(),
        })
        .collect()
}

/// Errors; each names the module (and file, parameter or holder).
#[derive(Debug, thiserror::Error)]
pub enum ModuleError {
    #[error(
        "{module} is loaded with {param}={loaded}, the policy asks for {param}={wanted}; unload it first (gpu-agent driver unload) or let the policy reload it"
    )]
    ParamMismatch {
        module: String,
        param: String,
        loaded: String,
        wanted: String,
    },
    #[error("{module}: {file} does not exist")]
    MissingFile { module: String, file: String },
    #[error(
        "{module} was built for kernel {built_for}, the running kernel is {running}: it cannot be loaded ({file})"
    )]
    Vermagic {
        module: String,
        file: String,
        built_for: String,
        running: String,
    },
    #[error("loading {module} from {file}: {source}")]
    Load {
        module: String,
        file: String,
        #[source]
        source: SyscallError,
    },
    #[error("{module} is in use{}{}; stop them first", holders_text(.holders), processes_text(.processes))]
    InUse {
        module: String,
        holders: Vec<String>,
        processes: Vec<Holder>,
    },
    #[error("unloading {module}: {source}")]
    Unload {
        module: String,
        #[source]
        source: SyscallError,
    },
    #[error("{path}: {message}")]
    ProcModules { path: String, message: String },
    #[error(
        "{path} does not exist: the kernel has no loadable-module support, so no module can be loaded or unloaded (use a kernel with the driver built in and spec.driver.enabled: false)"
    )]
    NoModuleSupport { path: String },
    #[error(
        "{module} cannot be unloaded: the kernel was built without module unloading (CONFIG_MODULE_UNLOAD; /proc/modules shows \"-\" for its reference count); reboot to change the driver"
    )]
    NoUnload { module: String },
    #[error(transparent)]
    Host(#[from] HostError),
}

fn holders_text(h: &[String]) -> String {
    if h.is_empty() {
        String::new()
    } else {
        format!(" by module(s) {}", h.join(", "))
    }
}

fn processes_text(p: &[Holder]) -> String {
    if p.is_empty() {
        String::new()
    } else {
        let list: Vec<String> = p
            .iter()
            .map(|h| format!("{} (pid {}, {})", h.command, h.pid, h.device))
            .collect();
        format!(
            " ({} process(es) have NVIDIA devices open: {})",
            p.len(),
            list.join(", ")
        )
    }
}

/// A process holding an NVIDIA device open.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holder {
    pub pid: u32,
    pub command: String,
    /// The device it has open (`/dev/nvidia0`).
    pub device: String,
}

/// A loaded module as `/proc/modules` and `/sys/module` show it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Loaded {
    pub name: String,
    /// `None` where the kernel shows `-`: it was built without module
    /// unloading, and nothing can be unloaded.
    pub refcount: Option<i32>,
    /// Modules using it (`/proc/modules`' used-by column, or `holders/`).
    pub holders: Vec<String>,
}

/// The loaded modules, by name (`/proc/modules`, through our own parser:
/// procfs-core fails on the `-` counts real kernels print, see
/// `hostlib::procfiles`). Loading and unloading need the whole list: a line
/// that cannot be read is an error naming it.
pub fn loaded(host: &HostRoot) -> Result<BTreeMap<String, Loaded>, ModuleError> {
    const PROC_MODULES: &str = "/proc/modules";
    let path = || {
        host.resolve(PROC_MODULES)
            .map(|p| p.display().to_string())
            .unwrap_or_else(|_| PROC_MODULES.into())
    };
    let Some(text) = host.read_optional(PROC_MODULES)? else {
        return Err(ModuleError::NoModuleSupport { path: path() });
    };
    let parsed = hostlib::procfiles::parse_modules(&text);
    if let Some(bad) = parsed.bad_lines.first() {
        return Err(ModuleError::ProcModules {
            path: path(),
            message: format!(
                "{bad}; cannot tell which modules are loaded (nothing was loaded or unloaded)"
            ),
        });
    }
    Ok(parsed
        .modules
        .into_values()
        .map(|m| {
            (
                m.name.clone(),
                Loaded {
                    name: m.name,
                    refcount: m.refcount.count(),
                    holders: m.used_by,
                },
            )
        })
        .collect())
}

/// A loaded module's parameter value (`/sys/module/<m>/parameters/<p>`),
/// `None` where the module does not expose it.
pub fn parameter(host: &HostRoot, module: &str, param: &str) -> Option<String> {
    host.read_optional(format!("/sys/module/{module}/parameters/{param}"))
        .ok()
        .flatten()
        .map(|s| s.trim().to_string())
}

/// The `vermagic` of a `.ko` (from its `.modinfo` strings: `vermagic=6.1.0-27-amd64 SMP …`).
pub fn vermagic(bytes: &[u8]) -> Option<String> {
    let key = b"vermagic=";
    let at = bytes.windows(key.len()).position(|w| w == key)? + key.len();
    let end = bytes[at..].iter().position(|b| *b == 0)? + at;
    Some(String::from_utf8_lossy(&bytes[at..end]).trim().to_string())
}

/// What loading one module did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LoadOutcome {
    Loaded { module: String, params: String },
    AlreadyLoaded { module: String },
}

/// Loads `specs` in order. Checks every file and its vermagic against the
/// running kernel before loading anything.
pub fn load(
    host: &HostRoot,
    sys: &dyn Syscalls,
    specs: &[ModuleSpec],
) -> Result<Vec<LoadOutcome>, ModuleError> {
    let running = host
        .read_to_string("/proc/sys/kernel/osrelease")?
        .trim()
        .to_string();
    let current = loaded(host)?;
    let mut files: Vec<PathBuf> = Vec::new();
    for s in specs {
        if let Some(l) = current.get(&s.name) {
            for (param, wanted) in &s.params {
                if let Some(have) = parameter(host, &l.name, param)
                    && &have != wanted
                {
                    return Err(ModuleError::ParamMismatch {
                        module: s.name.clone(),
                        param: param.clone(),
                        loaded: have,
                        wanted: wanted.clone(),
                    });
                }
            }
            files.push(PathBuf::new());
            continue;
        }
        let path = host.resolve(&s.file)?;
        let bytes = std::fs::read(&path).map_err(|_| ModuleError::MissingFile {
            module: s.name.clone(),
            file: s.file.clone(),
        })?;
        if let Some(v) = vermagic(&bytes) {
            let built_for = v.split_whitespace().next().unwrap_or("").to_string();
            if built_for != running {
                return Err(ModuleError::Vermagic {
                    module: s.name.clone(),
                    file: s.file.clone(),
                    built_for,
                    running,
                });
            }
        }
        files.push(path);
    }
    let mut out = Vec::new();
    for (s, path) in specs.iter().zip(files) {
        if current.contains_key(&s.name) {
            tracing::info!(stage = "driver", module = %s.name, "already loaded with the asked parameters");
            out.push(LoadOutcome::AlreadyLoaded {
                module: s.name.clone(),
            });
            continue;
        }
        let params = s.param_string();
        match sys.finit_module(&path, &params) {
            Ok(()) => {}
            // Loaded meanwhile (udev, another agent): the same result.
            Err(e) if e.errno == Errno::EEXIST => {}
            Err(source) => {
                return Err(ModuleError::Load {
                    module: s.name.clone(),
                    file: s.file.clone(),
                    source,
                });
            }
        }
        tracing::info!(stage = "driver", module = %s.name, params = %params, "loaded");
        out.push(LoadOutcome::Loaded {
            module: s.name.clone(),
            params,
        });
    }
    Ok(out)
}

/// The processes with an NVIDIA device (`/dev/nvidia*`) open, from `/proc/<pid>/fd`.
pub fn device_holders(host: &HostRoot) -> Vec<Holder> {
    let mut out = Vec::new();
    let Ok(pids) = host.read_dir_names("/proc") else {
        return out;
    };
    for pid in pids.iter().filter_map(|p| p.parse::<u32>().ok()) {
        let Ok(fds) = host.read_dir_names(format!("/proc/{pid}/fd")) else {
            continue;
        };
        let mut devices: Vec<String> = fds
            .iter()
            .filter_map(|fd| host.read_link(format!("/proc/{pid}/fd/{fd}")).ok())
            .map(|t| t.display().to_string())
            .filter(|t| t.starts_with("/dev/nvidia"))
            .collect();
        devices.sort();
        devices.dedup();
        if devices.is_empty() {
            continue;
        }
        let command = host
            .read_optional(format!("/proc/{pid}/comm"))
            .ok()
            .flatten()
            .map(|c| c.trim().to_string())
            .unwrap_or_else(|| "?".into());
        out.push(Holder {
            pid,
            command,
            device: devices.join(", "),
        });
    }
    out
}

/// Unloads `names` in reverse load order (those not loaded are skipped),
/// refusing while any is in use. Returns the modules unloaded.
pub fn unload(
    host: &HostRoot,
    sys: &dyn Syscalls,
    names: &[String],
) -> Result<Vec<String>, ModuleError> {
    // Refuse before unloading anything: a module is free when every user it
    // counts is one of the modules unloaded with it (each dependent module
    // holds one reference; an open device file holds another).
    let current = loaded(host)?;
    for name in names.iter().rev() {
        let Some(l) = current.get(name) else {
            continue;
        };
        let outside: Vec<String> = l
            .holders
            .iter()
            .filter(|h| !names.contains(*h))
            .cloned()
            .collect();
        let inside = l.holders.len() - outside.len();
        let Some(refcount) = l.refcount else {
            return Err(ModuleError::NoUnload {
                module: name.clone(),
            });
        };
        if !outside.is_empty() || refcount > inside as i32 {
            return Err(ModuleError::InUse {
                module: name.clone(),
                holders: outside,
                processes: device_holders(host),
            });
        }
    }
    let mut done = Vec::new();
    for name in names.iter().rev() {
        // Re-read each time: unloading a holder frees the module it held
        // (holders unloaded in this run are not counted, whatever /proc says).
        let current = loaded(host)?;
        let Some(l) = current.get(name) else {
            continue;
        };
        let holders: Vec<String> = l
            .holders
            .iter()
            .filter(|h| !done.contains(*h))
            .cloned()
            .collect();
        if !holders.is_empty() {
            return Err(ModuleError::InUse {
                module: name.clone(),
                holders,
                processes: device_holders(host),
            });
        }
        match sys.delete_module(name) {
            Ok(()) => {}
            Err(e) if e.errno == Errno::EWOULDBLOCK || e.errno == Errno::EBUSY => {
                return Err(ModuleError::InUse {
                    module: name.clone(),
                    holders: Vec::new(),
                    processes: device_holders(host),
                });
            }
            Err(source) => {
                return Err(ModuleError::Unload {
                    module: name.clone(),
                    source,
                });
            }
        }
        tracing::info!(stage = "driver", module = %name, "unloaded");
        done.push(name.clone());
    }
    Ok(done)
}
