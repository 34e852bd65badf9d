//! CDI specs: valid against the CDI specification's JSON schema and name
//! rules, the names the device plugin hands out all resolve in them, the
//! driver's files found through the real NVML path (fake library), and
//! `cdi generate --write` restorable like every file gpu-agent writes.

mod common;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use common::*;
use gpu_agent::cdi::{self, Spec};
use gpu_agent::plugin::allocate::container_response;
use gpu_agent::plugin::resources;
use gpu_agent::policy::Policy;
use gpu_agent::source::NodeView;
use hostlib::HostRoot;
use serde_json::Value;

const NODES: &[&str] = &["h100-sxm-8", "a10g-1", "t4-4", "h100-mig-2"];

fn hook_opts() -> cdi::Options {
    cdi::Options {
        hook_path: gpu_agent::policy::INSTALLED_HOOK_PATH.into(),
    }
}

fn generated(node: &str) -> (NodeView, gpu_agent::Inventory, cdi::Generated) {
    let view = NodeView::simulated(node).unwrap();
    let inv = gpu_agent::inventory::discover(&view.sys, view.backend.as_ref());
    let g = cdi::generate(&inv, &view.sys, &hook_opts()).unwrap();
    (view, inv, g)
}

/// The CDI schema, with `defs.json` references pointed at its definitions
/// merged into the one document.
fn schema() -> jsonschema::Validator {
    fn rewrite(v: &mut Value) {
        match v {
            Value::Object(o) => {
                if let Some(Value::String(r)) = o.get_mut("$ref")
                    && let Some(def) = r.strip_prefix("defs.json#/definitions/")
                {
                    *r = format!("#/definitions/{def}");
                }
                o.values_mut().for_each(rewrite);
            }
            Value::Array(a) => a.iter_mut().for_each(rewrite),
            _ => {}
        }
    }
    let read = |f: &str| -> Value {
        serde_json::from_slice(&fs::read(fixture(&format!("cdi/schema/{f}"))).unwrap()).unwrap()
    };
    let mut s = read("schema.json");
    rewrite(&mut s);
    let defs = read("defs.json")["definitions"].clone();
    s.as_object_mut()
        .unwrap()
        .insert("definitions".into(), defs);
    jsonschema::draft7::new(&s).unwrap()
}

/// The specification's name rules (SPEC.md, "CDI JSON Specification"):
/// vendor `[a-zA-Z0-9][a-zA-Z0-9_.-]*[a-zA-Z0-9]` (dots allowed), class
/// `[a-zA-Z0-9][a-zA-Z0-9_-]*[a-zA-Z0-9]`, device names
/// `[a-zA-Z0-9][a-zA-Z0-9_.:-]*`, and names starting with a digit need
/// cdiVersion 0.5.0 or later.
fn check_names(spec: &Spec) {
    let ok_edge = |s: &str| {
        s.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
            && s.chars().last().is_some_and(|c| c.is_ascii_alphanumeric())
    };
    let (vendor, class) = spec.kind.split_once('/').expect("kind is vendor/class");
    assert!(
        ok_edge(vendor)
            && vendor
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c)),
        "vendor {vendor:?}"
    );
    assert!(
        ok_edge(class)
            && class
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "_-".contains(c)),
        "class {class:?}"
    );
    let mut seen = std::collections::BTreeSet::new();
    for d in &spec.devices {
        assert!(
            d.name.chars().next().unwrap().is_ascii_alphanumeric()
                && d.name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_.:-".contains(c)),
            "device name {:?}",
            d.name
        );
        assert!(seen.insert(&d.name), "device {} twice", d.name);
        let digit = d.name.starts_with(|c: char| c.is_ascii_digit());
        let v: Vec<u32> = spec
            .cdi_version
            .split('.')
            .map(|p| p.parse().unwrap())
            .collect();
        assert!(
            !digit || (v[0], v[1]) >= (0, 5),
            "{} needs cdiVersion >= 0.5.0",
            d.name
        );
    }
}

