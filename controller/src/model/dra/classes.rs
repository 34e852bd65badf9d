//! The DeviceClasses users' claims name (NVIDIA's: `gpu.nvidia.com` for
//! whole GPUs, also behind `nvidia.com/gpu`, and `mig.nvidia.com`), and the
//! RBAC rules the controller needs for the DRA objects, as data.

use k8s_openapi::api::rbac::v1::PolicyRule;
use k8s_openapi::api::resource::v1::{
    CELDeviceSelector, DeviceClass, DeviceClassSpec, DeviceSelector,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::names::DRIVER;

/// The DeviceClass of whole GPUs.
pub const GPU_CLASS: &str = "gpu.nvidia.com";
/// The DeviceClass of MIG devices.
pub const MIG_CLASS: &str = "mig.nvidia.com";
/// The extended resource a pod asks for that the scheduler may serve from
/// [`GPU_CLASS`] (DRAExtendedResource).
pub const EXTENDED_RESOURCE: &str = "nvidia.com/gpu";

/// The CEL selecting this driver's devices of `kind` (`gpu`, `mig`).
fn selector(kind: &str) -> String {
    format!("device.driver == '{DRIVER}' && device.attributes['{DRIVER}'].type == '{kind}'")
}

fn class(name: &str, kind: &str, extended: Option<&str>) -> DeviceClass {
    DeviceClass {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        spec: DeviceClassSpec {
            selectors: Some(vec![DeviceSelector {
                cel: Some(CELDeviceSelector {
                    expression: selector(kind),
                }),
            }]),
            extended_resource_name: extended.map(String::from),
            config: None,
        },
    }
}

/// `gpu.nvidia.com` (with `extendedResourceName: nvidia.com/gpu`) and
/// `mig.nvidia.com`, as NVIDIA's chart defines them.
pub fn device_classes() -> Vec<DeviceClass> {
    vec![
        class(GPU_CLASS, "gpu", Some(EXTENDED_RESOURCE)),
        class(MIG_CLASS, "mig", None),
    ]
}

/// What the controller may do with the DRA objects: write its nodes'
/// ResourceSlices (`dra_slices.rs`), follow the claims allocated on them
/// (`dra_claims.rs`), keep the DeviceClasses: the verbs they use, as the
/// chart's and the kustomize base's ClusterRole grant them
/// (tests/packaging.rs holds the three together).
pub fn rbac_rules() -> Vec<PolicyRule> {
    let rule = |resource: &str, verbs: &[&str]| PolicyRule {
        api_groups: Some(vec!["resource.k8s.io".into()]),
        resources: Some(vec![resource.into()]),
        verbs: verbs.iter().map(|v| v.to_string()).collect(),
        ..Default::default()
    };
    vec![
        rule(
            "resourceslices",
            &["create", "update", "delete", "list", "watch"],
        ),
        rule("resourceclaims", &["list", "watch"]),
        rule("deviceclasses", &["get", "create", "update"]),
    ]
}
