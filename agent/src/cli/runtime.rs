//! `gpu-agent runtime configure|restore`: the container runtime's configuration.

use std::process::ExitCode;

use super::args::{Cli, RuntimeCommand};
use super::{Failure, bad_input, host_root, load_policy};

pub(crate) fn runtime_command(cli: &Cli, command: &RuntimeCommand) -> Result<ExitCode, Failure> {
    use gpu_agent::runtime::{self, RuntimeError};
    let host = host_root(cli)?;
    let map = |e: RuntimeError| match e {
        RuntimeError::Parse { .. } | RuntimeError::Invalid { .. } => bad_input(e),
        other => other.into(),
    };
    match command {
        RuntimeCommand::Configure {
            dry_run,
            containerd_version,
            no_wait,
        } => {
            let policy = load_policy(cli.policy.as_deref())?;
            let version = match containerd_version {
                Some(v) => Some(runtime::containerd::Version::parse(v).ok_or_else(|| {
                    bad_input(anyhow::anyhow!(
                        "--containerd-version: {v:?} is not a version like 1.7.2"
                    ))
                })?),
                None => None,
            };
            let plan = runtime::plan(&host, &policy.runtime_wanted(), version).map_err(map)?;
            for n in &plan.notes {
                eprintln!("note: {n}");
            }
            if plan.changes.is_empty() {
                println!(
                    "{:?} is already configured: nothing to change",
                    plan.runtime
                );
                return Ok(ExitCode::SUCCESS);
            }
            for c in &plan.changes {
                print!("{}", c.diff());
            }
            if *dry_run {
                return Ok(ExitCode::SUCCESS);
            }
            let changed =
                runtime::apply(&host, &hostlib::LinuxSyscalls, &plan, !no_wait).map_err(map)?;
            for p in &changed {
                let created = plan
                    .changes
                    .iter()
                    .any(|c| &c.path == p && c.before.is_none());
                if created {
                    eprintln!("wrote {p} (a new file; `gpu-agent runtime restore` removes it)");
                } else {
                    eprintln!(
                        "wrote {p} (the original is kept; `gpu-agent runtime restore` puts it back)"
                    );
                }
            }
        }
        RuntimeCommand::Restore { no_wait } => {
            let done = runtime::restore(&host, &hostlib::LinuxSyscalls, !no_wait).map_err(map)?;
            if done.is_empty() {
                println!("nothing to restore");
            }
            for d in done {
                match d {
                    hostlib::managed::Restored::Rewritten(p) => println!("restored {p}"),
                    hostlib::managed::Restored::Removed(p) => {
                        println!("removed {p} (gpu-agent had created it)")
                    }
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
