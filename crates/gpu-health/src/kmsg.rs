//! The kernel log as a health source.
//!
//! NVIDIA's driver reports every XID as one kernel log line, printed (in the
//! open kernel modules) as
//!
//! ```text
//! NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.
//! NVRM: Xid (PCI:0000:3b:00 GPU-I:05 GPU-CI:01): 94, pid='<unknown>', name=<unknown>, Contained: ...
//! NVRM: Xid (PCI:0000:2b:00): 79, GPU has fallen off the bus.          (no process)
//! NVRM: Xid (0000:03:00): 14, Channel 00000001                         (old drivers)
//! ```
//!
//! [`parse_line`] turns one such line into a [`KernelXid`]; a line that
//! names an XID (it contains both `NVRM` and `Xid`) but cannot be read is
//! [`Record::Unparsed`] with the reason, never dropped. Lines may come with
//! the `/dev/kmsg` prefix (`PRI,SEQ,TIMESTAMP_US,FLAGS;`) or without it
//! (`dmesg` text, `journalctl -k`), so fixtures can be written as text.
//!
//! [`KmsgReader`] follows `/dev/kmsg` (through [`HostRoot`]) and sends each
//! XID on a channel. It sleeps in epoll until the kernel has a record: no
//! timer runs. Decisions, with the kernel's `dev-kmsg` ABI document in mind:
//!
//! - **Backlog.** The first read after open returns the oldest record the
//!   kernel still holds, so old XIDs come first. The caller passes a
//!   cut-off on the kernel's clock ([`KmsgReader::since_boot_us`]): XIDs
//!   stamped before it are logged at info level and not sent. `0` replays
//!   everything since boot; [`monotonic_now_us`] at start-up acts on new
//!   XIDs only; a value saved by the previous agent resumes where it left.
//!   A record without a stamp (a plain line, or a stamp of 0) is never
//!   treated as backlog.
//! - **Clock.** The record stamp is the kernel's monotonic time in
//!   microseconds (it stands still during suspend, like `CLOCK_MONOTONIC`
//!   and unlike `CLOCK_BOOTTIME`), so [`monotonic_now_us`] reads
//!   `CLOCK_MONOTONIC`.
//! - **Overruns.** When the ring buffer overwrote records we had not read,
//!   `read` fails with `EPIPE` once and continues with the oldest record
//!   left; we log it and go on, and the jump in sequence numbers says how
//!   many records were lost.
//! - **Sizes.** Each `read` returns exactly one record, and `EINVAL` when
//!   the buffer is too small: we read 8 KiB (the kernel's largest record)
//!   and grow up to 64 KiB before giving up.
//! - **FIFOs.** Tests stand in a FIFO for `/dev/kmsg`; a FIFO's reads may
//!   hold several lines or part of one, so bytes are split on `\n` and a
//!   record is complete at the next record or when a read ends on a line
//!   end. When every writer closes, the FIFO is reopened (a character
//!   device never reports end of file).
//! - **Trust.** Root in user space can write to `/dev/kmsg`, but the kernel
//!   stamps such records with a non-kernel facility: an `NVRM: Xid` line
//!   from a facility other than 0 is [`Record::Unparsed`], never an XID.

use std::fs::File;
use std::future::Future;
use std::io::{self, Read};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use hostlib::{HostError, HostRoot};
use serde::Serialize;
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::sync::mpsc;

use super::xid::{self, Severity, XidInfo};

/// Where the kernel log lives on the host.
pub const KMSG_PATH: &str = "/dev/kmsg";

/// One kernel record fits (the kernel's own limit for a formatted record).
const READ_BUFFER: usize = 8 * 1024;
/// Growth stops here: a record larger than this is an error.
const MAX_READ_BUFFER: usize = 64 * 1024;
/// Longer lines (only a FIFO can send them) are cut into pieces this long.
pub const MAX_LINE: usize = 64 * 1024;
/// Reads per wake-up before looking at shutdown again.
const READS_PER_WAKE: usize = 256;

/// One XID report from the kernel log.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct KernelXid {
    /// The GPU's PCI address, normalised: `0000:3b:00.0`.
    pub bus_id: String,
    pub xid: u64,
    /// MIG attribution (`GPU-I:05`), when the driver gave one.
    pub gpu_instance: Option<u32>,
    /// MIG compute instance (`GPU-CI:01`), when the driver gave one.
    pub compute_instance: Option<u32>,
    /// The process that owned the failing work, when known.
    pub pid: Option<u32>,
    pub process: Option<String>,
    /// The driver's text after the number and the process.
    pub message: String,
    /// The kernel's record number; 0 for a line without the kmsg prefix.
    pub seq: u64,
    /// The kernel's monotonic stamp in microseconds; 0 when unknown.
    pub at_us: u64,
}

impl KernelXid {
    /// What the catalogue says about this XID.
    pub fn info(&self) -> Option<&'static XidInfo> {
        xid::lookup(self.xid)
    }
}

/// What one kernel log line is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    /// Not an NVIDIA XID report.
    Other,
    Xid(KernelXid),
    /// Names an XID (contains `NVRM` and `Xid`) but cannot be read.
    Unparsed {
        reason: String,
        line: String,
    },
}

/// The `/dev/kmsg` prefix of a record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KmsgPrefix {
    /// Syslog facility: 0 is the kernel itself.
    pub facility: u64,
    /// Syslog level (0 emergency … 7 debug).
    pub level: u8,
    pub seq: u64,
    /// Monotonic microseconds since boot.
    pub at_us: u64,
}

/// Splits `PRI,SEQ,TIMESTAMP_US,FLAGS[,...];MESSAGE` into the prefix and the
/// message, or `None` when the line has no such prefix.
pub fn split_prefix(line: &str) -> Option<(KmsgPrefix, &str)> {
    let (head, body) = line.split_once(';')?;
    let mut fields = head.split(',');
    let pri = decimal(fields.next()?)?;
    let seq = decimal(fields.next()?)?;
    let at_us = decimal(fields.next()?)?;
    // The flags field is always there (`-`, `c` or `+`).
    fields.next()?;
    Some((
        KmsgPrefix {
            facility: pri >> 3,
            level: (pri & 7) as u8,
            seq,
            at_us,
        },
        body,
    ))
}

