//! `GetPreferredAllocation`: which of the available devices a container
//! should get.
//!
//! Whole GPUs: the set with the highest sum of pair scores, a pair scoring
//! 100 per NVLink between the two GPUs plus its PCIe proximity (same board
//! 60, one switch 50, several switches 40, host bridge 30, same NUMA node 20,
//! across sockets 10), as NVIDIA's allocator scores them. Every set is tried
//! (exact) up to [`EXACT_LIMIT`] candidate sets, greedily beyond.
//!
//! Replicas: `distributed` takes replicas from the GPUs with the fewest in
//! use, `packed` from the GPUs with the most.

use std::collections::{BTreeMap, BTreeSet};

use super::config::AllocationPolicy;
use super::resources::{PluginDevice, Resource};
use gpu_model::backend::PcieLevel;
use gpu_model::inventory::Inventory;

/// The most candidate sets scored exactly before falling back to greedy.
pub const EXACT_LIMIT: u64 = 200_000;

/// A request that cannot be answered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PreferredError {
    #[error("{resource}: unknown device ID {id:?}")]
    Unknown { resource: String, id: String },
    #[error("{resource}: must-include device {id:?} is not among the available devices")]
    MustNotAvailable { resource: String, id: String },
    #[error(
        "{resource}: cannot pick {size} devices: {available} available, {must} must be included"
    )]
    BadSize {
        resource: String,
        size: usize,
        available: usize,
        must: usize,
    },
}

/// PCIe proximity score.
pub fn pcie_score(level: PcieLevel) -> u32 {
    match level {
        PcieLevel::SameBoard => 60,
        PcieLevel::SingleSwitch => 50,
        PcieLevel::MultiSwitch => 40,
        PcieLevel::HostBridge => 30,
        PcieLevel::SameNuma => 20,
        PcieLevel::CrossNuma => 10,
    }
}

/// The score of GPUs `a` and `b` (NVML indices).
pub fn pair_score(inv: &Inventory, a: u32, b: u32) -> u32 {
    inv.pair(a, b)
        .map_or(0, |p| 100 * p.nvlinks + p.pcie.map_or(0, pcie_score))
}

/// The total score of a set of GPUs.
pub fn set_score(inv: &Inventory, set: &[u32]) -> u32 {
    let mut s = 0;
    for (i, &a) in set.iter().enumerate() {
        for &b in &set[i + 1..] {
            s += pair_score(inv, a, b);
        }
    }
    s
}

fn lookup<'r>(resource: &'r Resource, id: &str) -> Result<&'r PluginDevice, PreferredError> {
    resource
        .devices
        .iter()
        .find(|d| d.id == id)
        .ok_or_else(|| PreferredError::Unknown {
            resource: resource.name.clone(),
            id: id.to_string(),
        })
}

/// The preferred devices for one container request.
pub fn preferred(
    resource: &Resource,
    inv: &Inventory,
    policy: AllocationPolicy,
    available: &[String],
    must_include: &[String],
    size: usize,
) -> Result<Vec<String>, PreferredError> {
    let mut avail: Vec<&PluginDevice> = Vec::new();
    for id in available {
        let d = lookup(resource, id)?;
        if !avail.iter().any(|x| x.id == d.id) {
            avail.push(d);
        }
    }
    let mut must: Vec<&PluginDevice> = Vec::new();
    for id in must_include {
        let d = lookup(resource, id)?;
        if !avail.iter().any(|x| x.id == d.id) {
            return Err(PreferredError::MustNotAvailable {
                resource: resource.name.clone(),
                id: id.clone(),
            });
        }
        if !must.iter().any(|x| x.id == d.id) {
            must.push(d);
        }
    }
    if size > avail.len() || must.len() > size {
        return Err(PreferredError::BadSize {
            resource: resource.name.clone(),
            size,
            available: avail.len(),
            must: must.len(),
        });
    }
    if resource.shared {
        Ok(replicas(resource, policy, &avail, &must, size))
    } else {
        Ok(whole(inv, &avail, &must, size))
    }
}

fn binomial(n: u64, k: u64) -> u64 {
    let k = k.min(n - k);
    let mut r: u64 = 1;
    for i in 0..k {
        r = r.saturating_mul(n - i) / (i + 1);
    }
    r
}

