//! The shards as a replica knows them ([`ShardMap`]) and the shard a node
//! belongs to ([`shard_of`]): plain data, no I/O.

use std::collections::{BTreeMap, BTreeSet};

use sha2::{Digest, Sha256};

/// The shard a node belongs to: the first 4 bytes of SHA-256 of its name,
/// big-endian, modulo `count` (0 is taken as 1). The same in every process
/// and version.
pub fn shard_of(node: &str, count: u32) -> u32 {
    let d = Sha256::digest(node.as_bytes());
    u32::from_be_bytes([d[0], d[1], d[2], d[3]]) % count.max(1)
}

/// Who holds a shard.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Holder {
    pub identity: String,
    /// Where agents reach it.
    pub address: String,
}

/// What a replica knows of the shards.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShardMap {
    pub count: u32,
    /// The shards this replica holds and acts for.
    pub mine: BTreeSet<u32>,
    /// Who holds each shard that is held (this replica's included).
    pub holders: BTreeMap<u32, Holder>,
    /// The live replicas, this one included.
    pub replicas: usize,
    /// What the other replicas say of the shards they hold (their Leases'
    /// `gpu-agent.io/policy-summary`, as written; `shards::SUMMARY`).
    pub summaries: BTreeMap<u32, String>,
}

impl ShardMap {
    /// Whether the node's shard is this replica's.
    pub fn owns(&self, node: &str) -> bool {
        self.mine.contains(&shard_of(node, self.count))
    }

    /// Who holds the node's shard, if anyone does.
    pub fn holder_of(&self, node: &str) -> Option<&Holder> {
        self.holders.get(&shard_of(node, self.count))
    }

    /// One line for `/readyz` and logs: `holds shards 0,3,5 of 8 (2
    /// replicas)`.
    pub fn words(&self) -> String {
        let replicas = match self.replicas {
            1 => "1 replica".to_string(),
            n => format!("{n} replicas"),
        };
        match self.mine.len() {
            0 => format!("holds no shard of {} ({replicas})", self.count),
            1 => format!(
                "holds shard {} of {} ({replicas})",
                listed(&self.mine),
                self.count
            ),
            _ => format!(
                "holds shards {} of {} ({replicas})",
                listed(&self.mine),
                self.count
            ),
        }
    }
}

/// `0,3,5`.
pub(super) fn listed<'a>(shards: impl IntoIterator<Item = &'a u32>) -> String {
    shards
        .into_iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words() {
        let mut m = ShardMap {
            count: 8,
            mine: [0, 3, 5].into(),
            replicas: 2,
            ..Default::default()
        };
        assert_eq!(m.words(), "holds shards 0,3,5 of 8 (2 replicas)");
        m.mine = [7].into();
        m.replicas = 1;
        assert_eq!(m.words(), "holds shard 7 of 8 (1 replica)");
        m.mine.clear();
        assert_eq!(m.words(), "holds no shard of 8 (1 replica)");
        assert!(!ShardMap::default().owns("n"));
        assert_eq!(shard_of("n", 0), 0);
    }
}
