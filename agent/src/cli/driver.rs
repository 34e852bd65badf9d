//! `gpu-agent driver …`: bundles, modules, device nodes, upgrades.

use std::io::IsTerminal;
use std::path::Path;
use std::process::ExitCode;

use gpu_agent::driver::{self, DriverError, NothingAdvertised, Upgrade};
use gpu_agent::{Inventory, render};
use hostlib::HostRoot;
use hostlib::managed::{HostFilesLock, ManagedError};
use kmod::bundle::{self, BundleError, Progress};
use kmod::modules::{self, LoadOutcome};

use super::args::{Cli, DriverCommand, FlavourArg};
use super::{Failure, bad_input, host_root, load_policy, node_view};

fn map_driver(e: DriverError) -> Failure {
    match e {
        DriverError::Bundle(
            BundleError::Checksum { .. }
            | BundleError::NoChecksum { .. }
            | BundleError::Sidecar { .. }
            | BundleError::Manifest { .. }
            | BundleError::Entry { .. }
            | BundleError::TooLarge { .. }
            | BundleError::Kernel { .. },
        ) => bad_input(e),
        other => other.into(),
    }
}

fn map_bundle(e: BundleError) -> Failure {
    map_driver(DriverError::Bundle(e))
}

/// A progress line on stderr when it is a terminal.
fn progress() -> Box<dyn FnMut(Progress)> {
    let tty = std::io::stderr().is_terminal();
    Box::new(move |p| {
        if !tty {
            return;
        }
        let (what, done, total) = match p {
            Progress::Verifying { done, total } => ("verifying", done, total),
            Progress::Unpacking { done, total } => ("unpacking", done, total),
        };
        let pct = (done * 100).checked_div(total).unwrap_or(100);
        let mib = |b: u64| b as f64 / f64::from(1 << 20);
        eprint!(
            "\r{what}: {pct:3}% ({:.1} of {:.1} MiB)",
            mib(done),
            mib(total)
        );
        if done >= total {
            eprintln!();
        }
    })
}

struct Env {
    host: HostRoot,
    policy: gpu_agent::Policy,
    inv: Option<Inventory>,
    kernel: String,
}

fn env(cli: &Cli) -> Result<Env, Failure> {
    let host = host_root(cli)?;
    let policy = load_policy(cli.policy.as_deref())?;
    let view = node_view(cli, &host)?;
    if view.simulated.is_some() {
        return Err(bad_input(anyhow::anyhow!(
            "gpu-agent driver works on the host's kernel; it cannot be used with --simulate"
        )));
    }
    let inv = Some(gpu_agent::inventory::discover(
        &view.sys,
        view.backend.as_ref(),
    ));
    let kernel = driver::running_kernel(&host).map_err(map_driver)?;
    Ok(Env {
        host,
        policy,
        inv,
        kernel,
    })
}

fn install_file(e: &Env, file: &Path, sha256: Option<&str>) -> Result<String, Failure> {
    let expected = bundle::expected_sha256(file, sha256).map_err(map_bundle)?;
    let got = bundle::install(
        &e.host,
        file,
        (&expected.0, &expected.1),
        &e.kernel,
        progress(),
    )
    .map_err(map_bundle)?;
    if got.unpacked {
        println!(
            "{}: sha256 {} ({}); unpacked {} file(s), {} bytes into {}",
            file.display(),
            expected.0,
            expected.1,
            got.files,
            got.bytes,
            got.dir
        );
    } else {
        println!("{}: already unpacked in {}", file.display(), got.dir);
    }
    Ok(got.manifest.dir_name(&e.kernel))
}

