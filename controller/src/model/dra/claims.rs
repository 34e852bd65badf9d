//! The ResourceClaims allocated to a node's devices of ours, for its agent
//! (issue 31, "claim allocations for prepare"): which node a claim is on,
//! what the agent's `NodePrepareResources` needs of it (this driver's
//! results and opaque configs, [`pb::DraClaim`], the agent's
//! `ClaimAllocation`), and every node's whole list ([`ClaimsByNode`]). Pure.
//!
//! Which node: the `pool` of the claim's results for driver
//! `gpu.nvidia.com`. Our pools are named after their node and their slices
//! are node-local (`spec.nodeName`, as NVIDIA's driver does,
//! docs/dra-facts.md §6), so the pool names the node of exactly the devices
//! the agent prepares. `status.allocation.nodeSelector` is the scheduler's
//! word for the whole allocation, every driver's devices together: one term
//! `matchFields: metadata.name In [<node>]` as soon as one device is
//! node-local (the allocator's `createNodeSelector`), but label terms, or
//! nothing, for devices of other drivers available on several nodes. It is
//! only checked against the pool where it names one node.

use std::collections::{BTreeMap, BTreeSet};

use gpu_agent_proto::report::v1 as pb;
use k8s_openapi::api::core::v1::NodeSelector;
use k8s_openapi::api::resource::v1::ResourceClaim;

use super::names::DRIVER;

/// A claim that cannot be handed to a node's agent.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ClaimError {
    #[error("ResourceClaim {claim} has no UID")]
    NoUid { claim: String },
    #[error(
        "ResourceClaim {claim}: its {DRIVER} devices are in the pools of several nodes ({pools}); ours are node-local"
    )]
    SeveralPools { claim: String, pools: String },
    #[error(
        "ResourceClaim {claim}: its {DRIVER} devices are in pool {pool}, its allocation's node selector names node {selected}"
    )]
    OtherNode {
        claim: String,
        pool: String,
        selected: String,
    },
    #[error(
        "ResourceClaim {claim}: opaque config #{index} for {DRIVER} comes from {given:?} (FromClass or FromClaim expected)"
    )]
    UnknownSource {
        claim: String,
        index: usize,
        given: String,
    },
}

/// A claim allocated to one node's devices of ours.
#[derive(Clone, Debug, PartialEq)]
pub struct Placed {
    pub node: String,
    pub claim: pb::DraClaim,
}

/// `namespace/name`, for messages.
fn name_of(c: &ResourceClaim) -> String {
    format!(
        "{}/{}",
        c.metadata.namespace.as_deref().unwrap_or_default(),
        c.metadata.name.as_deref().unwrap_or_default()
    )
}

/// The one node a node selector names by `metadata.name`, as the scheduler
/// writes it for node-local devices; `None` for any other selector.
pub fn selected_node(sel: &NodeSelector) -> Option<&str> {
    let [term] = sel.node_selector_terms.as_slice() else {
        return None;
    };
    term.match_fields
        .iter()
        .flatten()
        .find(|r| r.key == "metadata.name" && r.operator == "In")
        .and_then(|r| match r.values.as_deref() {
            Some([one]) => Some(one.as_str()),
            _ => None,
        })
}

/// Where `claim` is and what its node's agent is handed of it: `None` when
/// it is not allocated (`status.allocation` absent) or has no device of
/// ours. Other drivers' results and opaque configs are left out; ours keep
/// the allocation's order (the agent applies the last config that matches).
pub fn placed(claim: &ResourceClaim) -> Result<Option<Placed>, ClaimError> {
    let Some(alloc) = claim.status.as_ref().and_then(|s| s.allocation.as_ref()) else {
        return Ok(None);
    };
    let Some(devs) = alloc.devices.as_ref() else {
        return Ok(None);
    };
    let ours: Vec<_> = devs
        .results
        .iter()
        .flatten()
        .filter(|r| r.driver == DRIVER)
        .collect();
    if ours.is_empty() {
        return Ok(None);
    }
    let name = name_of(claim);
    let pools: BTreeSet<&str> = ours.iter().map(|r| r.pool.as_str()).collect();
    let node = match pools.iter().collect::<Vec<_>>().as_slice() {
        [one] => one.to_string(),
        _ => {
            return Err(ClaimError::SeveralPools {
                claim: name,
                pools: pools.into_iter().collect::<Vec<_>>().join(", "),
            });
        }
    };
    if let Some(selected) = alloc.node_selector.as_ref().and_then(selected_node)
        && selected != node
    {
        return Err(ClaimError::OtherNode {
            claim: name,
            pool: node,
            selected: selected.to_string(),
        });
    }
    let Some(uid) = claim.metadata.uid.clone().filter(|u| !u.is_empty()) else {
        return Err(ClaimError::NoUid { claim: name });
    };
    let devices = ours
        .iter()
        .map(|r| pb::DraAllocatedDevice {
            request: r.request.clone(),
            pool: r.pool.clone(),
            device: r.device.clone(),
            share_id: r.share_id.clone(),
        })
        .collect();
    let mut configs = Vec::new();
    for (index, c) in devs.config.iter().flatten().enumerate() {
        let Some(opaque) = c.opaque.as_ref().filter(|o| o.driver == DRIVER) else {
            continue;
        };
        let from_class = match c.source.as_str() {
            "FromClass" => true,
            "FromClaim" => false,
            other => {
                return Err(ClaimError::UnknownSource {
                    claim: name,
                    index,
                    given: other.to_string(),
                });
            }
        };
        configs.push(pb::DraOpaqueConfig {
            from_class,
            requests: c.requests.clone().unwrap_or_default(),
            parameters_json: opaque.parameters.0.to_string(),
        });
    }
    Ok(Some(Placed {
        node,
        claim: pb::DraClaim {
            uid,
            namespace: claim.metadata.namespace.clone().unwrap_or_default(),
            name: claim.metadata.name.clone().unwrap_or_default(),
            devices,
            configs,
        },
    }))
}