fn whole(
    inv: &Inventory,
    avail: &[&PluginDevice],
    must: &[&PluginDevice],
    size: usize,
) -> Vec<String> {
    let fixed: Vec<u32> = must.iter().map(|d| d.index).collect();
    let mut candidates: Vec<&PluginDevice> = avail
        .iter()
        .copied()
        .filter(|d| !must.iter().any(|m| m.id == d.id))
        .collect();
    candidates.sort_by_key(|d| d.index);
    let k = size - must.len();
    let chosen: Vec<usize> = if binomial(candidates.len() as u64, k as u64) <= EXACT_LIMIT {
        best_combination(inv, &fixed, &candidates, k)
    } else {
        greedy(inv, &fixed, &candidates, k)
    };
    must.iter()
        .map(|d| d.id.clone())
        .chain(chosen.into_iter().map(|i| candidates[i].id.clone()))
        .collect()
}

/// Every k-subset of the candidates (in lexicographic order; the first of
/// equal scores wins, so the answer is deterministic).
fn best_combination(
    inv: &Inventory,
    fixed: &[u32],
    candidates: &[&PluginDevice],
    k: usize,
) -> Vec<usize> {
    let n = candidates.len();
    let mut combo: Vec<usize> = (0..k).collect();
    let mut best = combo.clone();
    let mut best_score = None;
    let mut set: Vec<u32> = Vec::with_capacity(fixed.len() + k);
    loop {
        set.clear();
        set.extend_from_slice(fixed);
        set.extend(combo.iter().map(|&i| candidates[i].index));
        let s = set_score(inv, &set);
        if best_score.is_none_or(|b| s > b) {
            best_score = Some(s);
            best.clone_from(&combo);
        }
        // Next combination.
        let Some(i) = (0..k).rev().find(|&i| combo[i] < n - k + i) else {
            break;
        };
        combo[i] += 1;
        for j in i + 1..k {
            combo[j] = combo[j - 1] + 1;
        }
    }
    best
}

fn greedy(inv: &Inventory, fixed: &[u32], candidates: &[&PluginDevice], k: usize) -> Vec<usize> {
    let mut set: Vec<u32> = fixed.to_vec();
    let mut chosen: Vec<usize> = Vec::new();
    for _ in 0..k {
        let next = (0..candidates.len())
            .filter(|i| !chosen.contains(i))
            .max_by_key(|&i| {
                let gain: u32 = set
                    .iter()
                    .map(|&s| pair_score(inv, s, candidates[i].index))
                    .sum();
                (gain, std::cmp::Reverse(i))
            })
            .expect("enough candidates");
        set.push(candidates[next].index);
        chosen.push(next);
    }
    chosen
}

