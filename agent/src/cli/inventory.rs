//! `gpu-agent inventory`: the node's GPUs, as a table or JSON.

use std::process::ExitCode;

use gpu_agent::render;

use super::args::{Cli, Output};
use super::{Failure, host_root, node_view, print_json};

pub(crate) fn inventory(cli: &Cli, output: Output) -> Result<ExitCode, Failure> {
    let host = host_root(cli)?;
    let view = node_view(cli, &host)?;
    let inv = gpu_agent::inventory::discover(&view.sys, view.backend.as_ref());
    match output {
        Output::Json => print_json(&inv)?,
        Output::Table => print!("{}", render::inventory(&inv)),
    }
    Ok(ExitCode::SUCCESS)
}