/// Every claim on a node of ours, by claim UID, and each node's list as its
/// agent is sent it (sorted by UID, so an unchanged list compares equal).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ClaimsByNode {
    by_uid: BTreeMap<String, String>,
    by_node: BTreeMap<String, BTreeMap<String, pb::DraClaim>>,
}

impl ClaimsByNode {
    /// From a complete listing: every claim, by UID.
    pub fn from_all(all: impl IntoIterator<Item = Placed>) -> Self {
        let mut out = Self::default();
        for p in all {
            out.set(&p.claim.uid.clone(), Some(p));
        }
        out
    }

    /// Claim `uid` is now `placed` (`None`: deallocated, deleted, or not
    /// ours). Returns the nodes whose list changed.
    pub fn set(&mut self, uid: &str, placed: Option<Placed>) -> BTreeSet<String> {
        let mut changed = BTreeSet::new();
        if let Some(old) = self.by_uid.get(uid).cloned() {
            let same = placed
                .as_ref()
                .is_some_and(|p| p.node == old && self.by_node[&old].get(uid) == Some(&p.claim));
            if same {
                return changed;
            }
            self.by_uid.remove(uid);
            if let Some(list) = self.by_node.get_mut(&old) {
                list.remove(uid);
                if list.is_empty() {
                    self.by_node.remove(&old);
                }
            }
            changed.insert(old);
        }
        if let Some(p) = placed {
            self.by_uid.insert(uid.to_string(), p.node.clone());
            self.by_node
                .entry(p.node.clone())
                .or_default()
                .insert(uid.to_string(), p.claim);
            changed.insert(p.node);
        }
        changed
    }

    /// The node's whole list (empty when it has none).
    pub fn list(&self, node: &str) -> pb::DraClaims {
        pb::DraClaims {
            claims: self
                .by_node
                .get(node)
                .map(|l| l.values().cloned().collect())
                .unwrap_or_default(),
        }
    }

    /// Every node that has claims, with its list.
    pub fn lists(&self) -> BTreeMap<String, pb::DraClaims> {
        self.by_node
            .keys()
            .map(|n| (n.clone(), self.list(n)))
            .collect()
    }