/// Reads one line (a trailing `\n` is dropped).
pub fn parse_line(line: &str) -> Record {
    let line = line.strip_suffix('\n').unwrap_or(line);
    let line = line.strip_suffix('\r').unwrap_or(line);
    if !(line.contains("NVRM") && line.contains("Xid")) {
        return Record::Other;
    }
    let unparsed = |reason: String| Record::Unparsed {
        reason,
        line: line.to_string(),
    };
    let (seq, at_us, body) = match split_prefix(line) {
        Some((p, _)) if p.facility != 0 => {
            return unparsed(format!(
                "written from user space (syslog facility {}), not by the kernel",
                p.facility
            ));
        }
        Some((p, body)) => (p.seq, p.at_us, body),
        None => (0, dmesg_stamp(line).unwrap_or(0), line),
    };
    match parse_report(body) {
        Ok(r) => Record::Xid(KernelXid {
            bus_id: r.bus_id,
            xid: r.xid,
            gpu_instance: r.gpu_instance,
            compute_instance: r.compute_instance,
            pid: r.pid,
            process: r.process,
            message: r.message,
            seq,
            at_us,
        }),
        Err(reason) => unparsed(reason),
    }
}

/// Reads one record: its first line, followed by continuation lines
/// (` SUBSYSTEM=pci`, ` DEVICE=+pci:0000:3b:00.0`) that carry nothing the
/// XID needs and are skipped.
pub fn parse_record(record: &str) -> Record {
    parse_line(record.split('\n').next().unwrap_or(""))
}

/// The fields of an `NVRM: Xid (...)` report.
struct Report {
    bus_id: String,
    gpu_instance: Option<u32>,
    compute_instance: Option<u32>,
    xid: u64,
    pid: Option<u32>,
    process: Option<String>,
    message: String,
}

fn parse_report(body: &str) -> Result<Report, String> {
    const MARK: &str = "NVRM: Xid";
    let at = body
        .find(MARK)
        .ok_or("no \"NVRM: Xid\" report in the line")?;
    let rest = body[at + MARK.len()..].trim_start();
    let rest = rest
        .strip_prefix('(')
        .ok_or("no \"(PCI:...)\" after \"NVRM: Xid\"")?;
    let (inside, rest) = rest
        .split_once(')')
        .ok_or("the PCI address is not closed by ')'")?;
    let mut words = inside.split_whitespace();
    let addr = words.next().ok_or("empty PCI address")?;
    let addr = match addr.get(..4) {
        Some(p) if p.eq_ignore_ascii_case("PCI:") => &addr[4..],
        _ => addr,
    };
    let bus_id = normalise_bus_id(addr).ok_or_else(|| format!("bad PCI address {addr:?}"))?;
    let (mut gpu_instance, mut compute_instance) = (None, None);
    for w in words {
        if let Some(v) = w.strip_prefix("GPU-I:") {
            gpu_instance = Some(v.parse().map_err(|_| format!("bad GPU instance {w:?}"))?);
        } else if let Some(v) = w.strip_prefix("GPU-CI:") {
            compute_instance = Some(
                v.parse()
                    .map_err(|_| format!("bad compute instance {w:?}"))?,
            );
        } else {
            return Err(format!("unexpected {w:?} beside the PCI address"));
        }
    }
    let rest = rest
        .trim_start()
        .strip_prefix(':')
        .ok_or("no ':' after the PCI address")?
        .trim_start();
    let end = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    let (number, rest) = rest.split_at(end);
    if number.is_empty() {
        return Err("no XID number after the PCI address".into());
    }
    let xid: u64 = number
        .parse()
        .map_err(|_| format!("XID number {number} out of range"))?;
    let rest = match rest.strip_prefix(',') {
        Some(r) => r,
        None if rest.is_empty() || rest.starts_with(char::is_whitespace) => rest,
        None => return Err(format!("unexpected text right after XID {xid}")),
    };
    let mut rest = rest.trim_start();
    let (mut pid, mut process) = (None, None);
    if let Some(r) = rest.strip_prefix("pid=") {
        let (value, after) = next_field(r);
        // `'<unknown>'` (no channel to blame) and the like: no pid.
        pid = value.parse().ok();
        rest = after;
        if let Some(r) = rest.strip_prefix("name=") {
            let (value, after) = next_field(r);
            if !value.is_empty() && value != "<unknown>" {
                process = Some(value.to_string());
            }
            rest = after;
        }
    }
    Ok(Report {
        bus_id,
        gpu_instance,
        compute_instance,
        xid,
        pid,
        process,
        message: rest.trim().to_string(),
    })
}

/// The text up to the next `,` and what follows it.
fn next_field(s: &str) -> (&str, &str) {
    match s.split_once(',') {
        Some((value, after)) => (value.trim(), after.trim_start()),
        None => (s.trim(), ""),
    }
}

/// `0000:3b:00`, `0000:3b:00.0`, `3b:00`, `00000000:3B:00.0` all become
/// `0000:3b:00.0`; `None` when it is not a PCI address.
pub fn normalise_bus_id(addr: &str) -> Option<String> {
    let (main, function) = match addr.rsplit_once('.') {
        Some((m, f)) => (m, Some(f)),
        None => (addr, None),
    };
    let parts: Vec<&str> = main.split(':').collect();
    let (domain, bus, device) = match parts.as_slice() {
        [d, b, v] => (hex(d, 8)?, hex(b, 2)?, hex(v, 2)?),
        [b, v] => (0, hex(b, 2)?, hex(v, 2)?),
        _ => return None,
    };
    let function = match function {
        Some(f) => hex(f, 1)?,
        None => 0,
    };
    if device > 0x1f || function > 7 {
        return None;
    }
    Some(format!("{domain:04x}:{bus:02x}:{device:02x}.{function:x}"))
}

