//! The controller's model: plain data and pure functions, no API calls and
//! no tasks. What the rest of the controller shares lives here, so that the
//! fleet store and the workers above it depend on it and never on each
//! other:
//!
//! - [`node`]: a node's labels, conditions and taint, as they should be
//!   (from its agent's report), as the API has them, as last written;
//! - [`node_event`]: what becomes a Kubernetes Event about a node;
//! - [`upgrade_state`], [`upgrade_policy`], [`upgrade_plan`]: the driver
//!   rollout's per-node states, the ClusterPolicy's `upgradePolicy`, and the
//!   pure decision of which node moves next; [`upgrade_notes`], the two
//!   annotations that carry the rollout between sharded replicas;
//! - [`policy_texts`]: the ClusterPolicy as each agent is sent it, with the
//!   ConfigMaps it names inlined; [`policy_summary`], what each sharded
//!   replica says of its shards' nodes for the ClusterPolicy's status;
//! - [`dra`]: a node's DRA ResourceSlices, the DeviceClasses and the RBAC
//!   they need, from its agent's report (issue 31; no worker writes them yet).
//!
//! A module here may use another one here (never in a circle:
//! `controller/tests/layers.rs` checks it), and nothing above `model`.

pub mod dra;
pub mod node;
pub mod node_event;
pub mod policy_summary;
pub mod policy_texts;
pub mod upgrade_notes;
pub mod upgrade_plan;
pub mod upgrade_policy;
pub mod upgrade_state;
