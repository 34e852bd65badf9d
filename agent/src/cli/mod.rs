//! What each subcommand does (one module each), and what they share: the
//! failure with its exit code, the host root, the policy, the node view.

pub(crate) mod args;
pub(crate) mod cdi;
pub(crate) mod demo;
pub(crate) mod driver;
pub(crate) mod host_exec;
pub(crate) mod inventory;
pub(crate) mod labels;
pub(crate) mod policy;
pub(crate) mod run;
pub(crate) mod runtime;
pub(crate) mod status;
pub(crate) mod uninstall;

use std::io::Write;
use std::path::Path;

use gpu_agent::policy::Policy;
use gpu_agent::source::NodeView;
use hostlib::HostRoot;
use serde::Serialize;

use args::Cli;

/// Exit code for bad input (an invalid policy, node description or argument).
const EXIT_BAD_INPUT: u8 = 2;

/// An error with the exit code it should end the process with.
pub(crate) struct Failure {
    pub(crate) code: u8,
    pub(crate) error: anyhow::Error,
}

impl<E: Into<anyhow::Error>> From<E> for Failure {
    fn from(e: E) -> Self {
        Failure {
            code: 1,
            error: e.into(),
        }
    }
}

pub(crate) fn bad_input(e: impl Into<anyhow::Error>) -> Failure {
    Failure {
        code: EXIT_BAD_INPUT,
        error: e.into(),
    }
}

pub(crate) fn bad_input_if_description(e: anyhow::Error) -> Failure {
    if e.downcast_ref::<simnode::DescError>().is_some() {
        bad_input(e)
    } else {
        Failure { code: 1, error: e }
    }
}

pub(crate) fn host_root(cli: &Cli) -> Result<HostRoot, Failure> {
    HostRoot::new(&cli.host_root).map_err(|e| bad_input(anyhow::anyhow!("--host-root: {e}")))
}

/// The policy, and the device-plugin config it names, or exit 2.
pub(crate) fn load_policy(path: Option<&Path>) -> Result<Policy, Failure> {
    let policy = match path {
        Some(p) => Policy::from_file(p).map_err(bad_input)?,
        None => Policy::default(),
    };
    gpu_agent::plugin::settings(&policy.device_plugin, policy.mig.strategy).map_err(bad_input)?;
    Ok(policy)
}

pub(crate) fn node_view(cli: &Cli, host: &HostRoot) -> Result<NodeView, Failure> {
    match &cli.simulate {
        Some(name) => NodeView::simulated(name).map_err(|e| match e {
            gpu_agent::source::SourceError::Description(_) => bad_input(e),
            other => other.into(),
        }),
        None => Ok(NodeView::host(host, cli.nvml_lib.as_deref())),
    }
}

pub(crate) fn print_json<T: Serialize>(value: &T) -> Result<(), Failure> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer_pretty(&mut out, value)?;
    writeln!(out)?;
    Ok(())
}
