//! `gpu-agent host-exec` (hidden): a host program run as the agent runs it.

use std::process::ExitCode;

use super::args::Cli;
use super::{Failure, host_root};

/// `host-exec`: enters the host (see hostlib::process) and becomes the
/// program; returns only when that fails.
pub(crate) fn host_exec(
    cli: &Cli,
    shm: Option<&str>,
    argv: &[String],
) -> Result<ExitCode, Failure> {
    let root = host_root(cli)?;
    hostlib::process::enter(&root, shm, &hostlib::LinuxSyscalls)?;
    Err(hostlib::process::exec(argv).into())
}
