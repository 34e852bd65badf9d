//! Human output: the inventory and status tables, and errors in words.

use std::fmt::Write;

use crate::inventory::Inventory;
use crate::plugin::manager::ResourceStatus;
use crate::stages::StageStatus;
/// An error and its causes in words (the model's: the report says errors too).
pub use gpu_model::util::error_words;

/// Left-aligned columns, two spaces apart; the last column is not padded.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            widths[i] = widths[i].max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: Vec<&str>| {
        let last = cells.len() - 1;
        let mut l = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i == last {
                l.push_str(c);
            } else {
                let _ = write!(l, "{c:<w$}  ", w = widths[i]);
            }
        }
        out.push_str(l.trim_end());
        out.push('\n');
    };
    line(headers.to_vec());
    for row in rows {
        line(row.iter().map(String::as_str).collect());
    }
    out
}

fn or_dash<T: ToString>(v: Option<T>) -> String {
    v.map_or_else(|| "-".to_string(), |x| x.to_string())
}

/// One line about the node: machine, driver, CUDA, backend.
pub fn node_line(inv: &Inventory) -> String {
    let mut parts = Vec::new();
    if let Some(m) = &inv.machine {
        parts.push(m.clone());
    }
    match (&inv.driver.version, inv.driver.flavour) {
        (Some(v), Some(f)) => {
            parts.push(format!("driver {v} ({})", format!("{f:?}").to_lowercase()))
        }
        (Some(v), None) => parts.push(format!("driver {v}")),
        _ => parts.push("no NVIDIA driver loaded".into()),
    }
    if let Some(c) = inv.cuda_version {
        parts.push(format!("CUDA {c}"));
    }
    match &inv.backend.error {
        None => parts.push(format!("GPU backend: {}", inv.backend.name)),
        // On a node without GPUs the backend's absence is no news.
        Some(_) if inv.gpus.is_empty() => {}
        Some(e) => parts.push(format!("GPU backend {} unavailable: {e}", inv.backend.name)),
    }
    parts.join(" · ")
}

/// The inventory as people read it: node line, GPU table, topology matrix,
/// warnings.
pub fn inventory(inv: &Inventory) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "node: {}", node_line(inv));
    if inv.gpus.is_empty() {
        out.push_str("no NVIDIA GPU found on this node (no PCI function with vendor 0x10de and class 0x0300/0x0302)\n");
    } else {
        let rows: Vec<Vec<String>> = inv
            .gpus
            .iter()
            .map(|g| {
                vec![
                    or_dash(g.index),
                    g.bus_id.to_string(),
                    g.model.clone().unwrap_or_else(|| "-".into()),
                    g.uuid.clone().unwrap_or_else(|| "-".into()),
                    g.memory_mib
                        .map_or_else(|| "-".into(), |m| format!("{m} MiB")),
                    or_dash(g.compute_capability),
                    or_dash(g.numa_node),
                    match g.mig {
                        None => "-".into(),
                        Some(m) if m.current != m.pending => {
                            format!("{} (pending {})", onoff(m.current), onoff(m.pending))
                        }
                        Some(m) if m.current => format!("on ({} devices)", g.mig_devices.len()),
                        Some(m) => onoff(m.current).into(),
                    },
                    g.pci
                        .as_ref()
                        .and_then(|p| p.driver.clone())
                        .unwrap_or_else(|| "-".into()),
                ]
            })
            .collect();
        out.push_str(&table(
            &[
                "IDX", "BUS ID", "MODEL", "UUID", "MEMORY", "CC", "NUMA", "MIG", "BOUND TO",
            ],
            &rows,
        ));
        out.push_str(&topology(inv));
    }
    for w in &inv.warnings {
        let _ = writeln!(out, "warning: {w}");
    }
    out
}

fn onoff(b: bool) -> &'static str {
    if b { "on" } else { "off" }
}