fn hex(s: &str, max_digits: usize) -> Option<u32> {
    if s.is_empty() || s.len() > max_digits || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u32::from_str_radix(s, 16).ok()
}

fn decimal(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// The `[ 5107.644336]` stamp `dmesg` puts first, in microseconds.
fn dmesg_stamp(line: &str) -> Option<u64> {
    let (stamp, _) = line.strip_prefix('[')?.split_once(']')?;
    let (secs, frac) = stamp.trim().split_once('.')?;
    let secs = decimal(secs)?;
    decimal(frac)?;
    let mut micros = 0u64;
    let mut digits = frac.bytes();
    for _ in 0..6 {
        micros = micros * 10 + digits.next().map_or(0, |d| u64::from(d - b'0'));
    }
    secs.checked_mul(1_000_000)?.checked_add(micros)
}

/// Cuts a byte stream (what `read` returns) into records: lines, each
/// with the continuation lines (starting with a space) that follow it.
#[derive(Debug, Default)]
pub struct RecordSplitter {
    pending: Vec<u8>,
    current: Option<String>,
}

impl RecordSplitter {
    /// Takes the bytes of one read; returns the records now complete. A
    /// record is complete once the next line cannot be its continuation:
    /// at the next record, or when a read ends on a line end (a `/dev/kmsg`
    /// read is always one whole record).
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.pending.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some(line) = self.next_line() {
            self.line(line, &mut out);
        }
        // Complete unless what follows may still be a continuation line.
        if self.pending.first() != Some(&b' ') {
            out.extend(self.current.take());
        }
        out
    }

    /// The end of the stream: whatever is left is complete.
    pub fn finish(&mut self) -> Vec<String> {
        let mut out = Vec::new();
        if !self.pending.is_empty() {
            let line = String::from_utf8_lossy(&self.pending).into_owned();
            self.pending.clear();
            self.line(line, &mut out);
        }
        out.extend(self.current.take());
        out
    }

    fn next_line(&mut self) -> Option<String> {
        let limit = self.pending.len().min(MAX_LINE);
        let (take, skip) = match self.pending[..limit].iter().position(|b| *b == b'\n') {
            Some(pos) => (pos, pos + 1),
            None if self.pending.len() >= MAX_LINE => (MAX_LINE, MAX_LINE),
            None => return None,
        };
        let line = String::from_utf8_lossy(&self.pending[..take]).into_owned();
        self.pending.drain(..skip);
        Some(line)
    }

    fn line(&mut self, line: String, out: &mut Vec<String>) {
        // A line naming an XID always stands on its own, so that it is
        // read whatever the chunking.
        let continuation =
            line.starts_with(' ') && !(line.contains("NVRM") && line.contains("Xid"));
        match &mut self.current {
            Some(cur) if continuation => {
                if cur.len() + line.len() < MAX_LINE {
                    cur.push('\n');
                    cur.push_str(&line);
                }
            }
            _ => out.extend(self.current.replace(line)),
        }
    }
}

/// Counts records lost between two sequence numbers.
#[derive(Debug, Default)]
struct SeqTracker {
    last: Option<u64>,
}

impl SeqTracker {
    /// Notes `seq`; returns how many records were skipped before it.
    fn observe(&mut self, seq: u64) -> Option<u64> {
        let lost = match self.last {
            Some(last) if seq > last.saturating_add(1) => Some(seq - last - 1),
            _ => None,
        };
        self.last = Some(seq);
        lost
    }
}

/// The kernel's monotonic clock in microseconds: the clock of the record
/// stamps. 0 if it cannot be read (it always can on Linux).
pub fn monotonic_now_us() -> u64 {
    use nix::time::{ClockId, clock_gettime};
    match clock_gettime(ClockId::CLOCK_MONOTONIC) {
        Ok(t) => {
            let secs = u64::try_from(t.tv_sec()).unwrap_or(0);
            let micros = u64::try_from(t.tv_nsec() / 1000).unwrap_or(0);
            secs.saturating_mul(1_000_000).saturating_add(micros)
        }
        Err(_) => 0,
    }
}

