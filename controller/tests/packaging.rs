//! The Kubernetes packaging (packaging/helm/gpu-agent, packaging/kustomize)
//! as real tools render it: Helm's own `helm template` and `helm lint` (a
//! Helm 4 binary fetched by scripts/fetch-helm into target/helm) and
//! `kubectl kustomize`. Every object rendered, with the default values, the
//! EKS values and a values file in the GPU Operator's keys, is checked
//! against the real Kubernetes 1.36 schemas with unknown fields as errors
//! (the ClusterPolicy against the CRD we ship). The policy the chart renders
//! is read by the real gpu-agent (`policy check`), with the ConfigMaps it
//! names put where the DaemonSet mounts them. The chart's certificate is
//! served by the real gpu-controller and trusted by a TLS client under the
//! name agents dial. The controller's RBAC is proven least-privilege: the
//! controller runs a whole driver rollout against the scripted API server,
//! and every request it makes must be allowed by the rendered roles, and
//! every verb they grant used. The kustomize base and EKS overlay must be
//! the objects the chart renders.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{MockApi, Proc, kubelet_node, repo, schema, wait_for};
use serde::Deserialize;
use serde_json::{Value, json};

const NS: &str = "gpu-agent";
const RELEASE: &str = "gpu-agent";

// ---------------------------------------------------------------------------
// The tools
// ---------------------------------------------------------------------------

/// Helm, as scripts/fetch-helm puts it (GPU_AGENT_HELM names another).
fn helm() -> PathBuf {
    let p = std::env::var_os("GPU_AGENT_HELM")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join("target/helm/helm"));
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch-helm (it fetches a real Helm into target/helm)",
        p.display()
    );
    p
}

/// kubectl for `kubectl kustomize`: GPU_AGENT_KUBECTL, else the one
/// scripts/fetch-helm unpacks beside Helm (a known version), else the
/// machine's.
fn kubectl() -> PathBuf {
    if let Some(p) = std::env::var_os("GPU_AGENT_KUBECTL") {
        return PathBuf::from(p);
    }
    let fetched = repo().join("target/helm/kubectl");
    if fetched.exists() {
        return fetched;
    }
    PathBuf::from("kubectl")
}

fn chart() -> PathBuf {
    repo().join("packaging/helm/gpu-agent")
}

fn operator_values() -> PathBuf {
    repo().join("controller/tests/packaging/operator-values.yaml")
}

fn eks_values() -> PathBuf {
    chart().join("values-eks.yaml")
}

/// The GPU Operator chart's own default values.yaml, unchanged
/// (../shared/upstream/gpu-operator, whose README names its version).
fn upstream_operator_values() -> PathBuf {
    repo().join("../shared/upstream/gpu-operator/values.yaml")
}

/// What `helm template --api-versions` adds for a cluster that serves the
/// Prometheus Operator's ServiceMonitor kind.
const SERVICE_MONITOR_API: &str = "monitoring.coreos.com/v1/ServiceMonitor";

/// The documents of a multi-document YAML stream, as JSON values.
fn documents(text: &str, origin: &str) -> Vec<Value> {
    serde_yaml_ng::Deserializer::from_str(text)
        .map(|d| {
            Value::deserialize(d).unwrap_or_else(|e| panic!("{origin}: not YAML: {e}\n{text}"))
        })
        .filter(|v| !v.is_null())
        .collect()
}

/// `helm template` of the chart (release gpu-agent in namespace gpu-agent,
/// CRDs included) with `args`; its objects, or its stderr.
fn helm_template(args: &[&str]) -> Result<Vec<Value>, String> {
    let out = Command::new(helm())
        .args(["template", RELEASE])
        .arg(chart())
        .args(["--namespace", NS, "--include-crds"])
        .args(args)
        .output()
        .unwrap();
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    Ok(documents(
        &String::from_utf8_lossy(&out.stdout),
        &format!("helm template {args:?}"),
    ))
}

fn render(args: &[&str]) -> Vec<Value> {
    helm_template(args).unwrap_or_else(|e| panic!("helm template {args:?} failed:\n{e}"))
}

fn render_with(values: &Path) -> Vec<Value> {
    render(&["-f", values.to_str().unwrap()])
}

fn kustomize(dir: &str) -> Vec<Value> {
    let out = Command::new(kubectl())
        .arg("kustomize")
        .arg(repo().join(dir))
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", kubectl().display()));
    assert!(
        out.status.success(),
        "kubectl kustomize {dir}:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    documents(&String::from_utf8_lossy(&out.stdout), dir)
}

fn find<'a>(objs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objs.iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| {
            panic!(
                "no {kind} {name} among {:?}",
                objs.iter()
                    .map(|o| format!("{} {}", o["kind"], o["metadata"]["name"]))
                    .collect::<Vec<_>>()
            )
        })
}

fn kinds(objs: &[Value]) -> BTreeSet<String> {
    objs.iter()
        .map(|o| o["kind"].as_str().unwrap().to_string())
        .collect()
}

// ---------------------------------------------------------------------------
// Schemas
// ---------------------------------------------------------------------------

/// Objects of these kinds have no schema among Kubernetes' own and are
/// rendered only when asked for: the Prometheus Operator's ServiceMonitor
/// (dcgmExporter.serviceMonitor.enabled; its CRD is not ours).
const WITHOUT_SCHEMA: &[(&str, &str)] = &[("monitoring.coreos.com/v1", "ServiceMonitor")];

/// Kinds that are not namespaced.
const CLUSTER_SCOPED: &[&str] = &[
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "RuntimeClass",
    "CustomResourceDefinition",
    "ClusterPolicy",
];

/// The real schemas, plus the ClusterPolicy's from the CRD we ship (its
/// metadata is an ObjectMeta, as the API server checks a custom resource's).
fn schemas() -> BTreeMap<String, Value> {
    let mut all = schema::load();
    let mut cp = crd_file()["spec"]["versions"][0]["schema"]["openAPIV3Schema"].clone();
    cp["properties"]["metadata"] =
        json!({"$ref": "#/components/schemas/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"});
    all.insert("com.nvidia.v1.ClusterPolicy".into(), cp);
    all
}

/// Schema names by (apiVersion, kind), from the schemas' own
/// x-kubernetes-group-version-kind.
fn by_kind(all: &BTreeMap<String, Value>) -> BTreeMap<(String, String), String> {
    let mut idx = BTreeMap::new();
    for (name, s) in all {
        for g in s["x-kubernetes-group-version-kind"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let (group, version, kind) = (
                g["group"].as_str().unwrap_or(""),
                g["version"].as_str().unwrap_or(""),
                g["kind"].as_str().unwrap_or(""),
            );
            let api = if group.is_empty() {
                version.to_string()
            } else {
                format!("{group}/{version}")
            };
            idx.entry((api, kind.to_string()))
                .or_insert_with(|| name.clone());
        }
    }
    idx.insert(
        ("nvidia.com/v1".into(), "ClusterPolicy".into()),
        "com.nvidia.v1.ClusterPolicy".into(),
    );
    idx
}

/// Checks every object; returns the schema-less ones it let through.
fn check_objects(objs: &[Value], what: &str) -> Vec<String> {
    let all = schemas();
    let idx = by_kind(&all);
    let mut errs = Vec::new();
    let mut schemaless = Vec::new();
    for o in objs {
        let (api, kind) = (
            o["apiVersion"].as_str().unwrap_or("").to_string(),
            o["kind"].as_str().unwrap_or("").to_string(),
        );
        let name = o["metadata"]["name"].as_str().unwrap_or("?");
        let id = format!("{kind} {name}");
        let namespaced = !CLUSTER_SCOPED.contains(&kind.as_str());
        match (namespaced, o["metadata"]["namespace"].as_str()) {
            (true, None) => errs.push(format!("{id}: namespaced but names no namespace")),
            (false, Some(ns)) => errs.push(format!("{id}: cluster-scoped but in {ns}")),
            _ => {}
        }
        match idx.get(&(api.clone(), kind.clone())) {
            Some(s) => errs.extend(
                schema::check(&all, s, o, false)
                    .into_iter()
                    .map(|e| format!("{id}: {e}")),
            ),
            None if WITHOUT_SCHEMA.contains(&(api.as_str(), kind.as_str())) => schemaless.push(id),
            None => errs.push(format!("{id}: no schema for {api} {kind}")),
        }
    }
    assert!(errs.is_empty(), "{what}:\n{}", errs.join("\n"));
    schemaless
}

fn crd_file() -> Value {
    let p = repo().join("packaging/crds/nvidia.com_clusterpolicies.yaml");
    serde_yaml_ng::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

// ---------------------------------------------------------------------------
// Pieces of the rendered objects
// ---------------------------------------------------------------------------

fn daemonset(objs: &[Value]) -> &Value {
    find(objs, "DaemonSet", "gpu-agent")
}

fn pod_spec(workload: &Value) -> &Value {
    &workload["spec"]["template"]["spec"]
}

fn container<'a>(workload: &'a Value, name: &str) -> &'a Value {
    pod_spec(workload)["containers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no container {name}"))
}

fn args(c: &Value) -> Vec<String> {
    c["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect()
}

/// The container's environment variables that have a plain value.
fn env_values(c: &Value) -> BTreeMap<String, String> {
    c["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| {
            Some((
                e["name"].as_str()?.to_string(),
                e["value"].as_str()?.to_string(),
            ))
        })
        .collect()
}

/// The container's plain environment with its paths moved into a test's
/// directories: `/host…` under `host`, any other absolute path under
/// `container` (the container's own files).
fn env_in(c: &Value, host: &Path, container: &Path) -> BTreeMap<String, String> {
    env_values(c)
        .into_iter()
        .map(|(k, v)| {
            let moved = if v == "/host" || v.starts_with("/host/") {
                host.join(v["/host".len()..].trim_start_matches('/'))
                    .display()
                    .to_string()
            } else if v.starts_with('/') {
                container
                    .join(v.trim_start_matches('/'))
                    .display()
                    .to_string()
            } else {
                v
            };
            (k, moved)
        })
        .collect()
}

/// The value of `--flag=VALUE` in `args`.
fn flag(args: &[String], flag: &str) -> Option<String> {
    args.iter()
        .find_map(|a| a.strip_prefix(&format!("{flag}=")).map(str::to_string))
}

fn mount<'a>(c: &'a Value, name: &str) -> &'a Value {
    c["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == name)
        .unwrap_or_else(|| panic!("no volume mount {name}"))
}

fn volume<'a>(w: &'a Value, name: &str) -> &'a Value {
    pod_spec(w)["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == name)
        .unwrap_or_else(|| panic!("no volume {name}"))
}

/// The agents' policy file, as the ConfigMap holds it.
fn policy_text(objs: &[Value]) -> String {
    find(objs, "ConfigMap", "gpu-agent-policy")["data"]["policy.yaml"]
        .as_str()
        .unwrap()
        .to_string()
}

/// The files the agent container sees from ConfigMap volumes: path in the
/// container -> content (what the kubelet projects).
fn projected_files(objs: &[Value]) -> BTreeMap<String, String> {
    let ds = daemonset(objs);
    let c = container(ds, "gpu-agent");
    let mut files = BTreeMap::new();
    for m in c["volumeMounts"].as_array().unwrap() {
        let v = volume(ds, m["name"].as_str().unwrap());
        let Some(cm) = v["configMap"]["name"].as_str() else {
            continue;
        };
        let Some(obj) = objs
            .iter()
            .find(|o| o["kind"] == "ConfigMap" && o["metadata"]["name"] == cm)
        else {
            // An existing ConfigMap of the user's: nothing to project here.
            continue;
        };
        for (k, val) in obj["data"].as_object().unwrap() {
            files.insert(
                format!("{}/{k}", m["mountPath"].as_str().unwrap()),
                val.as_str().unwrap().to_string(),
            );
        }
    }
    files
}

/// `gpu-agent policy check --effective` of the chart's policy, run with the
/// ConfigMaps' files where the DaemonSet mounts them (under a temp root:
/// the policy's container paths are moved there, each one checked to be a
/// projected file first). Returns the effective policy.
fn agent_reads_policy(objs: &[Value]) -> Value {
    let dir = tempfile::tempdir().unwrap();
    let files = projected_files(objs);
    for (path, text) in &files {
        let p = dir.path().join(path.trim_start_matches('/'));
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, text).unwrap();
    }
    let mut policy: Value = serde_yaml_ng::from_str(&policy_text(objs)).unwrap();
    for ptr in [
        "/spec/devicePlugin/config/file",
        "/spec/migManager/config/file",
        "/spec/dcgmExporter/config",
    ] {
        if let Some(v) = policy.pointer_mut(ptr) {
            let path = v.as_str().unwrap().to_string();
            assert!(
                files.contains_key(&path),
                "the policy's {ptr} is {path}, which no ConfigMap of the chart projects into the agent (it has {:?})",
                files.keys().collect::<Vec<_>>()
            );
            *v = json!(
                dir.path()
                    .join(path.trim_start_matches('/'))
                    .display()
                    .to_string()
            );
        }
    }
    let file = dir.path().join("policy.yaml");
    std::fs::write(&file, serde_yaml_ng::to_string(&policy).unwrap()).unwrap();
    let out = Command::new(common::agent_bin())
        .args(["policy", "check", "--effective"])
        .arg(&file)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "gpu-agent refuses the chart's policy:\n{}\n{}\npolicy:\n{}",
        stdout,
        String::from_utf8_lossy(&out.stderr),
        policy_text(objs)
    );
    let effective = stdout
        .split_once("\n---\n")
        .map(|(_, y)| y)
        .unwrap_or_else(|| panic!("no effective policy in:\n{stdout}"));
    serde_yaml_ng::from_str(effective).unwrap()
}

/// Whether `tolerations` let a pod on a node with `taint` (the scheduler's
/// rule: key, effect, and Exists or Equal value).
fn tolerates(tolerations: &Value, taint: &Value) -> bool {
    tolerations.as_array().into_iter().flatten().any(|t| {
        let key_ok = (t["key"].is_null() && t["operator"] == "Exists") || t["key"] == taint["key"];
        let effect_ok = t["effect"].is_null() || t["effect"] == taint["effect"];
        let value_ok = match t["operator"].as_str().unwrap_or("Equal") {
            "Exists" => true,
            _ => t["value"].as_str().unwrap_or("") == taint["value"].as_str().unwrap_or(""),
        };
        key_ok && effect_ok && value_ok
    })
}