/// nvidia-smi-style matrix: NV<n> for NVLinks, else the PCIe level.
fn topology(inv: &Inventory) -> String {
    let indexed: Vec<u32> = inv.gpus.iter().filter_map(|g| g.index).collect();
    if indexed.len() < 2 || inv.pairs.is_empty() {
        return String::new();
    }
    let mut headers = vec![String::from("TOPOLOGY")];
    headers.extend(indexed.iter().map(|i| format!("GPU{i}")));
    let rows: Vec<Vec<String>> = indexed
        .iter()
        .map(|&a| {
            let mut row = vec![format!("GPU{a}")];
            for &b in &indexed {
                row.push(if a == b {
                    "X".into()
                } else {
                    match inv.pair(a, b) {
                        Some(p) if p.nvlinks > 0 => format!("NV{}", p.nvlinks),
                        Some(p) => p.pcie.map_or("-", |l| l.short()).to_string(),
                        None => "-".into(),
                    }
                });
            }
            row
        })
        .collect();
    let h: Vec<&str> = headers.iter().map(String::as_str).collect();
    let mut out = String::from("\n");
    out.push_str(&table(&h, &rows));
    out.push_str("(NV<n>: n NVLinks; PIX: one PCIe switch; PXB: several switches; PHB: host bridge; NODE: same NUMA node; SYS: across sockets)\n");
    out
}

/// The device plugin's resources.
pub fn plugin_resources(board: &[ResourceStatus]) -> String {
    let rows: Vec<Vec<String>> = board
        .iter()
        .map(|r| {
            vec![
                r.resource.clone(),
                r.socket.clone(),
                format!("{}/{}", r.devices - r.unhealthy, r.devices),
                match (&r.registered, &r.last_error) {
                    (true, _) => format!("yes ({}x)", r.registrations),
                    (false, Some(e)) => format!("no: {e}"),
                    (false, None) => "not yet".into(),
                },
            ]
        })
        .collect();
    table(&["RESOURCE", "SOCKET", "HEALTHY", "REGISTERED"], &rows)
}

/// The DRA plugin: the kubelet's verdict, DRA's GPUs and devices, the
/// controller's allocations, start-up's recovery, and the claims.
pub fn dra(d: &crate::state::DraStatus) -> String {
    let mut out = format!(
        "dra: {} · socket {} · {} GPU(s), device(s): {}\n",
        d.registration,
        if d.socket.is_empty() { "-" } else { &d.socket },
        d.gpus.len(),
        if d.devices.is_empty() {
            "none".to_string()
        } else {
            d.devices.join(", ")
        }
    );
    if let Some(e) = &d.error {
        out.push_str(&format!("dra: not serving: {e}\n"));
    }
    if !d.unmatched.is_empty() {
        out.push_str(&format!(
            "dra: spec.dra.gpus names no GPU of this node: {}\n",
            d.unmatched.join(", ")
        ));
    }
    out.push_str(&format!(
        "dra: allocations from gpu-controller: {}\n",
        match d.allocations {
            Some(n) => format!("{n} claim(s) allocated to this node"),
            None => "none received yet (prepare waits for them)".into(),
        }
    ));
    if !d.recovery.is_empty() {
        out.push_str(&format!("dra: at start: {}\n", d.recovery));
    }
    if let Some(why) = &d.mps_unavailable {
        out.push_str(&format!(
            "dra: claims cannot share GPUs through MPS here: {why}\n"
        ));
    }
    if !d.claims.is_empty() {
        let rows: Vec<Vec<String>> = d
            .claims
            .iter()
            .map(|c| {
                vec![
                    format!("{}/{}", c.namespace, c.name),
                    c.uid.clone(),
                    c.state.clone(),
                    c.devices.join(", "),
                    c.mps.clone().unwrap_or_else(|| "-".into()),
                ]
            })
            .collect();
        out.push_str(&table(
            &["CLAIM", "UID", "STATE", "DEVICES", "MPS DAEMON"],
            &rows,
        ));
    }
    out
}