/// `driver pack`: every regular file of `dir` (no subdirectories) under
/// `modules/<kernel>/<flavour>/`.
fn pack(
    dir: &Path,
    version: &str,
    kernel: &str,
    flavour: FlavourArg,
    out: &Path,
) -> Result<ExitCode, Failure> {
    let flavour = match flavour {
        FlavourArg::Open => bundle::Flavour::Open,
        FlavourArg::Proprietary => bundle::Flavour::Proprietary,
    };
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map_err(|err| bad_input(anyhow::anyhow!("{}: {err}", dir.display())))?
        .filter_map(|d| d.ok())
        .filter(|d| d.file_type().is_ok_and(|t| t.is_file()))
        .map(|d| d.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    if !names.iter().any(|n| n == "nvidia.ko") {
        return Err(bad_input(anyhow::anyhow!(
            "{}: no nvidia.ko in it",
            dir.display()
        )));
    }
    let mut files = Vec::new();
    for n in &names {
        let path = dir.join(n);
        let bytes =
            std::fs::read(&path).map_err(|err| anyhow::anyhow!("{}: {err}", path.display()))?;
        files.push((
            format!("modules/{kernel}/{}/{n}", flavour.name()),
            bytes,
            0o644,
        ));
    }
    let mut buf = Vec::new();
    bundle::build(&mut buf, version, &[kernel], &[flavour], &files)
        .map_err(|err| anyhow::anyhow!("building the bundle: {err}"))?;
    std::fs::write(out, &buf).map_err(|err| anyhow::anyhow!("{}: {err}", out.display()))?;
    let sum = bundle::sha256_file(out, &mut |_| {}).map_err(map_bundle)?;
    let sidecar = bundle::write_sidecar(out, &sum).map_err(map_bundle)?;
    println!(
        "wrote {} ({} module file(s), driver {version}, kernel {kernel}, {}) and {}",
        out.display(),
        files.len(),
        flavour.name(),
        sidecar.display()
    );
    Ok(ExitCode::SUCCESS)
}

/// The host-files lock for `what` (driver installs and upgrades change the
/// host as the runtime, CDI and label writers do: one at a time). When
/// another process holds it: says who and waits, or with `no_wait` fails
/// naming it.
fn lock_host_files(host: &HostRoot, what: &str, no_wait: bool) -> Result<HostFilesLock, Failure> {
    match HostFilesLock::take(host, what, false) {
        Ok(lock) => Ok(lock),
        Err(ManagedError::Locked { path, holder }) if !no_wait => {
            let who = holder.map_or_else(
                || "another process (it has not said who)".to_string(),
                |h| h.to_string(),
            );
            eprintln!("gpu-agent: waiting for {}: held by {who}", path.display());
            Ok(HostFilesLock::take(host, what, true)?)
        }
        Err(e) => Err(e.into()),
    }
}

/// What a file or name is called in the lock file.
fn shown(to: &str) -> String {
    Path::new(to)
        .file_name()
        .map_or_else(|| to.to_string(), |n| n.to_string_lossy().into_owned())
}

pub(crate) fn command(cli: &Cli, cmd: &DriverCommand) -> Result<ExitCode, Failure> {
    if let DriverCommand::Pack {
        dir,
        version,
        kernel,
        flavour,
        out,
    } = cmd
    {
        return pack(dir, version, kernel, *flavour, out);
    }
    let e = env(cli)?;
    let sys = hostlib::LinuxSyscalls;
    match cmd {
        DriverCommand::List => list(&e),
        DriverCommand::Install {
            bundle: file,
            sha256,
            no_wait,
        } => {
            let what = format!("driver install {}", shown(&file.to_string_lossy()));
            let _lock = lock_host_files(&e.host, &what, *no_wait)?;
            let name = install_file(&e, file, sha256.as_deref())?;
            let loaded = hostlib::driver::DriverState::read(&e.host).is_loaded();
            let current = bundle::current(&e.host).map_err(map_bundle)?;
            if current.as_deref() == Some(name.as_str()) {
                println!("{name} is the current driver");
            } else if loaded {
                println!(
                    "a driver is loaded: {name} is unpacked, not switched to; `gpu-agent driver upgrade {name}` switches the loaded driver"
                );
            } else {
                bundle::switch(&e.host, &name).map_err(map_bundle)?;
                println!(
                    "{name} is now the current driver (previous: {})",
                    current.as_deref().unwrap_or("none")
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        DriverCommand::Load { module_dir } => {
            let mut policy = e.policy.clone();
            if let Some(d) = module_dir {
                policy.driver.module_dir = Some(d.clone());
            }
            let plan = driver::plan_load(&e.host, &policy.driver, e.inv.as_ref(), &e.kernel, None)
                .map_err(map_driver)?;
            let out = driver::load(&e.host, &sys, &plan, policy.driver.on_param_mismatch)
                .map_err(map_driver)?;
            for o in &out {
                match o {
                    LoadOutcome::Loaded { module, params } if params.is_empty() => {
                        println!("loaded {module}")
                    }
                    LoadOutcome::Loaded { module, params } => {
                        println!("loaded {module} ({params})")
                    }
                    LoadOutcome::AlreadyLoaded { module } => {
                        println!("{module} already loaded with these parameters")
                    }
                }
            }
            nodes(&e, &sys)?;
            let want = plan.bundle.as_ref().map(|(_, v)| v.as_str());
            let version = driver::validate(&e.host, want, None).map_err(map_driver)?;
            println!(
                "driver {version} loaded from {}{}",
                plan.dir,
                if plan.why.is_empty() {
                    String::new()
                } else {
                    format!(" ({})", plan.why)
                }
            );
            Ok(ExitCode::SUCCESS)
        }
        DriverCommand::Unload => {
            let done = modules::unload(&e.host, &sys, &driver::all_modules())
                .map_err(DriverError::from)
                .map_err(map_driver)?;
            if done.is_empty() {
                println!("no NVIDIA module loaded");
            }
            for m in done {
                println!("unloaded {m}");
            }
            Ok(ExitCode::SUCCESS)
        }
        DriverCommand::Nodes => {
            nodes(&e, &sys)?;
            Ok(ExitCode::SUCCESS)
        }
        DriverCommand::Upgrade {
            to,
            sha256,
            no_wait,
        } => {
            let _lock =
                lock_host_files(&e.host, &format!("driver upgrade {}", shown(to)), *no_wait)?;
            let name = if Path::new(to).is_file() {
                install_file(&e, Path::new(to), sha256.as_deref())?
            } else {
                to.clone()
            };
            upgrade(&e, &sys, &name)
        }
        DriverCommand::Rollback { no_wait } => {
            let _lock = lock_host_files(&e.host, "driver rollback", *no_wait)?;
            let Some(prev) = bundle::previous(&e.host).map_err(map_bundle)? else {
                return Err(anyhow::anyhow!(
                    "no previous driver to roll back to ({} has no `previous` link)",
                    bundle::DRIVERS_DIR
                )
                .into());
            };
            if hostlib::driver::DriverState::read(&e.host).is_loaded() {
                upgrade(&e, &sys, &prev)
            } else {
                bundle::rollback(&e.host).map_err(map_bundle)?;
                println!("{prev} is now the current driver (none was loaded)");
                Ok(ExitCode::SUCCESS)
            }
        }
        DriverCommand::Pack { .. } => unreachable!("handled above"),
        DriverCommand::Remove { name, no_wait } => {
            let _lock = lock_host_files(&e.host, &format!("driver remove {name}"), *no_wait)?;
            bundle::remove(&e.host, name).map_err(map_bundle)?;
            println!("removed {name}");
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn nodes(e: &Env, sys: &dyn hostlib::Syscalls) -> Result<(), Failure> {
    let planned = driver::plan_nodes(&e.host, e.inv.as_ref()).map_err(map_driver)?;
    if planned.is_empty() {
        println!("the nvidia module is not loaded: no device node to make");
        return Ok(());
    }
    let out = kmod::devnodes::ensure(&e.host, sys, &planned)
        .map_err(DriverError::from)
        .map_err(map_driver)?;
    for o in &out {
        match o {
            kmod::devnodes::Outcome::Created(p) => println!("created {p}"),
            kmod::devnodes::Outcome::Replaced { path, was } => {
                println!("replaced {path} (was {was})")
            }
            kmod::devnodes::Outcome::Unchanged(_) => {}
            kmod::devnodes::Outcome::LeftToAdmin { path, is } => {
                println!("left {path} to the administrator (the driver says so); it is {is}")
            }
        }
    }
    println!("{}", driver::nodes_summary(&out));
    Ok(())
}

fn upgrade(e: &Env, sys: &dyn hostlib::Syscalls, name: &str) -> Result<ExitCode, Failure> {
    // Whatever its state file says: a live agent holds its lock.
    if let Some(pid) = gpu_agent::state::agent_running(&e.host) {
        return Err(anyhow::anyhow!(
            "gpu-agent is running (pid {pid}) and advertises the GPUs: set spec.driver.bundle in its policy and reload it (systemctl reload gpu-agent, or SIGHUP); it stops advertising, upgrades and advertises again"
        )
        .into());
    }
    let up = Upgrade {
        host: &e.host,
        sys,
        driver: &e.policy.driver,
        inv: e.inv.as_ref(),
        kernel: &e.kernel,
        drain: &NothingAdvertised,
        nvml: None,
    };
    let report = up.run(name).map_err(map_driver)?;
    println!("{report}");
    Ok(ExitCode::SUCCESS)
}

fn list(e: &Env) -> Result<ExitCode, Failure> {
    let all = bundle::list(&e.host).map_err(map_bundle)?;
    if all.is_empty() {
        println!("no driver unpacked under {}", bundle::DRIVERS_DIR);
    } else {
        let rows: Vec<Vec<String>> = all
            .iter()
            .map(|x| {
                vec![
                    x.name.clone(),
                    x.manifest.driver_version.clone(),
                    x.manifest.kernels.join(","),
                    x.manifest
                        .flavours
                        .iter()
                        .map(|f| f.name())
                        .collect::<Vec<_>>()
                        .join(","),
                    match (x.current, x.previous) {
                        (true, _) => "current".into(),
                        (_, true) => "previous".into(),
                        _ => String::new(),
                    },
                ]
            })
            .collect();
        print!(
            "{}",
            render::table(&["NAME", "DRIVER", "KERNELS", "FLAVOURS", ""], &rows)
        );
    }
    let state = hostlib::driver::DriverState::read(&e.host);
    let loaded: Vec<String> = state
        .modules
        .iter()
        .map(|m| {
            if m.used_by.is_empty() {
                m.name.clone()
            } else {
                format!("{} (used by {})", m.name, m.used_by.join(", "))
            }
        })
        .collect();
    if loaded.is_empty() {
        println!("loaded: none (kernel {})", e.kernel);
    } else {
        println!(
            "loaded: driver {} — {} (kernel {})",
            state.version.as_deref().unwrap_or("of unknown version"),
            loaded.join(", "),
            e.kernel
        );
    }
    Ok(ExitCode::SUCCESS)
}
