//! `gpu-agent run`: the agent itself, under its supervisor, and where the
//! cluster controller it reports to is.

use std::process::ExitCode;

use gpu_agent::caps::HeldCaps;
use gpu_agent::source::NodeView;
use hostlib::HostRoot;

use super::args::{Cli, ControllerArgs};
use super::{Failure, host_root, load_policy, node_view};

impl ControllerArgs {
    fn config(&self, host: &HostRoot) -> Option<gpu_agent::report::ReportConfig> {
        let endpoint = self.endpoint.clone().filter(|e| !e.is_empty())?;
        Some(gpu_agent::report::ReportConfig {
            endpoint,
            ca_file: self.ca.clone(),
            server_name: self.server_name.clone(),
            token_file: self.token_file.clone(),
            node_name: self
                .node_name
                .clone()
                .filter(|n| !n.is_empty())
                .unwrap_or_else(gpu_agent::report::node_name),
            boot_id: host
                .read_optional("/proc/sys/kernel/random/boot_id")
                .ok()
                .flatten()
                .map(|b| b.trim().to_string())
                .unwrap_or_default(),
            started_at: gpu_agent::state::now(),
        })
    }
}

pub(crate) fn run(
    cli: &Cli,
    once: bool,
    heartbeat: u64,
    controller: &ControllerArgs,
) -> Result<ExitCode, Failure> {
    let host = host_root(cli)?;
    let policy = load_policy(cli.policy.as_deref())?;
    // NVML is opened by the supervisor on a thread of its own, once it has
    // trimmed its capabilities, while it sets itself up.
    let view = match &cli.simulate {
        Some(_) => node_view(cli, &host)?,
        None => NodeView::host_opening_later(&host, cli.nvml_lib.as_deref()),
    };
    let report = controller.config(&host);
    let ok = gpu_agent::supervisor::run(gpu_agent::supervisor::Options {
        host,
        policy_path: cli.policy.clone(),
        policy,
        view,
        caps: HeldCaps::read(),
        heartbeat,
        once,
        report,
    })?;
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
