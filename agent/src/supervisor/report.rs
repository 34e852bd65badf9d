//! The node report gpu-controller is sent: the agent's state and labels, put
//! into the report's protocol (the report stream itself is gpu-report's).

use std::collections::BTreeMap;

use gpu_agent_proto::report::v1 as pb;

use crate::state::AgentState;

/// The node as the report tells it, from the agent's state and labels.
pub fn node_report(st: &AgentState, labels: &BTreeMap<String, String>) -> pb::NodeReport {
    let inventory = st.inventory.as_ref().map(|inv| pb::Inventory {
        driver_version: inv
            .backend
            .driver_version
            .clone()
            .or_else(|| inv.driver.version.clone())
            .unwrap_or_default(),
        cuda_version: inv.cuda_version.map(|v| v.to_string()).unwrap_or_default(),
        gpus: inv
            .gpus
            .iter()
            .map(|g| pb::Gpu {
                index: g.index.unwrap_or(u32::MAX),
                uuid: g.uuid.clone().unwrap_or_default(),
                model: g.model.clone().unwrap_or_default(),
                pci_bus_id: g.bus_id.nvml_bus_id(),
                memory_mib: g.memory_mib.unwrap_or(0),
                mig_enabled: g.mig.is_some_and(|m| m.current),
                mig_devices: g
                    .mig_devices
                    .iter()
                    .map(|m| pb::MigDevice {
                        uuid: m.uuid.clone(),
                        profile: m.profile.clone(),
                        gi_profile_id: m.gi_profile_id,
                        placement_start: m.placement_start,
                        // NVML's MIG attributes always carry these; 0 is
                        // what a state file from before them reads as.
                        memory_mib: (m.memory_mib > 0).then_some(m.memory_mib),
                        multiprocessors: (m.multiprocessors > 0).then_some(m.multiprocessors),
                        engines: Some(pb::MigEngines {
                            copy: m.engines.copy,
                            decoder: m.engines.decoder,
                            encoder: m.engines.encoder,
                            jpeg: m.engines.jpeg,
                            ofa: m.engines.ofa,
                        }),
                    })
                    .collect(),
                minor: g.minor,
                brand: g.brand.clone(),
                architecture: g.architecture.clone(),
                compute_capability: g.compute_capability.map(|c| c.to_string()),
                pcie_root: g.pcie_root.clone(),
                numa_node: g.numa_node,
            })
            .collect(),
        simulated: st.simulated.clone().unwrap_or_default(),
    });
    let stages = pb::Stages {
        stages: st
            .stages
            .iter()
            .map(|s| pb::Stage {
                name: s.stage.name().to_string(),
                state: s.state.label().to_string(),
                detail: s.detail.clone(),
                validated: s.validation.as_ref().map(|v| v.ok),
                validation_message: s
                    .validation
                    .as_ref()
                    .map(|v| v.detail.clone())
                    .unwrap_or_default(),
                repairs: s.repairs,
                last_repair: s
                    .last_repair
                    .as_ref()
                    .map(|r| r.what.clone())
                    .unwrap_or_default(),
                last_repair_at: s.last_repair.as_ref().map(|r| r.at).unwrap_or(0),
            })
            .collect(),
        ready: st.ready,
    };
    let health = pb::Health {
        gpus: st
            .health
            .iter()
            .map(|h| pb::GpuHealth {
                uuid: h.uuid.clone(),
                healthy: h.healthy,
                reason: h.reason.clone().unwrap_or_default(),
                advice: h.advice.clone().unwrap_or_default(),
                xid: if h.healthy { None } else { h.xid },
                lost: !h.healthy && h.lost,
            })
            .collect(),
    };
    let mig = st.mig.as_ref().map(|m| pb::MigState {
        layout: m.layout.clone(),
        state: m.state.as_str().to_string(),
        detail: m.detail.clone(),
    });
    pb::NodeReport {
        inventory,
        stages: Some(stages),
        labels: Some(pb::Labels {
            labels: labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        }),
        health: Some(health),
        // An unset section in a Change means "unchanged": a snapshot sends
        // every section, empty where the agent has nothing.
        mig: Some(mig.unwrap_or_default()),
        upgrade: Some(
            st.upgrade
                .as_ref()
                .map(|u| pb::UpgradeState {
                    state: u.state.clone(),
                    driver_version: u.driver_version.clone(),
                    detail: u.detail.clone(),
                })
                .unwrap_or_default(),
        ),
        policy: Some(pb::PolicyState {
            source: if st.policy_from_cluster {
                "ClusterPolicy"
            } else if st.policy.is_some() {
                "file"
            } else {
                "defaults"
            }
            .into(),
            ignored_keys: st.policy_ignored.clone(),
            error: st.policy_error.clone().unwrap_or_default(),
        }),
        dra: Some(super::dra_task::dra_report(st.dra.as_ref())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::health::GpuHealth;
    use crate::test_support::inventory_of;

    /// The agent's state for a simulated node, its GPUs' health as given.
    fn state_of(node: &str, health: impl Fn(&str) -> GpuHealth) -> AgentState {
        let mut st = AgentState::new(
            &hostlib::HostRoot::new(std::env::temp_dir()).unwrap(),
            0,
            Vec::new(),
        );
        let inv = inventory_of(node);
        st.health = inv
            .gpus
            .iter()
            .filter_map(|g| g.uuid.as_deref())
            .map(&health)
            .collect();
        st.inventory = Some(inv);
        st
    }

    fn healthy(uuid: &str) -> GpuHealth {
        GpuHealth {
            uuid: uuid.into(),
            healthy: true,
            reason: None,
            advice: None,
            xid: None,
            lost: false,
            events: 0,
        }
    }

    #[test]
    fn the_report_carries_what_dra_names_and_describes_devices_by() {
        let st = state_of("h100-mig-2", |uuid| {
            if uuid.ends_with("5a00") {
                GpuHealth {
                    healthy: false,
                    reason: Some("XID 79, from NVML".into()),
                    advice: Some("drain and reboot the node".into()),
                    xid: Some(79),
                    events: 1,
                    ..healthy(uuid)
                }
            } else {
                healthy(uuid)
            }
        });
        let r = node_report(&st, &BTreeMap::new());
        let gpus = &r.inventory.as_ref().unwrap().gpus;
        assert_eq!(gpus.len(), 2);
        for (i, g) in gpus.iter().enumerate() {
            // The simulated host numbers /dev/nvidia<N> as NVML's index.
            assert_eq!(g.minor, Some(i as u32), "{}", g.uuid);
            assert_eq!(g.compute_capability.as_deref(), Some("9.0"));
            assert_eq!(g.numa_node, Some(0));
            // NVIDIA's DRA driver's spellings; the root from sysfs's link
            // (the simulated host puts every device under pci0000:00).
            assert_eq!(g.brand.as_deref(), Some("Nvidia"));
            assert_eq!(g.architecture.as_deref(), Some("Hopper"));
            assert_eq!(g.pcie_root.as_deref(), Some("pci0000:00"));
        }
        let m = &gpus[0].mig_devices[0];
        assert_eq!(m.profile, "3g.40gb");
        assert_eq!(m.gi_profile_id, Some(9));
        assert!(m.placement_start.is_some());
        assert_eq!(m.memory_mib, Some(40192));
        assert_eq!(m.multiprocessors, Some(60));
        assert_eq!(
            m.engines,
            Some(pb::MigEngines {
                copy: 3,
                decoder: 3,
                encoder: 0,
                jpeg: 3,
                ofa: 0,
            })
        );
        // Every MIG device on a GPU has its own placement.
        for g in gpus {
            let mut starts: Vec<_> = g.mig_devices.iter().map(|m| m.placement_start).collect();
            starts.sort();
            starts.dedup();
            assert_eq!(starts.len(), g.mig_devices.len(), "{:?}", g.mig_devices);
        }
        let h = &r.health.as_ref().unwrap().gpus;
        assert_eq!(h[0].xid, Some(79));
        assert_eq!(h[0].reason, "XID 79, from NVML");
        assert_eq!(h[1].xid, None);
    }

    #[test]
    fn a_gpu_without_mig_reports_no_mig_facts() {
        let r = node_report(&state_of("t4-4", healthy), &BTreeMap::new());
        let g = &r.inventory.as_ref().unwrap().gpus[0];
        assert!(g.mig_devices.is_empty());
        assert_eq!(g.minor, Some(0));
        assert_eq!(g.compute_capability.as_deref(), Some("7.5"));
        assert_eq!(g.brand.as_deref(), Some("Tesla"));
        assert_eq!(g.architecture.as_deref(), Some("Turing"));
    }

    /// `--simulate h100-sxm-8`: every GPU of the report carries what
    /// NVIDIA's DRA driver publishes as `brand`, `architecture` and
    /// `resource.kubernetes.io/pcieRoot`.
    #[test]
    fn a_simulated_h100_node_reports_brand_architecture_and_pcie_root() {
        let r = node_report(&state_of("h100-sxm-8", healthy), &BTreeMap::new());
        let gpus = &r.inventory.as_ref().unwrap().gpus;
        assert_eq!(gpus.len(), 8);
        for g in gpus {
            assert_eq!(
                (
                    g.brand.as_deref(),
                    g.architecture.as_deref(),
                    g.pcie_root.as_deref()
                ),
                (Some("Nvidia"), Some("Hopper"), Some("pci0000:00")),
                "{}",
                g.uuid
            );
        }
    }
}
