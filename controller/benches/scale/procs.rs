//! The controller processes of the scale benchmark: started on core 1,
//! each with its own kubeconfig (its own bearer token, so the scripted API
//! server can tell which replica wrote a node), and what /proc says of
//! them (RSS, CPU time).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// One controller process.
pub struct Controller {
    /// `r1`, `r2`, ...: its identity on the shard Leases.
    pub name: String,
    /// The bearer token its kubeconfig gives it.
    pub bearer: String,
    pub port: u16,
    pub pid: u32,
    child: Child,
    pub log: PathBuf,
    /// Peak RSS (KiB) and open files (its connections, mostly) since the
    /// last [`Controller::take_peak`].
    peak: Arc<AtomicU64>,
    peak_fds: Arc<AtomicU64>,
    alive: Arc<std::sync::atomic::AtomicBool>,
}

/// How the controllers are started.
pub struct Setup<'a> {
    pub dir: &'a Path,
    pub kubeconfig: &'a Path,
    pub cert: &'a Path,
    pub key: &'a Path,
    pub interval: u64,
    pub replicas: usize,
}

/// Whether this gpu-controller takes `flag` (the check-in flags came with
/// the unary report; an older binary would refuse to start).
pub fn takes(flag: &str) -> bool {
    Command::new(env!("CARGO_BIN_EXE_gpu-controller"))
        .arg("--help")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains(flag))
        .unwrap_or(false)
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Controller {
    /// Starts replica `n` (from 1) on core 1, under GPU_BENCH_WRAP if set
    /// (a command to run it under: a profiler).
    pub fn start(s: &Setup<'_>, n: usize) -> Controller {
        let name = format!("r{n}");
        let bearer = format!("controller-{name}");
        let kubeconfig = s.dir.join(format!("kubeconfig-{name}"));
        let text = std::fs::read_to_string(s.kubeconfig).unwrap();
        std::fs::write(
            &kubeconfig,
            text.replace("token: controller-token", &format!("token: {bearer}")),
        )
        .unwrap();
        let port = free_port();
        let wrap: Vec<String> = std::env::var("GPU_BENCH_WRAP")
            .map(|w| w.split_whitespace().map(String::from).collect())
            .unwrap_or_default();
        let mut cmd = Command::new("taskset");
        cmd.args(["-c", "1"])
            .args(&wrap)
            .arg(env!("CARGO_BIN_EXE_gpu-controller"))
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .arg("--tls-cert")
            .arg(s.cert)
            .arg("--tls-key")
            .arg(s.key)
            .args(["--http-listen", &format!("127.0.0.1:{}", free_port())]);
        if takes("--check-in-interval") {
            cmd.args(["--check-in-interval", &s.interval.to_string()]);
        }
        if s.replicas > 1 {
            cmd.args(["--shards", "8", "--lease-namespace", "gpu-agent"])
                .args(["--identity", &name])
                .args(["--advertise", &format!("https://localhost:{port}")]);
        }
        let log = s.dir.join(format!("controller-{name}.log"));
        let child = cmd
            .env("KUBECONFIG", &kubeconfig)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("taskset and gpu-controller");
        let pid = child.id();
        let peak = Arc::new(AtomicU64::new(0));
        let peak_fds = Arc::new(AtomicU64::new(0));
        let alive = Arc::new(std::sync::atomic::AtomicBool::new(true));
        {
            let (peak, peak_fds, alive) = (peak.clone(), peak_fds.clone(), alive.clone());
            tokio::spawn(async move {
                while alive.load(Ordering::Relaxed) {
                    peak.fetch_max(rss_kib(pid), Ordering::Relaxed);
                    peak_fds.fetch_max(open_files(pid), Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
            });
        }
        Controller {
            name,
            bearer,
            port,
            pid,
            child,
            log,
            peak,
            peak_fds,
            alive,
        }
    }

    /// Waits until it takes connections.
    pub async fn ready(&mut self) {
        let t = Instant::now();
        while tokio::net::TcpStream::connect(("127.0.0.1", self.port))
            .await
            .is_err()
        {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "{} exited ({status}) before it took connections:\n{}",
                    self.name,
                    std::fs::read_to_string(&self.log).unwrap_or_default()
                );
            }
            assert!(
                t.elapsed() < Duration::from_secs(120),
                "{} never listened",
                self.name
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn endpoint(&self) -> String {
        format!("https://localhost:{}", self.port)
    }

    pub fn rss_kib(&self) -> u64 {
        rss_kib(self.pid)
    }

    /// The peak RSS since the last call (KiB), and starts a new one.
    pub fn take_peak(&self) -> u64 {
        self.peak
            .swap(rss_kib(self.pid), Ordering::Relaxed)
            .max(rss_kib(self.pid))
    }

    /// The most files it had open at once since the last call, and starts
    /// a new count.
    pub fn take_peak_fds(&self) -> u64 {
        self.peak_fds.swap(open_files(self.pid), Ordering::Relaxed)
    }

    /// CPU time used so far (user + system), in seconds.
    pub fn cpu_seconds(&self) -> f64 {
        cpu_seconds(self.pid)
    }

    /// SIGKILL: gone at once, its Leases left to expire.
    pub fn kill(&mut self) {
        self.alive.store(false, Ordering::Relaxed);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM (a profiler wrapping it writes its report as it exits).
    pub fn stop(&mut self) {
        if !self.alive.swap(false, Ordering::Relaxed) {
            return;
        }
        let _ = Command::new("kill")
            .args(["-TERM", &self.pid.to_string()])
            .stderr(Stdio::null())
            .status();
        let _ = self.child.wait();
    }

    /// The last lines of its log (WARN and above).
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

pub fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// Files open in `pid` (its sockets, mostly).
pub fn open_files(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count() as u64)
}

fn clock_ticks() -> f64 {
    static TICKS: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
            .unwrap_or(100.0)
    })
}

/// utime + stime of /proc/PID/stat, in seconds.
pub fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // After the command's name (in parentheses, which may hold spaces):
    // state is field 3, utime 14, stime 15.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<u64> = rest
        .split_whitespace()
        .map(|v| v.parse().unwrap_or(0))
        .collect();
    let ticks = f.get(11).copied().unwrap_or(0) + f.get(12).copied().unwrap_or(0);
    ticks as f64 / clock_ticks()
}

/// The CPU time of this process (the agents and the API server, on core
/// 0) and of the controllers (together, on core 1), sampled every 250 ms
/// from its start until dropped.
pub struct CpuTrace {
    /// (seconds since the start, this process's CPU s, the controllers' CPU s).
    samples: Arc<std::sync::Mutex<Vec<(f64, f64, f64)>>>,
    alive: Arc<std::sync::atomic::AtomicBool>,
}

impl CpuTrace {
    pub fn start(pids: Vec<u32>) -> CpuTrace {
        let samples = Arc::new(std::sync::Mutex::new(Vec::new()));
        let alive = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let (s, a) = (samples.clone(), alive.clone());
        let me = std::process::id();
        let sample = move || {
            let ctl: f64 = pids.iter().map(|p| cpu_seconds(*p)).sum();
            (cpu_seconds(me), ctl)
        };
        let t = Instant::now();
        let (m0, c0) = sample();
        tokio::spawn(async move {
            while a.load(Ordering::Relaxed) {
                tokio::time::sleep(Duration::from_millis(250)).await;
                let (m, c) = sample();
                s.lock()
                    .unwrap()
                    .push((t.elapsed().as_secs_f64(), m - m0, c - c0));
            }
        });
        CpuTrace { samples, alive }
    }

    /// Over the first `secs` (at least; to the first sample past it): the
    /// window, and the share of a core this process and the controllers
    /// used in it.
    pub fn busy(&self, secs: f64) -> Option<(f64, f64, f64)> {
        let s = self.samples.lock().unwrap();
        let (t, m, c) = s.iter().find(|(t, _, _)| *t >= secs).or(s.last())?;
        Some((*t, m / t, c / t))
    }
}

impl Drop for CpuTrace {
    fn drop(&mut self) {
        self.alive.store(false, Ordering::Relaxed);
    }
}