// ---------------------------------------------------------------------------
// The chart
// ---------------------------------------------------------------------------

#[test]
fn helm_lints_the_chart_with_every_values_file() {
    for values in [
        None,
        Some(eks_values()),
        Some(operator_values()),
        Some(upstream_operator_values()),
    ] {
        let mut cmd = Command::new(helm());
        cmd.args(["lint", "--strict"])
            .arg(chart())
            .args(["--namespace", NS]);
        if let Some(v) = &values {
            cmd.arg("-f").arg(v);
        }
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "helm lint --strict ({values:?}):\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn every_rendered_object_is_what_an_api_server_takes() {
    let default = render(&[]);
    assert!(
        check_objects(&default, "default values").is_empty(),
        "nothing schema-less by default"
    );
    assert_eq!(
        kinds(&default),
        [
            "ClusterRole",
            "ClusterRoleBinding",
            "ConfigMap",
            "CustomResourceDefinition",
            "DaemonSet",
            "Deployment",
            "Pod",
            "PodDisruptionBudget",
            "Role",
            "RoleBinding",
            "RuntimeClass",
            "Secret",
            "Service",
            "ServiceAccount",
        ]
        .map(String::from)
        .into(),
    );
    assert!(check_objects(&render_with(&eks_values()), "values-eks.yaml").is_empty());
    let op = render(&[
        "-f",
        operator_values().to_str().unwrap(),
        "--api-versions",
        SERVICE_MONITOR_API,
    ]);
    assert_eq!(
        check_objects(&op, "operator-values.yaml"),
        vec!["ServiceMonitor nvidia-dcgm-exporter".to_string()],
        "the ServiceMonitor is the one object without a schema, and only where the API serves it"
    );
    assert!(
        check_objects(&render_with(&operator_values()), "operator-values.yaml").is_empty(),
        "no ServiceMonitor where the API server does not serve the kind"
    );
    for o in &op {
        assert!(
            o["metadata"]["labels"]["app.kubernetes.io/part-of"] == "gpu-agent",
            "{} {} carries the chart's labels",
            o["kind"],
            o["metadata"]["name"]
        );
    }
    // The ServiceMonitor scrapes the metrics Service's named port, in its
    // namespace, by the Service's labels.
    let sm = find(&op, "ServiceMonitor", "nvidia-dcgm-exporter");
    let svc = find(&op, "Service", "nvidia-dcgm-exporter");
    for (k, v) in sm["spec"]["selector"]["matchLabels"].as_object().unwrap() {
        assert_eq!(&svc["metadata"]["labels"][k], v, "label {k}");
    }
    assert_eq!(sm["spec"]["namespaceSelector"]["matchNames"], json!([NS]));
    assert_eq!(
        sm["spec"]["endpoints"][0]["port"],
        svc["spec"]["ports"][0]["name"]
    );
    assert_eq!(sm["spec"]["endpoints"][0]["interval"], "30s");
    assert_eq!(sm["metadata"]["labels"]["release"], "prometheus");
    // The metrics Service selects the agents' pods and their metrics port.
    let ds = daemonset(&op);
    for (k, v) in svc["spec"]["selector"].as_object().unwrap() {
        assert_eq!(&ds["spec"]["template"]["metadata"]["labels"][k], v);
    }
    assert_eq!(
        container(ds, "gpu-agent")["ports"][0]["name"],
        svc["spec"]["ports"][0]["targetPort"]
    );
}

#[test]
fn the_agent_daemonset_is_privileged_with_the_host_at_slash_host() {
    let objs = render(&[]);
    let ds = daemonset(&objs);
    let spec = pod_spec(ds);
    let c = container(ds, "gpu-agent");
    assert_eq!(c["securityContext"]["privileged"], true);
    assert_eq!(spec["priorityClassName"], "system-node-critical");
    assert_eq!(spec["hostPID"], true);
    assert_eq!(spec["automountServiceAccountToken"], false);
    // The host's / at /host, later host mounts propagating in.
    let host = mount(c, "host-root");
    assert_eq!(host["mountPath"], "/host");
    assert_eq!(host["mountPropagation"], "HostToContainer");
    assert_eq!(volume(ds, "host-root")["hostPath"]["path"], "/");
    let a = args(c);
    // The host root is the container's environment (`kubectl exec` runs
    // get it too), not an argument of `run`.
    let env = env_values(c);
    assert_eq!(env["GPU_AGENT_HOST_ROOT"], "/host");
    assert_eq!(flag(&a, "--host-root"), None);
    assert_eq!(c["command"], json!(["/usr/bin/gpu-agent"]));
    // The kubelet's directories where the agent looks under /host.
    for (vol, dir) in [
        ("kubelet-device-plugins", "device-plugins"),
        ("kubelet-pod-resources", "pod-resources"),
    ] {
        assert_eq!(
            mount(c, vol)["mountPath"],
            format!("/host/var/lib/kubelet/{dir}")
        );
        assert_eq!(
            volume(ds, vol)["hostPath"]["path"],
            format!("/var/lib/kubelet/{dir}")
        );
    }
    // Readiness is the agent's validation.
    assert_eq!(
        c["readinessProbe"]["exec"]["command"],
        json!(["/usr/bin/gpu-agent", "status", "--ready"])
    );
    // One node at a time, never two agents on one node.
    let us = &ds["spec"]["updateStrategy"];
    assert_eq!(us["type"], "RollingUpdate");
    assert_eq!(us["rollingUpdate"]["maxUnavailable"], 1);
    assert_eq!(us["rollingUpdate"]["maxSurge"], 0);
    assert_eq!(spec["terminationGracePeriodSeconds"], 30);
    // The GPU taint is tolerated, whatever its value.
    for value in ["present", "true", ""] {
        let taint = json!({"key": "nvidia.com/gpu", "value": value, "effect": "NoSchedule"});
        assert!(tolerates(&spec["tolerations"], &taint), "{taint}");
    }
    // The policy is the ConfigMap, mounted whole (its updates reach the agent).
    let pm = mount(c, "policy");
    assert!(pm.get("subPath").is_none());
    assert_eq!(flag(&a, "--policy"), None);
    assert_eq!(
        env["GPU_AGENT_POLICY"],
        format!("{}/policy.yaml", pm["mountPath"].as_str().unwrap())
    );
    assert_eq!(
        volume(ds, "policy")["configMap"]["name"],
        "gpu-agent-policy"
    );
    // The metrics port is the one the policy listens on.
    let effective = agent_reads_policy(&objs);
    assert_eq!(
        effective["spec"]["dcgmExporter"]["listen"],
        format!(":{}", c["ports"][0]["containerPort"])
    );
    // The image is the chart's appVersion, the workspace's version.
    let cargo = std::fs::read_to_string(repo().join("Cargo.toml")).unwrap();
    let version = cargo
        .lines()
        .skip_while(|l| *l != "[workspace.package]")
        .find_map(|l| l.strip_prefix("version = \""))
        .unwrap()
        .trim_end_matches('"');
    assert_eq!(c["image"], format!("ghcr.io/gpu-agent/gpu-agent:{version}"));
}

#[test]
fn agents_reach_the_controller_with_a_token_and_the_ca_only() {
    let objs = render(&[]);
    let ds = daemonset(&objs);
    let c = container(ds, "gpu-agent");
    let a = args(c);
    // The URL is the controller's Service, in this namespace, on its port.
    let svc = find(&objs, "Service", "gpu-controller");
    let grpc = svc["spec"]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "grpc")
        .unwrap();
    assert_eq!(
        flag(&a, "--controller").unwrap(),
        format!("https://gpu-controller.{NS}.svc:{}", grpc["port"])
    );
    let dep = find(&objs, "Deployment", "gpu-controller");
    let cc = container(dep, "gpu-controller");
    let ca = args(cc);
    assert_eq!(
        flag(&ca, "--listen").unwrap(),
        format!("0.0.0.0:{}", grpc["port"])
    );
    for (k, v) in svc["spec"]["selector"].as_object().unwrap() {
        assert_eq!(&dep["spec"]["template"]["metadata"]["labels"][k], v);
    }
    // The token: projected, for the audience the controller reviews, at the
    // path given to the agent.
    let token = &volume(ds, "controller-token")["projected"]["sources"][0]["serviceAccountToken"];
    assert_eq!(
        token["audience"],
        gpu_agent_proto::report::v1::TOKEN_AUDIENCE
    );
    assert_eq!(
        flag(&a, "--token-file").unwrap(),
        format!(
            "{}/{}",
            mount(c, "controller-token")["mountPath"].as_str().unwrap(),
            token["path"].as_str().unwrap()
        )
    );
    // The CA: only ca.crt of the controller's Secret, never its key.
    let cav = &volume(ds, "controller-ca")["secret"];
    assert_eq!(cav["items"], json!([{"key": "ca.crt", "path": "ca.crt"}]));
    assert_eq!(
        flag(&a, "--controller-ca").unwrap(),
        format!(
            "{}/ca.crt",
            mount(c, "controller-ca")["mountPath"].as_str().unwrap()
        )
    );
    let tls_vol = &volume(dep, "tls")["secret"];
    assert_eq!(cav["secretName"], tls_vol["secretName"]);
    // The controller lets in the agents' account only.
    assert_eq!(
        flag(&ca, "--agent-service-account").unwrap(),
        format!(
            "{NS}:{}",
            pod_spec(ds)["serviceAccountName"].as_str().unwrap()
        )
    );
    let sa = find(&objs, "ServiceAccount", "gpu-agent");
    assert_eq!(sa["automountServiceAccountToken"], false);
    // Leader election in the pod's namespace, under the pod's name.
    let env: BTreeMap<&str, &Value> = cc["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["name"].as_str().unwrap(),
                &e["valueFrom"]["fieldRef"]["fieldPath"],
            )
        })
        .collect();
    assert_eq!(env["POD_NAMESPACE"], "metadata.namespace");
    assert_eq!(env["POD_NAME"], "metadata.name");
    assert_eq!(dep["spec"]["replicas"], 2);
    // Readiness is the process's health, not leadership (see the template).
    assert_eq!(cc["readinessProbe"]["httpGet"]["path"], "/healthz");
    // A disruption budget that takes one replica at a time and never holds
    // a drain up on a crashing one.
    let pdb = find(&objs, "PodDisruptionBudget", "gpu-controller");
    assert_eq!(pdb["spec"]["maxUnavailable"], 1);
    assert_eq!(pdb["spec"]["unhealthyPodEvictionPolicy"], "AlwaysAllow");
    assert_eq!(
        pdb["spec"]["selector"]["matchLabels"],
        dep["spec"]["selector"]["matchLabels"]
    );
    // Without a controller the agents are told of none.
    let alone = render(&["--set", "controller.enabled=false"]);
    let a = args(container(daemonset(&alone), "gpu-agent"));
    assert!(flag(&a, "--controller").is_none(), "{a:?}");
    assert!(!kinds(&alone).contains("Deployment"));
    assert!(!kinds(&alone).contains("ClusterRole"));
    check_objects(&alone, "controller.enabled=false");
}

#[test]
fn eks_values_leave_the_amis_driver_and_toolkit_and_tolerate_its_taint() {
    let objs = render_with(&eks_values());
    let effective = agent_reads_policy(&objs);
    assert_eq!(effective["spec"]["driver"]["enabled"], false);
    assert_eq!(effective["spec"]["toolkit"]["enabled"], false);
    assert_eq!(
        effective["spec"]["operator"]["defaultRuntime"],
        "containerd"
    );
    let spec = pod_spec(daemonset(&objs));
    let taint = json!({"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"});
    assert!(
        tolerates(&spec["tolerations"], &taint),
        "{}",
        spec["tolerations"]
    );
    assert!(
        spec.get("affinity").is_none(),
        "EKS node groups carry no GPU label: no node affinity ({})",
        spec["affinity"]
    );
    // The default values keep both on.
    let default = agent_reads_policy(&render(&[]));
    assert_eq!(default["spec"]["driver"]["enabled"], true);
    assert_eq!(default["spec"]["toolkit"]["enabled"], true);
}

