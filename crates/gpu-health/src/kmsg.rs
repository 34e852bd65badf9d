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
mod tests;