#[test]
fn every_simulated_node_gives_a_spec_valid_under_the_cdi_schema() {
    let validator = schema();
    for node in NODES {
        let (_view, inv, g) = generated(node);
        let doc: Value = serde_json::from_str(&g.to_json()).unwrap();
        let errors: Vec<String> = validator
            .iter_errors(&doc)
            .map(|e| format!("{} at {}", e, e.instance_path()))
            .collect();
        assert!(errors.is_empty(), "{node}: {errors:#?}");
        check_names(&g.spec);
        assert!(g.notes.is_empty(), "{node}: {:?}", g.notes);
        // Index, UUID per GPU and per MIG device, and all.
        let migs: usize = inv.gpus.iter().map(|g| g.mig_devices.len()).sum();
        assert_eq!(
            g.spec.devices.len(),
            2 * (inv.gpus.len() + migs) + 1,
            "{node}"
        );
    }
    // The schema does catch what it should: a device without edits.
    let mut bad: Value = serde_json::from_str(&generated("a10g-1").2.to_json()).unwrap();
    bad["devices"][0]
        .as_object_mut()
        .unwrap()
        .remove("containerEdits");
    assert!(!validator.is_valid(&bad));
}

#[test]
fn the_spec_has_the_drivers_files_once_each_at_the_hosts_paths() {
    let (_view, _inv, g) = generated("h100-sxm-8");
    let e = &g.spec.container_edits;
    let nodes: Vec<&str> = e.device_nodes.iter().map(|n| n.path.as_str()).collect();
    assert_eq!(
        nodes,
        [
            "/dev/nvidiactl",
            "/dev/nvidia-uvm",
            "/dev/nvidia-uvm-tools",
            "/dev/nvidia-modeset"
        ]
    );
    let mounts: Vec<&str> = e.mounts.iter().map(|m| m.host_path.as_str()).collect();
    // /lib is a link to usr/lib in the simulated host: each library once, by its real path.
    assert!(mounts.contains(&"/usr/lib/x86_64-linux-gnu/libcuda.so.550.127.08"));
    assert!(mounts.contains(&"/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.550.127.08"));
    assert!(mounts.contains(&"/usr/lib/x86_64-linux-gnu/vdpau/libvdpau_nvidia.so.550.127.08"));
    assert!(mounts.contains(&"/usr/lib/firmware/nvidia/550.127.08/gsp_ga10x.bin"));
    assert!(mounts.contains(&"/usr/bin/nvidia-smi"));
    assert!(mounts.contains(&"/run/nvidia-persistenced/socket"));
    assert!(!mounts.iter().any(|m| m.starts_with("/lib/")), "{mounts:?}");
    let unique: std::collections::BTreeSet<_> = mounts.iter().collect();
    assert_eq!(unique.len(), mounts.len(), "a file mounted twice");
    for m in &e.mounts {
        assert_eq!(m.host_path, m.container_path);
        assert_eq!(m.options, ["ro", "nosuid", "nodev", "rbind", "rprivate"]);
    }
    assert_eq!(e.env, ["NVIDIA_VISIBLE_DEVICES=void"]);
    let hooks: Vec<Vec<&str>> = e
        .hooks
        .iter()
        .map(|h| {
            assert_eq!(h.hook_name, "createContainer");
            assert_eq!(h.path, "/var/lib/gpu-agent/bin/gpu-agent");
            h.args.iter().map(String::as_str).collect()
        })
        .collect();
    assert_eq!(
        hooks,
        [
            vec![
                "gpu-agent",
                "cdi-hook",
                "create-symlinks",
                "--link",
                "libcuda.so.1::/usr/lib/x86_64-linux-gnu/libcuda.so"
            ],
            vec![
                "gpu-agent",
                "cdi-hook",
                "update-ldcache",
                "--folder",
                "/usr/lib/x86_64-linux-gnu",
                "--folder",
                "/usr/lib/x86_64-linux-gnu/vdpau"
            ]
        ]
    );
    let all = g.spec.devices.iter().find(|d| d.name == "all").unwrap();
    assert_eq!(all.container_edits.device_nodes.len(), 8);
}

