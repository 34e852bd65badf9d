//! The MIG label protocol end to end, with real processes: a user sets
//! `nvidia.com/mig.config=all-balanced` on a node; gpu-controller, which
//! watches that label, tells the node's gpu-agent; the agent (on the 8x
//! H100 fixture with the fake libnvidia-ml, so through the real NVML path)
//! applies the layout; its report makes `nvidia.com/mig.config.state`
//! `success` and the MIG resources' labels appear. The label removed: the
//! state label goes, the layout made stays (none selected: MIG is left as
//! it is).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{MockApi, Proc, kubelet_node, start_controller, wait_for};

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

fn label(api: &MockApi, key: &str) -> Option<String> {
    api.node("gpu-node-1")["metadata"]["labels"][key]
        .as_str()
        .map(String::from)
}

#[test]
fn a_node_label_selects_the_layout_and_its_state_comes_back_as_a_label() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let api = rt.block_on(MockApi::start());
    api.add_node("gpu-node-1", kubelet_node());
    api.add_token(
        "t1",
        "system:serviceaccount:gpu-agent:gpu-agent",
        "gpu-node-1",
    );
    let dir = tempfile::tempdir().unwrap();
    let (mut controller, port, ca) = start_controller(&api, dir.path(), None);

    let host = dir.path().join("host");
    common::h100_host(&host);
    let policy = dir.path().join("policy.yaml");
    std::fs::write(
        &policy,
        "spec:\n  driver:\n    enabled: false\n  toolkit:\n    enabled: false\n  mig:\n    strategy: mixed\n  migManager:\n    gpuClientsTimeoutSeconds: 5\n",
    )
    .unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "t1").unwrap();
    let conditions = dir.path().join("conditions");
    std::fs::write(&conditions, "").unwrap();
    let log = dir.path().join("agent.log");
    let mut agent = Proc {
        child: Command::new(
            Path::new(env!("CARGO_BIN_EXE_gpu-controller")).with_file_name("gpu-agent"),
        )
        .arg("--host-root")
        .arg(&host)
        .arg("--policy")
        .arg(&policy)
        .arg("--nvml-lib")
        .arg(fake_nvml(dir.path()))
        .args(["--log-format", "text", "run", "--controller"])
        .arg(format!("https://localhost:{port}"))
        .arg("--controller-ca")
        .arg(&ca)
        .arg("--token-file")
        .arg(&token)
        .args(["--node-name", "gpu-node-1"])
        .env("FAKE_NVML_NODE", "h100-sxm-8")
        .env("FAKE_NVML_MIG", dir.path().join("mig.json"))
        .env("FAKE_NVML_SYSFS", host.join("sys"))
        .env("FAKE_NVML_STATE", &conditions)
        .env("DCGM_EXPORTER_LISTEN", "127.0.0.1:0")
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap(),
        log,
    };
    wait_for(
        "the node's labels",
        Duration::from_secs(60),
        &[&controller, &agent],
        || label(&api, "nvidia.com/gpu.count").as_deref() == Some("8"),
    );
    assert_eq!(
        label(&api, "nvidia.com/mig.config.state"),
        None,
        "no layout selected yet"
    );

    // A user selects a layout.
    api.set_node_label("gpu-node-1", "nvidia.com/mig.config", Some("all-balanced"));
    wait_for(
        "mig.config.state=success",
        Duration::from_secs(60),
        &[&controller, &agent],
        || label(&api, "nvidia.com/mig.config.state").as_deref() == Some("success"),
    );
    wait_for(
        "the MIG resources' labels",
        Duration::from_secs(30),
        &[&controller, &agent],
        || {
            label(&api, "nvidia.com/mig-1g.10gb.count").as_deref() == Some("16")
                && label(&api, "nvidia.com/mig-3g.40gb.count").as_deref() == Some("8")
        },
    );
    let status =
        Command::new(Path::new(env!("CARGO_BIN_EXE_gpu-controller")).with_file_name("gpu-agent"))
            .arg("--host-root")
            .arg(&host)
            .arg("status")
            .output()
            .unwrap();
    let status = String::from_utf8_lossy(&status.stdout);
    assert!(
        status.contains(
            "controller asks: MIG layout all-balanced (applied as spec.migManager.default)"
        ),
        "{status}"
    );
    assert!(
        status.contains("mig: layout \"all-balanced\": success"),
        "{status}"
    );

    // The label removed: no layout is selected; the state label goes.
    api.set_node_label("gpu-node-1", "nvidia.com/mig.config", None);
    wait_for(
        "mig.config.state removed",
        Duration::from_secs(30),
        &[&controller, &agent],
        || label(&api, "nvidia.com/mig.config.state").is_none(),
    );
    assert_eq!(
        label(&api, "nvidia.com/mig-1g.10gb.count").as_deref(),
        Some("16"),
        "with no layout selected, MIG is left as it is"
    );
    agent.term();
    controller.term();
}
