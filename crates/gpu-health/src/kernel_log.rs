//! The kernel log as a health source: [`kmsg::KmsgReader`] follows the
//! host's `/dev/kmsg`; each `NVRM: Xid` line becomes a health event for the
//! GPU with that PCI bus id (the inventory says which UUID that is). XIDs
//! logged before the agent started count when they are younger than the
//! recovery period (a GPU that failed a minute before a restart is still
//! suspect), older ones are only logged. [`follow`] is one run of the
//! reader; the supervisor starts it again with backoff when it fails, and
//! [`Since`] makes a new run skip what an earlier one already sent.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use hostlib::HostRoot;
use tokio::sync::{mpsc, watch};

use super::kmsg::{self, KernelXid, KmsgReader};
use gpu_model::backend::HealthEvent;
use gpu_model::inventory::Inventory;

/// The kernel timestamp (µs since boot) from which XIDs count: at start,
/// now less the look-back; after each XID sent, just past it (a run that
/// starts again reads the log from its beginning).
#[derive(Clone, Debug)]
pub struct Since(Arc<AtomicU64>);

impl Since {
    /// XIDs from `lookback` before now count.
    pub fn new(lookback: Option<Duration>) -> Self {
        let now = kmsg::monotonic_now_us();
        let cutoff = lookback.map_or(now, |d| now.saturating_sub(d.as_micros() as u64));
        Since(Arc::new(AtomicU64::new(cutoff)))
    }

    fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }

    fn seen(&self, at_us: u64) {
        self.0.fetch_max(at_us.saturating_add(1), Ordering::Relaxed);
    }
}

/// How a run of the reader ended without failing.
#[derive(Debug, PartialEq, Eq)]
pub enum Ended {
    /// Nothing to read on this host (no `/dev/kmsg` under the host root):
    /// said once, health goes on from NVML.
    Off(String),
    /// The monitor is gone (the agent stops).
    Done,
}

/// Follows the host's kernel log, sending XIDs to `events`, until it fails
/// (`Err`, naming the path: to be started again) or [`Ended`].
pub async fn follow(
    host: HostRoot,
    inventory: watch::Receiver<Arc<Inventory>>,
    events: mpsc::UnboundedSender<HealthEvent>,
    since: Since,
) -> Result<Ended, String> {
    let reader = match KmsgReader::open(&host) {
        Ok(r) => r.since_boot_us(since.get()),
        Err(e) if e.is_not_found() => {
            tracing::warn!(stage = "health", source = "kmsg", error = %e, "no kernel log to read; XIDs come from NVML only");
            return Ok(Ended::Off(e.to_string()));
        }
        Err(e) => return Err(format!("cannot read the kernel log: {e}")),
    };
    let (tx, mut rx) = mpsc::unbounded_channel::<KernelXid>();
    let run = reader.run(tx, std::future::pending());
    tokio::pin!(run);
    let result = loop {
        tokio::select! {
            r = &mut run => break r,
            Some(x) = rx.recv() => forward(&inventory, &events, &since, x),
        }
    };
    while let Ok(x) = rx.try_recv() {
        forward(&inventory, &events, &since, x);
    }
    match result {
        Ok(()) => Ok(Ended::Done),
        Err(e) => Err(format!("the kernel log reader failed: {e}")),
    }
}

/// Sends an XID to the monitor for the GPU at its bus id.
fn forward(
    inventory: &watch::Receiver<Arc<Inventory>>,
    events: &mpsc::UnboundedSender<HealthEvent>,
    since: &Since,
    x: KernelXid,
) {
    since.seen(x.at_us);
    let inv = inventory.borrow();
    let gpu = inv
        .gpus
        .iter()
        .find(|g| g.bus_id.to_string().eq_ignore_ascii_case(&x.bus_id));
    match gpu.and_then(|g| g.uuid.clone()) {
        Some(uuid) => {
            let _ = events.send(HealthEvent::KernelXid {
                uuid,
                xid: x.xid,
                message: x.message.clone(),
            });
        }
        None => tracing::warn!(
            stage = "health",
            source = "kmsg",
            bus_id = %x.bus_id,
            xid = x.xid,
            "XID in the kernel log for a PCI device that is not a known GPU"
        ),
    }
}
