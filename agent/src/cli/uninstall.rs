//! `gpu-agent uninstall`: the host put back as it was before gpu-agent.

use std::process::ExitCode;

use super::args::Cli;
use super::{Failure, host_root};

pub(crate) fn uninstall(cli: &Cli, no_wait: bool) -> Result<ExitCode, Failure> {
    let host = host_root(cli)?;
    let done = gpu_agent::uninstall::uninstall(&host, &hostlib::LinuxSyscalls, !no_wait)?;
    if done.is_empty() {
        println!("nothing to undo: gpu-agent has changed nothing on this host");
    }
    for d in done {
        println!("{d}");
    }
    println!("kernel modules, and their device nodes, are left as they are");
    Ok(ExitCode::SUCCESS)
}
