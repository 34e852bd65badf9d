//! The opaque configurations of a claim's allocation (NVIDIA's `GpuConfig`
//! / `MigDeviceConfig`): which are understood, and refusing what this node
//! cannot apply yet (sharing) rather than preparing without it.

use super::allocation::OpaqueConfig;

/// The API version of NVIDIA's configuration kinds.
pub const CONFIG_API_VERSION: &str = "resource.nvidia.com/v1beta1";
const KINDS: &[&str] = &["GpuConfig", "MigDeviceConfig"];
const FIELDS: &[&str] = &["apiVersion", "kind", "sharing"];

/// Checks every configuration: `Err` says which one and why.
pub fn check(configs: &[OpaqueConfig]) -> Result<(), String> {
    for (i, c) in configs.iter().enumerate() {
        let at = |why: String| format!("opaque configuration #{i} ({:?}): {why}", c.source);
        let Some(obj) = c.parameters.as_object() else {
            return Err(at("parameters are not an object".into()));
        };
        let api = obj.get("apiVersion").and_then(|v| v.as_str()).unwrap_or("");
        let kind = obj.get("kind").and_then(|v| v.as_str()).unwrap_or("");
        if api != CONFIG_API_VERSION || !KINDS.contains(&kind) {
            return Err(at(format!(
                "{api:?} {kind:?} is not {CONFIG_API_VERSION} {}",
                KINDS.join(" or ")
            )));
        }
        if let Some(unknown) = obj.keys().find(|k| !FIELDS.contains(&k.as_str())) {
            return Err(at(format!("unknown field {unknown:?} in {kind}")));
        }
        match obj.get("sharing") {
            None | Some(serde_json::Value::Null) => {}
            Some(s) => {
                let strategy = s.get("strategy").and_then(|v| v.as_str()).unwrap_or("?");
                return Err(at(format!(
                    "{kind} asks for sharing (strategy {strategy}), which gpu-agent does not apply to claims yet"
                )));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::super::allocation::ConfigSource;
    use super::*;

    fn cfg(parameters: serde_json::Value) -> OpaqueConfig {
        OpaqueConfig {
            source: ConfigSource::FromClaim,
            requests: Vec::new(),
            parameters,
        }
    }

    #[test]
    fn plain_configs_pass_sharing_and_strangers_fail() {
        assert!(check(&[]).is_ok());
        let plain = cfg(json!({"apiVersion": CONFIG_API_VERSION, "kind": "GpuConfig"}));
        assert!(check(&[plain]).is_ok());
        let mps = cfg(
            json!({"apiVersion": CONFIG_API_VERSION, "kind": "GpuConfig",
            "sharing": {"strategy": "MPS"}}),
        );
        let err = check(&[mps]).unwrap_err();
        assert!(err.contains("strategy MPS"), "{err}");
        let other = cfg(json!({"apiVersion": "example.com/v1", "kind": "GpuConfig"}));
        assert!(check(&[other]).unwrap_err().contains("example.com/v1"));
        let extra =
            cfg(json!({"apiVersion": CONFIG_API_VERSION, "kind": "MigDeviceConfig", "x": 1}));
        assert!(check(&[extra]).unwrap_err().contains("unknown field \"x\""));
        assert!(check(&[cfg(json!("text"))]).is_err());
    }
}
