//! containerd's config.toml (versions 1, 2 and 3; containerd 1.6 to 2.1,
//! drop-ins from 2.1): the patched file parses as TOML and keeps every key
//! of the input (but for the `nvidia` runtime's own table, which gpu-agent
//! writes whole), and planning again over the result changes nothing; or
//! the input is refused with an error naming the file and a line. Never a
//! panic.
//!
//! The first byte picks the host: bits 0-2 containerd's version (unknown,
//! 1.6.20, 1.7.2, 2.0.0, 2.1.0), bit 3 make `nvidia` the default, bit 4
//! enable CDI, bit 5 the host has nvidia-container-runtime. The rest is
//! the config.
#![no_main]

use gpu_agent::runtime::RuntimeError;
use gpu_agent::runtime::containerd::{self, Options, Version};
use gpu_agent_fuzz::{Host, toml_keys};
use libfuzzer_sys::fuzz_target;

const CONFIG: &str = "/etc/containerd/config.toml";

fn owned(path: &[String]) -> bool {
    // plugins.<cri>.containerd.runtimes.nvidia…
    path.len() >= 5
        && path[0] == "plugins"
        && path[2] == "containerd"
        && path[3] == "runtimes"
        && path[4] == "nvidia"
}

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let Some(text) = gpu_agent_fuzz::text(rest) else {
        return;
    };
    let version = match flags & 7 {
        0 => None,
        1 => Version::parse("1.6.20"),
        2 => Version::parse("1.7.2"),
        3 => Version::parse("2.0.0"),
        _ => Version::parse("2.1.0"),
    };
    let opts = Options {
        config: CONFIG.into(),
        drop_in_dir: "/etc/containerd/conf.d".into(),
        runtime_name: "nvidia".into(),
        set_as_default: flags & 8 != 0,
        enable_cdi: flags & 16 != 0,
        binary_name: (flags & 32 != 0).then(|| "/usr/bin/nvidia-container-runtime".to_string()),
    };
    let host = Host::new();
    host.put(CONFIG, text);
    let plan = match containerd::plan(&host.root, &opts, version) {
        Ok(p) => p,
        Err(e @ (RuntimeError::Parse { .. } | RuntimeError::Invalid { .. })) => {
            let shown = e.to_string();
            assert!(
                shown.starts_with(CONFIG),
                "error does not name the file: {shown}"
            );
            if let RuntimeError::Invalid { line, .. } = e {
                assert!(line >= 1, "no line in {shown}");
            }
            return;
        }
        Err(RuntimeError::NoInjection(_)) if opts.binary_name.is_none() => return,
        Err(e) => panic!("unexpected error: {e}"),
    };
    let input = toml_edit::Document::parse(text.to_string()).expect("plan parsed it");
    let before = toml_keys(input.as_table());
    for change in &plan.changes {
        let out = toml_edit::Document::parse(change.after.clone()).unwrap_or_else(|e| {
            panic!(
                "{} does not parse after the patch: {e}\n{}",
                change.path, change.after
            )
        });
        if change.path == CONFIG {
            let after = toml_keys(out.as_table());
            for k in before.iter().filter(|k| !owned(k)) {
                assert!(after.contains(k), "the patch lost {k:?}\n{}", change.after);
            }
        }
    }
    for change in &plan.changes {
        host.put(&change.path, &change.after);
    }
    if let Some(bin) = &opts.binary_name {
        // Where the nvidia runtime is (the config, or the drop-in), it runs
        // the host's nvidia-container-runtime, whatever it named before.
        let found: Vec<String> = std::iter::once(CONFIG.to_string())
            .chain(plan.changes.iter().map(|c| c.path.clone()))
            .filter_map(|p| host.root.read_optional(&p).ok().flatten())
            .filter_map(|t| toml_edit::Document::parse(t).ok())
            .flat_map(|d| binary_names(d.as_table()))
            .collect();
        assert!(
            found.iter().any(|b| b == bin),
            "the nvidia runtime's BinaryName is {found:?}, not {bin}"
        );
    }
    let again = containerd::plan(&host.root, &opts, version)
        .unwrap_or_else(|e| panic!("the patched config is refused: {e}"));
    assert!(
        again.changes.is_empty(),
        "planning again changes {:?}",
        again.changes.iter().map(|c| c.diff()).collect::<Vec<_>>()
    );
});

/// `plugins.<cri>.containerd.runtimes.nvidia.options.BinaryName` of a config.
fn binary_names(doc: &toml_edit::Table) -> Vec<String> {
    let Some(plugins) = doc.get("plugins").and_then(toml_edit::Item::as_table_like) else {
        return Vec::new();
    };
    plugins
        .iter()
        .filter_map(|(_, cri)| {
            cri.get("containerd")?
                .get("runtimes")?
                .get("nvidia")?
                .get("options")?
                .get("BinaryName")?
                .as_str()
                .map(str::to_string)
        })
        .collect()
}