/// Errors from following the kernel log. Each names the path.
#[derive(Debug, thiserror::Error)]
pub enum KmsgError {
    #[error(transparent)]
    Host(#[from] HostError),
    #[error(
        "{path}: not allowed to read the kernel log: it needs CAP_SYSLOG while the sysctl kernel.dmesg_restrict is 1"
    )]
    NeedsCapSyslog { path: PathBuf },
    #[error(
        "{path}: is a {kind}, which epoll cannot watch for new records; the kernel log reader needs /dev/kmsg (or a FIFO in tests)"
    )]
    NotPollable { path: PathBuf, kind: &'static str },
    #[error("{path}: a kernel log record does not fit in {size} bytes")]
    RecordTooLarge { path: PathBuf, size: usize },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

impl KmsgError {
    /// Nothing to read there (no such file, or not a kernel log): no use
    /// trying again.
    pub fn is_not_found(&self) -> bool {
        match self {
            KmsgError::Host(e) => e.is_not_found(),
            KmsgError::Io { source, .. } => source.kind() == io::ErrorKind::NotFound,
            KmsgError::NotPollable { .. } => true,
            _ => false,
        }
    }

    fn io(path: &Path, source: io::Error) -> Self {
        KmsgError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

fn open_error(path: &Path, e: io::Error) -> KmsgError {
    if e.raw_os_error() == Some(libc::EPERM) {
        KmsgError::NeedsCapSyslog {
            path: path.to_path_buf(),
        }
    } else {
        KmsgError::io(path, e)
    }
}

/// Opens `path` for non-blocking reads (std adds `O_CLOEXEC`) and checks
/// that epoll can watch it.
fn open_nonblocking(path: &Path) -> Result<File, KmsgError> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| open_error(path, e))?;
    let kind = file
        .metadata()
        .map_err(|e| KmsgError::io(path, e))?
        .file_type();
    let refused = if kind.is_file() {
        Some("regular file")
    } else if kind.is_dir() {
        Some("directory")
    } else if kind.is_block_device() {
        Some("block device")
    } else {
        None
    };
    match refused {
        Some(kind) => Err(KmsgError::NotPollable {
            path: path.to_path_buf(),
            kind,
        }),
        None => Ok(file),
    }
}

fn register(path: &Path, file: File) -> Result<AsyncFd<File>, KmsgError> {
    // Tokio 1.54 deprecates the safe constructors in favour of `unsafe`
    // ones whose condition is that the descriptor stays open and the same
    // while the `AsyncFd` owns it. A `File` owns its descriptor and never
    // changes it, so the condition holds; the house has no `unsafe`.
    #[allow(deprecated)]
    let fd = AsyncFd::with_interest(file, Interest::READABLE);
    fd.map_err(|e| {
        if e.raw_os_error() == Some(libc::EPERM) {
            KmsgError::NotPollable {
                path: path.to_path_buf(),
                kind: "file that epoll refuses",
            }
        } else {
            KmsgError::io(path, e)
        }
    })
}

/// Follows the kernel log and sends every new XID.
#[derive(Debug)]
pub struct KmsgReader {
    path: PathBuf,
    file: File,
    since_us: u64,
}

impl KmsgReader {
    /// Opens the host's `/dev/kmsg`.
    pub fn open(host: &HostRoot) -> Result<Self, KmsgError> {
        Self::open_path(host, KMSG_PATH)
    }

    /// Opens another host path that behaves like `/dev/kmsg` (a FIFO in tests).
    pub fn open_path(host: &HostRoot, host_path: impl AsRef<Path>) -> Result<Self, KmsgError> {
        let path = host.resolve(host_path)?;
        let file = open_nonblocking(&path)?;
        Ok(KmsgReader {
            path,
            file,
            since_us: 0,
        })
    }

    /// XIDs stamped before `cutoff` (kernel monotonic microseconds, see
    /// [`monotonic_now_us`]) are logged, not sent. The default, 0, sends
    /// every XID since boot.
    pub fn since_boot_us(mut self, cutoff: u64) -> Self {
        self.since_us = cutoff;
        self
    }

    /// The path being read, as this process sees it.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads until `shutdown` resolves or the receiver of `tx` is gone,
    /// sending every XID at or after the cut-off. Must run inside a Tokio
    /// runtime with I/O enabled.
    pub async fn run(
        self,
        tx: mpsc::UnboundedSender<KernelXid>,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), KmsgError> {
        tokio::pin!(shutdown);
        let KmsgReader {
            path,
            file,
            since_us,
        } = self;
        let mut fd = register(&path, file)?;
        let mut buf = vec![0u8; READ_BUFFER];
        let mut splitter = RecordSplitter::default();
        let mut seqs = SeqTracker::default();
        tracing::info!(
            stage = "health",
            source = "kmsg",
            path = %path.display(),
            since_boot_us = since_us,
            "watching the kernel log for XIDs"
        );
        loop {
            let mut guard = tokio::select! {
                biased;
                () = &mut shutdown => return Ok(()),
                () = tx.closed() => return Ok(()),
                ready = fd.readable() => ready.map_err(|e| KmsgError::io(&path, e))?,
            };
            let mut eof = false;
            for _ in 0..READS_PER_WAKE {
                let read = guard.try_io(|inner| {
                    let mut f: &File = inner.get_ref();
                    f.read(&mut buf)
                });
                match read {
                    // Nothing more for now; readiness is cleared.
                    Err(_would_block) => break,
                    Ok(Ok(0)) => {
                        eof = true;
                        break;
                    }
                    Ok(Ok(n)) => {
                        for rec in splitter.push(&buf[..n]) {
                            if !handle(&rec, &path, since_us, &mut seqs, &tx) {
                                return Ok(());
                            }
                        }
                    }
                    Ok(Err(e)) => match e.raw_os_error() {
                        Some(libc::EPIPE) => tracing::warn!(
                            stage = "health",
                            source = "kmsg",
                            path = %path.display(),
                            "kernel log records were overwritten before gpu-agent read them"
                        ),
                        Some(libc::EINVAL) if buf.len() < MAX_READ_BUFFER => {
                            let size = buf.len() * 2;
                            buf.resize(size, 0);
                        }
                        Some(libc::EINVAL) => {
                            return Err(KmsgError::RecordTooLarge {
                                path,
                                size: buf.len(),
                            });
                        }
                        Some(libc::EINTR) => {}
                        _ => return Err(KmsgError::io(&path, e)),
                    },
                }
            }
            drop(guard);
            if eof {
                // Only a FIFO ends: its last writer closed. What it left is
                // complete; reopen, or epoll would report the hang-up forever.
                for rec in splitter.finish() {
                    if !handle(&rec, &path, since_us, &mut seqs, &tx) {
                        return Ok(());
                    }
                }
                tracing::debug!(stage = "health", source = "kmsg", path = %path.display(), "writer closed; reopening");
                drop(fd);
                fd = register(&path, open_nonblocking(&path)?)?;
            }
        }
    }
}

/// One record: logs it and sends it when it is a new XID. False when the
/// receiver is gone.
fn handle(
    rec: &str,
    path: &Path,
    since_us: u64,
    seqs: &mut SeqTracker,
    tx: &mpsc::UnboundedSender<KernelXid>,
) -> bool {
    if let Some((prefix, _)) = split_prefix(rec.split('\n').next().unwrap_or(""))
        && let Some(lost) = seqs.observe(prefix.seq)
    {
        tracing::warn!(
            stage = "health",
            source = "kmsg",
            path = %path.display(),
            lost,
            next_seq = prefix.seq,
            "kernel log records lost; an XID among them would be missed"
        );
    }
    match parse_record(rec) {
        Record::Other => true,
        Record::Unparsed { reason, line } => {
            tracing::warn!(
                stage = "health",
                source = "kmsg",
                path = %path.display(),
                %reason,
                %line,
                "kernel log line names an NVIDIA XID but cannot be read"
            );
            true
        }
        Record::Xid(x) if x.at_us != 0 && x.at_us < since_us => {
            tracing::info!(
                stage = "health",
                source = "kmsg",
                bus_id = %x.bus_id,
                xid = x.xid,
                at_us = x.at_us,
                since_boot_us = since_us,
                advice = %xid::describe(x.xid),
                "XID from before the cut-off; not acted on"
            );
            true
        }
        Record::Xid(x) => {
            let advice = xid::describe(x.xid);
            if xid::default_severity(x.xid) == Severity::Ignore {
                tracing::info!(stage = "health", source = "kmsg", bus_id = %x.bus_id, xid = x.xid, pid = x.pid, process = x.process.as_deref(), seq = x.seq, %advice, driver_message = %x.message, "NVIDIA XID");
            } else {
                tracing::warn!(stage = "health", source = "kmsg", bus_id = %x.bus_id, xid = x.xid, pid = x.pid, process = x.process.as_deref(), seq = x.seq, %advice, driver_message = %x.message, "NVIDIA XID");
            }
            tx.send(x).is_ok()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::io::Write;
    use std::time::Duration;

    fn xid(line: &str) -> KernelXid {
        match parse_line(line) {
            Record::Xid(x) => x,
            other => panic!("{line:?}: {other:?}"),
        }
    }

    fn unparsed_reason(line: &str) -> String {
        match parse_line(line) {
            Record::Unparsed { reason, line: l } => {
                assert_eq!(l, line.trim_end_matches('\n'));
                reason
            }
            other => panic!("{line:?}: {other:?}"),
        }
    }

    #[test]
    fn reads_the_current_driver_form_from_dev_kmsg() {
        let x = xid(
            "4,1873,1204567123,-;NVRM: Xid (PCI:0000:3B:00): 79, pid=1234, name=python, GPU has fallen off the bus.\n",
        );
        assert_eq!(
            x,
            KernelXid {
                bus_id: "0000:3b:00.0".into(),
                xid: 79,
                gpu_instance: None,
                compute_instance: None,
                pid: Some(1234),
                process: Some("python".into()),
                message: "GPU has fallen off the bus.".into(),
                seq: 1873,
                at_us: 1_204_567_123,
            }
        );
        assert_eq!(x.info().map(|i| i.xid), Some(79));
    }

    #[test]
    fn unknown_pid_and_name_are_none() {
        let x = xid(
            "NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp Exception on (GPC 7, TPC 7, SM 0): Illegal Instruction Parameter",
        );
        assert_eq!((x.xid, x.pid, x.process), (13, None, None));
        assert_eq!(
            x.message,
            "Graphics SM Warp Exception on (GPC 7, TPC 7, SM 0): Illegal Instruction Parameter"
        );
    }

    #[test]
    fn lines_without_a_process_and_old_drivers_lines() {
        let x = xid("NVRM: Xid (PCI:0000:2b:00): 79, GPU has fallen off the bus.");
        assert_eq!((x.pid, x.process.as_deref()), (None, None));
        assert_eq!(x.message, "GPU has fallen off the bus.");
        // Old drivers: no "PCI:" and the channel as the message.
        let x = xid("NVRM: Xid (0000:03:00): 14, Channel 00000001");
        assert_eq!((x.bus_id.as_str(), x.xid), ("0000:03:00.0", 14));
        assert_eq!(x.message, "Channel 00000001");
        // Old drivers, older still: no comma after the number.
        let x = xid("NVRM: Xid (PCI:0000:01:00): 32 Channel ID 00000000 intr 00004000");
        assert_eq!(
            (x.xid, x.message.as_str()),
            (32, "Channel ID 00000000 intr 00004000")
        );
        // A function number given by the kernel is kept.
        let x = xid("kernel: NVRM: Xid (PCI:0000:3b:00.1): 48, pid=77, name=a, DBE");
        assert_eq!(x.bus_id, "0000:3b:00.1");
    }

    #[test]
    fn mig_attribution_is_read() {
        let x = xid(
            "NVRM: Xid (PCI:0000:01:00 GPU-I:05): 94, pid=7194, name=train, Contained: CE User Channel (0x9). RST: No, D-RST: No",
        );
        assert_eq!((x.gpu_instance, x.compute_instance), (Some(5), None));
        assert_eq!(x.process.as_deref(), Some("train"));
        assert_eq!(
            x.message,
            "Contained: CE User Channel (0x9). RST: No, D-RST: No"
        );
        let x = xid(
            "NVRM: Xid (PCI:0000:3b:00 GPU-I:01 GPU-CI:02): 13, pid=9, name=a, Graphics Exception",
        );
        assert_eq!((x.gpu_instance, x.compute_instance), (Some(1), Some(2)));
        assert_eq!(x.bus_id, "0000:3b:00.0");
    }

    #[test]
    fn nvlink_and_recovery_action_lines() {
        let x = xid(
            "NVRM: Xid (PCI:0018:01:00): 149, NETIR_INT  Fatal   XC0 i0 Link -1 (0x000fe406 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)",
        );
        assert_eq!((x.bus_id.as_str(), x.xid), ("0018:01:00.0", 149));
        assert!(x.message.starts_with("NETIR_INT  Fatal"));
        let x = xid(
            "NVRM: Xid (PCI:0000:01:00): 154, GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)",
        );
        assert_eq!(x.xid, 154);
        let x = xid(
            "NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, Ch 00000001 caused by previous Xid 149",
        );
        assert_eq!((x.xid, x.pid), (45, Some(1_818_990)));
    }

    #[test]
    fn dmesg_and_journal_lines_are_accepted() {
        let x = xid("[ 5107.644336] NVRM: Xid (PCI:0000:03:00): 79, GPU has fallen off the bus.");
        assert_eq!((x.seq, x.at_us), (0, 5_107_644_336));
        let x = xid(
            "[12345.678] NVRM: Xid (PCI:0000:3b:00.0): 79, pid=1234, GPU has fallen off the bus.",
        );
        assert_eq!(x.at_us, 12_345_678_000);
        let x = xid(
            "May 18 19:02:39 gpu-7 kernel: NVRM: Xid (PCI:0000:2b:00): 79, GPU has fallen off the bus.",
        );
        assert_eq!((x.bus_id.as_str(), x.at_us), ("0000:2b:00.0", 0));
        let x = xid(
            "[Fri Aug 30 11:43:14 2024] NVRM: Xid (PCI:0000:cb:00): 109, pid=1797828, name=pt_main_thread, Ch 00000008, errorString CTX SWITCH TIMEOUT, Info 0x58005",
        );
        assert_eq!((x.xid, x.at_us), (109, 0));
        assert_eq!(x.process.as_deref(), Some("pt_main_thread"));
    }

    #[test]
    fn xid_lines_that_cannot_be_read_are_surfaced_with_a_reason() {
        assert!(
            unparsed_reason(
                "NVRM: Xid 154, GPU recovery action changed to 0x2 (Node Reboot Required)"
            )
            .contains("(PCI:")
        );
        assert!(
            unparsed_reason("NVRM: Xid (PCI:0000:08:00/0000:09:00): 154 ... GPU Reset Required")
                .contains("bad PCI address")
        );
        assert!(
            unparsed_reason("NVRM: Xid (PCI:0000:66:00): abc, pid=2280636")
                .contains("no XID number")
        );
        assert!(
            unparsed_reason("NVRM: Xid (PCI:0000:66:00): 99999999999999999999999, x")
                .contains("out of range")
        );
        assert!(
            unparsed_reason("NVRM: Xid (PCI:0000:66:00): 79abc").contains("right after XID 79")
        );
        assert!(unparsed_reason("NVRM: Xid (PCI:0000:66:00 GPU-I:x): 43").contains("GPU instance"));
        assert!(unparsed_reason("NVRM: Xid (PCI:0000:66:00: 43").contains("not closed"));
        assert!(unparsed_reason("NVRM: something about an Xid").contains("no \"NVRM: Xid\""));
        assert!(unparsed_reason("6,12,34,-;NVRM: Xid").contains("(PCI:"));
    }

    #[test]
    fn xid_lines_written_from_user_space_are_not_trusted() {
        // `echo ... > /dev/kmsg` is stamped with facility LOG_USER (1): 14 = 1<<3 | 6.
        let reason = unparsed_reason(
            "14,2201,99000000,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus.",
        );
        assert!(
            reason.contains("user space (syslog facility 1)"),
            "{reason}"
        );
    }

    #[test]
    fn other_lines_are_other() {
        for line in [
            "",
            "\n",
            "6,0,0,-;Linux version 6.8.0",
            "6,339,5140900,-;NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.14",
            "[    3.1] nvidia 0000:3b:00.0: enabling device (0000 -> 0003)",
            " SUBSYSTEM=pci",
            "nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error",
        ] {
            assert_eq!(parse_line(line), Record::Other, "{line:?}");
        }
    }

    #[test]
    fn bus_ids_are_normalised() {
        for (given, want) in [
            ("0000:3b:00", Some("0000:3b:00.0")),
            ("0000:3B:00.0", Some("0000:3b:00.0")),
            ("00000000:3b:00.0", Some("0000:3b:00.0")),
            ("3b:00", Some("0000:3b:00.0")),
            ("0018:01:00", Some("0018:01:00.0")),
            ("10000:01:00.7", Some("10000:01:00.7")),
            ("0000:3b:1f.0", Some("0000:3b:1f.0")),
            ("0000:3b:20.0", None),
            ("0000:3b:00.8", None),
            ("0000:3b:00.", None),
            ("0000:+3:00", None),
            ("0000:123:00", None),
            ("000000000:3b:00", None),
            ("3b", None),
            ("", None),
            ("a:b:c:d", None),
        ] {
            assert_eq!(normalise_bus_id(given).as_deref(), want, "{given:?}");
        }
    }

    #[test]
    fn kmsg_prefixes_are_split() {
        let (p, body) = split_prefix("4,1873,1204567123,-,caller=T42;NVRM: x").unwrap();
        assert_eq!(
            p,
            KmsgPrefix {
                facility: 0,
                level: 4,
                seq: 1873,
                at_us: 1_204_567_123
            }
        );
        assert_eq!(body, "NVRM: x");
        assert_eq!(split_prefix("4,1873,12;no flags"), None);
        assert_eq!(split_prefix("NVRM: a;b"), None);
        assert_eq!(split_prefix("4,-1,12,-;x"), None);
    }

    #[test]
    fn continuation_lines_belong_to_their_record() {
        let mut s = RecordSplitter::default();
        let recs = s.push(
            b"4,10,100,-;NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.\n SUBSYSTEM=pci\n DEVICE=+pci:0000:3b:00.0\n6,11,200,-;next\n",
        );
        assert_eq!(
            recs,
            [
                "4,10,100,-;NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.\n SUBSYSTEM=pci\n DEVICE=+pci:0000:3b:00.0",
                "6,11,200,-;next"
            ]
        );
        assert_eq!(
            parse_record(&recs[0]),
            parse_line(recs[0].lines().next().unwrap())
        );
        assert!(matches!(parse_record(&recs[0]), Record::Xid(x) if x.xid == 79));
        assert_eq!(s.finish(), Vec::<String>::new());
    }

    #[test]
    fn records_split_across_reads_are_put_back_together() {
        let mut s = RecordSplitter::default();
        assert_eq!(
            s.push(b"4,10,100,-;NVRM: Xid (PCI:00"),
            Vec::<String>::new()
        );
        assert_eq!(
            s.push(b"00:3b:00): 48, DBE\n SUBSYSTEM=pci\n6,11,"),
            ["4,10,100,-;NVRM: Xid (PCI:0000:3b:00): 48, DBE\n SUBSYSTEM=pci"]
        );
        assert_eq!(s.push(b"200,-;tail"), Vec::<String>::new());
        assert_eq!(s.finish(), ["6,11,200,-;tail"]);
        // A partial line starting with a space may be a continuation: wait.
        assert_eq!(s.push(b"6,12,300,-;a\n SUB"), Vec::<String>::new());
        assert_eq!(s.push(b"SYSTEM=pci\n"), ["6,12,300,-;a\n SUBSYSTEM=pci"]);
        // A line longer than MAX_LINE is cut, not buffered forever.
        let mut s = RecordSplitter::default();
        let long = vec![b'x'; MAX_LINE + 10];
        let recs = s.push(&long);
        assert_eq!(recs.len(), 1);
        assert_eq!(recs[0].len(), MAX_LINE);
        assert_eq!(s.finish(), ["x".repeat(10)]);
    }

    #[test]
    fn sequence_gaps_count_lost_records() {
        let mut t = SeqTracker::default();
        assert_eq!(t.observe(5), None);
        assert_eq!(t.observe(6), None);
        assert_eq!(t.observe(10), Some(3));
        // A new writer starting over (a FIFO) is not a loss.
        assert_eq!(t.observe(1), None);
        assert_eq!(t.observe(u64::MAX), Some(u64::MAX - 2));
    }

    #[test]
    fn open_errors_say_what_is_missing() {
        let e = open_error(
            Path::new("/dev/kmsg"),
            io::Error::from_raw_os_error(libc::EPERM),
        );
        assert!(matches!(e, KmsgError::NeedsCapSyslog { .. }));
        assert_eq!(
            e.to_string(),
            "/dev/kmsg: not allowed to read the kernel log: it needs CAP_SYSLOG while the sysctl kernel.dmesg_restrict is 1"
        );
        let e = open_error(
            Path::new("/host/dev/kmsg"),
            io::Error::from_raw_os_error(libc::ENOENT),
        );
        assert!(
            e.to_string().starts_with("/host/dev/kmsg: No such file"),
            "{e}"
        );
    }

    #[test]
    fn a_regular_file_is_refused_with_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("dev")).unwrap();
        std::fs::write(dir.path().join("dev/kmsg"), "6,1,1,-;hello\n").unwrap();
        let host = HostRoot::new(dir.path()).unwrap();
        let err = KmsgReader::open(&host).unwrap_err();
        assert!(matches!(err, KmsgError::NotPollable { .. }), "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains("dev/kmsg: is a regular file, which epoll cannot watch"),
            "{msg}"
        );
        assert!(msg.starts_with(&host.path().display().to_string()), "{msg}");
        // A missing one names the path too.
        let empty = tempfile::tempdir().unwrap();
        let host = HostRoot::new(empty.path()).unwrap();
        let err = KmsgReader::open(&host).unwrap_err();
        assert!(err.to_string().contains("dev/kmsg: No such file"), "{err}");
    }

    #[test]
    fn the_monotonic_clock_moves_forward() {
        let a = monotonic_now_us();
        std::thread::sleep(Duration::from_millis(2));
        let b = monotonic_now_us();
        assert!(a > 0 && b >= a + 1_000, "{a} {b}");
    }

    async fn recv(rx: &mut mpsc::UnboundedReceiver<KernelXid>) -> KernelXid {
        tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .expect("an XID within 5 s")
            .expect("the reader is running")
    }

    #[tokio::test]
    async fn a_fifo_stands_in_for_dev_kmsg() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("dev")).unwrap();
        let fifo = dir.path().join("dev/kmsg");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let host = HostRoot::new(dir.path()).unwrap();
        let reader = KmsgReader::open(&host).unwrap().since_boot_us(1_000_000);
        let (tx, mut rx) = mpsc::unbounded_channel();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(reader.run(tx, async {
            stopped.await.ok();
        }));

        let mut w = std::fs::OpenOptions::new().write(true).open(&fifo).unwrap();
        let started = std::time::Instant::now();
        // Before the cut-off: logged, not sent. Then a live one with its
        // continuation lines, all in one write.
        w.write_all(
            b"4,90,500000,-;NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.\n\
              6,91,1500000,-;nvidia 0000:3b:00.0: something else\n SUBSYSTEM=pci\n\
              4,92,2000000,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.\n SUBSYSTEM=pci\n DEVICE=+pci:0000:3b:00.0\n",
        )
        .unwrap();
        let x = recv(&mut rx).await;
        assert_eq!(
            (x.bus_id.as_str(), x.xid, x.seq, x.pid),
            ("0000:3b:00.0", 79, 92, Some(1234))
        );
        // A record split across two writes.
        w.write_all(b"4,93,2100000,-;NVRM: Xid (PCI:0000:86:0")
            .unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        w.write_all(b"0.0): 48, pid='<unknown>', name=<unknown>, DBE (0x1)\n")
            .unwrap();
        let x = recv(&mut rx).await;
        assert_eq!(
            (x.bus_id.as_str(), x.xid, x.pid),
            ("0000:86:00.0", 48, None)
        );
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );

        // The writer goes away and a new one comes: the reader reopens.
        w.write_all(b"[ 3.5] NVRM: Xid (PCI:0000:3b:00): 94, pid=7, name=t, Contained")
            .unwrap();
        drop(w);
        let x = recv(&mut rx).await;
        assert_eq!((x.xid, x.at_us), (94, 3_500_000));
        let mut w = std::fs::OpenOptions::new().write(true).open(&fifo).unwrap();
        w.write_all(b"4,95,3000000,-;NVRM: Xid (PCI:0000:3b:00 GPU-I:02): 13, pid=8, name=u, Graphics Exception\n")
            .unwrap();
        let x = recv(&mut rx).await;
        assert_eq!((x.xid, x.gpu_instance), (13, Some(2)));

        stop.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert!(rx.try_recv().is_err(), "nothing else was sent");
    }

    #[tokio::test]
    async fn the_reader_stops_when_nobody_listens() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("dev")).unwrap();
        let fifo = dir.path().join("dev/kmsg");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let host = HostRoot::new(dir.path()).unwrap();
        let reader = KmsgReader::open(&host).unwrap();
        let (tx, rx) = mpsc::unbounded_channel();
        drop(rx);
        let done = tokio::time::timeout(
            Duration::from_secs(5),
            reader.run(tx, std::future::pending()),
        )
        .await;
        assert!(matches!(done, Ok(Ok(()))), "{done:?}");
    }

    /// The real `/dev/kmsg`: either it is read (one whole record per read,
    /// EAGAIN when done) or the error says why.
    #[tokio::test]
    async fn the_real_dev_kmsg_is_read_or_refused_clearly() {
        match KmsgReader::open(&HostRoot::system()) {
            Ok(reader) => {
                let reader = reader.since_boot_us(monotonic_now_us());
                let (tx, _rx) = mpsc::unbounded_channel();
                let done = reader
                    .run(tx, tokio::time::sleep(Duration::from_millis(200)))
                    .await;
                assert!(done.is_ok(), "{done:?}");
            }
            Err(e) => assert!(e.to_string().starts_with("/dev/kmsg: "), "{e}"),
        }
    }

    /// Writes one line to the machine's kernel log and reads it back: the
    /// kernel stamps it as user space, so it must not come out as an XID.
    #[tokio::test]
    #[ignore = "writes to the real kernel log (needs root); run by hand"]
    async fn injected_xid_lines_on_the_real_dev_kmsg_are_not_trusted() {
        let reader = KmsgReader::open(&HostRoot::system())
            .unwrap()
            .since_boot_us(0);
        let (tx, mut rx) = mpsc::unbounded_channel();
        let marker = format!("gpu-agent-test-{}", std::process::id());
        std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/kmsg")
            .unwrap()
            .write_all(
                format!("NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name={marker}, injected\n")
                    .as_bytes(),
            )
            .unwrap();
        let done = reader
            .run(tx, tokio::time::sleep(Duration::from_millis(500)))
            .await;
        assert!(done.is_ok(), "{done:?}");
        while let Ok(x) = rx.try_recv() {
            assert_ne!(x.process.as_deref(), Some(marker.as_str()));
        }
        // The record is there, one per read, and reads as user space.
        let mut f = open_nonblocking(Path::new("/dev/kmsg")).unwrap();
        let mut buf = vec![0u8; READ_BUFFER];
        let mut found = None;
        loop {
            match f.read(&mut buf) {
                Ok(n) => {
                    let rec = String::from_utf8_lossy(&buf[..n]).into_owned();
                    assert!(rec.ends_with('\n'), "{rec:?}");
                    if rec.contains(&marker) {
                        found = Some(rec);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.raw_os_error() == Some(libc::EPIPE) => {}
                Err(e) => panic!("{e}"),
            }
        }
        let rec = found.expect("the injected record");
        match parse_record(&rec) {
            Record::Unparsed { reason, .. } => assert!(reason.contains("user space"), "{reason}"),
            other => panic!("{other:?}"),
        }
    }

    fn xid_or_unparsed(r: &Record) -> bool {
        matches!(r, Record::Xid(_) | Record::Unparsed { .. })
    }

    proptest! {
        #[test]
        fn any_string_parses_and_xid_lines_are_never_other(s in ".*") {
            let r = parse_line(&s);
            if s.contains("NVRM") && s.contains("Xid") {
                prop_assert!(xid_or_unparsed(&r), "{:?} -> {:?}", s, r);
            }
        }

        #[test]
        fn near_misses_of_real_lines_are_never_other(
            prefix in "([0-9]{1,3},[0-9]{1,5},[0-9]{1,9},[-c+];)?",
            addr in "(PCI:)?[0-9a-fA-F:.]{0,14}( GPU-I:[0-9x]{1,3})?( GPU-CI:[0-9]{1,3})?",
            number in "[0-9a-z]{0,22}",
            tail in "(, pid=[0-9'<>a-z]{0,12}(, name=[ -~]{0,12})?)?[ -~]{0,40}",
        ) {
            let line = format!("{prefix}NVRM: Xid ({addr}): {number}{tail}");
            let r = parse_line(&line);
            prop_assert!(xid_or_unparsed(&r), "{:?} -> {:?}", line, r);
            if let Record::Xid(x) = &r {
                prop_assert!(normalise_bus_id(&x.bus_id).as_deref() == Some(x.bus_id.as_str()));
            }
        }

        #[test]
        fn any_bytes_parse_and_xid_lines_are_never_other(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let s = String::from_utf8_lossy(&bytes);
            let r = parse_line(&s);
            if s.contains("NVRM") && s.contains("Xid") {
                prop_assert!(xid_or_unparsed(&r));
            }
        }

        #[test]
        fn any_chunking_gives_the_same_xids(
            lines in proptest::collection::vec(
                prop_oneof![
                    Just("4,7,9000,-;NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.".to_string()),
                    Just(" SUBSYSTEM=pci".to_string()),
                    Just(" NVRM: Xid (PCI:0000:3b:00): 48, x".to_string()),
                    Just("NVRM: Xid 154, no address".to_string()),
                    "[ -~]{0,30}",
                    proptest::collection::vec(any::<u8>(), 0..40)
                        .prop_map(|b| String::from_utf8_lossy(&b).into_owned()),
                ],
                0..12,
            ),
            cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..8),
        ) {
            let text = lines.join("\n");
            let bytes = text.as_bytes();
            let mut at: Vec<usize> = cuts.iter().map(|i| i.index(bytes.len() + 1)).collect();
            at.sort_unstable();
            let mut s = RecordSplitter::default();
            let mut recs = Vec::new();
            let mut from = 0;
            for to in at.into_iter().chain([bytes.len()]) {
                recs.extend(s.push(&bytes[from..to]));
                from = to;
            }
            recs.extend(s.finish());
            let got: Vec<Record> = recs.iter().map(|r| parse_record(r)).filter(xid_or_unparsed).collect();
            let want: Vec<Record> = text.split('\n').map(parse_line).filter(xid_or_unparsed).collect();
            prop_assert_eq!(got, want);
        }
    }
}
