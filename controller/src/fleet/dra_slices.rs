//! What the ResourceSlice publisher (`dra_slices.rs`, issue 31) hears of
//! the fleet: the name of every node that needs writing (a report came,
//! its agent went), and a look at a node's entry that makes none.

use tokio::sync::mpsc;

use super::{Fleet, NodeEntry};

impl Fleet {
    /// Each node the writer is told of is also sent to `tx`.
    pub fn with_dra_slices(mut self, tx: mpsc::UnboundedSender<String>) -> Self {
        self.dra_slices = Some(tx);
        self
    }

    pub(super) fn tell_dra_slices(&self, node: &str) {
        if let Some(tx) = &self.dra_slices {
            let _ = tx.send(node.to_string());
        }
    }

    /// Runs `f` on a node's entry, if the fleet has one (none is made).
    pub fn peek<T>(&self, node: &str, f: impl FnOnce(&NodeEntry) -> T) -> Option<T> {
        self.nodes.lock().unwrap().get(node).map(|e| f(e))
    }
}
