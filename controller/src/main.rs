//! `gpu-controller`: reads the command line and runs the controller.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use gpu_controller::model::node::TaintPolicy;

/// The cluster half of gpu-agent: takes the agents' reports and writes node
/// labels, conditions and taints.
#[derive(Debug, Parser)]
#[command(name = "gpu-controller", version)]
struct Cli {
    /// Where agents connect (TLS).
    #[arg(long, env = "GPU_CONTROLLER_LISTEN", default_value = "0.0.0.0:8443")]
    listen: SocketAddr,
    /// The serving certificate (PEM).
    #[arg(
        long,
        env = "GPU_CONTROLLER_TLS_CERT",
        default_value = "/etc/gpu-controller/tls/tls.crt"
    )]
    tls_cert: PathBuf,
    /// Its key (PEM).
    #[arg(
        long,
        env = "GPU_CONTROLLER_TLS_KEY",
        default_value = "/etc/gpu-controller/tls/tls.key"
    )]
    tls_key: PathBuf,
    /// The agents' service account, NAMESPACE:NAME: only its tokens are let in.
    #[arg(long, env = "GPU_CONTROLLER_AGENT_ACCOUNT", default_value = "gpu-agent:gpu-agent", value_parser = account)]
    agent_service_account: (String, String),
    /// When the nvidia.com/gpu.health=unhealthy:NoSchedule taint goes on.
    #[arg(long, value_enum, default_value = "none-healthy")]
    taint: TaintPolicy,
    /// Seconds a node's conditions stay as they were after its agent's stream
    /// ends (or, for a node whose agent does not connect, after this replica
    /// starts leading).
    #[arg(long, default_value_t = 60)]
    agent_grace_seconds: u64,
    /// Agents check in at least this often (seconds), and at once when
    /// something on their node changes.
    #[arg(long, env = "GPU_CONTROLLER_CHECK_IN_INTERVAL", default_value_t = 30)]
    check_in_interval: u64,
    /// Check-ins a second this replica takes at most: with more nodes
    /// than interval x rate, the interval it tells agents grows.
    #[arg(long, env = "GPU_CONTROLLER_CHECK_IN_RATE", default_value_t = 500)]
    check_in_rate: u32,
    /// Spread the nodes over this many shard Leases, each held by one
    /// replica that serves and writes its nodes (0: one leader serves
    /// every node). Every replica must be given the same number; needs
    /// --lease-namespace.
    #[arg(long, env = "GPU_CONTROLLER_SHARDS", default_value_t = 0)]
    shards: u32,
    /// Where agents reach this replica, put on its shard Leases (default:
    /// https://$POD_IP:<the --listen port>).
    #[arg(long, env = "GPU_CONTROLLER_ADVERTISE")]
    advertise: Option<String>,
    /// The fleet page and /fleet.json (plain HTTP); "off" for none.
    #[arg(long, env = "GPU_CONTROLLER_HTTP_LISTEN", default_value = "0.0.0.0:8080", value_parser = http_listen)]
    http_listen: Listen,
    /// Elect one leader among replicas through a Lease in this namespace
    /// (the pod's; unset: no election, this replica always leads).
    #[arg(long, env = "POD_NAMESPACE")]
    lease_namespace: Option<String>,
    /// This replica's name in the Lease (default: the hostname).
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// The ClusterPolicy sent to agents when the cluster has several.
    #[arg(long, default_value = "cluster-policy")]
    cluster_policy: String,
    /// Where the ConfigMaps the ClusterPolicy names are (the GPU Operator
    /// keeps them in its own namespace). Default: this pod's namespace
    /// (POD_NAMESPACE), else the kubeconfig's.
    #[arg(long, env = "GPU_CONTROLLER_CONFIG_MAP_NAMESPACE")]
    config_map_namespace: Option<String>,
    /// Agent connections held at once (one per node, and room for
    /// reconnects); connections beyond are closed as they come.
    #[arg(long, env = "GPU_CONTROLLER_MAX_CONNECTIONS", default_value_t = 20_000)]
    max_connections: usize,
    /// Seconds a client has to finish its TLS handshake.
    #[arg(
        long,
        env = "GPU_CONTROLLER_TLS_HANDSHAKE_SECONDS",
        default_value_t = 10
    )]
    tls_handshake_seconds: u64,
    /// Seconds a node's agent has, from its driver upgrade's go-ahead, to
    /// report the new driver loaded and validated; then the node is
    /// upgrade-failed (it stays cordoned and stops the rollout; it goes on
    /// by itself if the agent reports it done later). 0: no limit.
    #[arg(
        long,
        env = "GPU_CONTROLLER_UPGRADE_VALIDATION_TIMEOUT_SECONDS",
        default_value_t = 1800
    )]
    upgrade_validation_timeout_seconds: u64,
    /// Publish the ResourceSlices of the nodes whose agent's DRA plugin is
    /// registered with the kubelet, and the gpu.nvidia.com and
    /// mig.nvidia.com DeviceClasses (`--dra-publish=false`: neither).
    #[arg(
        long,
        env = "GPU_CONTROLLER_DRA_PUBLISH",
        default_value_t = true,
        action = clap::ArgAction::Set
    )]
    dra_publish: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    /// Leave every node that has a gpu-agent as it was before gpu-agent:
    /// make a held uninstall pod for each, delete the agents' DaemonSet,
    /// wait for its pods to stop, let the uninstall pods run `gpu-agent
    /// uninstall`, and wait for them (the chart's pre-delete hook). Exits 1
    /// naming each node not uninstalled; run again, it goes on from there.
    UninstallAgents {
        /// The agents' namespace.
        #[arg(long, env = "POD_NAMESPACE")]
        namespace: String,
        /// The agents' DaemonSet.
        #[arg(long, default_value = "gpu-agent")]
        daemonset: String,
        /// The agents' pods (a label selector, `k=v,k=v`).
        #[arg(
            long,
            default_value = "app.kubernetes.io/name=gpu-agent,app.kubernetes.io/component=agent"
        )]
        agent_selector: String,
        /// The uninstall pod (JSON): its labels find the uninstall pods
        /// again, its name prefixes theirs.
        #[arg(long, value_name = "FILE")]
        pod_template: PathBuf,
        /// Seconds the whole run may take.
        #[arg(long, default_value_t = 240)]
        timeout_seconds: u64,
    },
}