    /// Claims held, all nodes together.
    pub fn len(&self) -> usize {
        self.by_uid.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_uid.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// A claim as the API serves it (the JSON of `resource.k8s.io/v1`).
    fn claim(uid: &str, status: serde_json::Value) -> ResourceClaim {
        serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": format!("claim-{uid}"), "namespace": "ml", "uid": uid,
                         "resourceVersion": "7"},
            "spec": {"devices": {"requests": [
                {"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
            "status": status,
        }))
        .unwrap()
    }

    fn on_node(node: &str) -> serde_json::Value {
        json!({"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [node]}]}]})
    }

    fn result(request: &str, driver: &str, pool: &str, device: &str) -> serde_json::Value {
        json!({"request": request, "driver": driver, "pool": pool, "device": device})
    }

    fn device(request: &str, pool: &str, device: &str) -> pb::DraAllocatedDevice {
        pb::DraAllocatedDevice {
            request: request.into(),
            pool: pool.into(),
            device: device.into(),
            share_id: None,
        }
    }

    #[test]
    fn a_whole_gpu_with_another_drivers_device_and_configs_mixed_in() {
        let c = claim(
            "u1",
            json!({"allocation": {
                "devices": {
                    "results": [
                        result("nic", "rdma.example.com", "node-a-nics", "nic-3"),
                        result("gpu", DRIVER, "node-a", "gpu-0"),
                    ],
                    "config": [
                        {"source": "FromClass", "requests": [],
                         "opaque": {"driver": DRIVER, "parameters":
                            {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}}},
                        {"source": "FromClaim", "requests": ["nic"],
                         "opaque": {"driver": "rdma.example.com", "parameters": {"mtu": 9000}}},
                        {"source": "FromClaim", "requests": ["gpu"],
                         "opaque": {"driver": DRIVER, "parameters":
                            {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
                             "sharing": {"strategy": "TimeSlicing",
                                         "timeSlicingConfig": {"interval": "Long"}}}}},
                    ],
                },
                "nodeSelector": on_node("node-a"),
                "allocationTimestamp": "2026-11-27T05:00:00Z",
            }}),
        );
        let p = placed(&c).unwrap().unwrap();
        assert_eq!(p.node, "node-a");
        assert_eq!(p.claim.uid, "u1");
        assert_eq!(
            (p.claim.namespace.as_str(), p.claim.name.as_str()),
            ("ml", "claim-u1")
        );
        assert_eq!(p.claim.devices, vec![device("gpu", "node-a", "gpu-0")]);
        assert_eq!(p.claim.configs.len(), 2, "the NIC's config is left out");
        assert!(p.claim.configs[0].from_class);
        assert!(p.claim.configs[0].requests.is_empty());
        assert!(!p.claim.configs[1].from_class);
        assert_eq!(p.claim.configs[1].requests, ["gpu"]);
        let params: serde_json::Value =
            serde_json::from_str(&p.claim.configs[1].parameters_json).unwrap();
        assert_eq!(params["kind"], "GpuConfig");
        assert_eq!(params["sharing"]["timeSlicingConfig"]["interval"], "Long");
    }

    #[test]
    fn a_mig_device_and_a_shared_device() {
        let mig = "gpu-0-mig-1g10gb-19-6";
        let c = claim(
            "u2",
            json!({"allocation": {"devices": {"results": [
                result("mig", DRIVER, "node-b", mig),
                {"request": "shared", "driver": DRIVER, "pool": "node-b", "device": "gpu-3",
                 "shareID": "4f6b7c1e-0000-4000-8000-000000000001"},
            ]}, "nodeSelector": on_node("node-b")}}),
        );
        let p = placed(&c).unwrap().unwrap();
        assert_eq!(p.node, "node-b");
        let mut shared = device("shared", "node-b", "gpu-3");
        shared.share_id = Some("4f6b7c1e-0000-4000-8000-000000000001".into());
        assert_eq!(p.claim.devices, vec![device("mig", "node-b", mig), shared]);
        assert!(p.claim.configs.is_empty());
    }

    #[test]
    fn not_allocated_or_not_ours_is_on_no_node() {
        assert_eq!(placed(&claim("u3", json!({}))).unwrap(), None);
        assert_eq!(placed(&claim("u3", json!(null))).unwrap(), None);
        let other = claim(
            "u4",
            json!({"allocation": {"devices": {"results": [
                result("nic", "rdma.example.com", "node-a", "nic-0")]},
                "nodeSelector": on_node("node-a")}}),
        );
        assert_eq!(placed(&other).unwrap(), None);
        // Being deleted while still allocated (its pods still run): still
        // on its node until the API drops it.
        let mut deleting = claim(
            "u5",
            json!({"allocation": {"devices": {"results": [result("gpu", DRIVER, "node-a", "gpu-2")]}},
                   "reservedFor": [{"resource": "pods", "name": "p", "uid": "pod-1"}]}),
        );
        deleting.metadata.deletion_timestamp =
            serde_json::from_value(json!("2026-11-27T05:00:00Z")).unwrap();
        assert_eq!(placed(&deleting).unwrap().unwrap().node, "node-a");
    }

    #[test]
    fn a_selector_without_one_node_leaves_the_pool_to_say() {
        // Devices of another driver available on labelled nodes: the
        // selector is a label term; the pool names the node.
        let c = claim(
            "u6",
            json!({"allocation": {"devices": {"results": [result("gpu", DRIVER, "node-c", "gpu-1")]},
                "nodeSelector": {"nodeSelectorTerms": [{"matchExpressions": [
                    {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["z1"]}]}]}}}),
        );
        assert_eq!(placed(&c).unwrap().unwrap().node, "node-c");
        let none = claim(
            "u7",
            json!({"allocation": {"devices": {"results": [result("gpu", DRIVER, "node-c", "gpu-1")]}}}),
        );
        assert_eq!(placed(&none).unwrap().unwrap().node, "node-c");
    }

    #[test]
    fn claims_that_cannot_be_placed_are_named() {
        let two = claim(
            "u8",
            json!({"allocation": {"devices": {"results": [
                result("a", DRIVER, "node-a", "gpu-0"), result("b", DRIVER, "node-b", "gpu-0")]}}}),
        );
        let e = placed(&two).unwrap_err();
        assert_eq!(
            e.to_string(),
            "ResourceClaim ml/claim-u8: its gpu.nvidia.com devices are in the pools of several nodes (node-a, node-b); ours are node-local"
        );
        let elsewhere = claim(
            "u9",
            json!({"allocation": {"devices": {"results": [result("a", DRIVER, "node-a", "gpu-0")]},
                "nodeSelector": on_node("node-z")}}),
        );
        assert!(matches!(
            placed(&elsewhere).unwrap_err(),
            ClaimError::OtherNode { pool, selected, .. } if pool == "node-a" && selected == "node-z"
        ));
        let mut no_uid = claim(
            "u10",
            json!({"allocation": {"devices": {"results": [result("a", DRIVER, "node-a", "gpu-0")]}}}),
        );
        no_uid.metadata.uid = None;
        assert_eq!(
            placed(&no_uid).unwrap_err().to_string(),
            "ResourceClaim ml/claim-u10 has no UID"
        );
        let mut odd = claim(
            "u11",
            json!({"allocation": {"devices": {
                "results": [result("a", DRIVER, "node-a", "gpu-0")],
                "config": [{"source": "FromClass", "opaque": {"driver": DRIVER, "parameters": {}}}]}}}),
        );
        if let Some(cfg) = odd
            .status
            .as_mut()
            .and_then(|s| s.allocation.as_mut())
            .and_then(|a| a.devices.as_mut())
            .and_then(|d| d.config.as_mut())
        {
            cfg[0].source = "FromSomewhere".into();
        }
        assert_eq!(
            placed(&odd).unwrap_err(),
            ClaimError::UnknownSource {
                claim: "ml/claim-u11".into(),
                index: 0,
                given: "FromSomewhere".into()
            }
        );
    }

    fn at(node: &str, uid: &str, dev: &str) -> Placed {
        Placed {
            node: node.into(),
            claim: pb::DraClaim {
                uid: uid.into(),
                namespace: "ml".into(),
                name: format!("claim-{uid}"),
                devices: vec![device("gpu", node, dev)],
                configs: Vec::new(),
            },
        }
    }

    fn uids(l: &pb::DraClaims) -> Vec<&str> {
        l.claims.iter().map(|c| c.uid.as_str()).collect()
    }

    #[test]
    fn each_node_has_its_whole_list_and_only_changes_are_said() {
        let mut m = ClaimsByNode::from_all([at("a", "u2", "gpu-1"), at("a", "u1", "gpu-0")]);
        assert_eq!(uids(&m.list("a")), ["u1", "u2"], "sorted by UID");
        assert!(m.list("b").claims.is_empty());
        // The same allocation again: no node changed.
        assert!(m.set("u1", Some(at("a", "u1", "gpu-0"))).is_empty());
        // A new claim on b.
        assert_eq!(
            m.set("u3", Some(at("b", "u3", "gpu-0"))),
            BTreeSet::from(["b".to_string()])
        );
        // Another device for u1: a's list changes.
        assert_eq!(
            m.set("u1", Some(at("a", "u1", "gpu-5"))),
            BTreeSet::from(["a".to_string()])
        );
        assert_eq!(m.list("a").claims[0].devices[0].device, "gpu-5");
        // Deallocated and allocated elsewhere: both nodes change.
        assert_eq!(
            m.set("u2", Some(at("b", "u2", "gpu-1"))),
            BTreeSet::from(["a".to_string(), "b".to_string()])
        );
        assert_eq!(m.len(), 3);
        // Deleted: its node changes; a node without claims is left out.
        assert_eq!(m.set("u1", None), BTreeSet::from(["a".to_string()]));
        assert!(m.list("a").claims.is_empty());
        assert_eq!(m.lists().keys().collect::<Vec<_>>(), ["b"]);
        assert_eq!(uids(&m.list("b")), ["u2", "u3"]);
        // Gone twice: nothing changes.
        assert!(m.set("u1", None).is_empty());
        assert!(!m.is_empty());
    }
}