#[test]
fn mig_devices_get_their_parent_and_capability_nodes() {
    let (_view, _inv, g) = generated("h100-mig-2");
    let nodes = |name: &str| -> Vec<String> {
        g.spec
            .devices
            .iter()
            .find(|d| d.name == name)
            .unwrap_or_else(|| panic!("no device {name}"))
            .container_edits
            .device_nodes
            .iter()
            .map(|n| n.path.clone())
            .collect()
    };
    // GPU 1 (minor 1), its third MIG device: GPU instance 2, compute
    // instance 0 → mig-minors gpu1/gi2/access and gpu1/gi2/ci0/access.
    let caps = hostlib_minors(&_view.sys);
    let want = vec![
        "/dev/nvidia1".to_string(),
        format!("/dev/nvidia-caps/nvidia-cap{}", caps["gpu1/gi2/access"]),
        format!("/dev/nvidia-caps/nvidia-cap{}", caps["gpu1/gi2/ci0/access"]),
    ];
    assert_eq!(nodes("1:2"), want);
    assert_eq!(nodes("MIG-0c1d2e3f-4a5b-5c6d-8e7f-90a1b2c3d406"), want);
    let all = nodes("all");
    assert!(want.iter().all(|n| all.contains(n)));
    // 2 GPUs + 2 capability nodes for each of the 11 MIG devices.
    assert_eq!(all.len(), 2 + 2 * 11);
}

fn hostlib_minors(sys: &HostRoot) -> std::collections::BTreeMap<String, u32> {
    hostlib::driver::read_mig_minors(sys).unwrap().unwrap()
}

/// Every CDI name the device plugin puts in an Allocate response, for every
/// resource, sharing mode, MIG strategy and ID strategy, is a device in the
/// spec.
#[test]
fn every_name_the_device_plugin_hands_out_is_in_the_spec() {
    let cdi_cri =
        |ids: &str| format!("    deviceListStrategy: cdi-cri\n    deviceIdStrategy: {ids}\n");
    let sliced = "    deviceListStrategy: cdi-annotations\n    config:\n      inline:\n        version: v1\n        sharing:\n          timeSlicing:\n            resources:\n              - name: nvidia.com/gpu\n                replicas: 4\n";
    let policies = [
        ("h100-sxm-8", cdi_cri("uuid")),
        ("h100-sxm-8", cdi_cri("index")),
        ("t4-4", sliced.to_string()),
        ("h100-mig-2", cdi_cri("index")),
        ("h100-mig-2", cdi_cri("uuid")),
    ];
    let mut checked = 0;
    for (node, plugin) in policies {
        for strategy in ["single", "mixed"] {
            if node != "h100-mig-2" && strategy == "mixed" {
                continue;
            }
            let yaml =
                format!("spec:\n  mig:\n    strategy: {strategy}\n  devicePlugin:\n{plugin}");
            let policy =
                Policy::from_yaml(&yaml, "test.yaml").unwrap_or_else(|e| panic!("{e}\n{yaml}"));
            let settings =
                gpu_agent::plugin::settings(&policy.device_plugin, policy.mig.strategy).unwrap();
            let (view, inv, g) = generated(node);
            let names: Vec<String> = g
                .spec
                .devices
                .iter()
                .map(|d| format!("{}={}", g.spec.kind, d.name))
                .collect();
            let rs = match resources::build(&inv, &settings) {
                Ok(rs) => rs,
                // single with mixed MIG profiles is refused by the plugin.
                Err(_) if strategy == "single" && node == "h100-mig-2" => continue,
                Err(e) => panic!("{node}/{strategy}: {e}"),
            };
            for r in &rs {
                for d in &r.devices {
                    let resp =
                        container_response(r, &settings, &view.sys, std::slice::from_ref(&d.id))
                            .unwrap();
                    let mut handed: Vec<String> =
                        resp.cdi_devices.iter().map(|c| c.name.clone()).collect();
                    for (k, v) in &resp.annotations {
                        if k.starts_with("cdi.k8s.io/") {
                            handed.extend(v.split(',').map(str::to_string));
                        }
                    }
                    assert!(!handed.is_empty(), "{node}: {} gave no CDI name", d.id);
                    for h in handed {
                        assert!(
                            names.contains(&h),
                            "{node}/{strategy}: {h} is not in the spec"
                        );
                        checked += 1;
                    }
                }
            }
        }
    }
    assert!(checked > 50, "only {checked} names checked");
}

