//! The policy's section the driver front end owns: `spec.driver`. The
//! agent's policy assembles it (and checks it: `Policy::check_driver`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

fn yes() -> bool {
    true
}

/// `spec.driver`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct DriverSpec {
    /// Manage the driver. `false` when the host already has one (EKS's
    /// AL2023 NVIDIA AMI): the agent then only checks it and makes device nodes.
    #[serde(default = "yes")]
    pub enabled: bool,
    /// The driver version to install, e.g. `550.127.08`; empty: keep what is loaded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// Open kernel modules (`true`), proprietary (`false`), or by GPU
    /// generation when unset (open for Turing and newer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub use_open_kernel_modules: Option<bool>,
    /// A driver bundle to install (a host path, `.tar.gz`; README, "Driver
    /// bundles"). Unpacked once under /var/lib/gpu-agent/drivers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bundle: Option<String>,
    /// The bundle's sha256; without it, `<bundle>.sha256` beside it is read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bundle_sha256: Option<String>,
    /// Load the modules from this host directory (`nvidia.ko`, …) instead of
    /// the installed bundle (e.g. modules DKMS built).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub module_dir: Option<String>,
    /// Parameters per module: `{nvidia: {NVreg_EnableGpuFirmware: "1"}}`.
    /// The GPU Operator's `name` entry (a ConfigMap of `<module>.conf`
    /// files, `""` for none) is taken and not used: an agent on a node
    /// cannot read a ConfigMap. gpu-controller reads it and sends its
    /// parameters in this shape instead of the name; a name it could not
    /// resolve is named as left out.
    #[serde(
        default,
        skip_serializing_if = "BTreeMap::is_empty",
        deserialize_with = "module_parameters"
    )]
    pub kernel_module_config: BTreeMap<String, BTreeMap<String, String>>,
    /// Also load `nvidia-drm`.
    #[serde(default)]
    pub drm: bool,
    /// Also load `nvidia-peermem` (GPUDirect RDMA).
    #[serde(default)]
    pub peermem: bool,
    /// A module already loaded with other parameters: `error` (default,
    /// say so and change nothing) or `reload` (unload and load again).
    #[serde(default)]
    pub on_param_mismatch: OnParamMismatch,
    /// How long an upgrade waits for processes using the GPUs to exit.
    #[serde(default = "upgrade_timeout")]
    pub upgrade_timeout_seconds: u64,
}

fn upgrade_timeout() -> u64 {
    300
}

/// The operator's `name: <ConfigMap>`: a string (`""` or null: none).
struct ConfigMapName;

impl<'de> serde::de::DeserializeSeed<'de> for ConfigMapName {
    type Value = ();
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = ();
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a ConfigMap name (a string)")
            }
            fn visit_str<E: serde::de::Error>(self, _: &str) -> Result<(), E> {
                Ok(())
            }
            fn visit_unit<E: serde::de::Error>(self) -> Result<(), E> {
                Ok(())
            }
        }
        d.deserialize_any(V)
    }
}

/// `spec.driver.kernelModuleConfig`: `{module: {param: value}}`, where an
/// entry `name` holding a string is the GPU Operator's ConfigMap (dropped
/// here; "name" is no module). Each value's type is still checked, its
/// path named.
fn module_parameters<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<BTreeMap<String, BTreeMap<String, String>>, D::Error> {
    struct V;
    impl<'de> serde::de::Visitor<'de> for V {
        type Value = BTreeMap<String, BTreeMap<String, String>>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(
                "parameters per module ({nvidia: {NVreg_...: value}}) or the GPU Operator's {name: <ConfigMap>}",
            )
        }
        fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
            Ok(BTreeMap::new())
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(
            self,
            mut map: A,
        ) -> Result<Self::Value, A::Error> {
            let mut out = BTreeMap::new();
            while let Some(key) = map.next_key::<String>()? {
                if key == "name" {
                    map.next_value_seed(ConfigMapName)?;
                } else {
                    let params = map.next_value()?;
                    out.insert(key, params);
                }
            }
            Ok(out)
        }
    }
    d.deserialize_any(V)
}

/// `spec.driver.onParamMismatch`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnParamMismatch {
    #[default]
    Error,
    Reload,
}

impl Default for DriverSpec {
    fn default() -> Self {
        DriverSpec {
            enabled: true,
            version: None,
            use_open_kernel_modules: None,
            bundle: None,
            bundle_sha256: None,
            module_dir: None,
            kernel_module_config: BTreeMap::new(),
            drm: false,
            peermem: false,
            on_param_mismatch: OnParamMismatch::Error,
            upgrade_timeout_seconds: upgrade_timeout(),
        }
    }
}

impl DriverSpec {
    /// `kernelModuleConfig` with module names as the kernel knows them
    /// (`nvidia-uvm` → `nvidia_uvm`).
    pub fn module_params(&self) -> BTreeMap<String, BTreeMap<String, String>> {
        self.kernel_module_config
            .iter()
            .map(|(m, p)| (m.replace('-', "_"), p.clone()))
            .collect()
    }
}
