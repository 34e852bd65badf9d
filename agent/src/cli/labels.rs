//! `gpu-agent labels`: GPU feature discovery's labels for this node.

use std::process::ExitCode;

use super::args::{Cli, Output};
use super::{Failure, host_root, load_policy, node_view, print_json};

pub(crate) fn labels(cli: &Cli, output: Output) -> Result<ExitCode, Failure> {
    let host = host_root(cli)?;
    let policy = load_policy(cli.policy.as_deref())?;
    let view = node_view(cli, &host)?;
    let inv = gpu_agent::inventory::discover(&view.sys, view.backend.as_ref());
    let (labels, warnings) =
        gpu_agent::labels::node_labels_noted(&inv, &policy.device_plugin, policy.mig.strategy)?;
    for w in &warnings {
        eprintln!("warning: {w}");
    }
    match output {
        Output::Json => print_json(&labels)?,
        Output::Table => print!("{}", gpu_agent::labels::render(&labels)),
    }
    Ok(ExitCode::SUCCESS)
}