/// The stage table: state, last validation, repairs; failed validations
/// and the last repairs below it.
pub fn stages(stages: &[StageStatus]) -> String {
    let now = crate::state::now();
    let rows: Vec<Vec<String>> = stages
        .iter()
        .map(|s| {
            vec![
                s.stage.name().to_string(),
                s.state.label().to_string(),
                match &s.validation {
                    Some(v) if v.ok => format!("ok ({})", ago(now, v.since)),
                    Some(_) => "FAILED".into(),
                    None => "-".into(),
                },
                s.repairs.to_string(),
                s.detail.clone(),
            ]
        })
        .collect();
    let mut out = table(&["STAGE", "STATE", "VALIDATED", "REPAIRS", "DETAIL"], &rows);
    for s in stages {
        if let Some(v) = s.validation.as_ref().filter(|v| !v.ok) {
            out.push_str(&format!(
                "validation of {} failed ({}): {}\n",
                s.stage.name(),
                ago(now, v.since),
                v.detail
            ));
        }
        if let Some(r) = &s.last_repair {
            out.push_str(&format!(
                "last repair of {} ({}): {}\n",
                s.stage.name(),
                ago(now, r.at),
                r.what
            ));
        }
    }
    out
}

/// The capabilities the running agent holds, each with the stages that
/// use it and what for; what it dropped at start and why.
pub fn privileges(p: &crate::caps::Privileges) -> String {
    let rows: Vec<Vec<String>> = p
        .held
        .iter()
        .map(|h| {
            vec![
                h.name.clone(),
                if h.stages.is_empty() {
                    "-".into()
                } else {
                    h.stages.join(", ")
                },
                h.why.clone(),
            ]
        })
        .collect();
    let mut out = if rows.is_empty() {
        "capabilities: none held\n".to_string()
    } else {
        table(&["CAPABILITY", "USED BY", "WHY"], &rows)
    };
    for d in &p.dropped {
        let _ = writeln!(out, "dropped at start: {}, because {}", d.name, d.because);
    }
    if p.dropped_count > 0 {
        let _ = write!(
            out,
            "{} capabilities dropped at start in all",
            p.dropped_count
        );
        let held: std::collections::BTreeSet<&str> =
            p.held.iter().map(|h| h.name.as_str()).collect();
        match &p.bounding {
            Some(b)
                if b.iter()
                    .map(String::as_str)
                    .collect::<std::collections::BTreeSet<_>>()
                    != held =>
            {
                let _ = writeln!(out, "; bounding set: {}", b.join(", "));
            }
            _ => out.push_str("; the bounding set holds no more than the above\n"),
        }
    }
    for n in &p.notes {
        let _ = writeln!(out, "capabilities: {n}");
    }
    if let Some(c) = &p.cluster {
        let _ = writeln!(out, "capabilities: {c}");
    }
    out
}

/// `12 s ago`, `5 min ago`, `3 h ago`.
pub fn ago(now: u64, then: u64) -> String {
    let d = now.saturating_sub(then);
    match d {
        0..120 => format!("{d} s ago"),
        120..7200 => format!("{} min ago", d / 60),
        _ => format!("{} h ago", d / 3600),
    }
}

/// Each GPU's health, with the advice for the unhealthy ones, in the
/// order of the GPUs' indices, each named by index and bus id as well as
/// UUID (from `inventory`; a GPU it does not name comes last, by UUID).
pub fn health(
    board: &[crate::health::GpuHealth],
    inventory: Option<&crate::inventory::Inventory>,
) -> String {
    let find = |uuid: &str| {
        inventory.and_then(|inv| inv.gpus.iter().find(|g| g.uuid.as_deref() == Some(uuid)))
    };
    let mut sorted: Vec<_> = board
        .iter()
        .map(|g| (find(&g.uuid).and_then(|i| i.index), find(&g.uuid), g))
        .collect();
    sorted.sort_by(|a, b| (a.0.is_none(), a.0, &a.2.uuid).cmp(&(b.0.is_none(), b.0, &b.2.uuid)));
    let rows: Vec<Vec<String>> = sorted
        .into_iter()
        .map(|(index, gpu, g)| {
            vec![
                index.map_or("-".into(), |i| i.to_string()),
                gpu.map_or("-".into(), |i| i.bus_id.to_string()),
                g.uuid.clone(),
                if g.healthy { "healthy" } else { "UNHEALTHY" }.into(),
                g.events.to_string(),
                match (&g.reason, &g.advice) {
                    (Some(r), Some(a)) if !g.healthy => format!("{r} — {a}"),
                    (Some(r), _) if !g.healthy => r.clone(),
                    _ => String::new(),
                },
            ]
        })
        .collect();
    table(&["IDX", "BUS ID", "GPU", "HEALTH", "EVENTS", "WHY"], &rows)
}

