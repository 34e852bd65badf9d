//! The ConfigMaps the cluster's ClusterPolicy names reach the agents, end
//! to end with real processes: gpu-controller reads them (in its namespace,
//! here `gpu-operator`, from the scripted API server) and sends their
//! contents with the policy; gpu-agent runs them. The operator's own files
//! are the ConfigMaps, unchanged (../shared/upstream/gpu-operator): its
//! test's time-slicing config (10 replicas) and its default MIG layouts.
//! A ConfigMap changed, a node label selecting another entry, a ConfigMap
//! missing or not parsing: each reaches the agent, and the ClusterPolicy's
//! status says which ConfigMap is not used and why.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{MockApi, Proc, kubelet_node, start_controller_with, wait_for};
use serde_json::{Value, json};

const NS: &str = "gpu-operator";
const ACCOUNT: &str = "system:serviceaccount:gpu-agent:gpu-agent";

fn upstream(file: &str) -> String {
    let path = common::repo()
        .join("../shared/upstream/gpu-operator")
        .join(file);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn label(api: &MockApi, key: &str) -> Option<String> {
    api.node("gpu-node-1")["metadata"]["labels"][key]
        .as_str()
        .map(String::from)
}

fn status_message(api: &MockApi) -> String {
    api.cluster_policy("cluster-policy")["status"]["conditions"][0]["message"]
        .as_str()
        .unwrap_or("")
        .to_string()
}

/// The controller's log lines that sent an agent a new Desired.
fn sent(controller: &Proc) -> usize {
    controller
        .log()
        .matches("telling the agent what is wanted")
        .count()
}

/// The `nvidia.com/gpu` row of the agent's resource table.
fn gpu_row(status: &str) -> String {
    status
        .lines()
        .find(|l| l.starts_with("nvidia.com/gpu "))
        .unwrap_or("")
        .to_string()
}

fn controller(api: &MockApi, dir: &Path) -> (Proc, u16, PathBuf) {
    start_controller_with(
        api,
        dir,
        None,
        &[("GPU_CONTROLLER_CONFIG_MAP_NAMESPACE", NS)],
    )
}

#[test]
fn the_operators_time_slicing_config_map_reaches_the_agent() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let api = rt.block_on(MockApi::start());
    api.add_node("gpu-node-1", kubelet_node());
    api.add_token("t1", ACCOUNT, "gpu-node-1");
    // The operator's test config, as `kubectl create configmap
    // time-slicing-config --from-file=plugin-config.yaml` makes it, and a
    // counters file of two fields.
    api.set_config_map(
        NS,
        "time-slicing-config",
        json!({"plugin-config.yaml": upstream("tests_plugin-config.yaml")}),
    );
    let counters = "# DCGM FIELD, Prometheus metric type, help message\nDCGM_FI_DEV_GPU_TEMP, gauge, GPU temperature (in C).\nDCGM_FI_DEV_POWER_USAGE, gauge, Power draw (in W).\n";
    api.set_config_map(
        NS,
        "custom-dcgm-metrics",
        json!({"dcgm-metrics.csv": counters}),
    );
    let spec = json!({
        "driver": {"enabled": false},
        "toolkit": {"enabled": false},
        "mig": {"strategy": "none"},
        "devicePlugin": {"enabled": true, "config": {"name": "time-slicing-config", "default": ""}},
        "dcgmExporter": {"enabled": true, "config": {"name": "custom-dcgm-metrics"}},
    });
    api.set_cluster_policy("cluster-policy", spec.clone());
    let dir = tempfile::tempdir().unwrap();
    let (mut controller, port, ca) = controller(&api, dir.path());
    let host = dir.path().join("host");
    common::h100_host(&host);
    let policy = common::eks_policy();
    let global = [
        "--simulate".as_ref(),
        "h100-sxm-8".as_ref(),
        "--policy".as_ref(),
        policy.as_os_str(),
    ];
    let mut agent = common::reporting_agent(
        dir.path(),
        &host,
        &global,
        &[],
        port,
        &ca,
        "t1",
        "gpu-node-1",
    );
    let status = || common::agent_status(&host);

    // 8 GPUs, 10 replicas each: 80 devices, labelled as GFD labels them.
    wait_for(
        "the time-sliced capacity",
        Duration::from_secs(60),
        &[&controller, &agent],
        || {
            gpu_row(&status()).contains(" 80/80 ")
                && label(&api, "nvidia.com/gpu.replicas").as_deref() == Some("10")
        },
    );
    assert_eq!(
        label(&api, "nvidia.com/gpu.product").as_deref(),
        Some("NVIDIA-H100-80GB-HBM3-SHARED")
    );
    assert_eq!(
        label(&api, "nvidia.com/gpu.sharing-strategy").as_deref(),
        Some("time-slicing")
    );
    assert_eq!(label(&api, "nvidia.com/gpu.count").as_deref(), Some("8"));
    let s = status();
    assert!(
        s.contains("policy: the cluster's ClusterPolicy, from gpu-controller"),
        "{s}"
    );
    assert!(
        !s.contains("keys gpu-agent does not use"),
        "the ConfigMaps' names are resolved, not left out:\n{s}"
    );
    // The counters ConfigMap's two fields are what is exported.
    wait_for(
        "the counters ConfigMap's fields",
        Duration::from_secs(30),
        &[&controller, &agent],
        || {
            status()
                .lines()
                .any(|l| l.starts_with("metrics ") && l.contains("serving 2 field(s)"))
        },
    );
    // The ClusterPolicy's status has nothing to say of its ConfigMaps.
    wait_for(
        "the ClusterPolicy's status",
        Duration::from_secs(30),
        &[&controller, &agent],
        || status_message(&api).contains("reporting nodes run it"),
    );
    assert!(
        !status_message(&api).contains("ConfigMap"),
        "{}",
        status_message(&api)
    );

    // Nothing changes (the same ClusterPolicy and ConfigMap written
    // again): the agent is sent nothing new.
    std::thread::sleep(Duration::from_secs(1));
    let before = sent(&controller);
    api.set_cluster_policy("cluster-policy", spec.clone());
    api.set_config_map(
        NS,
        "time-slicing-config",
        json!({"plugin-config.yaml": upstream("tests_plugin-config.yaml")}),
    );
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(sent(&controller), before, "{}", controller.log());

    // The node's label names an entry the ConfigMap does not have: the
    // node runs without one, and the ClusterPolicy's status says so.
    api.set_node_label(
        "gpu-node-1",
        "nvidia.com/device-plugin.config",
        Some("four"),
    );
    wait_for(
        "the status naming the missing entry",
        Duration::from_secs(30),
        &[&controller, &agent],
        || {
            status_message(&api).starts_with(
                "ConfigMap gpu-operator/time-slicing-config (spec.devicePlugin.config.name): no entry four (it has plugin-config.yaml), which nvidia.com/device-plugin.config of gpu-node-1 names; they run without a device-plugin config; ",
            )
        },
    );
    let st = api.cluster_policy("cluster-policy")["status"].clone();
    assert_eq!(st["state"], "notReady", "{st}");
    assert_eq!(st["conditions"][0]["reason"], "ConfigMapNotUsed", "{st}");
    wait_for(
        "whole GPUs again",
        Duration::from_secs(30),
        &[&controller, &agent],
        || label(&api, "nvidia.com/gpu.replicas").as_deref() == Some("1"),
    );

    // The ConfigMap changes (the entry added): it reaches the agent.
    let four = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n";
    api.set_config_map(
        NS,
        "time-slicing-config",
        json!({"plugin-config.yaml": upstream("tests_plugin-config.yaml"), "four": four}),
    );
    wait_for(
        "4 replicas",
        Duration::from_secs(30),
        &[&controller, &agent],
        || {
            label(&api, "nvidia.com/gpu.replicas").as_deref() == Some("4")
                && gpu_row(&status()).contains(" 32/32 ")
        },
    );
    wait_for(
        "the status without the problem",
        Duration::from_secs(30),
        &[&controller, &agent],
        || !status_message(&api).contains("ConfigMap"),
    );

    // The counters ConfigMap goes: dcgm-exporter's defaults, and the status
    // says which ConfigMap and why.
    api.delete_config_map(NS, "custom-dcgm-metrics");
    wait_for(
        "the status naming the deleted ConfigMap",
        Duration::from_secs(30),
        &[&controller, &agent],
        || {
            status_message(&api).starts_with(
                "ConfigMap gpu-operator/custom-dcgm-metrics (spec.dcgmExporter.config.name): not found; the agents export dcgm-exporter's default counters; ",
            )
        },
    );
    wait_for(
        "the default counters",
        Duration::from_secs(30),
        &[&controller, &agent],
        || {
            status().lines().any(|l| {
                l.starts_with("metrics ")
                    && !l.contains("serving 2 field(s)")
                    && l.contains("serving ")
            })
        },
    );
    // Only the namespace's ConfigMaps were asked for, each by name.
    for r in api.requests() {
        if r.uri.contains("/configmaps") {
            assert!(
                r.uri
                    .starts_with("/api/v1/namespaces/gpu-operator/configmaps?")
                    && r.uri.contains("fieldSelector=metadata.name%3D"),
                "{} {}",
                r.method,
                r.uri
            );
        }
    }
    agent.term();
    controller.term();
}

