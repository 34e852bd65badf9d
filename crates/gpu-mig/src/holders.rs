//! Processes holding the GPUs a plan changes (open device nodes, NVML's
//! process list), and the wait for them to let go.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use hostlib::HostRoot;

use crate::planner::Plan;
use gpu_model::mig::MigControl;

/// A process that holds a GPU that is about to change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holder {
    pub pid: u32,
    pub command: String,
    pub device: String,
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "pid {} ({}) on {}", self.pid, self.command, self.device)
    }
}

/// Processes other than this agent (and the driver's persistence daemon,
/// which holds every GPU and does not stand in MIG's way) holding the
/// changing GPUs: open `/dev/nvidiaN` or MIG capability nodes (from the
/// host's /proc), and what NVML lists as running on them.
pub fn holders(control: &dyn MigControl, host: &HostRoot, plan: &Plan) -> Vec<Holder> {
    let mut wanted: BTreeMap<String, u32> = BTreeMap::new();
    for g in plan.changing() {
        if let Some(m) = g.minor {
            wanted.insert(format!("/dev/nvidia{m}"), g.index);
        }
        for c in &g.cap_nodes {
            wanted.insert(c.clone(), g.index);
        }
    }
    let me = host
        .read_link("/proc/self")
        .ok()
        .and_then(|p| p.to_str().and_then(|s| s.parse::<u32>().ok()))
        .unwrap_or_else(std::process::id);
    let command = |pid: u32| {
        host.read_to_string(format!("/proc/{pid}/comm"))
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "?".into())
    };
    let mut found: Vec<Holder> = Vec::new();
    for name in host.read_dir_names("/proc").unwrap_or_default() {
        let Ok(pid) = name.parse::<u32>() else {
            continue;
        };
        if pid == me {
            continue;
        }
        let Ok(fds) = host.read_dir_names(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for fd in fds {
            let Ok(target) = host.read_link(format!("/proc/{pid}/fd/{fd}")) else {
                continue;
            };
            let target = target.display().to_string();
            if wanted.contains_key(&target)
                && !found.iter().any(|h| h.pid == pid && h.device == target)
            {
                found.push(Holder {
                    pid,
                    command: command(pid),
                    device: target,
                });
            }
        }
    }
    for g in plan.changing() {
        for pid in control.processes(&g.uuid).unwrap_or_default() {
            if pid != me && !found.iter().any(|h| h.pid == pid) {
                found.push(Holder {
                    pid,
                    command: command(pid),
                    device: format!("GPU {} ({})", g.index, g.uuid),
                });
            }
        }
    }
    found.retain(|h| h.command != "nvidia-persiste");
    found.sort_by(|a, b| (a.pid, &a.device).cmp(&(b.pid, &b.device)));
    found
}

/// Waits until no process holds the changing GPUs, up to `timeout`;
/// `Err` names those that still do.
pub fn wait_for_holders(
    control: &dyn MigControl,
    host: &HostRoot,
    plan: &Plan,
    timeout: Duration,
) -> Result<(), String> {
    let deadline = Instant::now() + timeout;
    loop {
        let h = holders(control, host, plan);
        if h.is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(holders_message(&h, timeout));
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

pub fn holders_message(h: &[Holder], timeout: Duration) -> String {
    format!(
        "GPUs still in use after {} s (spec.migManager.gpuClientsTimeoutSeconds): {}",
        timeout.as_secs(),
        h.iter()
            .map(Holder::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    )
}
