//! Where GPU instances go: each profile can start only at some memory
//! slices (NVML's possible placements), and instances may not overlap. A
//! layout fits when every wanted instance gets a start; mig-parted finds one
//! by trying creation orders, gpu-agent by searching the placements NVML
//! lists, then creating each instance at its start.

/// A GPU instance's place: its first memory slice and how many it spans.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Placement {
    pub start: u32,
    pub size: u32,
}

impl Placement {
    fn mask(self) -> u128 {
        if self.size >= 128 || self.start >= 128 {
            return u128::MAX;
        }
        let ones = if self.size == 0 {
            0
        } else {
            (1u128 << self.size) - 1
        };
        ones << self.start
    }
}

/// How many tries the search makes before it gives up (a GPU has at most a
/// few dozen placements; this only bounds a pathological input).
const MAX_STEPS: usize = 200_000;

/// Up to `limit` ways to place `wanted` (each item: the placements its
/// profile allows), given slices already taken by `taken`; each way lists
/// one placement per item, in the items' order. Items with fewer choices and
/// bigger sizes are placed first.
pub fn solutions(
    wanted: &[&[Placement]],
    taken: &[Placement],
    limit: usize,
) -> Vec<Vec<Placement>> {
    let mut order: Vec<usize> = (0..wanted.len()).collect();
    order.sort_by_key(|&i| {
        let size = wanted[i].iter().map(|p| p.size).max().unwrap_or(0);
        (std::cmp::Reverse(size), wanted[i].len(), i)
    });
    let used = taken.iter().fold(0u128, |m, p| m | p.mask());
    let mut found = Vec::new();
    let mut chosen: Vec<Option<Placement>> = vec![None; wanted.len()];
    let mut steps = 0;
    search(
        wanted,
        &order,
        0,
        used,
        &mut chosen,
        &mut found,
        limit,
        &mut steps,
    );
    found
}

#[allow(clippy::too_many_arguments)]
fn search(
    wanted: &[&[Placement]],
    order: &[usize],
    depth: usize,
    used: u128,
    chosen: &mut Vec<Option<Placement>>,
    found: &mut Vec<Vec<Placement>>,
    limit: usize,
    steps: &mut usize,
) {
    if found.len() >= limit || *steps >= MAX_STEPS {
        return;
    }
    *steps += 1;
    let Some(&item) = order.get(depth) else {
        found.push(
            chosen
                .iter()
                .map(|p| p.expect("every item placed"))
                .collect(),
        );
        return;
    };
    // Two items with the same choices (two instances of one profile) take
    // them in increasing order: the same set of starts is one solution.
    let floor = order[..depth]
        .iter()
        .rev()
        .find(|&&j| wanted[j] == wanted[item])
        .and_then(|&j| chosen[j]);
    for &p in wanted[item] {
        if floor.is_some_and(|f| p <= f) {
            continue;
        }
        if used & p.mask() != 0 {
            continue;
        }
        chosen[item] = Some(p);
        search(
            wanted,
            order,
            depth + 1,
            used | p.mask(),
            chosen,
            found,
            limit,
            steps,
        );
        chosen[item] = None;
        if found.len() >= limit {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn starts(size: u32, s: &[u32]) -> Vec<Placement> {
        s.iter().map(|&start| Placement { start, size }).collect()
    }

    #[test]
    fn an_h100_balanced_layout_fits_and_overfull_ones_do_not() {
        // H100 80GB: 1g size 1 at 0..6, 2g size 2 at 0,2,4, 3g size 4 at 0,4.
        let one = starts(1, &[0, 1, 2, 3, 4, 5, 6]);
        let two = starts(2, &[0, 2, 4]);
        let three = starts(4, &[0, 4]);
        let seven = starts(8, &[0]);
        let s = solutions(&[&one, &one, &two, &three], &[], 1);
        assert_eq!(s.len(), 1);
        let mut all: Vec<Placement> = s[0].clone();
        all.sort();
        for w in all.windows(2) {
            assert!(w[0].start + w[0].size <= w[1].start, "{all:?}");
        }
        assert!(solutions(&[&three, &three, &one], &[], 1).is_empty());
        assert!(solutions(&[&seven, &one], &[], 1).is_empty());
        assert_eq!(solutions(&[one.as_slice(); 7], &[], 5).len(), 1);
        assert!(solutions(&[one.as_slice(); 8], &[], 1).is_empty());
        // 4g + 2g + 1g: only with the 2g at 4 and the 1g at 6.
        let four = starts(4, &[0]);
        assert_eq!(
            solutions(&[&four, &two, &one], &[], 10),
            vec![vec![
                Placement { start: 0, size: 4 },
                Placement { start: 4, size: 2 },
                Placement { start: 6, size: 1 }
            ]]
        );
        // Slices already taken are avoided.
        assert!(solutions(&[&four], &[Placement { start: 2, size: 1 }], 1).is_empty());
    }

    #[test]
    fn identical_instances_are_not_counted_twice() {
        let one = starts(1, &[0, 1, 2]);
        assert_eq!(solutions(&[&one, &one], &[], 100).len(), 3);
    }
}