/// An address, or `off`.
#[derive(Clone, Copy, Debug)]
struct Listen(Option<SocketAddr>);

fn http_listen(s: &str) -> Result<Listen, String> {
    if s == "off" {
        return Ok(Listen(None));
    }
    s.parse()
        .map(|a| Listen(Some(a)))
        .map_err(|e| format!("{s:?}: {e}"))
}

fn account(s: &str) -> Result<(String, String), String> {
    match s.split_once(':') {
        Some((ns, name)) if !ns.is_empty() && !name.is_empty() => Ok((ns.into(), name.into())),
        _ => Err(format!("{s:?}: expected NAMESPACE:NAME")),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(Command::UninstallAgents {
        namespace,
        daemonset,
        agent_selector,
        pod_template,
        timeout_seconds,
    }) = cli.command
    {
        return rt.block_on(uninstall_agents(gpu_controller::uninstall::Options {
            namespace,
            daemonset,
            agent_selector,
            pod_template: match read_pod(&pod_template) {
                Ok(p) => p,
                Err(e) => {
                    eprintln!("error: {}: {e}", pod_template.display());
                    return ExitCode::from(2);
                }
            },
            timeout: Duration::from_secs(timeout_seconds),
            poll: Duration::from_secs(1),
        }));
    }
    let opts = gpu_controller::Options {
        listen: cli.listen,
        tls_cert: cli.tls_cert,
        tls_key: cli.tls_key,
        agent_account: cli.agent_service_account,
        taint: cli.taint,
        grace: Duration::from_secs(cli.agent_grace_seconds),
        http_listen: cli.http_listen.0,
        cluster_policy: cli.cluster_policy.clone(),
        config_map_namespace: cli
            .config_map_namespace
            .clone()
            .or_else(|| cli.lease_namespace.clone()),
        max_connections: cli.max_connections,
        handshake_within: Duration::from_secs(cli.tls_handshake_seconds),
        upgrade_validation_timeout: (cli.upgrade_validation_timeout_seconds > 0)
            .then(|| Duration::from_secs(cli.upgrade_validation_timeout_seconds)),
        dra_slices: cli.dra_publish,
        check_in_interval: std::time::Duration::from_secs(cli.check_in_interval.max(1)),
        check_in_rate: cli.check_in_rate,
        shards: (cli.shards > 0).then(|| gpu_controller::Sharding {
            count: cli.shards,
            advertise: cli.advertise.clone().unwrap_or_else(|| {
                let ip = std::env::var("POD_IP").unwrap_or_else(|_| "127.0.0.1".into());
                let ip = if ip.contains(':') {
                    format!("[{ip}]")
                } else {
                    ip
                };
                format!("https://{ip}:{}", cli.listen.port())
            }),
        }),
        election: cli.lease_namespace.as_deref().map(|ns| {
            let identity = cli.identity.clone().unwrap_or_else(|| {
                std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .map(|h| h.trim().to_string())
                    .unwrap_or_else(|_| format!("gpu-controller-{}", std::process::id()))
            });
            gpu_controller::lease::Election::new(ns, &identity)
        }),
    };
    match rt.block_on(gpu_controller::run(opts)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", gpu_controller::error_chain(&e));
            ExitCode::FAILURE
        }
    }
}

fn read_pod(path: &std::path::Path) -> Result<k8s_openapi::api::core::v1::Pod, String> {
    let text = std::fs::read(path).map_err(|e| e.to_string())?;
    serde_json::from_slice(&text).map_err(|e| format!("not a Pod (JSON): {e}"))
}

async fn uninstall_agents(opts: gpu_controller::uninstall::Options) -> ExitCode {
    let client = match kube::Client::try_default().await {
        Ok(c) => c,
        Err(e) => {
            eprintln!(
                "error: no Kubernetes API to talk to (in-cluster config or KUBECONFIG): {}",
                gpu_controller::error_chain(&e)
            );
            return ExitCode::FAILURE;
        }
    };
    let mut say = |line: String| println!("{line}");
    match gpu_controller::uninstall::run(client, &opts, &mut say).await {
        Ok(nodes) => {
            println!("gpu-agent uninstalled from {} node(s)", nodes.len());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {}", gpu_controller::error_chain(&e));
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_well_formed() {
        super::Cli::command().debug_assert();
        let cli = <super::Cli as clap::Parser>::try_parse_from([
            "gpu-controller",
            "--http-listen",
            "off",
            "--agent-service-account",
            "ns:sa",
        ])
        .unwrap();
        assert!(cli.http_listen.0.is_none());
        assert_eq!(
            cli.agent_service_account,
            ("ns".to_string(), "sa".to_string())
        );
        let e = <super::Cli as clap::Parser>::try_parse_from([
            "gpu-controller",
            "--agent-service-account",
            "nocolon",
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("\"nocolon\": expected NAMESPACE:NAME"), "{e}");
    }
}
