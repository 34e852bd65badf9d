//! The `gpu-agent` command.

mod demo;
mod driver_cli;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};
use gpu_agent::caps::HeldCaps;
use gpu_agent::logging::{self, LogFormat};
use gpu_agent::plugin::manager::ResourceStatus;
use gpu_agent::policy::Policy;
use gpu_agent::source::NodeView;
use gpu_agent::stages::{self, Context, Stage, StageStatus};
use gpu_agent::state::{self, AgentState, Liveness};
use gpu_agent::{Inventory, render};
use hostlib::HostRoot;
use serde::Serialize;

/// Exit code for bad input (an invalid policy, node description or argument).
const EXIT_BAD_INPUT: u8 = 2;
/// Exit code of `status` when no running agent answered (none, stopped,
/// crashed, starting or hung): what it printed is an inspection of the
/// host. LSB's "program is not running", as `systemctl status` exits for a
/// unit that is not active.
const EXIT_NOT_RUNNING: u8 = 3;

#[derive(Debug, Parser)]
#[command(
    name = "gpu-agent",
    version,
    about = "The GPU node agent: discovers NVIDIA GPUs and manages the node's whole GPU stack",
    long_about = None,
)]
struct Cli {
    /// Where the host's / is: / on bare metal, /host in a DaemonSet.
    #[arg(
        long,
        global = true,
        env = "GPU_AGENT_HOST_ROOT",
        default_value = "/",
        value_name = "DIR"
    )]
    host_root: PathBuf,
    /// The policy file (ClusterPolicy-shaped YAML). Without one, every default applies.
    #[arg(long, global = true, env = "GPU_AGENT_POLICY", value_name = "FILE")]
    policy: Option<PathBuf>,
    /// Simulate the node's GPUs from a node description: a file, or a built-in
    /// name (h100-sxm-8, a10g-1, t4-4, no-gpu).
    #[arg(
        long,
        global = true,
        env = "GPU_AGENT_SIMULATE",
        value_name = "FILE|NAME"
    )]
    simulate: Option<String>,
    /// The NVML library to load (default: the host's libnvidia-ml.so.1).
    #[arg(long, global = true, env = "GPU_AGENT_NVML_LIB", value_name = "PATH")]
    nvml_lib: Option<PathBuf>,
    /// How to log: auto (the journal under systemd, else text), text, json, journald.
    #[arg(
        long,
        global = true,
        env = "GPU_AGENT_LOG_FORMAT",
        value_enum,
        default_value = "auto"
    )]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the agent: every stage in order, then stay up, refreshing the state
    /// file until SIGTERM or SIGINT.
    Run {
        /// Run the stages once and exit (1 if a stage failed).
        #[arg(long)]
        once: bool,
        /// Seconds between liveness stamps of the state file (its mtime;
        /// no data written), so that `status` can tell a hung agent. 0: no
        /// stamps, and nothing wakes an idle agent (a live agent is known by
        /// its lock).
        #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=3600))]
        heartbeat: u64,
        #[command(flatten)]
        controller: ControllerArgs,
    },
    /// Show each stage's state: from the running agent (exit 0), or by
    /// inspecting the host when no running agent answers (exit 3).
    Status {
        #[arg(long, short, value_enum, default_value = "table")]
        output: Output,
        /// Exit 0 when the running agent reports every enabled stage
        /// validated, else 1 saying why (a readiness probe).
        #[arg(long, conflicts_with = "output")]
        ready: bool,
    },
    /// List the node's GPUs.
    Inventory {
        #[arg(long, short, value_enum, default_value = "table")]
        output: Output,
    },
    /// GPU feature discovery's labels for this node (`key=value`, sorted), as
    /// the labels stage writes them to NFD's feature file.
    Labels {
        #[arg(long, short, value_enum, default_value = "table")]
        output: Output,
    },
    /// The container runtime's configuration.
    Runtime {
        #[command(subcommand)]
        command: RuntimeCommand,
    },
    /// CDI specs for the node's GPUs.
    Cdi {
        #[command(subcommand)]
        command: CdiCommand,
    },
    /// The createContainer hooks gpu-agent's CDI specs name; a container
    /// runtime runs them with the container's OCI state on stdin.
    CdiHook {
        #[command(subcommand)]
        command: HookCommand,
    },
    /// The NVIDIA driver on the host: bundles, kernel modules, device nodes, upgrades.
    Driver {
        #[command(subcommand)]
        command: driver_cli::DriverCommand,
    },
    /// Policy files.
    Policy {
        #[command(subcommand)]
        command: PolicyCommand,
    },
    /// Runs a host program as the agent runs it (the MPS control daemon):
    /// with --shm, in a mount namespace of its own with that host directory
    /// as /dev/shm; chrooted into the host root when it is not /. The
    /// environment is passed through as is.
    #[command(hide = true)]
    HostExec {
        /// A host directory to bind over /dev/shm.
        #[arg(long, value_name = "HOST_DIR")]
        shm: Option<String>,
        /// The program (a host path) and its arguments.
        #[arg(last = true, required = true, value_name = "PROGRAM")]
        argv: Vec<String>,
    },
    /// A simulated 8x H100 node in a sandbox: runs the agent's stages over it
    /// and shows what it did. Changes nothing outside a temp dir.
    Demo {
        /// The node to simulate (a built-in name or a description file).
        #[arg(long, default_value = "h100-sxm-8")]
        node: String,
        /// Keep the sandbox afterwards (its path is printed).
        #[arg(long)]
        keep: bool,
    },
    /// Leave the host as it was before gpu-agent: put back every host file
    /// it changed (byte for byte), remove every file and directory it made.
    /// Loaded kernel modules and their device nodes stay. The agent must be
    /// stopped first.
    Uninstall {
        /// Exit instead of waiting when another gpu-agent holds the host-files lock.
        #[arg(long)]
        no_wait: bool,
    },
}