/// The NVML path (fake library) gives the same spec as the simulated
/// backend: over the committed 8x H100 fixture, and over the MIG node, whose
/// capability nodes need the GPU/compute instance IDs that NVML gives
/// through the raw calls nvml-wrapper does not wrap.
#[test]
fn the_nvml_path_gives_the_same_spec() {
    let (_dir, lib) = fake_nvml();
    let mig_host = tempfile::tempdir().unwrap();
    simnode::NodeDescription::load("h100-mig-2")
        .unwrap()
        .materialize(mig_host.path())
        .unwrap();
    for (node, host) in [
        ("h100-sxm-8", host_fixture("h100-sxm-8")),
        ("h100-mig-2", mig_host.path().to_path_buf()),
    ] {
        let (code, out, err) = run(at(&host)
            .args(["--nvml-lib"])
            .arg(&lib)
            .args(["cdi", "generate"])
            .env("FAKE_NVML_NODE", node));
        assert_eq!(code, 0, "{node}: {err}");
        assert!(err.is_empty(), "{node}: notes: {err}");
        let (_view, _inv, g) = generated(node);
        assert_eq!(out, g.to_json(), "{node}");
    }
}

#[test]
fn generate_write_installs_the_hook_and_restore_removes_both() {
    let host = tempfile::tempdir().unwrap();
    let (code, out, err) =
        run(at(host.path()).args(["--simulate", "h100-mig-2", "cdi", "generate", "--write"]));
    assert_eq!(code, 0, "{err}");
    let spec_file = host
        .path()
        .join("var/run/cdi/gpu-agent-nvidia.com-gpu.json");
    assert_eq!(fs::read_to_string(&spec_file).unwrap(), out);
    let hook = host.path().join("var/lib/gpu-agent/bin/gpu-agent");
    assert_eq!(
        fs::read(&hook).unwrap(),
        fs::read(env!("CARGO_BIN_EXE_gpu-agent")).unwrap()
    );
    assert_eq!(
        fs::metadata(&hook).unwrap().permissions().mode() & 0o777,
        0o755
    );
    assert!(
        err.contains("wrote /var/run/cdi/gpu-agent-nvidia.com-gpu.json"),
        "{err}"
    );
    // Again: nothing changes.
    let (code, _, err) =
        run(at(host.path()).args(["--simulate", "h100-mig-2", "cdi", "generate", "--write"]));
    assert_eq!(code, 0);
    assert!(err.contains("is up to date"), "{err}");
    let (code, out, err) = run(at(host.path()).args(["runtime", "restore"]));
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("removed /var/run/cdi/gpu-agent-nvidia.com-gpu.json"),
        "{out}"
    );
    assert!(!spec_file.exists() && !hook.exists());
}

#[test]
fn a_hook_path_that_is_not_on_the_host_is_refused_before_writing() {
    let host = tempfile::tempdir().unwrap();
    let policy = host.path().join("p.yaml");
    fs::write(&policy, "spec:\n  cdi:\n    hookPath: /usr/bin/gpu-agent\n").unwrap();
    let (code, _, err) = run(at(host.path()).arg("--policy").arg(&policy).args([
        "--simulate",
        "a10g-1",
        "cdi",
        "generate",
        "--write",
    ]));
    assert_eq!(code, 1);
    assert!(
        err.contains("spec.cdi.hookPath: /usr/bin/gpu-agent does not exist on the host"),
        "{err}"
    );
    assert!(!host.path().join("var/run/cdi").exists());
}

