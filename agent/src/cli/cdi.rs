//! `gpu-agent cdi generate` and the `cdi-hook` programs a container
//! runtime runs from gpu-agent's CDI specs.

use std::process::ExitCode;

use anyhow::Context as _;
use hostlib::HostRoot;

use super::args::{Cli, HookCommand};
use super::{Failure, host_root, load_policy, node_view};

pub(crate) fn cdi_generate(cli: &Cli, write: bool, no_wait: bool) -> Result<ExitCode, Failure> {
    use gpu_agent::cdi;
    let host = host_root(cli)?;
    let policy = load_policy(cli.policy.as_deref())?;
    let view = node_view(cli, &host)?;
    let inv = gpu_agent::inventory::discover(&view.sys, view.backend.as_ref());
    let opts = cdi::Options {
        hook_path: policy.cdi.hook_path.clone(),
    };
    let generated = cdi::generate(&inv, &view.sys, &opts)?;
    for n in &generated.notes {
        eprintln!("note: {n}");
    }
    print!("{}", generated.to_json());
    if write {
        let changed = cdi::apply(
            &host,
            &hostlib::LinuxSyscalls,
            &generated,
            &policy.cdi,
            !no_wait,
        )?;
        if changed.is_empty() {
            eprintln!("{} is up to date", cdi::spec_path(&policy.cdi.spec_dir));
        }
        for p in changed {
            eprintln!("wrote {p} (`gpu-agent runtime restore` removes it)");
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub(crate) fn cdi_hook(command: &HookCommand) -> Result<ExitCode, Failure> {
    use gpu_agent::cdi::hook;
    use std::io::Read as _;
    let mut state = String::new();
    std::io::stdin()
        .read_to_string(&mut state)
        .context("reading the OCI state from stdin")?;
    let root = hook::container_root(&state)?;
    match command {
        HookCommand::CreateSymlinks { links } => {
            hook::create_symlinks(&root, links)?;
        }
        HookCommand::UpdateLdcache { folders } => {
            let ldconfig = hook::host_ldconfig(&HostRoot::system())?;
            hook::update_ldcache(&root, folders, &ldconfig, &hostlib::command::SystemRunner)?;
        }
    }
    Ok(ExitCode::SUCCESS)
}