#[derive(Debug, Subcommand)]
enum RuntimeCommand {
    /// Add the nvidia runtime (and CDI) to the policy's container runtime;
    /// prints a unified diff of what changes.
    Configure {
        /// Print the diff, change nothing.
        #[arg(long)]
        dry_run: bool,
        /// The containerd version, when the host's binary cannot be run
        /// (e.g. `1.7.2`).
        #[arg(long, value_name = "VERSION")]
        containerd_version: Option<String>,
        /// Exit instead of waiting when another gpu-agent holds the host-files lock.
        #[arg(long)]
        no_wait: bool,
    },
    /// Put every file gpu-agent changed back byte for byte, remove the files it created.
    Restore {
        #[arg(long)]
        no_wait: bool,
    },
}

#[derive(Debug, Subcommand)]
enum CdiCommand {
    /// Print the CDI spec for this node's GPUs (JSON); notes go to stderr.
    Generate {
        /// Also write it to the policy's spec dir (spec.cdi.specDir), and
        /// install the hook program at the default spec.cdi.hookPath.
        #[arg(long)]
        write: bool,
        /// Exit instead of waiting when another gpu-agent holds the host-files lock.
        #[arg(long)]
        no_wait: bool,
    },
}

#[derive(Debug, Subcommand)]
enum HookCommand {
    /// Make links in the container's root: --link TARGET::LINK (repeatable).
    CreateSymlinks {
        #[arg(long = "link", value_name = "TARGET::LINK")]
        links: Vec<String>,
    },
    /// List the driver's library dirs in the container's ld.so.conf.d and
    /// rebuild its linker cache with the host's ldconfig.
    UpdateLdcache {
        #[arg(long = "folder", value_name = "DIR")]
        folders: Vec<String>,
    },
}