/// The supervised tasks.
pub fn tasks(tasks: &[crate::state::TaskStatus]) -> String {
    let rows: Vec<Vec<String>> = tasks
        .iter()
        .map(|t| {
            vec![
                t.name.clone(),
                if t.running { "running" } else { "stopped" }.into(),
                t.restarts.to_string(),
                t.last_error.clone().unwrap_or_default(),
            ]
        })
        .collect();
    table(&["TASK", "STATE", "RESTARTS", "LAST ERROR"], &rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The health table is in index order, each GPU named by index and bus
    /// id (it was sorted by UUID, GPU 0 the fifth row on an 8-GPU node).
    #[test]
    fn health_rows_follow_the_gpu_indices() {
        let inv = crate::test_support::inventory_of("h100-sxm-8");
        let mut board: Vec<crate::health::GpuHealth> = inv
            .gpus
            .iter()
            .map(|g| crate::health::GpuHealth {
                uuid: g.uuid.clone().unwrap(),
                healthy: g.index != Some(3),
                reason: (g.index == Some(3)).then(|| "XID 79".to_string()),
                advice: None,
                xid: (g.index == Some(3)).then_some(79),
                lost: false,
                events: u64::from(g.index == Some(3)),
            })
            .collect();
        board.sort_by(|a, b| a.uuid.cmp(&b.uuid));
        board.push(crate::health::GpuHealth {
            uuid: "GPU-00000000-gone".into(),
            healthy: false,
            reason: Some("GPU lost".into()),
            advice: None,
            xid: None,
            lost: true,
            events: 1,
        });
        let out = health(&board, Some(&inv));
        let lines: Vec<&str> = out.lines().collect();
        assert!(lines[0].starts_with("IDX  BUS ID"), "{out}");
        for (row, g) in lines[1..9].iter().zip(&inv.gpus) {
            let idx = g.index.unwrap().to_string();
            let bus = g.bus_id.to_string();
            assert!(
                row.starts_with(&format!("{idx:<5}{bus}")),
                "{row} is not GPU {idx} ({bus}):\n{out}"
            );
        }
        assert!(
            lines[4].contains("UNHEALTHY") && lines[4].contains("XID 79"),
            "{out}"
        );
        // A GPU the inventory no longer has comes last, without index.
        assert!(lines[9].starts_with("-    -"), "{out}");
    }

    #[test]
    fn columns_align_and_last_is_not_padded() {
        let t = table(
            &["A", "LONGER"],
            &[
                vec!["xyz".into(), "1".into()],
                vec!["q".into(), "22".into()],
            ],
        );
        assert_eq!(t, "A    LONGER\nxyz  1\nq    22\n");
    }

    #[test]
    fn privileges_name_stages_reasons_and_what_was_dropped() {
        use crate::caps::{DroppedCap, HeldCap, Privileges};
        let p = Privileges {
            held: vec![
                HeldCap {
                    name: "CAP_MKNOD".into(),
                    stages: vec!["devnodes".into()],
                    why: "make nodes (mknod)".into(),
                },
                HeldCap {
                    name: "CAP_NET_ADMIN".into(),
                    stages: vec![],
                    why: "no enabled stage uses it".into(),
                },
            ],
            dropped: vec![DroppedCap {
                name: "CAP_SYS_MODULE".into(),
                because: "driver was disabled (spec.driver.enabled is false)".into(),
            }],
            dropped_count: 38,
            bounding: Some(vec!["CAP_MKNOD".into(), "CAP_NET_ADMIN".into()]),
            notes: vec![],
            cluster: None,
        };
        assert_eq!(
            privileges(&p),
            "CAPABILITY     USED BY   WHY\n\
             CAP_MKNOD      devnodes  make nodes (mknod)\n\
             CAP_NET_ADMIN  -         no enabled stage uses it\n\
             dropped at start: CAP_SYS_MODULE, because driver was disabled (spec.driver.enabled is false)\n\
             38 capabilities dropped at start in all; the bounding set holds no more than the above\n"
        );
    }
}