#[test]
fn no_driver_is_said_plainly() {
    let host = tempfile::tempdir().unwrap();
    let (code, _, err) = run(at(host.path()).args(["--simulate", "no-gpu", "cdi", "generate"]));
    assert_eq!(code, 1);
    assert!(err.contains("no NVIDIA driver is loaded"), "{err}");
}

/// The hooks as a runtime runs them: OCI state on stdin, links made inside
/// the container's root.
#[test]
fn the_create_symlinks_hook_runs_from_the_oci_state() {
    let bundle = tempfile::tempdir().unwrap();
    let rootfs = bundle.path().join("rootfs");
    fs::create_dir_all(rootfs.join("usr/lib/x86_64-linux-gnu")).unwrap();
    fs::write(
        bundle.path().join("config.json"),
        r#"{"ociVersion":"1.2.0","root":{"path":"rootfs"}}"#,
    )
    .unwrap();
    let state = format!(
        r#"{{"ociVersion":"1.2.0","id":"abc","status":"creating","pid":1,"bundle":"{}"}}"#,
        bundle.path().display()
    );
    let out = run_with_stdin(
        &[
            "cdi-hook",
            "create-symlinks",
            "--link",
            "libcuda.so.1::/usr/lib/x86_64-linux-gnu/libcuda.so",
        ],
        &state,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        fs::read_link(rootfs.join("usr/lib/x86_64-linux-gnu/libcuda.so")).unwrap(),
        Path::new("libcuda.so.1")
    );
}

/// The linker-cache hook against a real root with a real shared library and
/// the host's real ldconfig (which chroots: root only; scripts/test runs it).
#[test]
#[ignore = "needs root (ldconfig -r chroots); scripts/test runs it as root"]
fn the_update_ldcache_hook_puts_the_libraries_in_the_containers_cache() {
    let bundle = tempfile::tempdir().unwrap();
    let rootfs = bundle.path().join("rootfs");
    let libdir = rootfs.join("opt/driver/lib");
    fs::create_dir_all(&libdir).unwrap();
    fs::create_dir_all(rootfs.join("etc")).unwrap();
    // Any real shared library stands in for a driver library: ldconfig
    // reads its SONAME and links it.
    let real = [
        "/usr/lib/x86_64-linux-gnu/libz.so.1",
        "/lib/x86_64-linux-gnu/libz.so.1",
    ]
    .into_iter()
    .find(|p| Path::new(p).exists())
    .expect("libz.so.1 on this machine");
    fs::copy(
        fs::canonicalize(real).unwrap(),
        libdir.join("libz.so.1.9.9"),
    )
    .unwrap();
    fs::write(
        bundle.path().join("config.json"),
        r#"{"ociVersion":"1.2.0","root":{"path":"rootfs"}}"#,
    )
    .unwrap();
    let state = format!(r#"{{"bundle":"{}"}}"#, bundle.path().display());
    let out = run_with_stdin(
        &["cdi-hook", "update-ldcache", "--folder", "/opt/driver/lib"],
        &state,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let cache = rootfs.join("etc/ld.so.cache");
    let listed = std::process::Command::new("ldconfig")
        .arg("-C")
        .arg(&cache)
        .arg("-p")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&listed.stdout);
    assert!(
        text.contains("libz.so.1") && text.contains("/opt/driver/lib/libz.so.1"),
        "{text}"
    );
    assert_eq!(
        fs::read_link(libdir.join("libz.so.1")).unwrap(),
        Path::new("libz.so.1.9.9")
    );
    assert!(
        rootfs
            .join("etc/ld.so.conf.d/00-gpu-agent-cdi.conf")
            .exists()
    );
}