#[test]
fn gpu_operator_value_keys_mean_the_same_in_the_agents_policy() {
    let objs = render_with(&operator_values());
    let effective = agent_reads_policy(&objs);
    let s = &effective["spec"];
    assert_eq!(s["driver"]["enabled"], true);
    assert_eq!(s["driver"]["version"], "560.35.03");
    assert_eq!(
        s["driver"]["useOpenKernelModules"], true,
        "kernelModuleType: open"
    );
    assert_eq!(s["toolkit"]["enabled"], true);
    assert_eq!(s["cdi"]["default"], true);
    assert_eq!(s["mig"]["strategy"], "mixed");
    assert_eq!(s["gfd"]["enabled"], false);
    assert_eq!(s["operator"]["defaultRuntime"], "containerd");
    assert_eq!(s["operator"]["runtimeClass"], "nvidia");
    // devicePlugin.config: the ConfigMap made from data, its default entry
    // read by the agent where the DaemonSet mounts it.
    let dp = &s["devicePlugin"]["config"];
    assert_eq!(dp["name"], "time-slicing-config");
    assert_eq!(dp["default"], "any");
    let cm = find(&objs, "ConfigMap", "time-slicing-config");
    assert!(cm["data"]["any"].as_str().unwrap().contains("timeSlicing"));
    let files = projected_files(&objs);
    assert_eq!(
        files["/etc/gpu-agent/device-plugin/any"],
        cm["data"]["any"].as_str().unwrap()
    );
    // migManager.config: the layouts' ConfigMap (key config.yaml) and the
    // default layout.
    let mm = &s["migManager"];
    assert_eq!(mm["config"]["default"], "all-balanced");
    assert_eq!(mm["config"]["name"], "custom-mig-parted-config");
    assert!(files["/etc/gpu-agent/mig-parted/config.yaml"].contains("all-balanced:"));
    // dcgmExporter.config: the counters file.
    assert!(
        files["/etc/gpu-agent/dcgm-exporter/dcgm-metrics.csv"]
            .contains("DCGM_FI_DEV_SM_CLOCK, gauge")
    );
    // daemonsets.*, nodeSelector, hostPaths.kubeletRootDir.
    let ds = daemonset(&objs);
    let spec = pod_spec(ds);
    let taint = json!({"key": "dedicated", "value": "gpu", "effect": "NoSchedule"});
    assert!(tolerates(&spec["tolerations"], &taint));
    assert!(!tolerates(
        &spec["tolerations"],
        &json!({"key": "dedicated", "value": "cpu", "effect": "NoSchedule"})
    ));
    assert_eq!(
        spec["nodeSelector"],
        json!({"nvidia.com/gpu.deploy.operands": "true"})
    );
    assert_eq!(
        ds["spec"]["template"]["metadata"]["labels"]["team"],
        "ml-platform"
    );
    assert_eq!(
        ds["spec"]["template"]["metadata"]["annotations"]["example.com/owner"],
        "ml-platform"
    );
    assert_eq!(
        ds["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"],
        "10%"
    );
    assert_eq!(
        volume(ds, "kubelet-device-plugins")["hostPath"]["path"],
        "/var/snap/microk8s/common/var/lib/kubelet/device-plugins"
    );
    assert_eq!(
        mount(container(ds, "gpu-agent"), "kubelet-device-plugins")["mountPath"],
        "/host/var/lib/kubelet/device-plugins"
    );
    // clusterPolicy.deployCR: the same policy as a ClusterPolicy, with the
    // rollout the controller reads (and agents are not sent).
    let cp = find(&objs, "ClusterPolicy", "cluster-policy");
    let up = gpu_controller::upgrade::UpgradePolicy::from_spec(&cp["spec"])
        .unwrap_or_else(|e| panic!("the controller refuses the rendered upgradePolicy: {e}"));
    assert!(up.auto_upgrade);
    let mut spec_only = cp["spec"].clone();
    spec_only["driver"]
        .as_object_mut()
        .unwrap()
        .remove("upgradePolicy");
    let policy: Value = serde_yaml_ng::from_str(&policy_text(&objs)).unwrap();
    assert_eq!(
        spec_only, policy["spec"],
        "the ClusterPolicy and the ConfigMap say the same"
    );
    let dep = find(&objs, "Deployment", "gpu-controller");
    assert_eq!(
        flag(&args(container(dep, "gpu-controller")), "--cluster-policy").unwrap(),
        "cluster-policy"
    );
    // agent.policy adds and overrides any key of the policy.
    let over = render(&[
        "-f",
        operator_values().to_str().unwrap(),
        "--set",
        "agent.policy.health.recoverAfterSeconds=0",
        "--set",
        "agent.policy.driver.enabled=false",
    ]);
    let e = agent_reads_policy(&over);
    assert_eq!(e["spec"]["health"]["recoverAfterSeconds"], 0);
    assert_eq!(e["spec"]["driver"]["enabled"], false);
    assert_eq!(e["spec"]["driver"]["version"], "560.35.03");
}

#[test]
fn the_runtime_class_is_the_runtime_the_agent_adds() {
    for args in [&[][..], &["--set", "operator.runtimeClass=nvidia-cdi"][..]] {
        let objs = render(args);
        let effective = agent_reads_policy(&objs);
        let name = effective["spec"]["operator"]["runtimeClass"]
            .as_str()
            .unwrap();
        let rc = find(&objs, "RuntimeClass", name);
        assert_eq!(rc["handler"], name, "{args:?}");
    }
    let none = render(&["--set", "runtimeClass.create=false"]);
    assert!(!kinds(&none).contains("RuntimeClass"));
}

#[test]
fn bad_values_are_refused_naming_the_key() {
    let cases: &[(&[&str], &str)] = &[
        // A key neither gpu-agent nor the GPU Operator has, at the top and
        // in gpu-agent's own sections, is not silently ignored.
        (
            &["--set", "drivr.enabled=false"],
            "additional properties 'drivr' not allowed",
        ),
        (
            &["--set", "agent.polcy.driver.enabled=false"],
            "at '/agent': additional properties 'polcy' not allowed",
        ),
        (
            &["--set", "metricsService.gpuOperatorName=false"],
            "at '/metricsService': additional properties 'gpuOperatorName' not allowed",
        ),
        // The types of the operator keys gpu-agent reads are checked.
        (&["--set", "toolkit.env=CONTAINERD_CONFIG"], "/toolkit/env"),
        (
            &["--set", "dcgmExporter.serviceMonitor.enabled=sometimes"],
            "/dcgmExporter/serviceMonitor/enabled",
        ),
        (&["--set", "mig.strategy=bogus"], "/mig/strategy"),
        (
            &["--set", "controller.tls.mode=self"],
            "/controller/tls/mode",
        ),
        (
            &["--set", "driver.kernelModuleType=closed"],
            "/driver/kernelModuleType",
        ),
        (
            &[
                "--set",
                "devicePlugin.config.create=true",
                "--set",
                "devicePlugin.config.name=x",
            ],
            "devicePlugin.config.data:",
        ),
        (
            &[
                "--set",
                "devicePlugin.config.create=true",
                "--set-string",
                "devicePlugin.config.data.a=version: v1",
                "--set-string",
                "devicePlugin.config.data.b=version: v1",
            ],
            "devicePlugin.config.default:",
        ),
        (
            &[
                "--set",
                "devicePlugin.config.create=true",
                "--set",
                "devicePlugin.config.default=c",
                "--set-string",
                "devicePlugin.config.data.a=version: v1",
            ],
            "devicePlugin.config.default: \"c\" is not an entry of devicePlugin.config.data (it has: a)",
        ),
        (
            &["--set", "migManager.config.create=true"],
            "migManager.config.data:",
        ),
        (
            &[
                "--set",
                "dcgmExporter.serviceMonitor.enabled=always",
                "--set",
                "dcgmExporter.enabled=false",
            ],
            "dcgmExporter.serviceMonitor.enabled: always:",
        ),
        (
            &[
                "--set",
                "dcgmExporter.serviceMonitor.enabled=always",
                "--set",
                "metricsService.enabled=false",
            ],
            "dcgmExporter.serviceMonitor.enabled: always:",
        ),
    ];
    for (args, want) in cases {
        match helm_template(args) {
            Ok(_) => panic!("helm template {args:?} rendered; it should have been refused"),
            Err(e) => assert!(
                e.contains(want),
                "helm template {args:?}: {want:?} not in:\n{e}"
            ),
        }
    }
    // One entry is the default when none is named.
    let one = render(&[
        "--set",
        "devicePlugin.config.create=true",
        "--set-string",
        "devicePlugin.config.data.only=version: v1",
    ]);
    let p: Value = serde_yaml_ng::from_str(&policy_text(&one)).unwrap();
    assert_eq!(p["spec"]["devicePlugin"]["config"]["default"], "only");
}

// ---------------------------------------------------------------------------
// The GPU Operator's values (issue 29 points 5 and 6)
// ---------------------------------------------------------------------------

/// `helm install --dry-run=client` of the chart with `args` (no cluster
/// reached): the notes Helm prints after an install (NOTES.txt).
fn helm_notes(args: &[&str]) -> String {
    let out = Command::new(helm())
        .args(["install", RELEASE])
        .arg(chart())
        .args(["--namespace", NS, "--dry-run=client"])
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "helm install --dry-run=client {args:?}:\n{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .split_once("\nNOTES:\n")
        .map(|(_, n)| n.to_string())
        .unwrap_or_else(|| panic!("no NOTES in:\n{stdout}"))
}

/// The operator keys the notes name as taken but not used: key -> why.
fn named_in_notes(notes: &str) -> BTreeMap<String, String> {
    let mut named = BTreeMap::new();
    let Some((_, list)) = notes.split_once("GPU Operator values taken but not used by gpu-agent")
    else {
        return named;
    };
    let mut lines = list.lines().skip_while(|l| !l.starts_with("- "));
    while let Some(keys) = lines.next() {
        let Some(keys) = keys.strip_prefix("- ").and_then(|k| k.strip_suffix(':')) else {
            break;
        };
        let why = lines.next().unwrap_or_default().trim().to_string();
        assert!(!why.is_empty(), "{keys}: no reason in the notes:\n{notes}");
        for k in keys.split(", ") {
            named.insert(k.to_string(), why.clone());
        }
    }
    named
}

