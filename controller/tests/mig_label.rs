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
use std::time::Duration;

use common::{MockApi, kubelet_node, start_controller, wait_for};

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
    let conditions = dir.path().join("conditions");
    std::fs::write(&conditions, "").unwrap();
    let nvml = fake_nvml(dir.path());
    let (mig, sysfs) = (dir.path().join("mig.json"), host.join("sys"));
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
    let status = common::agent_status(&host);
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
