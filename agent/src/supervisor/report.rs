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
                    })
                    .collect(),
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
    }
}