/// A values file written by a test.
fn values_file(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// Whether a node with `labels` is one the pod's required node affinity
/// lets it on (the scheduler's rule: any term, every expression of it).
fn affinity_admits(pod_spec: &Value, labels: &[(&str, &str)]) -> bool {
    let terms = &pod_spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        ["nodeSelectorTerms"];
    let Some(terms) = terms.as_array() else {
        return true;
    };
    let label = |k: &str| labels.iter().find(|(l, _)| *l == k).map(|(_, v)| *v);
    terms.iter().any(|t| {
        t["matchExpressions"]
            .as_array()
            .into_iter()
            .flatten()
            .all(|e| {
                let values: Vec<&str> = e["values"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|v| v.as_str().unwrap())
                    .collect();
                let have = label(e["key"].as_str().unwrap());
                match e["operator"].as_str().unwrap() {
                    "In" => have.is_some_and(|v| values.contains(&v)),
                    "NotIn" => have.is_none_or(|v| !values.contains(&v)),
                    "Exists" => have.is_some(),
                    "DoesNotExist" => have.is_none(),
                    op => panic!("operator {op} not handled here"),
                }
            })
    })
}

#[test]
fn the_gpu_operators_own_values_file_renders_whole() {
    let values = upstream_operator_values();
    let objs = render_with(&values);
    assert!(check_objects(&objs, "the GPU Operator's values.yaml").is_empty());
    // The keys that mean something for gpu-agent are in the agents' policy,
    // which the real gpu-agent takes.
    let e = agent_reads_policy(&objs);
    let s = &e["spec"];
    assert_eq!(s["driver"]["enabled"], true);
    assert_eq!(s["driver"]["version"], "595.91.07");
    assert_eq!(s["toolkit"]["enabled"], true);
    assert_eq!(s["cdi"]["enabled"], true);
    assert_eq!(s["mig"]["strategy"], "single");
    assert_eq!(s["migManager"]["config"]["default"], "all-disabled");
    assert_eq!(s["operator"]["runtimeClass"], "nvidia");
    // clusterPolicy.deployCR: true makes the ClusterPolicy, with the
    // driver's upgradePolicy as gpu-controller reads it.
    let cp = find(&objs, "ClusterPolicy", "cluster-policy");
    let up = gpu_controller::upgrade::UpgradePolicy::from_spec(&cp["spec"])
        .unwrap_or_else(|e| panic!("the controller refuses the rendered upgradePolicy: {e}"));
    assert!(up.auto_upgrade);
    // dcgmExporter.service.internalTrafficPolicy on the metrics Service.
    let svc = find(&objs, "Service", "nvidia-dcgm-exporter");
    assert_eq!(svc["spec"]["internalTrafficPolicy"], "Cluster");
    // The keys with no meaning for gpu-agent are named, with why, in the
    // notes: images, the operator's own Deployment, its validator, NFD...
    let named = named_in_notes(&helm_notes(&["-f", values.to_str().unwrap()]));
    for key in [
        "driver.repository",
        "driver.image",
        "driver.manager",
        "toolkit.version",
        "toolkit.installDir",
        "devicePlugin.repository",
        "dcgmExporter.image",
        "validator.repository",
        "operator.repository",
        "operator.upgradeCRD",
        "nfd.enabled",
        "node-feature-discovery",
        "hostPaths.driverInstallDir",
        "driver.licensingConfig",
    ] {
        assert!(named.contains_key(key), "{key} is not named: {named:#?}");
    }
    assert!(named["operator.upgradeCRD"].contains("crds/"));
    assert!(named["nfd.enabled"].contains("Node Feature Discovery"));
    // What asks for nothing is not named: operands that are off, empty
    // settings, and the keys gpu-agent reads.
    for key in [
        "dcgm",
        "psa",
        "gds",
        "nodeStatusExporter",
        "vgpuManager",
        "ccManager",
        "sandboxWorkloads",
        "draDriver",
        "driver.usePrecompiled",
        "driver.rdma",
        "driver.version",
        "driver.upgradePolicy",
        "driver.kernelModuleConfig",
        "mig",
        "dcgmExporter.serviceMonitor",
        "dcgmExporter.service",
        "dcgmExporter.enablePodLabels",
        "clusterPolicy",
        "daemonsets",
        "extraObjects",
        "devicePlugin.mps.root",
    ] {
        assert!(
            !named
                .keys()
                .any(|k| k == key || k.starts_with(&format!("{key}."))),
            "{key} is named, though it asks for nothing gpu-agent does not do: {named:#?}"
        );
    }
}

#[test]
fn older_gpu_operator_values_formats_render_too() {
    // The operator's values.yaml with the keys earlier versions of its chart
    // had (v1.9 to v26.3), written over the unchanged file.
    let text = std::fs::read_to_string(upstream_operator_values()).unwrap();
    let mut v: Value = serde_yaml_ng::from_str(&text).unwrap();
    let top = v.as_object_mut().unwrap();
    // Before v26.7 the chart always made its ClusterPolicy (no key), and
    // had no DRA, Kata sandbox plugin or extra objects.
    for k in [
        "clusterPolicy",
        "gpuCluster",
        "draDriver",
        "kataSandboxDevicePlugin",
        "extraObjects",
    ] {
        top.remove(k);
    }
    top.insert("psp".into(), json!({"enabled": false}));
    v["operator"]["defaultRuntime"] = json!("docker");
    v["operator"]["initContainer"] = json!({"repository": "nvcr.io/nvidia", "image": "cuda",
        "version": "12.3.2-base-ubi8", "imagePullPolicy": "IfNotPresent"});
    v["driver"]["version"] = json!("535.104.05");
    v["driver"]["useOpenKernelModules"] = json!(true);
    v["driver"]["rollingUpdate"] = json!({"maxUnavailable": "1"});
    v["driver"]["securityContext"] = json!({"privileged": true, "seLinuxOptions": {"level": "s0"}});
    v["driver"]["licensingConfig"] = json!({"configMapName": "", "nlsEnabled": false});
    v["validator"]["driver"] =
        json!({"env": [{"name": "DISABLE_DEV_CHAR_SYMLINK_CREATION", "value": "true"}]});
    v["dcgm"]["hostPort"] = json!(5555);
    v["dcgmExporter"].as_object_mut().unwrap().remove("service");
    v["dcgmExporter"]["env"] = json!([
        {"name": "DCGM_EXPORTER_LISTEN", "value": ":9400"},
        {"name": "DCGM_EXPORTER_KUBERNETES", "value": "true"},
        {"name": "DCGM_EXPORTER_COLLECTORS", "value": "/etc/dcgm-exporter/dcp-metrics-included.csv"},
    ]);
    v["dcgmExporter"]["serviceMonitor"] = json!({"enabled": false, "interval": "15s",
        "honorLabels": false, "additionalLabels": {}});
    v["devicePlugin"]["env"] = json!([
        {"name": "PASS_DEVICE_SPECS", "value": "true"},
        {"name": "FAIL_ON_INIT_ERROR", "value": "true"},
        {"name": "DEVICE_LIST_STRATEGY", "value": "envvar"},
        {"name": "DEVICE_ID_STRATEGY", "value": "uuid"},
        {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
    ]);
    // v23.3 to v24.3 named the operator's own default layouts.
    v["migManager"]["config"] =
        json!({"name": "default-mig-parted-config", "default": "all-disabled"});
    let dir = tempfile::tempdir().unwrap();
    let file = values_file(
        dir.path(),
        "old-operator-values.yaml",
        &serde_yaml_ng::to_string(&v).unwrap(),
    );
    let objs = render_with(&file);
    assert!(check_objects(&objs, "older operator values").is_empty());
    assert!(
        !kinds(&objs).contains("ClusterPolicy"),
        "clusterPolicy.deployCR is gpu-agent's false where the file has none"
    );
    let e = agent_reads_policy(&objs);
    let s = &e["spec"];
    assert_eq!(s["driver"]["version"], "535.104.05");
    assert_eq!(s["operator"]["defaultRuntime"], "docker");
    assert_eq!(s["devicePlugin"]["passDeviceSpecs"], true);
    assert_eq!(s["devicePlugin"]["deviceListStrategy"], "envvar");
    assert_eq!(s["devicePlugin"]["deviceIdStrategy"], "uuid");
    // The operator's own default layouts ConfigMap (gone with it) is not
    // mounted: gpu-agent's built-in layouts stand for it.
    let ds = daemonset(&objs);
    assert!(
        pod_spec(ds)["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .all(|v| v["configMap"]["name"] != "default-mig-parted-config"),
        "{}",
        pod_spec(ds)["volumes"]
    );
    assert!(s["migManager"]["config"].get("name").is_none());
    assert_eq!(s["migManager"]["config"]["default"], "all-disabled");
    // No ServiceMonitor: the file turns it off.
    assert!(
        !kinds(&render(&[
            "-f",
            file.to_str().unwrap(),
            "--api-versions",
            SERVICE_MONITOR_API
        ]))
        .contains("ServiceMonitor")
    );
    let named = named_in_notes(&helm_notes(&["-f", file.to_str().unwrap()]));
    for key in [
        "operator.defaultRuntime=docker",
        "operator.initContainer",
        "driver.useOpenKernelModules",
        "driver.rollingUpdate",
        "driver.securityContext",
        "driver.upgradePolicy",
        "validator.driver",
        "dcgmExporter.env DCGM_EXPORTER_COLLECTORS",
        "dcgmExporter.env DCGM_EXPORTER_LISTEN",
        "devicePlugin.env FAIL_ON_INIT_ERROR",
        "devicePlugin.env NVIDIA_VISIBLE_DEVICES",
        "migManager.config.name=default-mig-parted-config",
    ] {
        assert!(named.contains_key(key), "{key} is not named: {named:#?}");
    }
    assert!(named["driver.upgradePolicy"].contains("clusterPolicy.deployCR"));
    for key in [
        "psp.enabled",
        "dcgm.hostPort",
        "devicePlugin.env PASS_DEVICE_SPECS",
    ] {
        assert!(!named.contains_key(key), "{key}: {named:#?}");
    }
}

#[test]
fn the_metrics_service_keeps_the_gpu_operators_scrape_identity_by_default() {
    let objs = render(&[]);
    // The operator's Service for dcgm-exporter: name, label app, the
    // annotation Prometheus's annotation-driven jobs keep, port name.
    let svc = find(&objs, "Service", "nvidia-dcgm-exporter");
    assert_eq!(svc["metadata"]["labels"]["app"], "nvidia-dcgm-exporter");
    assert_eq!(
        svc["metadata"]["annotations"]["prometheus.io/scrape"],
        "true"
    );
    let port = &svc["spec"]["ports"][0];
    assert_eq!(port["name"], "gpu-metrics");
    assert_eq!(port["port"], 9400);
    // ... over the agents' pods and their metrics port.
    let ds = daemonset(&objs);
    for (k, v) in svc["spec"]["selector"].as_object().unwrap() {
        assert_eq!(&ds["spec"]["template"]["metadata"]["labels"][k], v);
    }
    let c = container(ds, "gpu-agent");
    assert_eq!(c["ports"][0]["name"], port["targetPort"]);
    assert_eq!(c["ports"][0]["containerPort"], 9400);
    assert!(
        !objs
            .iter()
            .any(|o| o["kind"] == "Service" && o["metadata"]["name"] == "gpu-agent-metrics")
    );
    // gpu-agent's own names, when asked for.
    let own = render(&["--set", "metricsService.gpuOperatorNames=false"]);
    let svc = find(&own, "Service", "gpu-agent-metrics");
    assert_eq!(svc["spec"]["clusterIP"], "None");
    assert_eq!(svc["spec"]["ports"][0]["name"], "metrics");
    assert!(svc["metadata"]["labels"].get("app").is_none());
    assert!(svc["metadata"].get("annotations").is_none());
    // dcgmExporter.service: the operator's type and traffic policy.
    let np = render(&[
        "--set",
        "dcgmExporter.service.type=NodePort",
        "--set",
        "dcgmExporter.service.internalTrafficPolicy=Local",
    ]);
    check_objects(&np, "dcgmExporter.service");
    let svc = find(&np, "Service", "nvidia-dcgm-exporter");
    assert_eq!(svc["spec"]["type"], "NodePort");
    assert_eq!(svc["spec"]["internalTrafficPolicy"], "Local");
    // The notes say so.
    let notes = helm_notes(&[]);
    assert!(
        notes.contains("Service nvidia-dcgm-exporter (port gpu-metrics, 9400)"),
        "{notes}"
    );
}

#[test]
fn a_service_monitor_with_job_label_app_is_made_where_the_api_serves_it() {
    let objs = render(&["--api-versions", SERVICE_MONITOR_API]);
    assert_eq!(
        check_objects(&objs, "--api-versions ServiceMonitor"),
        vec!["ServiceMonitor nvidia-dcgm-exporter".to_string()]
    );
    let sm = find(&objs, "ServiceMonitor", "nvidia-dcgm-exporter");
    let svc = find(&objs, "Service", "nvidia-dcgm-exporter");
    // jobLabel app: Prometheus's job label is the Service's label app.
    assert_eq!(sm["spec"]["jobLabel"], "app");
    assert_eq!(
        svc["metadata"]["labels"][sm["spec"]["jobLabel"].as_str().unwrap()],
        "nvidia-dcgm-exporter",
        "job=\"nvidia-dcgm-exporter\""
    );
    assert_eq!(sm["metadata"]["labels"]["app"], "nvidia-dcgm-exporter");
    for (k, v) in sm["spec"]["selector"]["matchLabels"].as_object().unwrap() {
        assert_eq!(&svc["metadata"]["labels"][k], v, "label {k}");
    }
    assert_eq!(sm["spec"]["namespaceSelector"]["matchNames"], json!([NS]));
    let ep = &sm["spec"]["endpoints"][0];
    assert_eq!(ep["port"], "gpu-metrics");
    assert_eq!(ep["path"], "/metrics");
    assert_eq!(ep["interval"], "15s");
    assert_eq!(ep["scrapeTimeout"], "10s");
    assert_eq!(ep["honorLabels"], false);
    // Not made where the API does not serve the kind (the chart installs
    // without the Prometheus Operator), nor when turned off; "always"
    // makes it regardless.
    assert!(!kinds(&render(&[])).contains("ServiceMonitor"));
    assert!(
        !kinds(&render(&[
            "--api-versions",
            SERVICE_MONITOR_API,
            "--set",
            "dcgmExporter.serviceMonitor.enabled=false"
        ]))
        .contains("ServiceMonitor")
    );
    find(
        &render(&["--set", "dcgmExporter.serviceMonitor.enabled=always"]),
        "ServiceMonitor",
        "nvidia-dcgm-exporter",
    );
    assert!(
        helm_notes(&[]).contains("No ServiceMonitor: the API server"),
        "the notes say why there is none"
    );
    // The operator's own values.yaml (serviceMonitor.enabled: true) too.
    let up = render(&[
        "-f",
        upstream_operator_values().to_str().unwrap(),
        "--api-versions",
        SERVICE_MONITOR_API,
    ]);
    let sm = find(&up, "ServiceMonitor", "nvidia-dcgm-exporter");
    assert_eq!(sm["spec"]["jobLabel"], "app");
    // gpu-agent's own names: the job is the Service's name.
    let own = render(&[
        "--api-versions",
        SERVICE_MONITOR_API,
        "--set",
        "metricsService.gpuOperatorNames=false",
    ]);
    let sm = find(&own, "ServiceMonitor", "gpu-agent");
    assert!(sm["spec"].get("jobLabel").is_none());
    assert_eq!(sm["spec"]["endpoints"][0]["port"], "metrics");
}

#[test]
fn gpu_operator_keys_with_a_meaning_for_gpu_agent_reach_its_policy() {
    let dir = tempfile::tempdir().unwrap();
    // k3s as NVIDIA's docs set the operator up for it, and the other keys
    // of issue 29 point 6.
    let file = values_file(
        dir.path(),
        "k3s.yaml",
        r#"
toolkit:
  env:
    - name: CONTAINERD_CONFIG
      value: /var/lib/rancher/k3s/agent/etc/containerd/config.toml.tmpl
    - name: CONTAINERD_SOCKET
      value: /run/k3s/containerd/containerd.sock
    - name: RUNTIME_CONFIG_SOURCE
      value: file=/var/lib/rancher/k3s/agent/etc/containerd/config.toml
    - name: CONTAINERD_RUNTIME_CLASS
      value: nvidia
    - name: CONTAINERD_SET_AS_DEFAULT
      value: "true"
    - name: RUNTIME_RESTART_MODE
      value: none
    - name: RUNTIME_DROP_IN_CONFIG
      value: /etc/containerd/conf.d/99-nvidia.toml
    - name: NVIDIA_CONTAINER_RUNTIME_DEBUG
      value: /dev/stderr
migManager:
  env:
    - name: WITH_REBOOT
      value: "true"
driver:
  rdma:
    enabled: true
    useHostMofed: true
  usePrecompiled: true
  kernelModuleConfig:
    name: kernel-module-params
devicePlugin:
  env:
    - name: DEVICE_LIST_STRATEGY
      value: cdi-annotations,cdi-cri
    - name: DEVICE_ID_STRATEGY
      value: index
dcgmExporter:
  enablePodLabels: true
  env:
    - name: DCGM_EXPORTER_INTERVAL
      value: "30000"
validator:
  repository: nvcr.io/nvidia
  plugin:
    env:
      - name: WITH_WORKLOAD
        value: "true"
nfd:
  enabled: true
psa:
  enabled: true
dcgm:
  enabled: true
operator:
  upgradeCRD: true
hostPaths:
  driverInstallDir: /run/nvidia/driver
"#,
    );
    let objs = render_with(&file);
    assert!(check_objects(&objs, "k3s.yaml").is_empty());
    let e = agent_reads_policy(&objs);
    let s = &e["spec"];
    assert_eq!(
        s["toolkit"]["containerd"]["config"],
        "/var/lib/rancher/k3s/agent/etc/containerd/config.toml.tmpl"
    );
    assert_eq!(
        s["toolkit"]["containerd"]["dropInDir"],
        "/etc/containerd/conf.d"
    );
    assert_eq!(
        s["validator"]["criSocket"],
        "/run/k3s/containerd/containerd.sock"
    );
    assert_eq!(s["toolkit"]["setAsDefault"], true);
    assert_eq!(s["toolkit"]["reload"], "none");
    assert_eq!(s["operator"]["runtimeClass"], "nvidia");
    assert_eq!(s["migManager"]["reboot"], true);
    assert_eq!(s["driver"]["peermem"], true);
    assert_eq!(s["validator"]["workload"], true);
    assert_eq!(
        s["devicePlugin"]["deviceListStrategy"],
        json!(["cdi-annotations", "cdi-cri"])
    );
    assert_eq!(s["devicePlugin"]["deviceIdStrategy"], "index");
    assert_eq!(s["dcgmExporter"]["collectIntervalMs"], 30000);
    let p: Value = serde_yaml_ng::from_str(&policy_text(&objs)).unwrap();
    assert_eq!(
        p["spec"]["driver"]["kernelModuleConfig"]["name"],
        "kernel-module-params"
    );
    // agent.policy still wins over them.
    let over = render(&[
        "-f",
        file.to_str().unwrap(),
        "--set",
        "agent.policy.toolkit.setAsDefault=false",
    ]);
    assert_eq!(
        agent_reads_policy(&over)["spec"]["toolkit"]["setAsDefault"],
        false
    );
    // Docker's restart by signal; CRI-O's socket.
    let docker = render(&[
        "--set",
        "operator.defaultRuntime=docker",
        "--set",
        "toolkit.env[0].name=RUNTIME_RESTART_MODE",
        "--set",
        "toolkit.env[0].value=signal",
    ]);
    assert_eq!(
        agent_reads_policy(&docker)["spec"]["toolkit"]["reload"],
        "signal"
    );
    let crio = render(&[
        "--set",
        "operator.defaultRuntime=crio",
        "--set",
        "toolkit.env[0].name=RUNTIME_SOCKET",
        "--set",
        "toolkit.env[0].value=/run/crio/crio.sock",
    ]);
    assert_eq!(
        agent_reads_policy(&crio)["spec"]["validator"]["criSocket"],
        "/run/crio/crio.sock"
    );
    // The keys with no meaning for gpu-agent: named in the notes, with why.
    let named = named_in_notes(&helm_notes(&["-f", file.to_str().unwrap()]));
    for (key, why) in [
        ("nfd.enabled", "Node Feature Discovery"),
        (
            "psa.enabled",
            "pod-security.kubernetes.io/enforce=privileged",
        ),
        ("dcgm.enabled", "DCGM host engine"),
        ("dcgmExporter.enablePodLabels", "pods' labels"),
        ("operator.upgradeCRD", "crds/"),
        ("driver.usePrecompiled", "bundles"),
        ("driver.rdma.useHostMofed", "MOFED"),
        ("driver.kernelModuleConfig.name", "clusterPolicy.deployCR"),
        ("hostPaths.driverInstallDir", "driver container"),
        ("toolkit.env RUNTIME_CONFIG_SOURCE", "k3s"),
        (
            "toolkit.env NVIDIA_CONTAINER_RUNTIME_DEBUG",
            "installs no toolkit",
        ),
        ("validator.repository", "validates its own stages"),
    ] {
        let got = named
            .get(key)
            .unwrap_or_else(|| panic!("{key} is not named: {named:#?}"));
        assert!(got.contains(why), "{key}: {got:?} does not say {why:?}");
    }
    for key in [
        "toolkit.env CONTAINERD_CONFIG",
        "toolkit.env CONTAINERD_SOCKET",
        "toolkit.env CONTAINERD_RUNTIME_CLASS",
        "migManager.env WITH_REBOOT",
        "driver.rdma.enabled",
        "validator.plugin.env WITH_WORKLOAD",
        "dcgmExporter.env DCGM_EXPORTER_INTERVAL",
    ] {
        assert!(!named.contains_key(key), "{key} is used, not named");
    }
}

#[test]
fn sandbox_workloads_keep_the_agents_off_vm_nodes_and_extra_objects_are_made() {
    let gpu = ("nvidia.com/gpu.present", "true");
    let workload = "nvidia.com/gpu.workload.config";
    // sandboxWorkloads.enabled with the default workload container: every
    // GPU node but those labelled for VMs.
    let objs = render(&["--set", "sandboxWorkloads.enabled=true"]);
    check_objects(&objs, "sandboxWorkloads");
    let spec = pod_spec(daemonset(&objs));
    assert!(affinity_admits(spec, &[gpu]));
    assert!(affinity_admits(spec, &[gpu, (workload, "container")]));
    assert!(!affinity_admits(spec, &[gpu, (workload, "vm-passthrough")]));
    assert!(!affinity_admits(spec, &[gpu, (workload, "vm-vgpu")]));
    assert!(
        !affinity_admits(spec, &[(workload, "container")]),
        "still GPU nodes only"
    );
    // A VM default: only the nodes labelled container.
    let objs = render(&[
        "--set",
        "sandboxWorkloads.enabled=true",
        "--set",
        "sandboxWorkloads.defaultWorkload=vm-passthrough",
        "--set",
        "agent.affinity=null",
    ]);
    let spec = pod_spec(daemonset(&objs));
    assert!(!affinity_admits(spec, &[gpu]));
    assert!(affinity_admits(spec, &[gpu, (workload, "container")]));
    // Off (the operator's default): the affinity is agent.affinity's.
    let off = render(&["--set", "sandboxWorkloads.enabled=false"]);
    assert_eq!(
        pod_spec(daemonset(&off))["affinity"],
        pod_spec(daemonset(&render(&[])))["affinity"]
    );
    // The sandbox operands, only meaningful with it, are named then.
    let named = named_in_notes(&helm_notes(&[
        "--set",
        "sandboxWorkloads.enabled=true",
        "--set",
        "vfioManager.enabled=true",
    ]));
    assert!(named["sandboxWorkloads.enabled"].contains("VM passthrough"));
    assert!(named.contains_key("vfioManager"), "{named:#?}");
    // extraObjects: made, as templates of the chart.
    let dir = tempfile::tempdir().unwrap();
    let file = values_file(
        dir.path(),
        "extra.yaml",
        r#"
extraObjects:
  - apiVersion: v1
    kind: ConfigMap
    metadata:
      name: "{{ .Release.Name }}-extra"
      namespace: "{{ .Release.Namespace }}"
      labels:
        app.kubernetes.io/part-of: gpu-agent
    data:
      a: b
  - |
    apiVersion: v1
    kind: ConfigMap
    metadata:
      name: time-slicing-config
      namespace: {{ .Release.Namespace }}
      labels:
        app.kubernetes.io/part-of: gpu-agent
    data:
      any: "version: v1"
"#,
    );
    let objs = render_with(&file);
    check_objects(&objs, "extraObjects");
    assert_eq!(
        find(&objs, "ConfigMap", "gpu-agent-extra")["data"]["a"],
        "b"
    );
    find(&objs, "ConfigMap", "time-slicing-config");
}

#[test]
fn gpu_operator_keys_gpu_agent_would_not_honour_are_refused_naming_them() {
    let env = |name: &'static str, value: &'static str| -> Vec<String> {
        vec![
            "--set".into(),
            format!("toolkit.env[0].name={name}"),
            "--set".into(),
            format!("toolkit.env[0].value={value}"),
        ]
    };
    let with = |mut a: Vec<String>, more: &[&str]| -> Vec<String> {
        a.extend(more.iter().map(|s| s.to_string()));
        a
    };
    let cases: Vec<(Vec<String>, &[&str])> = vec![
        (
            env("NVIDIA_RUNTIME_NAME", "nvidia-x"),
            &[
                "toolkit.env NVIDIA_RUNTIME_NAME=nvidia-x",
                "operator.runtimeClass: nvidia-x",
            ],
        ),
        (
            with(
                env("DOCKER_RUNTIME_NAME", "nvidia-docker"),
                &["--set", "operator.defaultRuntime=docker"],
            ),
            &[
                "toolkit.env DOCKER_RUNTIME_NAME=nvidia-docker",
                "operator.runtimeClass",
            ],
        ),
        (
            with(
                env("DOCKER_CONFIG", "/etc/docker/custom.json"),
                &["--set", "operator.defaultRuntime=docker"],
            ),
            &[
                "toolkit.env DOCKER_CONFIG=/etc/docker/custom.json",
                "/etc/docker/daemon.json",
            ],
        ),
        (
            with(
                env("RUNTIME_DROP_IN_CONFIG", "/etc/crio/other.d/99-nvidia.conf"),
                &["--set", "operator.defaultRuntime=crio"],
            ),
            &[
                "toolkit.env RUNTIME_DROP_IN_CONFIG=",
                "/etc/crio/crio.conf.d",
            ],
        ),
        (
            env("CONTAINERD_SET_AS_DEFAULT", "yes"),
            &["toolkit.env CONTAINERD_SET_AS_DEFAULT=yes: not true or false"],
        ),
        (
            env("RUNTIME_RESTART_MODE", "kill"),
            &["toolkit.env RUNTIME_RESTART_MODE=kill"],
        ),
        (
            env("CONTAINERD_CONFIG", "etc/containerd/config.toml"),
            &["toolkit.env CONTAINERD_CONFIG=etc/containerd/config.toml: not an absolute path"],
        ),
        (
            vec![
                "--set".into(),
                "toolkit.env[0].name=CONTAINERD_SOCKET".into(),
                "--set".into(),
                "toolkit.env[0].valueFrom.configMapKeyRef.name=k3s".into(),
            ],
            &["toolkit.env CONTAINERD_SOCKET: given by valueFrom"],
        ),
        (
            vec![
                "--set".into(),
                "hostPaths.driverInstallDir=/home/kubernetes/bin/nvidia".into(),
            ],
            &[
                "hostPaths.driverInstallDir=/home/kubernetes/bin/nvidia",
                "would get no driver",
            ],
        ),
        (
            vec!["--set".into(), "gpuCluster.deployCR=true".into()],
            &["gpuCluster.deployCR", "no DRA driver"],
        ),
        (
            vec![
                "--set".into(),
                "devicePlugin.env[0].name=MIG_STRATEGY".into(),
                "--set".into(),
                "devicePlugin.env[0].value=mixed".into(),
            ],
            &[
                "devicePlugin.env MIG_STRATEGY=mixed",
                "set mig.strategy: mixed",
            ],
        ),
        (
            vec![
                "--set".into(),
                "migManager.env[0].name=WITH_REBOOT".into(),
                "--set".into(),
                "migManager.env[0].value=maybe".into(),
            ],
            &["migManager.env WITH_REBOOT=maybe: not true or false"],
        ),
        (
            vec![
                "--set".into(),
                "dcgmExporter.env[0].name=DCGM_EXPORTER_INTERVAL".into(),
                "--set".into(),
                "dcgmExporter.env[0].value=30s".into(),
            ],
            &["dcgmExporter.env DCGM_EXPORTER_INTERVAL=30s"],
        ),
        (
            vec![
                "--set".into(),
                "dcgmExporter.service.type=ExternalName".into(),
            ],
            &["/dcgmExporter/service/type"],
        ),
        // Several at once: each is named.
        (
            with(
                env("NVIDIA_RUNTIME_NAME", "other"),
                &["--set", "gpuCluster.deployCR=true"],
            ),
            &["NVIDIA_RUNTIME_NAME=other", "gpuCluster.deployCR"],
        ),
    ];
    for (args, want) in &cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        match helm_template(&args) {
            Ok(_) => panic!("helm template {args:?} rendered; it should have been refused"),
            Err(e) => {
                for w in *want {
                    assert!(e.contains(w), "helm template {args:?}: {w:?} not in:\n{e}");
                }
            }
        }
    }
    // The operator set CONTAINERD_RUNTIME_CLASS itself over a value given
    // for containerd: taken as it did, named.
    let args = env("CONTAINERD_RUNTIME_CLASS", "other");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let objs = render(&args);
    assert_eq!(
        agent_reads_policy(&objs)["spec"]["operator"]["runtimeClass"],
        "nvidia"
    );
    let named = named_in_notes(&helm_notes(&args));
    assert!(
        named["toolkit.env CONTAINERD_RUNTIME_CLASS"].contains("operator.runtimeClass"),
        "{named:#?}"
    );
}

#[test]
fn the_cluster_policy_crd_is_one_file_shipped_by_both() {
    let crd = crd_file();
    let from_helm = render(&[]);
    assert_eq!(
        find(
            &from_helm,
            "CustomResourceDefinition",
            "clusterpolicies.nvidia.com"
        ),
        &crd
    );
    let from_kustomize = kustomize("packaging/kustomize/base");
    assert_eq!(
        find(
            &from_kustomize,
            "CustomResourceDefinition",
            "clusterpolicies.nvidia.com"
        ),
        &crd
    );
    // The chart ships the file itself (a link makes Helm say "found
    // symbolic link in path" on every render, and a packaged chart needs
    // the real file), the same bytes as packaging/crds/.
    let in_chart = chart().join("crds/nvidia.com_clusterpolicies.yaml");
    assert!(
        std::fs::symlink_metadata(&in_chart)
            .unwrap()
            .file_type()
            .is_file(),
        "{} is a plain file, not a link",
        in_chart.display()
    );
    assert!(
        std::fs::read(&in_chart).unwrap()
            == std::fs::read(repo().join("packaging/crds/nvidia.com_clusterpolicies.yaml"))
                .unwrap(),
        "{} and packaging/crds/nvidia.com_clusterpolicies.yaml differ: copy one over the other",
        in_chart.display()
    );
    // No other file in either directory that the other lacks.
    let names = |d: PathBuf| -> BTreeSet<String> {
        std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n != "kustomization.yaml")
            .collect()
    };
    assert_eq!(
        names(chart().join("crds")),
        names(repo().join("packaging/crds"))
    );
    // `helm template --include-crds` says nothing but the objects.
    let out = Command::new(helm())
        .args(["template", RELEASE])
        .arg(chart())
        .args(["--namespace", NS, "--include-crds"])
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "",
        "helm template --include-crds prints nothing on stderr"
    );
}

