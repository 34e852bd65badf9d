//! The controller's feed of allocations (`ControllerMessage.dra_claims` on
//! the report stream) in the node's terms: one [`ClaimAllocation`] per claim
//! UID, ready for [`super::MemoryAllocations::replace_all`].

use std::collections::BTreeMap;

use gpu_agent_proto::report::v1 as pb;

use super::allocation::{AllocatedDevice, ClaimAllocation, ConfigSource, OpaqueConfig};

/// Every claim of `feed` by UID. Parameters that are not JSON are kept as
/// the text they are, so that prepare refuses the claim naming its
/// configuration (never a claim prepared without its configuration).
pub fn allocations(feed: &pb::DraClaims) -> BTreeMap<String, ClaimAllocation> {
    feed.claims
        .iter()
        .map(|c| {
            let a = ClaimAllocation {
                namespace: c.namespace.clone(),
                name: c.name.clone(),
                devices: c
                    .devices
                    .iter()
                    .map(|d| AllocatedDevice {
                        request: d.request.clone(),
                        pool: d.pool.clone(),
                        device: d.device.clone(),
                        share_id: d.share_id.clone(),
                    })
                    .collect(),
                configs: c
                    .configs
                    .iter()
                    .map(|o| OpaqueConfig {
                        source: if o.from_class {
                            ConfigSource::FromClass
                        } else {
                            ConfigSource::FromClaim
                        },
                        requests: o.requests.clone(),
                        parameters: serde_json::from_str(&o.parameters_json).unwrap_or_else(|_| {
                            serde_json::Value::String(o.parameters_json.clone())
                        }),
                    })
                    .collect(),
            };
            (c.uid.clone(), a)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_feed_becomes_allocations_by_uid() {
        let feed = pb::DraClaims {
            claims: vec![pb::DraClaim {
                uid: "u1".into(),
                namespace: "ns".into(),
                name: "one-gpu".into(),
                devices: vec![pb::DraAllocatedDevice {
                    request: "gpu".into(),
                    pool: "node-a".into(),
                    device: "gpu-0".into(),
                    share_id: Some("s-1".into()),
                }],
                configs: vec![
                    pb::DraOpaqueConfig {
                        from_class: true,
                        requests: vec![],
                        parameters_json:
                            r#"{"apiVersion":"resource.nvidia.com/v1beta1","kind":"GpuConfig"}"#
                                .into(),
                    },
                    pb::DraOpaqueConfig {
                        from_class: false,
                        requests: vec!["gpu".into()],
                        parameters_json: "{not json".into(),
                    },
                ],
            }],
        };
        let all = allocations(&feed);
        let a = &all["u1"];
        assert_eq!((a.namespace.as_str(), a.name.as_str()), ("ns", "one-gpu"));
        assert_eq!(a.devices[0].device, "gpu-0");
        assert_eq!(a.devices[0].share_id.as_deref(), Some("s-1"));
        assert_eq!(a.configs[0].source, ConfigSource::FromClass);
        assert_eq!(a.configs[0].parameters["kind"], "GpuConfig");
        assert_eq!(a.configs[1].source, ConfigSource::FromClaim);
        // Kept as text: prepare refuses it, naming the configuration.
        let err = super::super::config::check(&a.configs).unwrap_err();
        assert!(err.contains("#1") && err.contains("not an object"), "{err}");
    }
}
