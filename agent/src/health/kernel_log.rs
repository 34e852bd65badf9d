//! The kernel log as a health source: [`kmsg::KmsgReader`] follows the
//! host's `/dev/kmsg`; each `NVRM: Xid` line becomes a health event for the
//! GPU with that PCI bus id (the inventory says which UUID that is). XIDs
//! logged before the agent started count when they are younger than the
//! recovery period (a GPU that failed a minute before a restart is still
//! suspect), older ones are only logged. The reader is started again with
//! backoff when it fails; without a `/dev/kmsg` under the host root it says
//! so once and stays off (NVML events still come).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use hostlib::HostRoot;
use tokio::sync::{mpsc, oneshot, watch};

use super::kmsg::{self, KernelXid, KmsgReader};
use crate::backend::HealthEvent;
use crate::inventory::Inventory;

/// The reader's state, for `status`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelLogStatus {
    pub running: bool,
    pub restarts: u32,
    pub last_error: Option<String>,
}

/// Starts following the kernel log; returns the stop handle and the status.
pub fn start(
    host: &HostRoot,
    inventory: watch::Receiver<Arc<Inventory>>,
    events: mpsc::UnboundedSender<HealthEvent>,
    lookback: Option<Duration>,
) -> (oneshot::Sender<()>, Arc<Mutex<KernelLogStatus>>) {
    let (stop, mut stopped) = oneshot::channel::<()>();
    let status = Arc::new(Mutex::new(KernelLogStatus::default()));
    let host = host.clone();
    let st = status.clone();
    tokio::spawn(async move {
        let now = kmsg::monotonic_now_us();
        let cutoff = lookback.map_or(now, |d| now.saturating_sub(d.as_micros() as u64));
        let mut backoff = Duration::from_secs(1);
        loop {
            let failure = match KmsgReader::open(&host) {
                Ok(reader) => {
                    st.lock().unwrap().running = true;
                    let (tx, mut rx) = mpsc::unbounded_channel::<KernelXid>();
                    let run = reader.since_boot_us(cutoff).run(tx, std::future::pending());
                    tokio::pin!(run);
                    let result = loop {
                        tokio::select! {
                            _ = &mut stopped => return,
                            r = &mut run => break r,
                            Some(x) = rx.recv() => forward(&inventory, &events, x),
                        }
                    };
                    while let Ok(x) = rx.try_recv() {
                        forward(&inventory, &events, x);
                    }
                    st.lock().unwrap().running = false;
                    match result {
                        Ok(()) => return,
                        Err(e) => format!("the kernel log reader failed: {e}"),
                    }
                }
                Err(e) if e.is_not_found() => {
                    tracing::warn!(stage = "health", source = "kmsg", error = %e, "no kernel log to read; XIDs come from NVML only");
                    st.lock().unwrap().last_error = Some(e.to_string());
                    return;
                }
                Err(e) => format!("cannot read the kernel log: {e}"),
            };
            tracing::error!(stage = "health", source = "kmsg", error = %failure, retry_in = ?backoff, "kernel log unreadable; trying again");
            {
                let mut s = st.lock().unwrap();
                s.last_error = Some(failure);
                s.restarts += 1;
            }
            tokio::select! {
                _ = &mut stopped => return,
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(Duration::from_secs(300));
        }
    });
    (stop, status)
}

/// Sends an XID to the monitor for the GPU at its bus id.
fn forward(
    inventory: &watch::Receiver<Arc<Inventory>>,
    events: &mpsc::UnboundedSender<HealthEvent>,
    x: KernelXid,
) {
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