// ---------------------------------------------------------------------------
// kustomize = the chart
// ---------------------------------------------------------------------------

/// An object as compared between the chart and kustomize: without Helm's
/// own labels; ConfigMap YAML entries parsed.
fn normalized(o: &Value) -> Value {
    let mut o = o.clone();
    for ptr in ["/metadata/labels", "/spec/template/metadata/labels"] {
        if let Some(l) = o.pointer_mut(ptr).and_then(Value::as_object_mut) {
            l.remove("helm.sh/chart");
            l.remove("app.kubernetes.io/managed-by");
        }
    }
    if o["kind"] == "ConfigMap"
        && let Some(data) = o["data"].as_object_mut()
    {
        for (k, v) in data.iter_mut() {
            if k.ends_with(".yaml") {
                *v = serde_yaml_ng::from_str(v.as_str().unwrap()).unwrap();
            }
        }
    }
    o
}

fn by_id(objs: &[Value]) -> BTreeMap<String, Value> {
    objs.iter()
        .map(|o| {
            (
                format!(
                    "{} {}/{}",
                    o["kind"].as_str().unwrap(),
                    o["metadata"]["namespace"].as_str().unwrap_or(""),
                    o["metadata"]["name"].as_str().unwrap()
                ),
                normalized(o),
            )
        })
        .collect()
}

fn assert_same(chart: &[Value], kustomized: &[Value], what: &str) {
    // The uninstall hook's objects are Helm's to run (`helm uninstall`);
    // packaging/kustomize/uninstall has them for kustomize.
    let chart: Vec<Value> = chart
        .iter()
        .filter(|o| !o["metadata"]["annotations"]["helm.sh/hook"].is_string())
        .cloned()
        .collect();
    let (h, mut k) = (by_id(&chart), by_id(kustomized));
    // The base makes the namespace (with its Pod Security labels); Helm's is
    // made by `--create-namespace` or by you.
    let ns = k
        .remove(&format!("Namespace /{NS}"))
        .expect("the base makes the namespace");
    assert_eq!(
        ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"],
        "privileged"
    );
    assert_eq!(
        h.keys().collect::<Vec<_>>(),
        k.keys().collect::<Vec<_>>(),
        "{what}: the same objects"
    );
    for (id, ho) in &h {
        assert!(
            ho == &k[id],
            "{what}: {id} differs\nchart:\n{}\nkustomize:\n{}",
            serde_json::to_string_pretty(ho).unwrap(),
            serde_json::to_string_pretty(&k[id]).unwrap()
        );
    }
}