#[derive(Debug, Subcommand)]
enum PolicyCommand {
    /// Check a policy file; exit 2 naming the bad key if it is invalid.
    Check {
        file: PathBuf,
        /// Print the effective policy, defaults filled in, as YAML.
        #[arg(long)]
        effective: bool,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Output {
    Table,
    Json,
}

/// An error with the exit code it should end the process with.
struct Failure {
    code: u8,
    error: anyhow::Error,
}

impl<E: Into<anyhow::Error>> From<E> for Failure {
    fn from(e: E) -> Self {
        Failure {
            code: 1,
            error: e.into(),
        }
    }
}

fn bad_input(e: impl Into<anyhow::Error>) -> Failure {
    Failure {
        code: EXIT_BAD_INPUT,
        error: e.into(),
    }
}

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
        } => run(&cli, *once, *heartbeat, controller),
        Command::Status { ready: true, .. } => status_ready(&cli),
        Command::Status { output, .. } => status(&cli, *output),
        Command::Inventory { output } => inventory(&cli, *output),
        Command::Labels { output } => labels(&cli, *output),
        Command::Policy {
            command: PolicyCommand::Check { file, effective },
        } => policy_check(file, *effective),
        Command::Runtime { command } => runtime_command(&cli, command),
        Command::Cdi {
            command: CdiCommand::Generate { write, no_wait },
        } => cdi_generate(&cli, *write, *no_wait),
        Command::CdiHook { command } => cdi_hook(command),
        Command::HostExec { shm, argv } => host_exec(&cli, shm.as_deref(), argv),
        Command::Driver { command } => driver_cli::command(&cli, command),
        Command::Uninstall { no_wait } => uninstall(&cli, *no_wait),
        Command::Demo { node, keep } => {
            demo::run(node, *keep, &mut std::io::stdout().lock())
                .map_err(bad_input_if_description)?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn bad_input_if_description(e: anyhow::Error) -> Failure {
    if e.downcast_ref::<simnode::DescError>().is_some() {
        bad_input(e)
    } else {
        Failure { code: 1, error: e }
    }
}

fn host_root(cli: &Cli) -> Result<HostRoot, Failure> {
    HostRoot::new(&cli.host_root).map_err(|e| bad_input(anyhow::anyhow!("--host-root: {e}")))
}

/// The policy, and the device-plugin config it names, or exit 2.
fn load_policy(path: Option<&Path>) -> Result<Policy, Failure> {
    let policy = match path {
        Some(p) => Policy::from_file(p).map_err(bad_input)?,
        None => Policy::default(),
    };
    gpu_agent::plugin::settings(&policy.device_plugin, policy.mig.strategy).map_err(bad_input)?;
    Ok(policy)
}

fn node_view(cli: &Cli, host: &HostRoot) -> Result<NodeView, Failure> {
    match &cli.simulate {
        Some(name) => NodeView::simulated(name).map_err(|e| match e {
            gpu_agent::source::SourceError::Description(_) => bad_input(e),
            other => other.into(),
        }),
        None => Ok(NodeView::host(host, cli.nvml_lib.as_deref())),
    }
}

fn print_json<T: Serialize>(value: &T) -> Result<(), Failure> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer_pretty(&mut out, value)?;
    writeln!(out)?;
    Ok(())
}

fn inventory(cli: &Cli, output: Output) -> Result<ExitCode, Failure> {
    let host = host_root(cli)?;
    let view = node_view(cli, &host)?;
    let inv = gpu_agent::inventory::discover(&view.sys, view.backend.as_ref());
    match output {
        Output::Json => print_json(&inv)?,
        Output::Table => print!("{}", render::inventory(&inv)),
    }
    Ok(ExitCode::SUCCESS)
}

fn labels(cli: &Cli, output: Output) -> Result<ExitCode, Failure> {
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

fn runtime_command(cli: &Cli, command: &RuntimeCommand) -> Result<ExitCode, Failure> {
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

fn cdi_generate(cli: &Cli, write: bool, no_wait: bool) -> Result<ExitCode, Failure> {
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

fn cdi_hook(command: &HookCommand) -> Result<ExitCode, Failure> {
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

/// `host-exec`: enters the host (see hostlib::process) and becomes the
/// program; returns only when that fails.
fn host_exec(cli: &Cli, shm: Option<&str>, argv: &[String]) -> Result<ExitCode, Failure> {
    let root = host_root(cli)?;
    hostlib::process::enter(&root, shm, &hostlib::LinuxSyscalls)?;
    Err(hostlib::process::exec(argv).into())
}

fn policy_check(file: &Path, effective: bool) -> Result<ExitCode, Failure> {
    let policy = load_policy(Some(file))?;
    let settings = gpu_agent::plugin::settings(&policy.device_plugin, policy.mig.strategy)
        .map_err(bad_input)?;
    // The other files the policy names, read as the running agent reads
    // them: a file that is missing or does not parse fails the check.
    let mut mig_warning = None;
    if policy.mig_manager.enabled {
        let (config, origin) =
            gpu_agent::mig::load_config(&policy.mig_manager).map_err(bad_input)?;
        if let Some(layout) = policy.mig_manager.selected_layout()
            && let Err(e) = config.layout(layout, &origin, "spec.migManager.default")
        {
            // The built-in layouts are one list for every GPU model gpu-agent
            // knows, and `all-<profile>`, `all-balanced` derived for the
            // others at run time; another name missing there may still be a
            // model's it does not know: a warning. A file's or inline
            // layouts are the user's: an error.
            if config.builtin {
                mig_warning = Some(
                    if gpu_agent::mig::derive::Generic::parse(layout).is_some() {
                        format!(
                            "note: layout {layout:?} is not in gpu-agent's built-in MIG config: each GPU gets it derived from the MIG profiles NVML lists for it"
                        )
                    } else {
                        format!("warning: {e}")
                    },
                );
            } else {
                return Err(bad_input(e));
            }
        }
    }
    let counters = if policy.dcgm_exporter.enabled {
        Some(
            gpu_agent::metrics::server::ExporterConfig::from_spec(&policy.dcgm_exporter)
                .map_err(bad_input)?
                .fields,
        )
    } else {
        None
    };
    println!("{}: valid policy", file.display());
    if let Some(w) = &mig_warning {
        println!("{w}");
    }
    for u in &settings.unacted {
        println!(
            "{}: device-plugin config key not acted on: {u}",
            if u.warn { "warning" } else { "note" }
        );
    }
    for s in counters.iter().flat_map(|c| &c.skipped) {
        println!("warning: counters file: not exported: {s}");
    }
    for n in counters.iter().flat_map(|c| &c.notes) {
        println!("note: counters file: {n}");
    }
    let rows: Vec<Vec<String>> = Stage::ALL
        .iter()
        .map(|s| {
            let state = match s.disabled_by(&policy) {
                Some(why) => format!("off ({why})"),
                None => "on".into(),
            };
            vec![s.name().to_string(), state]
        })
        .collect();
    print!("{}", render::table(&["STAGE", "BY THIS POLICY"], &rows));
    if effective {
        println!(
            "---\n{}",
            serde_yaml_ng::to_string(&serde_json::json!({ "spec": policy }))?
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// The pass context of this process: `apply` changes the host (`run`),
/// without it stages only look (`status`).
fn context<'a>(
    policy: &'a Policy,
    caps: &'a HeldCaps,
    view: &'a NodeView,
    host: &'a HostRoot,
    apply: bool,
) -> Context<'a> {
    Context {
        policy,
        caps,
        sys: &view.sys,
        backend: view.backend.as_ref(),
        host,
        apply: apply
            .then_some(&hostlib::command::SystemRunner as &dyn hostlib::command::CommandRunner),
        syscalls: &hostlib::LinuxSyscalls,
        simulated: view.simulated.is_some(),
        drain: None,
        serve_first: false,
        changes: Default::default(),
        mig_hold: None,
        upgrade: Default::default(),
        logged: None,
    }
}

/// Where the cluster controller is (`run`); without `--controller` the
/// agent works on its own.
#[derive(Debug, clap::Args)]
struct ControllerArgs {
    /// Report to this gpu-controller (`https://host:port`).
    #[arg(long = "controller", env = "GPU_AGENT_CONTROLLER", value_name = "URL")]
    endpoint: Option<String>,
    /// PEM file of the CA that signed the controller's certificate.
    #[arg(
        long = "controller-ca",
        env = "GPU_AGENT_CONTROLLER_CA",
        value_name = "FILE",
        default_value = "/var/run/secrets/gpu-controller/ca.crt"
    )]
    ca: PathBuf,
    /// The name the controller's certificate must carry (default: the URL's host).
    #[arg(
        long = "controller-server-name",
        env = "GPU_AGENT_CONTROLLER_SERVER_NAME",
        value_name = "NAME"
    )]
    server_name: Option<String>,
    /// The projected service-account token (audience `gpu-controller`).
    #[arg(
        long = "token-file",
        env = "GPU_AGENT_TOKEN_FILE",
        value_name = "FILE",
        default_value = "/var/run/secrets/tokens/gpu-controller"
    )]
    token_file: PathBuf,
    /// This node's Kubernetes name (default: the hostname).
    #[arg(long = "node-name", env = "NODE_NAME", value_name = "NAME")]
    node_name: Option<String>,
}

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

