//! Helpers for unit tests: simulated nodes written to temp dirs.

use hostlib::HostRoot;
use simnode::NodeDescription;

use crate::sim::SimulatedBackend;
use gpu_model::inventory::Inventory;

/// A built-in node written out under a temp dir, and its simulated backend.
pub fn sim_node(name: &str) -> (tempfile::TempDir, HostRoot, SimulatedBackend) {
    let dir = tempfile::tempdir().unwrap();
    let desc = NodeDescription::load(name).unwrap();
    desc.materialize(dir.path()).unwrap();
    let root = HostRoot::new(dir.path()).unwrap();
    (dir, root, SimulatedBackend::new(desc))
}

/// The inventory of a built-in node.
pub fn inventory_of(name: &str) -> Inventory {
    let (_dir, root, backend) = sim_node(name);
    crate::discover::discover(&root, &backend)
}