#[test]
fn the_kustomize_base_and_eks_overlay_are_the_chart_rendered() {
    let base = kustomize("packaging/kustomize/base");
    assert!(check_objects(&base, "kustomize base").is_empty());
    // The base's TLS Secret is the user's to make: the chart's "secret" mode.
    let chart = render(&["--set", "controller.tls.mode=secret"]);
    assert!(!kinds(&chart).contains("Secret"));
    assert_same(&chart, &base, "base");
    let eks = kustomize("packaging/kustomize/overlays/eks");
    assert!(check_objects(&eks, "kustomize overlays/eks").is_empty());
    let chart_eks = render(&[
        "-f",
        eks_values().to_str().unwrap(),
        "--set",
        "controller.tls.mode=secret",
    ]);
    assert_same(&chart_eks, &eks, "overlays/eks");
}

// ---------------------------------------------------------------------------
// The chart's certificate, served by the real controller
// ---------------------------------------------------------------------------

/// Standard base64 (RFC 4648), as Secret data is written.
fn base64_decode(s: &str) -> Vec<u8> {
    let val = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => (c - b'A') as u32,
            b'a'..=b'z' => (c - b'a') as u32 + 26,
            b'0'..=b'9' => (c - b'0') as u32 + 52,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {c:?}"),
        }
    };
    let bytes: Vec<u8> = s.bytes().filter(|c| !c.is_ascii_whitespace()).collect();
    let mut out = Vec::new();
    for chunk in bytes.chunks(4) {
        let pad = chunk.iter().filter(|c| **c == b'=').count();
        let mut n = 0u32;
        for (i, c) in chunk.iter().enumerate() {
            n |= if *c == b'=' { 0 } else { val(*c) } << (18 - 6 * i);
        }
        let three = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&three[..3 - pad]);
    }
    out
}

/// gpu-controller run with the rendered Deployment's arguments, but
/// listening on loopback, with `tls` (cert, key) and the API server `api`.
fn controller_as_rendered(
    dep: &Value,
    api: &MockApi,
    dir: &Path,
    tls: (&Path, &Path),
    env: &[(&str, &str)],
) -> (Proc, u16) {
    let c = container(dep, "gpu-controller");
    let port = common::free_port();
    let mut argv: Vec<String> = args(c)
        .into_iter()
        .filter(|a| {
            !["--listen=", "--http-listen=", "--tls-cert=", "--tls-key="]
                .iter()
                .any(|p| a.starts_with(p))
        })
        .collect();
    argv.extend([
        format!("--listen=127.0.0.1:{port}"),
        "--http-listen=off".into(),
        format!("--tls-cert={}", tls.0.display()),
        format!("--tls-key={}", tls.1.display()),
    ]);
    let log = dir.join("controller.log");
    let child = Command::new(env!("CARGO_BIN_EXE_gpu-controller"))
        .args(&argv)
        .env("KUBECONFIG", api.kubeconfig(dir))
        .env("RUST_LOG", "info")
        .envs(env.iter().copied())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let p = Proc { child, log };
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "gpu-controller never listened:\n{}",
            p.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    (p, port)
}

/// Opens a report stream over TLS to `port`, trusting `ca`, checking the
/// certificate for `name`; the status the controller answers with.
async fn dial(port: u16, ca: &[u8], name: &str, token: &str) -> Result<(), String> {
    use gpu_agent_proto::report::v1 as pb;
    let tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(ca))
        .domain_name(name);
    let channel = tonic::transport::Endpoint::from_shared(format!("https://127.0.0.1:{port}"))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .map_err(|e| format!("connect: {}", gpu_controller::error_chain(&e)))?;
    let hello = pb::AgentMessage {
        seq: 1,
        body: Some(pb::agent_message::Body::Hello(pb::Hello {
            node_name: "gpu-node-1".into(),
            ..Default::default()
        })),
    };
    let mut req = tonic::Request::new(tokio_stream::iter(vec![hello]));
    req.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    pb::report_client::ReportClient::new(channel)
        .attach(req)
        .await
        .map(|_| ())
        .map_err(|s| format!("{:?}: {}", s.code(), s.message()))
}

#[test]
fn the_controller_serves_agents_with_the_charts_certificate() {
    let objs = render(&[]);
    let secret = find(&objs, "Secret", "gpu-controller-tls");
    assert_eq!(secret["type"], "kubernetes.io/tls");
    let dir = tempfile::tempdir().unwrap();
    let file = |key: &str| {
        let p = dir.path().join(key);
        std::fs::write(&p, base64_decode(secret["data"][key].as_str().unwrap())).unwrap();
        p
    };
    let (cert, key, ca) = (file("tls.crt"), file("tls.key"), file("ca.crt"));
    let ca = std::fs::read(ca).unwrap();
    let ds = daemonset(&objs);
    let url = flag(&args(container(ds, "gpu-agent")), "--controller").unwrap();
    let host = url
        .strip_prefix("https://")
        .and_then(|u| u.split(':').next())
        .unwrap()
        .to_string();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let api = rt.block_on(MockApi::start());
    let dep = find(&objs, "Deployment", "gpu-controller");
    let (mut controller, port) = controller_as_rendered(dep, &api, dir.path(), (&cert, &key), &[]);
    // The handshake holds for the name agents dial; the controller then
    // asks the API server about the token (unknown there: refused).
    let got = rt.block_on(dial(port, &ca, &host, "not-a-known-token"));
    assert_eq!(
        got,
        Err(
            "Unauthenticated: the API server did not authenticate the token: invalid bearer token"
                .into()
        ),
        "{}",
        controller.log()
    );
    // The Service's other names are in the certificate too; a name it does
    // not carry is refused by the client's TLS.
    for name in [
        format!("gpu-controller.{NS}.svc.cluster.local"),
        format!("gpu-controller.{NS}"),
    ] {
        let got = rt.block_on(dial(port, &ca, &name, "x"));
        assert!(
            got.as_ref()
                .is_err_and(|e| e.starts_with("Unauthenticated")),
            "{name}: {got:?}"
        );
    }
    let got = rt.block_on(dial(port, &ca, "gpu-controller.elsewhere.svc", "x"));
    assert!(
        got.as_ref().is_err_and(|e| e.starts_with("connect:")),
        "{got:?}"
    );
    controller.term();
    // A new render makes a new CA (no cluster to find the Secret in), so
    // the checksum that restarts the controller moves with it.
    let again = render(&[]);
    let sum = |o: &[Value]| {
        find(o, "Deployment", "gpu-controller")["spec"]["template"]["metadata"]["annotations"]
            ["checksum/tls"]
            .clone()
    };
    assert_ne!(sum(&objs), sum(&again));
}

// ---------------------------------------------------------------------------
// RBAC: what the controller does, and no more
// ---------------------------------------------------------------------------

/// A request as the API server's authorizer sees it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Attributes {
    verb: String,
    group: String,
    /// With its subresource: `pods/eviction`.
    resource: String,
    namespace: Option<String>,
    name: Option<String>,
}

/// The authorizer's attributes of a request (its RequestInfo rules).
fn attributes(method: &str, uri: &str) -> Attributes {
    let (path, query) = uri.split_once('?').unwrap_or((uri, ""));
    let segs: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let (group, mut rest) = match segs.first() {
        Some(&"api") => ("", &segs[2..]),
        Some(&"apis") => (segs[1], &segs[3..]),
        _ => panic!("not an API resource request: {method} {uri}"),
    };
    let mut namespace = None;
    if rest.first() == Some(&"namespaces") && rest.len() >= 3 {
        namespace = Some(rest[1].to_string());
        rest = &rest[2..];
    }
    let name = rest.get(1).map(|s| s.to_string());
    let resource = match rest.get(2) {
        Some(sub) => format!("{}/{sub}", rest[0]),
        None => rest[0].to_string(),
    };
    let watch = query
        .split('&')
        .any(|kv| kv == "watch=true" || kv == "watch=1");
    let verb = match (method, name.is_some()) {
        ("GET", _) if watch => "watch",
        ("GET", true) => "get",
        ("GET", false) => "list",
        ("POST", _) => "create",
        ("PUT", _) => "update",
        ("PATCH", _) => "patch",
        ("DELETE", true) => "delete",
        ("DELETE", false) => "deletecollection",
        _ => panic!("method {method}"),
    };
    Attributes {
        verb: verb.into(),
        group: group.into(),
        resource,
        namespace,
        name,
    }
}

/// One rule of a (Cluster)Role as granted to the controller: where it holds
/// (a Role's namespace; None: everywhere, from a ClusterRole).
#[derive(Debug)]
struct Grant {
    role: String,
    namespace: Option<String>,
    rule: Value,
}

/// The rules bound to `namespace/account` by the rendered bindings.
fn grants(objs: &[Value], namespace: &str, account: &str) -> Vec<Grant> {
    let mut out = Vec::new();
    for b in objs
        .iter()
        .filter(|o| o["kind"] == "ClusterRoleBinding" || o["kind"] == "RoleBinding")
    {
        let bound = b["subjects"].as_array().unwrap().iter().any(|s| {
            s["kind"] == "ServiceAccount" && s["name"] == account && s["namespace"] == namespace
        });
        if !bound {
            continue;
        }
        let role = find(
            objs,
            b["roleRef"]["kind"].as_str().unwrap(),
            b["roleRef"]["name"].as_str().unwrap(),
        );
        assert_eq!(b["roleRef"]["apiGroup"], "rbac.authorization.k8s.io");
        let ns = (b["kind"] == "RoleBinding").then(|| {
            let ns = b["metadata"]["namespace"].as_str().unwrap().to_string();
            assert_eq!(
                role["metadata"]["namespace"],
                ns.as_str(),
                "a RoleBinding's Role is in its namespace"
            );
            ns
        });
        for rule in role["rules"].as_array().unwrap() {
            out.push(Grant {
                role: format!("{} {}", role["kind"], role["metadata"]["name"]),
                namespace: ns.clone(),
                rule: rule.clone(),
            });
        }
    }
    out
}

fn has(list: &Value, item: &str) -> bool {
    list.as_array()
        .into_iter()
        .flatten()
        .any(|v| v == item || v == "*")
}

/// Whether the grant allows `a` (RBAC's rule matching: group, resource with
/// subresource, verb, resourceNames; a Role only in its namespace).
fn allows(g: &Grant, a: &Attributes) -> bool {
    if let Some(ns) = &g.namespace
        && a.namespace.as_deref() != Some(ns.as_str())
    {
        return false;
    }
    let names = g.rule["resourceNames"].as_array();
    has(&g.rule["apiGroups"], &a.group)
        && has(&g.rule["resources"], &a.resource)
        && has(&g.rule["verbs"], &a.verb)
        && names.is_none_or(|n| {
            n.is_empty() || a.name.as_ref().is_some_and(|x| n.iter().any(|v| v == x))
        })
}

/// A GPU pod a ReplicaSet runs on `node`.
fn gpu_pod(node: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "labels": {"app": "train"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "train", "uid": "u-1", "controller": true}],
        },
        "spec": {
            "nodeName": node,
            "containers": [{"name": "main", "image": "cuda:12", "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
        },
        "status": {"phase": "Running"},
    })
}