fn run(
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

/// What `status` shows, in either output form.
#[derive(Debug, Serialize)]
pub(crate) struct StatusReport {
    /// `running-agent` or `host-inspection`.
    source: &'static str,
    /// Why the host was inspected, or which agent answered.
    note: String,
    held_caps: Vec<String>,
    /// Held capabilities with their reasons, what was dropped (running agent only).
    #[serde(skip_serializing_if = "Option::is_none")]
    privileges: Option<gpu_agent::caps::Privileges>,
    stages: Vec<StageStatus>,
    inventory: Option<Inventory>,
    /// The device plugin's resources (running agent only).
    plugin: Vec<ResourceStatus>,
    /// Every enabled stage validated (running agent only).
    #[serde(skip_serializing_if = "Option::is_none")]
    ready: Option<bool>,
    /// Running agent only.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    health: Vec<gpu_agent::health::GpuHealth>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tasks: Vec<gpu_agent::supervisor::TaskStatus>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reconcile_interval_secs: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    policy_error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    mig: Option<gpu_agent::mig::MigStatus>,
    /// The report stream to gpu-controller (running agent only; none when
    /// the agent works on its own).
    #[serde(skip_serializing_if = "Option::is_none")]
    controller: Option<gpu_agent::report::ControllerLink>,
    /// The running policy is the cluster's ClusterPolicy, less these keys.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    policy_from_cluster: bool,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    policy_ignored: Vec<String>,
}

impl StatusReport {
    /// The report of a running agent, from its state file.
    pub(crate) fn from_agent(st: AgentState, age_secs: u64) -> Self {
        StatusReport {
            source: "running-agent",
            note: format!(
                "from the running agent (pid {}, version {}, updated {age_secs} s ago{})",
                st.pid,
                st.version,
                st.simulated
                    .as_deref()
                    .map(|s| format!(", simulating {s}"))
                    .unwrap_or_default()
            ),
            held_caps: st.held_caps,
            privileges: st.privileges,
            stages: st.stages,
            inventory: st.inventory,
            plugin: st.plugin,
            ready: Some(st.ready),
            health: st.health,
            tasks: st.tasks,
            reconcile_interval_secs: Some(st.reconcile_interval_secs),
            policy_error: st.policy_error,
            mig: st.mig,
            controller: st.controller,
            policy_from_cluster: st.policy_from_cluster,
            policy_ignored: st.policy_ignored,
        }
    }
}

fn uninstall(cli: &Cli, no_wait: bool) -> Result<ExitCode, Failure> {
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

/// `status --ready`: the running agent's own word, one line.
fn status_ready(cli: &Cli) -> Result<ExitCode, Failure> {
    let host = host_root(cli)?;
    let not = |why: String| {
        println!("not ready: {why}");
        Ok(ExitCode::from(1))
    };
    let st = match AgentState::read(&host) {
        Ok(Some(st)) => st,
        Ok(None) => {
            return not(format!(
                "no running agent ({} does not exist)",
                host.resolve(state::STATE_FILE)?.display()
            ));
        }
        Err(e) => return not(e.to_string()),
    };
    match st.liveness(state::now(), state::agent_running(&host)) {
        Liveness::Live { .. } => {}
        Liveness::Starting { pid } => return not(format!("the agent (pid {pid}) is starting")),
        Liveness::Hung { age_secs } => {
            return not(format!(
                "the agent (pid {}) has not stamped its state for {age_secs} s: it hangs",
                st.pid
            ));
        }
        Liveness::Stale { .. } | Liveness::Stopped { .. } => {
            return not(format!("the agent (pid {}) is not running", st.pid));
        }
    }
    let line = gpu_agent::supervisor::notify::status_line(&st);
    println!("{line}");
    Ok(if st.ready {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn status(cli: &Cli, output: Output) -> Result<ExitCode, Failure> {
    let host = host_root(cli)?;
    let now = state::now();
    let note = match AgentState::read(&host) {
        Ok(Some(st)) => match st.liveness(now, state::agent_running(&host)) {
            Liveness::Starting { pid } => format!(
                "an agent (pid {pid}) is starting and has not written its state yet; inspecting the host"
            ),
            Liveness::Live { age_secs } => {
                return print_status(&StatusReport::from_agent(st, age_secs), output);
            }
            Liveness::Hung { age_secs } => format!(
                "the agent (pid {}) holds its lock but has not stamped its state for {age_secs} s (heartbeat {} s): it hangs; inspecting the host",
                st.pid, st.heartbeat_secs
            ),
            Liveness::Stale { age_secs } => format!(
                "the agent (pid {}) is not running and did not say it stopped (killed or crashed; state {age_secs} s old); inspecting the host",
                st.pid
            ),
            Liveness::Stopped { age_secs } => {
                format!(
                    "the agent (pid {}) stopped {age_secs} s ago; inspecting the host",
                    st.pid
                )
            }
        },
        Ok(None) => format!(
            "no running agent ({} does not exist); inspecting the host",
            host.resolve(state::STATE_FILE)?.display()
        ),
        Err(e) => format!("{e}; inspecting the host"),
    };
    let policy = load_policy(cli.policy.as_deref())?;
    let caps = HeldCaps::read();
    let view = node_view(cli, &host)?;
    // Inspecting: stages plan but change nothing (`apply: None`).
    let pass = stages::run_pass(&context(&policy, &caps, &view, &host, false));
    let report = StatusReport {
        source: "host-inspection",
        note,
        held_caps: caps.names(),
        privileges: None,
        stages: pass.stages,
        inventory: pass.inventory,
        plugin: Vec::new(),
        ready: None,
        health: Vec::new(),
        tasks: Vec::new(),
        reconcile_interval_secs: None,
        policy_error: None,
        mig: pass.mig,
        controller: None,
        policy_from_cluster: false,
        policy_ignored: Vec::new(),
    };
    print_status(&report, output)
}

/// Prints the report; exits 0 when it is the running agent's, 3 when no
/// running agent answered and the host was inspected instead.
fn print_status(report: &StatusReport, output: Output) -> Result<ExitCode, Failure> {
    match output {
        Output::Json => print_json(report)?,
        Output::Table => print!("{}", status_text(report)),
    }
    Ok(if report.source == "running-agent" {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(EXIT_NOT_RUNNING)
    })
}

pub(crate) fn status_text(report: &StatusReport) -> String {
    let mut out = format!("gpu-agent status: {}\n", report.note);
    if let Some(inv) = &report.inventory {
        out.push_str(&format!(
            "node: {} · {} GPU(s){}\n",
            render::node_line(inv),
            inv.gpus.len(),
            if inv.gpus.is_empty() {
                String::new()
            } else {
                format!(": {}", inv.models_summary())
            }
        ));
    }
    if let Some(ready) = report.ready {
        let reconcile = match report.reconcile_interval_secs {
            Some(0) | None => "reconciles on policy changes and SIGHUP".to_string(),
            Some(s) => format!("reconciles every {s} s, on policy changes and SIGHUP"),
        };
        out.push_str(&format!(
            "ready: {} · {reconcile}\n",
            if ready {
                "yes (every enabled stage validated)"
            } else {
                "no (not every enabled stage is validated)"
            }
        ));
    }
    if report.policy_from_cluster {
        out.push_str("policy: the cluster's ClusterPolicy, from gpu-controller (the policy file is not used)\n");
        if !report.policy_ignored.is_empty() {
            out.push_str(&format!(
                "policy: ClusterPolicy keys gpu-agent does not use (left out): {}\n",
                report.policy_ignored.join(", ")
            ));
        }
    }
    if let Some(e) = &report.policy_error {
        out.push_str(&format!("policy: not applied: {e}\n"));
    }
    match (&report.controller, report.ready) {
        (Some(link), _) => {
            out.push_str(&format!("controller: {}\n", link.summary()));
            if let Some(d) = &link.desired {
                out.push_str(&format!("controller asks: {d}\n"));
            }
        }
        (None, Some(_)) => out.push_str(
            "controller: none configured; the agent works on its own (`run --controller URL` reports to gpu-controller)\n",
        ),
        (None, None) => {}
    }
    if let Some(m) = &report.mig {
        out.push_str(&format!(
            "mig: layout {:?}: {} ({})\n",
            m.layout,
            m.state.as_str(),
            m.detail
        ));
    }
    out.push('\n');
    out.push_str(&render::stages(&report.stages));
    if !report.plugin.is_empty() {
        out.push('\n');
        out.push_str(&render::plugin_resources(&report.plugin));
    }
    if let Some(p) = &report.privileges {
        out.push('\n');
        out.push_str(&render::privileges(p));
    }
    if report.health.iter().any(|g| !g.healthy || g.events > 0) {
        out.push('\n');
        out.push_str(&render::health(&report.health, report.inventory.as_ref()));
    }
    if !report.tasks.is_empty() {
        out.push('\n');
        out.push_str(&render::tasks(&report.tasks));
    }
    if let Some(inv) = &report.inventory {
        for w in &inv.warnings {
            out.push_str(&format!("warning: {w}\n"));
        }
    }
    out
}