fn replicas(
    resource: &Resource,
    policy: AllocationPolicy,
    avail: &[&PluginDevice],
    must: &[&PluginDevice],
    size: usize,
) -> Vec<String> {
    // Replicas are grouped by the device they share (a GPU or a MIG device).
    let mut total: BTreeMap<&str, u32> = BTreeMap::new();
    for d in &resource.devices {
        *total.entry(d.uuid.as_str()).or_default() += 1;
    }
    let mut free: BTreeMap<&str, Vec<&PluginDevice>> = BTreeMap::new();
    for d in avail {
        free.entry(d.uuid.as_str()).or_default().push(d);
    }
    for v in free.values_mut() {
        v.sort_by_key(|d| d.replica);
    }
    let mut picked: BTreeMap<&str, u32> = BTreeMap::new();
    let mut out: Vec<String> = Vec::new();
    let mut taken: BTreeSet<&str> = BTreeSet::new();
    for d in must {
        out.push(d.id.clone());
        taken.insert(&d.id);
        *picked.entry(d.uuid.as_str()).or_default() += 1;
    }
    while out.len() < size {
        // In use = replicas not available + picked in this request.
        let candidates = free
            .iter()
            .filter(|(_, ds)| ds.iter().any(|d| !taken.contains(d.id.as_str())));
        let key = |(dev, ds): &(&&str, &Vec<&PluginDevice>)| {
            let in_use = total.get(**dev).copied().unwrap_or(0) - ds.len() as u32;
            let this_round = picked.get(**dev).copied().unwrap_or(0);
            (
                in_use + this_round,
                this_round,
                ds[0].index,
                ds[0].index_name.clone(),
            )
        };
        let chosen = match policy {
            AllocationPolicy::Distributed => candidates.min_by_key(|c| key(c)),
            AllocationPolicy::Packed => candidates.max_by_key(|c| {
                let (used, this_round, index, name) = key(c);
                (
                    used,
                    std::cmp::Reverse(this_round),
                    std::cmp::Reverse(index),
                    std::cmp::Reverse(name),
                )
            }),
        };
        let Some((dev, ds)) = chosen else { break };
        let d = ds
            .iter()
            .find(|d| !taken.contains(d.id.as_str()))
            .expect("filtered above");
        out.push(d.id.clone());
        taken.insert(&d.id);
        *picked.entry(*dev).or_default() += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::PluginConfig;
    use crate::resources::{PluginSettings, build};
    use crate::test_support::inventory_of;
    use proptest::prelude::*;

    fn setup(node: &str) -> (Inventory, Resource) {
        let inv = inventory_of(node);
        let r = build(&inv, &PluginSettings::default()).unwrap().remove(0);
        (inv, r)
    }

    fn all_ids(r: &Resource) -> Vec<String> {
        r.devices.iter().map(|d| d.id.clone()).collect()
    }

    fn indices(r: &Resource, ids: &[String]) -> Vec<u32> {
        ids.iter()
            .map(|id| r.devices.iter().find(|d| &d.id == id).unwrap().index)
            .collect()
    }

    #[test]
    fn t4_pairs_stay_behind_one_switch() {
        let (inv, r) = setup("t4-4");
        let got = preferred(
            &r,
            &inv,
            AllocationPolicy::Distributed,
            &all_ids(&r),
            &[],
            2,
        )
        .unwrap();
        assert_eq!(indices(&r, &got), [0, 1]);
        // With GPU 2 required, its switch partner 3 joins it.
        let got = preferred(
            &r,
            &inv,
            AllocationPolicy::Distributed,
            &all_ids(&r),
            &[r.devices[2].id.clone()],
            2,
        )
        .unwrap();
        assert_eq!(indices(&r, &got), [2, 3]);
    }

    #[test]
    fn h100_prefers_the_same_pcie_switch_among_equal_nvlink() {
        let (inv, r) = setup("h100-sxm-8");
        let avail: Vec<String> = [1, 2, 3, 5]
            .iter()
            .map(|&i| r.devices[i].id.clone())
            .collect();
        let got = preferred(&r, &inv, AllocationPolicy::Distributed, &avail, &[], 2).unwrap();
        assert_eq!(indices(&r, &got), [2, 3]);
    }

    #[test]
    fn bad_requests_are_refused() {
        let (inv, r) = setup("t4-4");
        let ids = all_ids(&r);
        let p = AllocationPolicy::Distributed;
        assert!(matches!(
            preferred(&r, &inv, p, &ids, &[], 5),
            Err(PreferredError::BadSize { .. })
        ));
        assert!(matches!(
            preferred(&r, &inv, p, &["x".into()], &[], 1),
            Err(PreferredError::Unknown { .. })
        ));
        assert!(matches!(
            preferred(&r, &inv, p, &ids[..2], &[ids[3].clone()], 2),
            Err(PreferredError::MustNotAvailable { .. })
        ));
    }

    fn shared(node: &str, replicas: u32) -> (Inventory, Resource) {
        let inv = inventory_of(node);
        let c = PluginConfig::from_yaml(
            &format!("version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {{name: nvidia.com/gpu, replicas: {replicas}}}\n"),
            "c",
        )
        .unwrap();
        let s = PluginSettings {
            time_slicing: c.sharing.time_slicing,
            ..PluginSettings::default()
        };
        let r = build(&inv, &s).unwrap().remove(0);
        (inv, r)
    }

    #[test]
    fn distributed_spreads_and_packed_stacks() {
        let (inv, r) = shared("t4-4", 4);
        // GPU 0 already has 3 replicas in use, GPU 1 has 1.
        let avail: Vec<String> = r
            .devices
            .iter()
            .filter(|d| {
                let in_use = (d.index == 0 && d.replica.unwrap() < 3)
                    || (d.index == 1 && d.replica == Some(0));
                !in_use
            })
            .map(|d| d.id.clone())
            .collect();
        let got = preferred(&r, &inv, AllocationPolicy::Distributed, &avail, &[], 2).unwrap();
        assert_eq!(indices(&r, &got), [2, 3]);
        let got = preferred(&r, &inv, AllocationPolicy::Packed, &avail, &[], 2).unwrap();
        assert_eq!(indices(&r, &got), [0, 1]);
    }

    /// The maximum set score over every size-k subset containing `must`,
    /// by plain recursion (independent of the implementation's enumerator).
    fn brute_force_best(inv: &Inventory, avail: &[u32], must: &[u32], k: usize) -> u32 {
        fn rec(inv: &Inventory, rest: &[u32], cur: &mut Vec<u32>, k: usize, best: &mut u32) {
            if cur.len() == k {
                *best = (*best).max(set_score(inv, cur));
                return;
            }
            for (i, &g) in rest.iter().enumerate() {
                cur.push(g);
                rec(inv, &rest[i + 1..], cur, k, best);
                cur.pop();
            }
        }
        let rest: Vec<u32> = avail
            .iter()
            .copied()
            .filter(|g| !must.contains(g))
            .collect();
        let mut best = 0;
        rec(inv, &rest, &mut must.to_vec(), k, &mut best);
        best
    }

    fn check_whole(node: &str, mask: u8, must_mask: u8, size: usize) -> Result<(), TestCaseError> {
        let (inv, r) = setup(node);
        let n = r.devices.len();
        let avail: Vec<u32> = (0..n as u32).filter(|i| mask & (1 << i) != 0).collect();
        let must: Vec<u32> = avail
            .iter()
            .copied()
            .filter(|i| must_mask & (1 << i) != 0)
            .collect();
        prop_assume!(!avail.is_empty());
        let size = 1 + size % avail.len();
        prop_assume!(must.len() <= size);
        let id = |i: u32| r.devices[i as usize].id.clone();
        let avail_ids: Vec<String> = avail.iter().map(|&i| id(i)).collect();
        let must_ids: Vec<String> = must.iter().map(|&i| id(i)).collect();
        let got = preferred(
            &r,
            &inv,
            AllocationPolicy::Distributed,
            &avail_ids,
            &must_ids,
            size,
        )
        .unwrap();
        let got_idx = indices(&r, &got);
        prop_assert_eq!(got.len(), size);
        prop_assert!(
            got_idx.iter().all(|g| avail.contains(g)),
            "not a subset of available"
        );
        prop_assert!(
            must.iter().all(|m| got_idx.contains(m)),
            "must-include missing"
        );
        let unique: BTreeSet<u32> = got_idx.iter().copied().collect();
        prop_assert_eq!(unique.len(), size);
        prop_assert_eq!(
            set_score(&inv, &got_idx),
            brute_force_best(&inv, &avail, &must, size)
        );
        Ok(())
    }

    proptest! {
        #[test]
        fn whole_gpus_h100_maximal(mask in 1u8.., must_mask in any::<u8>(), size in 0usize..8) {
            check_whole("h100-sxm-8", mask, must_mask, size)?;
        }

        #[test]
        fn whole_gpus_t4_maximal(mask in 1u8..16, must_mask in 0u8..16, size in 0usize..4) {
            check_whole("t4-4", mask, must_mask, size)?;
        }

        #[test]
        fn replicas_subset_must_and_size(used in proptest::collection::vec(any::<bool>(), 16), must_pick in any::<u16>(), size in 1usize..16, packed in any::<bool>()) {
            let (inv, r) = shared("t4-4", 4);
            let avail: Vec<String> = r.devices.iter().zip(&used).filter(|(_, u)| !**u).map(|(d, _)| d.id.clone()).collect();
            prop_assume!(!avail.is_empty());
            let size = 1 + (size - 1) % avail.len();
            let must: Vec<String> = avail.iter().enumerate().filter(|(i, _)| must_pick & (1 << i) != 0).map(|(_, id)| id.clone()).take(size).collect();
            let policy = if packed { AllocationPolicy::Packed } else { AllocationPolicy::Distributed };
            let got = preferred(&r, &inv, policy, &avail, &must, size).unwrap();
            prop_assert_eq!(got.len(), size);
            prop_assert!(got.iter().all(|g| avail.contains(g)));
            prop_assert!(must.iter().all(|m| got.contains(m)));
            let unique: BTreeSet<&String> = got.iter().collect();
            prop_assert_eq!(unique.len(), size);
        }
    }
}