/// A report of one GPU that DRA hands out (registered or not), unhealthy
/// by `xid` when given.
fn dra_report(registered: bool, xid: Option<u64>) -> gpu_agent_proto::report::v1::NodeReport {
    use gpu_agent_proto::report::v1 as pb;
    pb::NodeReport {
        inventory: Some(pb::Inventory {
            driver_version: "580.95.05".into(),
            gpus: vec![pb::Gpu {
                uuid: "GPU-dra-0".into(),
                minor: Some(0),
                model: "NVIDIA H100 80GB HBM3".into(),
                memory_mib: 81559,
                ..Default::default()
            }],
            ..Default::default()
        }),
        health: Some(pb::Health {
            gpus: vec![pb::GpuHealth {
                uuid: "GPU-dra-0".into(),
                healthy: xid.is_none(),
                xid,
                ..Default::default()
            }],
        }),
        dra: Some(pb::DraState {
            registered,
            gpu_uuids: vec!["GPU-dra-0".into()],
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The chart's and the kustomize base's rules for `resource.k8s.io` are
/// the model's (`model::dra::rbac_rules`), verb for verb.
#[test]
fn the_dra_rbac_is_the_models() {
    let want: BTreeSet<(String, BTreeSet<String>)> = gpu_controller::model::dra::rbac_rules()
        .into_iter()
        .map(|r| {
            (
                r.resources.unwrap().join(","),
                r.verbs.into_iter().collect(),
            )
        })
        .collect();
    for (what, objs) in [
        ("the chart", render_with(&operator_values())),
        ("the kustomize base", kustomize("packaging/kustomize/base")),
    ] {
        let role = find(&objs, "ClusterRole", "gpu-controller");
        let have: BTreeSet<(String, BTreeSet<String>)> = role["rules"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["apiGroups"] == json!(["resource.k8s.io"]))
            .map(|r| {
                let strings = |v: &Value| -> Vec<String> {
                    v.as_array()
                        .unwrap()
                        .iter()
                        .map(|x| x.as_str().unwrap().to_string())
                        .collect()
                };
                (
                    strings(&r["resources"]).join(","),
                    strings(&r["verbs"]).into_iter().collect(),
                )
            })
            .collect();
        assert_eq!(have, want, "{what}'s resource.k8s.io rules");
    }
}

#[test]
fn the_controller_rbac_allows_what_it_does_and_no_more() {
    let objs = render_with(&operator_values());
    let dep = find(&objs, "Deployment", "gpu-controller");
    let account = pod_spec(dep)["serviceAccountName"].as_str().unwrap();
    let granted = grants(&objs, NS, account);
    for g in &granted {
        for key in ["apiGroups", "resources", "verbs", "resourceNames"] {
            assert!(
                !g.rule[key]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|v| v == "*"),
                "{}: no wildcards ({})",
                g.role,
                g.rule
            );
        }
    }
    // The Lease the roles name is the one the controller takes.
    let lease = gpu_controller::lease::Election::new(NS, "x").name;
    assert!(
        granted
            .iter()
            .any(|g| g.rule["resourceNames"] == json!([lease]))
    );

    // The scene: a node with a MIG layout label, a GPU pod on it, the
    // chart's ClusterPolicy with a driver rollout, and an agent (Python
    // grpcio, not ours) that upgrades on the controller's go-ahead. The
    // controller runs with the rendered arguments, as the pod it would be.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let api = rt.block_on(MockApi::start());
    let mut node = kubelet_node();
    node["metadata"]["labels"]["nvidia.com/mig.config"] = json!("all-balanced");
    api.add_node("py-node", node);
    let agent_account = flag(
        &args(container(dep, "gpu-controller")),
        "--agent-service-account",
    )
    .unwrap();
    api.add_token(
        "py-token",
        &format!("system:serviceaccount:{agent_account}"),
        "py-node",
    );
    api.add_pod("ml", "train-py", gpu_pod("py-node"));
    // A node whose agent serves DRA (issue 31), and the MIG DeviceClass as
    // someone changed it: the controller puts it back.
    api.add_node("dra-node", kubelet_node());
    api.add_token(
        "dra-token",
        &format!("system:serviceaccount:{agent_account}"),
        "dra-node",
    );
    let mut mig_class =
        serde_json::to_value(&gpu_controller::model::dra::device_classes()[1]).unwrap();
    mig_class["spec"]["selectors"] = json!([{"cel": {"expression": "true"}}]);
    api.add_device_class(mig_class);
    let cp = find(&objs, "ClusterPolicy", "cluster-policy");
    let target = cp["spec"]["driver"]["version"].as_str().unwrap();
    // The device-plugin config in the operator's shape (a ConfigMap named,
    // no file mounted): the controller reads it (config_maps.rs).
    let mut spec = cp["spec"].clone();
    spec["devicePlugin"]["config"] = json!({"name": "time-slicing-config", "default": "any"});
    api.set_config_map(
        NS,
        "time-slicing-config",
        json!({"any": "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 4}\n"}),
    );
    api.set_cluster_policy("cluster-policy", spec);
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = common::certs(dir.path());
    let (mut controller, port) = controller_as_rendered(
        dep,
        &api,
        dir.path(),
        (&cert, &key),
        &[
            ("POD_NAMESPACE", NS),
            ("POD_NAME", "gpu-controller-7d9f-abcde"),
        ],
    );
    let out = common::report_client(
        port,
        &ca,
        "py-node",
        &["--token", "py-token", "--upgrade", target, "--hold", "6"],
    );
    assert!(
        out.status.success(),
        "grpcio agent: {}\n{}\ncontroller:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        controller.log()
    );
    let seen = |method: &str, prefix: &str| {
        api.requests()
            .iter()
            .any(|r| r.method == method && r.uri.starts_with(prefix))
    };
    wait_for(
        "the rollout's end, an event, the Lease renewed and the ClusterPolicy's status",
        Duration::from_secs(30),
        &[&controller],
        || {
            api.node("py-node")["metadata"]["labels"]["nvidia.com/gpu-driver-upgrade-state"]
                == "upgrade-done"
                && seen("POST", "/api/v1/namespaces/default/events")
                && seen(
                    "PUT",
                    &format!("/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/"),
                )
                && seen(
                    "PATCH",
                    "/apis/nvidia.com/v1/clusterpolicies/cluster-policy/status",
                )
                && api.requests().iter().any(|r| {
                    r.uri
                        .starts_with(&format!("/api/v1/namespaces/{NS}/configmaps?"))
                        && r.uri.contains("watch=true")
                })
        },
    );
    // DRA: the node's ResourceSlices made while its agent's plugin is
    // registered, updated when a GPU turns unhealthy, deleted when the
    // plugin is no longer registered (each a new stream of a stand-in
    // agent, whose snapshot replaces the report).
    let dra_slices = || {
        api.resource_slices()
            .into_iter()
            .filter(|s| s["spec"]["nodeName"] == "dra-node")
            .collect::<Vec<_>>()
    };
    for (registered, xid, what) in [
        (true, None, "the DRA node's ResourceSlices made"),
        (true, Some(48), "its ResourceSlices updated"),
        (false, None, "its ResourceSlices deleted"),
    ] {
        let agent = rt
            .block_on(common::fake_agent(
                port,
                &ca,
                "dra-token",
                "dra-node",
                dra_report(registered, xid),
                vec![],
            ))
            .unwrap();
        wait_for(what, Duration::from_secs(30), &[&controller], || {
            let s = dra_slices();
            match (registered, xid) {
                (true, None) => s.len() == 1,
                (true, Some(_)) => s.len() == 1 && s[0]["spec"]["pool"]["generation"] == 2,
                _ => s.is_empty(),
            }
        });
        drop(agent);
    }
    wait_for(
        "the MIG DeviceClass put back",
        Duration::from_secs(30),
        &[&controller],
        || {
            api.device_classes().iter().any(|c| {
                c["metadata"]["name"] == "mig.nvidia.com"
                    && c["spec"]["selectors"][0]["cel"]["expression"] != "true"
            })
        },
    );
    controller.term();
    assert!(api.pods().is_empty(), "the GPU pod was evicted");

    // Every request the controller made is allowed by the rendered roles...
    let mut used: BTreeSet<(usize, String, String)> = BTreeSet::new();
    let mut seen_attrs = BTreeSet::new();
    for r in api.requests() {
        let a = attributes(&r.method, &r.uri);
        let by: Vec<usize> = (0..granted.len())
            .filter(|i| allows(&granted[*i], &a))
            .collect();
        assert!(
            !by.is_empty(),
            "{} {} ({a:?}) is not allowed by the chart's RBAC for {NS}/{account}",
            r.method,
            r.uri
        );
        for i in by {
            used.insert((i, a.resource.clone(), a.verb.clone()));
        }
        seen_attrs.insert((a.verb, a.group, a.resource, a.namespace));
    }
    // ...and every verb on every resource they grant was used.
    let mut unused = Vec::new();
    for (i, g) in granted.iter().enumerate() {
        for res in g.rule["resources"].as_array().unwrap() {
            for verb in g.rule["verbs"].as_array().unwrap() {
                let key = (
                    i,
                    res.as_str().unwrap().to_string(),
                    verb.as_str().unwrap().to_string(),
                );
                if !used.contains(&key) {
                    unused.push(format!("{}: {verb} {res} ({})", g.role, g.rule));
                }
            }
        }
    }
    assert!(
        unused.is_empty(),
        "granted but never used by the controller:\n{}\nrequests made: {seen_attrs:#?}",
        unused.join("\n")
    );
}

#[test]
fn the_kustomize_tls_recipe_makes_a_certificate_the_controller_serves() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("tls");
    let run = Command::new(repo().join("packaging/kustomize/controller-tls.sh"))
        .arg(NS)
        .arg(&out)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&run.stdout).into_owned();
    assert!(
        run.status.success(),
        "controller-tls.sh: {said}{}",
        String::from_utf8_lossy(&run.stderr)
    );
    // The Secret, made by the command it prints (kubectl, client side only).
    let create = said
        .lines()
        .skip_while(|l| !l.contains("create secret generic"))
        .collect::<Vec<_>>()
        .join(" ")
        .replace('\\', " ");
    let words: Vec<&str> = create.split_whitespace().skip(1).collect();
    let made = Command::new(kubectl())
        .args(&words)
        .args(["--dry-run=client", "-o", "yaml"])
        .output()
        .unwrap();
    assert!(
        made.status.success(),
        "kubectl {words:?}: {}",
        String::from_utf8_lossy(&made.stderr)
    );
    let secret = documents(&String::from_utf8_lossy(&made.stdout), "the Secret").remove(0);
    check_objects(std::slice::from_ref(&secret), "the kustomize TLS Secret");
    let base = kustomize("packaging/kustomize/base");
    let dep = find(&base, "Deployment", "gpu-controller");
    assert_eq!(
        volume(dep, "tls")["secret"]["secretName"],
        secret["metadata"]["name"]
    );
    assert_eq!(secret["metadata"]["namespace"], NS);
    assert_eq!(secret["type"], "kubernetes.io/tls");
    for key in ["tls.crt", "tls.key", "ca.crt"] {
        assert!(secret["data"][key].is_string(), "{key} in the Secret");
    }
    // Served by the real controller, trusted under the name agents dial.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let api = rt.block_on(MockApi::start());
    let (mut controller, port) = controller_as_rendered(
        dep,
        &api,
        dir.path(),
        (&out.join("tls.crt"), &out.join("tls.key")),
        &[],
    );
    let ca = base64_decode(secret["data"]["ca.crt"].as_str().unwrap());
    let url = flag(
        &args(container(daemonset(&base), "gpu-agent")),
        "--controller",
    )
    .unwrap();
    let host = url
        .trim_start_matches("https://")
        .split(':')
        .next()
        .unwrap()
        .to_string();
    let got = rt.block_on(dial(port, &ca, &host, "not-a-known-token"));
    assert!(
        got.as_ref()
            .is_err_and(|e| e.starts_with("Unauthenticated")),
        "{got:?}\n{}",
        controller.log()
    );
    controller.term();
}

/// The DaemonSet's readiness probe is a command gpu-agent takes: on a host
/// where no agent has run it says not ready (exit 1, with the reason), never
/// a usage error (exit 2), which would keep every agent unready for good.
#[test]
fn the_readiness_probe_is_a_command_gpu_agent_takes() {
    let objs = render(&[]);
    let c = container(daemonset(&objs), "gpu-agent");
    let argv: Vec<String> = c["readinessProbe"]["exec"]["command"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        argv[0], c["command"][0],
        "the probe runs the container's gpu-agent"
    );
    let host = tempfile::tempdir().unwrap();
    let container = tempfile::tempdir().unwrap();
    let probe_args = &argv[1..];
    let out = Command::new(common::agent_bin())
        .args(probe_args)
        .env_clear()
        .envs(env_in(c, host.path(), container.path()))
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        out.status.code(),
        Some(1),
        "gpu-agent {probe_args:?}:\n{said}"
    );
    assert!(
        !said.trim().is_empty(),
        "the probe says why it is not ready"
    );
}

/// `kubectl exec ds/gpu-agent -- gpu-agent status` runs with the
/// container's environment and none of `run`'s arguments: it must look at
/// the host the running agent manages (the host root is in the
/// environment) and find that agent, exit 0. Here the container's
/// command and arguments run the agent over a temp host root (its paths
/// moved there, the GPUs simulated), and a bare `gpu-agent status` with
/// the same environment answers from it.
#[test]
fn kubectl_exec_status_sees_the_running_agent() {
    let objs = render(&["--set", "controller.enabled=false"]);
    let c = container(daemonset(&objs), "gpu-agent");
    assert_eq!(
        env_values(c).get("GPU_AGENT_HOST_ROOT").map(String::as_str),
        mount(c, "host-root")["mountPath"].as_str(),
        "the container's environment names where the host's / is mounted"
    );
    let host = tempfile::tempdir().unwrap();
    let container_root = tempfile::tempdir().unwrap();
    let env = env_in(c, host.path(), container_root.path());
    // The agent's policy where the container has it; a sandbox has no
    // container runtime to configure or service manager to reload.
    let policy = Path::new(&env["GPU_AGENT_POLICY"]);
    std::fs::create_dir_all(policy.parent().unwrap()).unwrap();
    std::fs::write(policy, "spec:\n  toolkit:\n    enabled: false\n").unwrap();
    std::fs::create_dir_all(host.path().join("var/lib")).unwrap();
    let path = std::env::var("PATH").unwrap_or_default();
    let log = container_root.path().join("agent.log");
    let mut agent = Proc {
        child: Command::new(common::agent_bin())
            .args(args(c))
            .env_clear()
            .envs(&env)
            .env("PATH", &path)
            .env("GPU_AGENT_SIMULATE", "a10g-1")
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
        log,
    };
    let status = || {
        Command::new(common::agent_bin())
            .arg("status")
            .env_clear()
            .envs(&env)
            .env("PATH", &path)
            .env("GPU_AGENT_SIMULATE", "a10g-1")
            .output()
            .unwrap()
    };
    let mut last = String::new();
    wait_for(
        "`gpu-agent status` (the container's environment only) to answer from the running agent",
        Duration::from_secs(30),
        &[&agent],
        || {
            let out = status();
            last = format!(
                "exit {:?}\n{}{}",
                out.status.code(),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            out.status.code() == Some(0)
                && String::from_utf8_lossy(&out.stdout).contains("from the running agent")
        },
    );
    assert!(last.contains("from the running agent"), "{last}");
    agent.term();
    // With the agent stopped, the same command says so and exits 3.
    let out = status();
    assert_eq!(
        out.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("stopped"));
}

// ---------------------------------------------------------------------------
// helm uninstall: the pre-delete hook leaves every node as it was
// ---------------------------------------------------------------------------

/// The hook objects of a render (those with a `helm.sh/hook` annotation).
fn hooks(objs: &[Value]) -> Vec<&Value> {
    objs.iter()
        .filter(|o| o["metadata"]["annotations"]["helm.sh/hook"].is_string())
        .collect()
}

/// Every entry under `root`: kind, mode, and bytes (sha256) or link target.
fn host_tree(root: &Path) -> BTreeMap<String, String> {
    use sha2::Digest;
    use std::os::unix::fs::PermissionsExt;
    let mut out = BTreeMap::new();
    let mut todo = vec![root.to_path_buf()];
    while let Some(dir) = todo.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            let m = std::fs::symlink_metadata(&p).unwrap();
            let rel = p.strip_prefix(root).unwrap().display().to_string();
            let mode = m.permissions().mode() & 0o7777;
            let what = if m.file_type().is_symlink() {
                format!("link {}", std::fs::read_link(&p).unwrap().display())
            } else if m.is_dir() {
                todo.push(p.clone());
                format!("dir {mode:o}")
            } else if m.is_file() {
                let sha = sha2::Sha256::digest(std::fs::read(&p).unwrap());
                let hex: String = sha.iter().map(|b| format!("{b:02x}")).collect();
                format!("file {mode:o} {hex}")
            } else {
                format!("other {mode:o}")
            };
            out.insert(rel, what);
        }
    }
    out
}

/// The one stage entry of a `status -o json`.
fn stage_ok(st: &Value, name: &str) -> bool {
    st["stages"].as_array().is_some_and(|a| {
        a.iter()
            .any(|s| s["stage"] == name && s["validation"]["ok"] == true)
    })
}

/// One node of the scene: a host root on which the real agent runs.
struct FakeNode {
    name: String,
    host: tempfile::TempDir,
    before: BTreeMap<String, String>,
    agent: Option<Proc>,
}

/// A node like the agent's: the real agent over `host`, with the GPUs
/// simulated and the container runtime left alone (no runtime in a sandbox).
fn agent_env(cmd: &mut Command, host: &Path, policy: &Path) {
    cmd.env("GPU_AGENT_HOST_ROOT", host)
        .env("GPU_AGENT_POLICY", policy)
        .env("GPU_AGENT_SIMULATE", "a10g-1")
        .env("DCGM_EXPORTER_LISTEN", "127.0.0.1:0");
}

