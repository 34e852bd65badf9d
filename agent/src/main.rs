//! The `gpu-agent` command: its command line, logging, and which module
//! under `cli/` does each subcommand.

mod cli;

use std::process::ExitCode;

use clap::Parser;
use gpu_agent::logging;
use gpu_agent::render;

use cli::Failure;
use cli::args::{CdiCommand, Cli, Command, PolicyCommand};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let default_level = match cli.command {
        Command::Run { .. } => "info",
        // The demo says in words what happens; its (expected) warnings would only clutter it.
        Command::Demo { .. } => "error",
        _ => "warn",
    };
    if let Some(note) = logging::init(cli.log_format, default_level) {
        eprintln!("gpu-agent: {note}");
    }
    match dispatch(cli) {
        Ok(code) => code,
        Err(Failure { code, error }) => {
            eprintln!("error: {}", render::error_words(&*error));
            ExitCode::from(code)
        }
    }
}

fn dispatch(cli: Cli) -> Result<ExitCode, Failure> {
    match &cli.command {
        Command::Run {
            once,
            heartbeat,
            controller,
        } => cli::run::run(&cli, *once, *heartbeat, controller),
        Command::Status { ready: true, .. } => cli::status::status_ready(&cli),
        Command::Status { output, .. } => cli::status::status(&cli, *output),
        Command::Inventory { output } => cli::inventory::inventory(&cli, *output),
        Command::Labels { output } => cli::labels::labels(&cli, *output),
        Command::Policy {
            command: PolicyCommand::Check { file, effective },
        } => cli::policy::policy_check(file, *effective),
        Command::Runtime { command } => cli::runtime::runtime_command(&cli, command),
        Command::Cdi {
            command: CdiCommand::Generate { write, no_wait },
        } => cli::cdi::cdi_generate(&cli, *write, *no_wait),
        Command::CdiHook { command } => cli::cdi::cdi_hook(command),
        Command::HostExec { shm, argv } => cli::host_exec::host_exec(&cli, shm.as_deref(), argv),
        Command::Driver { command } => cli::driver::command(&cli, command),
        Command::Uninstall { no_wait } => cli::uninstall::uninstall(&cli, *no_wait),
        Command::Demo { node, keep } => {
            cli::demo::run(node, *keep, &mut std::io::stdout().lock())
                .map_err(cli::bad_input_if_description)?;
            Ok(ExitCode::SUCCESS)
        }
    }
}
