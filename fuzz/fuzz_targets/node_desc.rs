//! Node descriptions (simnode's YAML): parsed and validated or refused
//! naming the file; a description that parses writes its simulated /sys and
//! /dev tree under the root it is given and nowhere else, and comes back
//! the same through YAML. Never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use simnode::NodeDescription;

const ORIGIN: &str = "fuzz/node.yaml";

fuzz_target!(|data: &[u8]| {
    let Some(text) = gpu_agent_fuzz::text(data) else {
        return;
    };
    let desc = match NodeDescription::from_yaml(text, ORIGIN) {
        Ok(d) => d,
        Err(e) => {
            let shown = e.to_string();
            assert!(
                shown.contains(ORIGIN),
                "error does not name the file: {shown}"
            );
            return;
        }
    };
    let again = serde_yaml_ng::to_string(&desc).expect("a description serialises");
    let back = NodeDescription::from_yaml(&again, ORIGIN)
        .unwrap_or_else(|e| panic!("written back, the description is refused: {e}\n{again}"));
    assert_eq!(
        format!("{back:?}"),
        format!("{desc:?}"),
        "round trip changed it"
    );
    let dir = tempfile::Builder::new()
        .prefix("gpu-agent-fuzz")
        .tempdir()
        .expect("a temporary directory");
    let root = dir.path().join("root");
    std::fs::create_dir(&root).expect("mkdir");
    let _ = desc.materialize(&root);
    for f in gpu_agent_fuzz::files_under(dir.path()) {
        assert!(
            f == "root" || f.starts_with("root/"),
            "materialize wrote {f} outside its root"
        );
    }
});