/// `helm uninstall`'s pre-delete hook, end to end: the chart's hook Pod
/// (gpu-controller uninstall-agents with its rendered arguments and pod
/// template) against a scripted API server in which a stand-in kubelet and
/// DaemonSet controller act: deleting the DaemonSet stops the real agents
/// (SIGTERM) and removes their pods; an uninstall pod whose gate is lifted
/// runs its rendered command, the real `gpu-agent uninstall`, over its
/// node's host root. Every node is left as it was before the agent ran,
/// to the byte; a node whose uninstall fails fails the hook, naming it and
/// its pod's log, and a second run finishes it. Every request the hook
/// makes is allowed by the hook's Role, and every verb the Role grants is
/// used.
#[test]
fn helm_uninstall_leaves_every_node_as_it_was() {
    let objs = render(&[]);
    let hook = hooks(&objs);
    let kinds_of: BTreeSet<String> = hook
        .iter()
        .map(|o| o["kind"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        kinds_of,
        ["ConfigMap", "Pod", "Role", "RoleBinding", "ServiceAccount"]
            .map(String::from)
            .into()
    );
    let weight = |o: &Value| -> i64 {
        o["metadata"]["annotations"]["helm.sh/hook-weight"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap()
    };
    let job = find(&objs, "Pod", "gpu-agent-uninstall");
    for o in &hook {
        assert_eq!(o["metadata"]["annotations"]["helm.sh/hook"], "pre-delete");
        assert_eq!(
            o["metadata"]["annotations"]["helm.sh/hook-delete-policy"],
            "before-hook-creation,hook-succeeded"
        );
        if o["kind"] != "Pod" {
            assert!(
                weight(o) < weight(job),
                "{} before the hook's Pod",
                o["kind"]
            );
        }
    }
    // The pod template is a Pod an API server takes.
    let template: Value = serde_json::from_str(
        find(&objs, "ConfigMap", "gpu-agent-uninstall")["data"]["pod.json"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert!(check_objects(std::slice::from_ref(&template), "the uninstall pod").is_empty());
    // It is not one of the agents' (the DaemonSet would adopt it).
    let ds = daemonset(&objs);
    for (k, v) in ds["spec"]["selector"]["matchLabels"].as_object().unwrap() {
        assert!(template["metadata"]["labels"][k] != *v, "label {k}");
    }
    let uc = &template["spec"]["containers"][0];
    assert_eq!(uc["command"], json!(["/usr/bin/gpu-agent", "uninstall"]));
    assert_eq!(uc["image"], container(ds, "gpu-agent")["image"]);
    // The same host paths as the agent, where the agent has them.
    for vol in [
        "host-root",
        "kubelet-device-plugins",
        "kubelet-pod-resources",
    ] {
        let tv = template["spec"]["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == vol)
            .unwrap();
        assert_eq!(tv["hostPath"], volume(ds, vol)["hostPath"], "{vol}");
        assert_eq!(
            mount(uc, vol)["mountPath"],
            mount(container(ds, "gpu-agent"), vol)["mountPath"]
        );
    }
    assert_eq!(env_values(uc)["GPU_AGENT_HOST_ROOT"], "/host");

    // The scene: three nodes with a running agent each.
    let work = tempfile::tempdir().unwrap();
    let policy = work.path().join("policy.yaml");
    std::fs::write(&policy, "spec:\n  toolkit:\n    enabled: false\n").unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let api = rt.block_on(MockApi::start());
    api.add_daemonset(NS, "gpu-agent");
    let agent_labels = ds["spec"]["template"]["metadata"]["labels"].clone();
    let mut nodes = Vec::new();
    for name in ["gpu-a", "gpu-b", "gpu-c"] {
        // What every Linux host has (/run is not the agent's to remove).
        let host = tempfile::tempdir().unwrap();
        for d in ["etc", "run", "var/lib"] {
            std::fs::create_dir_all(host.path().join(d)).unwrap();
        }
        let before = host_tree(host.path());
        let log = work.path().join(format!("{name}.log"));
        let mut cmd = Command::new(common::agent_bin());
        cmd.arg("run")
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        agent_env(&mut cmd, host.path(), &policy);
        let agent = Proc {
            child: cmd.spawn().unwrap(),
            log,
        };
        api.add_pod(
            NS,
            &format!("gpu-agent-{name}"),
            json!({"metadata": {"labels": agent_labels.clone()},
                   "spec": {"nodeName": name, "containers": [{"name": "gpu-agent", "image": "x"}]},
                   "status": {"phase": "Running"}}),
        );
        nodes.push(FakeNode {
            name: name.into(),
            host,
            before,
            agent: Some(agent),
        });
    }
    // Someone else's pod in the namespace, which the hook leaves alone.
    api.add_pod(
        NS,
        "gpu-controller-0",
        json!({"metadata": {"labels": {"app.kubernetes.io/name": "gpu-controller"}},
               "spec": {"nodeName": "cpu-1"}, "status": {"phase": "Running"}}),
    );
    for n in &nodes {
        let agent = n.agent.as_ref().unwrap();
        wait_for(
            &format!("the agent on {} to validate", n.name),
            Duration::from_secs(30),
            &[agent],
            || {
                let mut cmd = Command::new(common::agent_bin());
                cmd.args(["status", "-o", "json"]);
                agent_env(&mut cmd, n.host.path(), &policy);
                let out = cmd.output().unwrap();
                serde_json::from_slice::<Value>(&out.stdout).is_ok_and(|st| {
                    st["source"] == "running-agent"
                        && stage_ok(&st, "cdi")
                        && stage_ok(&st, "labels")
                })
            },
        );
        // What the issue found left behind, there now.
        for p in [
            "etc/kubernetes/node-feature-discovery/features.d/gfd",
            "var/run/cdi/gpu-agent-nvidia.com-gpu.json",
            "var/lib/gpu-agent",
            "run/gpu-agent/state.json",
            "run/nvidia/validations/driver-ready",
        ] {
            assert!(n.host.path().join(p).exists(), "{}: {p}", n.name);
        }
    }

    // The stand-in kubelet and DaemonSet controller.
    let nodes = std::sync::Arc::new(std::sync::Mutex::new(nodes));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let violations = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    // gpu-b's first uninstall pod fails (as one whose host refused it).
    let fail_once =
        std::sync::Arc::new(std::sync::Mutex::new(BTreeSet::from(["gpu-b".to_string()])));
    let kubelet = {
        let (api, nodes, stop, violations, fail_once, policy) = (
            api.clone(),
            nodes.clone(),
            stop.clone(),
            violations.clone(),
            fail_once.clone(),
            policy.clone(),
        );
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let gone = api.daemonsets().is_empty();
                let pods = api.pod_objects();
                let agents_left = pods
                    .iter()
                    .filter(|p| p["metadata"]["labels"]["app.kubernetes.io/component"] == "agent")
                    .count();
                for p in &pods {
                    let labels = &p["metadata"]["labels"];
                    let pod = p["metadata"]["name"].as_str().unwrap().to_string();
                    if labels["app.kubernetes.io/component"] == "agent" && gone {
                        // The DaemonSet's garbage: SIGTERM, then gone.
                        let node = p["spec"]["nodeName"].as_str().unwrap();
                        let mut ns = nodes.lock().unwrap();
                        let n = ns.iter_mut().find(|n| n.name == node).unwrap();
                        if let Some(mut a) = n.agent.take() {
                            a.term();
                        }
                        api.remove_pod(NS, &pod);
                    }
                    if labels["app.kubernetes.io/component"] != "node-uninstall"
                        || p["status"]["phase"] != "Pending"
                        || p["spec"]["schedulingGates"].is_array()
                    {
                        continue;
                    }
                    // The scheduler: the node its affinity names.
                    let node = p["spec"]["affinity"]["nodeAffinity"]
                        ["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
                        [0]["matchFields"][0]["values"][0]
                        .as_str()
                        .unwrap()
                        .to_string();
                    if agents_left > 0 {
                        violations.lock().unwrap().push(format!(
                            "{pod} let run on {node} while {agents_left} agent pod(s) were left"
                        ));
                    }
                    if fail_once.lock().unwrap().remove(&node) {
                        api.set_pod_phase(NS, &pod, "Failed");
                        continue;
                    }
                    // The kubelet runs the container as rendered.
                    let c = &p["spec"]["containers"][0];
                    let argv: Vec<String> = c["command"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .chain(c["args"].as_array().into_iter().flatten())
                        .map(|a| a.as_str().unwrap().to_string())
                        .collect();
                    assert_eq!(argv[0], "/usr/bin/gpu-agent");
                    let host = {
                        let ns = nodes.lock().unwrap();
                        ns.iter()
                            .find(|n| n.name == node)
                            .unwrap()
                            .host
                            .path()
                            .to_path_buf()
                    };
                    let ctr = tempfile::tempdir().unwrap();
                    let out = Command::new(common::agent_bin())
                        .args(&argv[1..])
                        .env_clear()
                        .envs(env_in(c, &host, ctr.path()))
                        .env("GPU_AGENT_SIMULATE", "a10g-1")
                        .env("GPU_AGENT_POLICY", &policy)
                        .output()
                        .unwrap();
                    if !out.status.success() {
                        violations.lock().unwrap().push(format!(
                            "{pod} on {node}: {}{}",
                            String::from_utf8_lossy(&out.stdout),
                            String::from_utf8_lossy(&out.stderr)
                        ));
                    }
                    api.set_pod_phase(
                        NS,
                        &pod,
                        if out.status.success() {
                            "Succeeded"
                        } else {
                            "Failed"
                        },
                    );
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };

    // The hook's container, as rendered, with its pod template where the
    // ConfigMap is mounted.
    let jc = &job["spec"]["containers"][0];
    assert_eq!(jc["name"], "uninstall-agents");
    let mounted = mount(jc, "pod-template")["mountPath"].as_str().unwrap();
    let template_file = work.path().join("pod.json");
    std::fs::write(
        &template_file,
        find(&objs, "ConfigMap", "gpu-agent-uninstall")["data"]["pod.json"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    let job_args: Vec<String> = args(jc)
        .into_iter()
        .map(|a| {
            a.replace(
                &format!("{mounted}/pod.json"),
                template_file.to_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        jc["command"],
        json!(["/usr/bin/gpu-controller", "uninstall-agents"])
    );
    let kubeconfig = api.kubeconfig(work.path());
    let hook_run = || {
        Command::new(env!("CARGO_BIN_EXE_gpu-controller"))
            .arg("uninstall-agents")
            .args(&job_args)
            .env("KUBECONFIG", &kubeconfig)
            .output()
            .unwrap()
    };
    let said = |o: &std::process::Output| {
        format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    };

    // First run: gpu-b's uninstall fails; the hook fails naming it.
    let first = hook_run();
    assert_eq!(first.status.code(), Some(1), "{}", said(&first));
    let err = String::from_utf8_lossy(&first.stderr);
    assert!(
        err.contains(
            "not uninstalled on gpu-b (kubectl -n gpu-agent logs gpu-agent-uninstall-node-"
        ),
        "{}",
        said(&first)
    );
    assert!(
        !err.contains("gpu-a (") && !err.contains("gpu-c ("),
        "{err}"
    );
    assert!(api.daemonsets().is_empty(), "the DaemonSet is deleted");
    // Second run (`helm uninstall` again): goes on from there.
    let second = hook_run();
    assert_eq!(second.status.code(), Some(0), "{}", said(&second));
    let out = String::from_utf8_lossy(&second.stdout);
    assert!(
        out.contains("gpu-b: an earlier uninstall failed; trying again"),
        "{out}"
    );
    for n in ["gpu-a", "gpu-b", "gpu-c"] {
        assert!(out.contains(&format!("{n}: uninstalled")), "{out}");
    }
    assert!(
        out.contains("gpu-agent uninstalled from 3 node(s)"),
        "{out}"
    );
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    kubelet.join().unwrap();
    let v = violations.lock().unwrap();
    assert!(v.is_empty(), "{v:#?}");
    // Only the other pod is left; every node is as it was.
    assert_eq!(api.pods(), vec![format!("{NS}/gpu-controller-0")]);
    for n in nodes.lock().unwrap().iter() {
        let after = host_tree(n.host.path());
        let diff: Vec<String> = n
            .before
            .iter()
            .filter(|(k, v)| after.get(*k) != Some(*v))
            .map(|(k, v)| format!("changed or gone: {k} ({v})"))
            .chain(
                after
                    .iter()
                    .filter(|(k, _)| !n.before.contains_key(*k))
                    .map(|(k, v)| format!("left: {k} ({v})")),
            )
            .collect();
        assert!(diff.is_empty(), "{}:\n{}", n.name, diff.join("\n"));
    }

    // Every request the hook made is allowed by its Role, and every verb
    // the Role grants was used.
    let account = job["spec"]["serviceAccountName"].as_str().unwrap();
    let granted = grants(&objs, NS, account);
    assert!(!granted.is_empty());
    let mut used = BTreeSet::new();
    for r in api.requests() {
        let a = attributes(&r.method, &r.uri);
        let by: Vec<usize> = (0..granted.len())
            .filter(|i| allows(&granted[*i], &a))
            .collect();
        assert!(
            !by.is_empty(),
            "{} {} ({a:?}) is not allowed by the hook's Role",
            r.method,
            r.uri
        );
        for i in by {
            used.insert((i, a.resource.clone(), a.verb.clone()));
        }
    }
    for (i, g) in granted.iter().enumerate() {
        for res in g.rule["resources"].as_array().unwrap() {
            for verb in g.rule["verbs"].as_array().unwrap() {
                assert!(
                    used.contains(&(
                        i,
                        res.as_str().unwrap().to_string(),
                        verb.as_str().unwrap().to_string()
                    )),
                    "{}: {verb} {res} granted but never used",
                    g.role
                );
            }
        }
    }
}

/// `uninstall.enabled: false`: no hook; the agents go with the rest and
/// what they did stays on the nodes.
#[test]
fn the_uninstall_hook_can_be_turned_off() {
    let objs = render(&["--set", "uninstall.enabled=false"]);
    assert!(hooks(&objs).is_empty());
    let e = helm_template(&["--set", "uninstall.timeoutSeconds=1"]).unwrap_err();
    assert!(e.contains("timeoutSeconds"), "{e}");
}
