//! The scale benchmark's health events during the steady phase, in three
//! groups of nodes that do not overlap (a node's Events are rate-limited,
//! so a node bursts once):
//!
//! - rolling: 1 % of the fleet a second, each node a burst of
//!   `agents::BURST` events, for the first 40 % of the phase (at 10,000
//!   nodes: 100 nodes and 500 events a second, far above what a fleet's
//!   GPUs report): the load the latency target is for;
//! - a tenth of the fleet at once, halfway;
//! - the rest of the fleet at once, later: what one core takes when every
//!   node reports in the same instant (each check-in a new connection and
//!   TLS handshake), printed without a target.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use super::agents::Agent;
use super::procs::{Controller, CpuTrace};

/// One group of bursts: what it was, the marks sent, and for each of its
/// agents how long after its burst its check-in was answered.
pub struct Group {
    pub what: String,
    pub sent: HashSet<String>,
    pub taken: Vec<Option<Duration>>,
}

/// When each node bursts, from the phase's start.
pub struct Bursts {
    /// (agent, when, group), in order of when.
    at: Vec<(usize, Duration, usize)>,
    groups: Vec<Group>,
}

impl Bursts {
    pub fn plan(n: usize, load: Duration) -> Bursts {
        let per_s = (n / 100).max(1);
        let window = load.mul_f64(0.4);
        let rolled = ((per_s as f64 * window.as_secs_f64()) as usize).min(n * 3 / 10);
        let tenth = (n / 10).max(1).min(n - rolled);
        let rest = n - rolled - tenth;
        let mut at = Vec::with_capacity(n);
        for k in 0..rolled {
            at.push((k, Duration::from_secs_f64(k as f64 / per_s as f64), 0));
        }
        for k in rolled..rolled + tenth {
            at.push((k, load / 2, 1));
        }
        for k in rolled + tenth..n {
            at.push((k, load.mul_f64(0.65), 2));
        }
        let group = |what: String, k: usize| Group {
            what,
            sent: HashSet::new(),
            taken: Vec::with_capacity(k),
        };
        Bursts {
            at,
            groups: vec![
                group(
                    format!(
                        "rolling bursts: {per_s} nodes a second for {:.0} s, {rolled} nodes",
                        window.as_secs_f64()
                    ),
                    rolled,
                ),
                group(
                    format!("{tenth} nodes at once (a tenth of the fleet)"),
                    tenth,
                ),
                group(
                    format!("{rest} nodes at once (the rest of the fleet)"),
                    rest,
                ),
            ],
        }
    }

    /// Fires the bursts on time and notes each agent's answered check-in
    /// until the phase ends (or a minute past it for those not answered).
    /// Returns the groups and a CPU trace from the last group's burst.
    pub async fn run(
        mut self,
        fleet: &[Agent],
        ctrls: &[Controller],
        t: Instant,
        load: Duration,
    ) -> (Vec<Group>, CpuTrace) {
        const TAGS: [&str; 3] = ["rolling", "tenth", "rest"];
        // (agent, group, answers before its burst, when it burst)
        let mut pending: Vec<(usize, usize, u64, Instant)> = Vec::new();
        let mut next = 0;
        let mut trace = None;
        loop {
            let now = Instant::now();
            while next < self.at.len() && t + self.at[next].1 <= now {
                let (i, _, g) = self.at[next];
                if g == self.groups.len() - 1 && trace.is_none() {
                    trace = Some(CpuTrace::start(ctrls.iter().map(|c| c.pid).collect()));
                }
                let base = fleet[i].answers();
                self.groups[g].sent.extend(fleet[i].burst(TAGS[g]));
                pending.push((i, g, base, Instant::now()));
                next += 1;
            }
            let groups = &mut self.groups;
            pending.retain(|&(i, g, base, when)| {
                if fleet[i].answers() > base {
                    groups[g].taken.push(Some(when.elapsed()));
                    false
                } else {
                    true
                }
            });
            let over = now >= t + load && next == self.at.len();
            if over && (pending.is_empty() || now >= t + load + Duration::from_secs(60)) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        for (_, g, _, _) in pending {
            self.groups[g].taken.push(None);
        }
        let trace = trace.unwrap_or_else(|| CpuTrace::start(ctrls.iter().map(|c| c.pid).collect()));
        (self.groups, trace)
    }
}
