//! The command line: every subcommand and flag (clap), read by `main.rs` and
//! handed to the module under `cli/` that does the work.

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};
use gpu_agent::logging::LogFormat;

#[derive(Debug, Parser)]
#[command(
    name = "gpu-agent",
    version,
    about = "The GPU node agent: discovers NVIDIA GPUs and manages the node's whole GPU stack",
    long_about = None,
)]
pub(crate) struct Cli {
    /// Where the host's / is: / on bare metal, /host in a DaemonSet.
    #[arg(
        long,
        global = true,
        env = "GPU_AGENT_HOST_ROOT",
        default_value = "/",
        value_name = "DIR"
    )]
    pub(crate) host_root: PathBuf,
    /// The policy file (ClusterPolicy-shaped YAML). Without one, every default applies.
    #[arg(long, global = true, env = "GPU_AGENT_POLICY", value_name = "FILE")]
    pub(crate) policy: Option<PathBuf>,
    /// Simulate the node's GPUs from a node description: a file, or a built-in
    /// name (h100-sxm-8, a10g-1, t4-4, no-gpu).
    #[arg(
        long,
        global = true,
        env = "GPU_AGENT_SIMULATE",
        value_name = "FILE|NAME"
    )]
    pub(crate) simulate: Option<String>,
    /// The NVML library to load (default: the host's libnvidia-ml.so.1).
    #[arg(long, global = true, env = "GPU_AGENT_NVML_LIB", value_name = "PATH")]
    pub(crate) nvml_lib: Option<PathBuf>,
    /// How to log: auto (the journal under systemd, else text), text, json, journald.
    #[arg(
        long,
        global = true,
        env = "GPU_AGENT_LOG_FORMAT",
        value_enum,
        default_value = "auto"
    )]
    pub(crate) log_format: LogFormat,
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
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
        command: DriverCommand,
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
pub(crate) enum RuntimeCommand {
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
pub(crate) enum CdiCommand {
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
pub(crate) enum HookCommand {
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
pub(crate) enum PolicyCommand {
    /// Check a policy file; exit 2 naming the bad key if it is invalid.
    Check {
        file: PathBuf,
        /// Print the effective policy, defaults filled in, as YAML.
        #[arg(long)]
        effective: bool,
    },
}

/// Where the cluster controller is (`run`); without `--controller` the
/// agent works on its own.
#[derive(Debug, clap::Args)]
pub(crate) struct ControllerArgs {
    /// Report to this gpu-controller (`https://host:port`).
    #[arg(long = "controller", env = "GPU_AGENT_CONTROLLER", value_name = "URL")]
    pub(crate) endpoint: Option<String>,
    /// PEM file of the CA that signed the controller's certificate.
    #[arg(
        long = "controller-ca",
        env = "GPU_AGENT_CONTROLLER_CA",
        value_name = "FILE",
        default_value = "/var/run/secrets/gpu-controller/ca.crt"
    )]
    pub(crate) ca: PathBuf,
    /// The name the controller's certificate must carry (default: the URL's host).
    #[arg(
        long = "controller-server-name",
        env = "GPU_AGENT_CONTROLLER_SERVER_NAME",
        value_name = "NAME"
    )]
    pub(crate) server_name: Option<String>,
    /// The projected service-account token (audience `gpu-controller`).
    #[arg(
        long = "token-file",
        env = "GPU_AGENT_TOKEN_FILE",
        value_name = "FILE",
        default_value = "/var/run/secrets/tokens/gpu-controller"
    )]
    pub(crate) token_file: PathBuf,
    /// This node's Kubernetes name (default: the hostname).
    #[arg(long = "node-name", env = "NODE_NAME", value_name = "NAME")]
    pub(crate) node_name: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Output {
    Table,
    Json,
}

#[derive(Debug, Subcommand)]
pub(crate) enum DriverCommand {
    /// Unpacked drivers (current, previous) and the loaded modules.
    List,
    /// Verify a driver bundle (its sha256, then every file's) and unpack it
    /// beside the installed ones; it becomes current when no driver is loaded.
    Install {
        /// The bundle (`.tar.gz`, README "Driver bundles").
        bundle: PathBuf,
        /// The bundle's sha256 (default: the `<bundle>.sha256` file beside it).
        #[arg(long, value_name = "HEX")]
        sha256: Option<String>,
        /// Exit instead of waiting when another gpu-agent holds the host-files lock.
        #[arg(long)]
        no_wait: bool,
    },
    /// Load the modules (policy's parameters) from the current driver or
    /// --module-dir, then make the device nodes and check the version.
    Load {
        /// A host directory of `.ko` files instead of the current bundle.
        #[arg(long, value_name = "DIR")]
        module_dir: Option<String>,
    },
    /// Unload the NVIDIA modules in reverse order, refusing while in use.
    Unload,
    /// Make the /dev/nvidia* nodes and /dev/char links for the loaded driver.
    Nodes,
    /// Switch to another driver: a bundle file (verified and unpacked
    /// first) or the name of an unpacked one. Waits for GPU processes to
    /// exit, unloads, switches, loads, validates; rolls back on failure.
    Upgrade {
        /// A bundle file, or an unpacked driver's name (`driver list`).
        to: String,
        #[arg(long, value_name = "HEX")]
        sha256: Option<String>,
        /// Exit instead of waiting when another gpu-agent holds the host-files lock.
        #[arg(long)]
        no_wait: bool,
    },
    /// Go back to the previous driver (an upgrade to it when one is loaded).
    Rollback {
        /// Exit instead of waiting when another gpu-agent holds the host-files lock.
        #[arg(long)]
        no_wait: bool,
    },
    /// Delete an unpacked driver that is neither current nor previous.
    Remove {
        name: String,
        /// Exit instead of waiting when another gpu-agent holds the host-files lock.
        #[arg(long)]
        no_wait: bool,
    },
    /// Make a bundle from a directory of kernel modules (built for one
    /// kernel, one flavour), with its `<out>.sha256` beside it.
    Pack {
        /// The directory holding `nvidia.ko` and the others.
        dir: PathBuf,
        /// The driver version the modules are (`550.127.08`).
        #[arg(long)]
        version: String,
        /// The kernel release they were built for (`uname -r`).
        #[arg(long)]
        kernel: String,
        #[arg(long, value_enum)]
        flavour: FlavourArg,
        /// The bundle to write (`.tar.gz`).
        #[arg(long, short)]
        out: PathBuf,
    },
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub(crate) enum FlavourArg {
    Open,
    Proprietary,
}