fn fake_nvml(dir: &Path) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    let built = [
        deps.join("libfake_nvml.so"),
        deps.parent().unwrap().join("libfake_nvml.so"),
    ]
    .into_iter()
    .find(|p| p.exists())
    .unwrap_or_else(|| {
        panic!(
            "libfake_nvml.so is not in {}: cargo build -p fake-nvml",
            deps.display()
        )
    });
    let lib = dir.join("libnvidia-ml.so.1");
    std::os::unix::fs::symlink(&built, &lib).unwrap();
    lib
}

#[test]
fn the_operators_mig_layouts_config_map_reaches_the_agent() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let api = rt.block_on(MockApi::start());
    api.add_node("gpu-node-1", kubelet_node());
    api.add_token("t1", ACCOUNT, "gpu-node-1");
    // The operator's default layouts ConfigMap, as the operator makes it
    // (its namespace filled in).
    let cm: Value =
        serde_yaml_ng::from_str(&upstream("state-mig-manager_0400_configmap.yaml")).unwrap();
    let cm_name = cm["metadata"]["name"].as_str().unwrap().to_string();
    let layouts_text = cm["data"]["config.yaml"].as_str().unwrap().to_string();
    api.set_cluster_policy(
        "cluster-policy",
        json!({
            "driver": {"enabled": false},
            "toolkit": {"enabled": false},
            "dcgmExporter": {"enabled": false},
            "mig": {"strategy": "mixed"},
            "migManager": {"enabled": true, "config": {"name": cm_name}, "gpuClientsTimeoutSeconds": 5},
        }),
    );
    let dir = tempfile::tempdir().unwrap();
    let (mut controller, port, ca) = controller(&api, dir.path());
    let host = dir.path().join("host");
    common::h100_host(&host);
    let conditions = dir.path().join("conditions");
    std::fs::write(&conditions, "").unwrap();
    let nvml = fake_nvml(dir.path());
    let (mig, sysfs) = (dir.path().join("mig.json"), host.join("sys"));
    let policy = common::eks_policy();
    let global = [
        "--policy".as_ref(),
        policy.as_os_str(),
        "--nvml-lib".as_ref(),
        nvml.as_os_str(),
    ];
    let env = [
        ("FAKE_NVML_NODE", "h100-sxm-8".as_ref()),
        ("FAKE_NVML_MIG", mig.as_os_str()),
        ("FAKE_NVML_SYSFS", sysfs.as_os_str()),
        ("FAKE_NVML_STATE", conditions.as_os_str()),
    ];
    let mut agent = common::reporting_agent(
        dir.path(),
        &host,
        &global,
        &env,
        port,
        &ca,
        "t1",
        "gpu-node-1",
    );

    // Not there yet: the agents run the policy without it, and the status
    // says which ConfigMap and why.
    wait_for(
        "the status naming the missing ConfigMap",
        Duration::from_secs(60),
        &[&controller, &agent],
        || {
            status_message(&api).starts_with(
                "ConfigMap gpu-operator/default-mig-parted-config (spec.migManager.config.name): not found; the agents use their built-in MIG layouts; ",
            )
        },
    );
    wait_for(
        "the agent running the ClusterPolicy",
        Duration::from_secs(30),
        &[&controller, &agent],
        || {
            common::agent_status(&host)
                .contains("policy: the cluster's ClusterPolicy, from gpu-controller")
        },
    );

    // A ConfigMap that does not parse: said, still not used.
    api.set_config_map(
        NS,
        &cm_name,
        json!({"config.yaml": "version: v1\nmig-configs: [\n"}),
    );
    wait_for(
        "the status saying it does not parse",
        Duration::from_secs(30),
        &[&controller, &agent],
        || {
            status_message(&api).starts_with(
                "ConfigMap gpu-operator/default-mig-parted-config (spec.migManager.config.name): config.yaml does not parse as YAML: ",
            )
        },
    );

    // The operator's own: the agent has every layout of it.
    api.set_config_map(NS, &cm_name, cm["data"].clone());
    let remembered = host.join("var/lib/gpu-agent/cluster-policy.yaml");
    let want: Value = serde_yaml_ng::from_str(&layouts_text).unwrap();
    wait_for(
        "the operator's layouts on the agent",
        Duration::from_secs(30),
        &[&controller, &agent],
        || {
            std::fs::read_to_string(&remembered)
                .ok()
                .and_then(|t| serde_yaml_ng::from_str::<Value>(&t).ok())
                .is_some_and(|p| p["spec"]["migManager"]["config"]["inline"] == want)
        },
    );
    wait_for(
        "the status without the problem",
        Duration::from_secs(30),
        &[&controller, &agent],
        || {
            let m = status_message(&api);
            m.contains("reporting nodes run it") && !m.contains("ConfigMap")
        },
    );

    // A custom layout the operator's ConfigMap does not have: the layout
    // fails, as mig-manager fails it.
    api.set_node_label("gpu-node-1", "nvidia.com/mig.config", Some("custom-h100"));
    wait_for(
        "mig.config.state=failed",
        Duration::from_secs(60),
        &[&controller, &agent],
        || label(&api, "nvidia.com/mig.config.state").as_deref() == Some("failed"),
    );
    // The ConfigMap changes to have it: it reaches the agent, which
    // applies it.
    let custom = format!(
        "{layouts_text}\n  custom-h100:\n    - devices: [0, 1]\n      mig-enabled: true\n      mig-devices:\n        \"1g.10gb\": 7\n    - devices: [2, 3, 4, 5, 6, 7]\n      mig-enabled: false\n"
    );
    api.set_config_map(NS, &cm_name, json!({"config.yaml": custom}));
    wait_for(
        "mig.config.state=success",
        Duration::from_secs(60),
        &[&controller, &agent],
        || label(&api, "nvidia.com/mig.config.state").as_deref() == Some("success"),
    );
    wait_for(
        "the custom layout's MIG devices",
        Duration::from_secs(30),
        &[&controller, &agent],
        || label(&api, "nvidia.com/mig-1g.10gb.count").as_deref() == Some("14"),
    );
    let s = common::agent_status(&host);
    assert!(s.contains("mig: layout \"custom-h100\": success"), "{s}");
    agent.term();
    controller.term();
}
