//! A stand-in for NVIDIA's `nvidia-cuda-mps-control`, for tests without a
//! GPU. It is not gpu-agent: it is what gpu-agent drives. The end-to-end
//! test (agent/tests/mps.rs) compiles it statically with `rustc` and puts
//! it at the test host root's `/usr/bin/nvidia-cuda-mps-control`, so that
//! it runs chrooted there exactly as the host's would.
//!
//! - `-f`: the control daemon in the foreground. It listens on
//!   `$CUDA_MPS_PIPE_DIRECTORY/control` (a Unix socket), writes its pid to
//!   `nvidia-cuda-mps-control.pid` there, and records to
//!   `$CUDA_MPS_LOG_DIRECTORY/control.log`: a `start` line (pid, its
//!   `CUDA_VISIBLE_DEVICES`, whether `/dev/shm` is the MPS shm directory it
//!   was meant to get: it leaves a marker file there; `multi_user=yes` when
//!   started with `-M` too) and a `command` line for every command it
//!   gets. `quit` ends it.
//! - `-d`: the same daemon, in the background (started again with `-f`,
//!   detached; this process exits at once, as the real `-d` does).
//! - `-M` after `-f` or `-d`: multi-user mode (only recorded).
//! - no argument: the control client. It sends stdin's command lines to
//!   the daemon and prints the answers; without a daemon it says so and
//!   exits 1, and it exits 1 when the daemon refuses a command.
//!
//! Answers: `get_default_active_thread_percentage` → the percentage set
//! (`100.0` at first); `set_default_active_thread_percentage N` → `N.0`;
//! `set_default_device_pinned_mem_limit DEV VALUE` and
//! `get_default_device_pinned_mem_limit DEV` as the real daemon's; `quit`
//! → nothing; anything else → refused.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::process::ExitCode;

fn pipe_dir() -> PathBuf {
    std::env::var_os("CUDA_MPS_PIPE_DIRECTORY")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/tmp/nvidia-mps"))
}

fn log_dir() -> PathBuf {
    std::env::var_os("CUDA_MPS_LOG_DIRECTORY")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/log/nvidia-mps"))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let multi_user = match args.get(1).map(String::as_str) {
        None => false,
        Some("-M") if args.len() == 2 => true,
        Some(_) => {
            eprintln!("unknown options {}", args[1..].join(" "));
            return ExitCode::FAILURE;
        }
    };
    match args.first().map(String::as_str) {
        Some("-f") => daemon(multi_user),
        Some("-d") => {
            let me = std::env::current_exe().expect("own path");
            match std::process::Command::new(me)
                .arg("-f")
                .args(multi_user.then_some("-M"))
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
            {
                Ok(_) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("cannot start the daemon: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        None => client(),
        Some(_) if multi_user => {
            eprintln!("-M goes with -f or -d");
            ExitCode::FAILURE
        }
        Some(other) => {
            eprintln!("unknown option {other}");
            ExitCode::FAILURE
        }
    }
}

fn client() -> ExitCode {
    let socket = pipe_dir().join("control");
    let mut input = String::new();
    if std::io::stdin().read_to_string(&mut input).is_err() {
        return ExitCode::FAILURE;
    }
    let Ok(mut s) = UnixStream::connect(&socket) else {
        eprintln!("Cannot find MPS control daemon process");
        return ExitCode::FAILURE;
    };
    if s.write_all(input.as_bytes()).is_err() || s.shutdown(std::net::Shutdown::Write).is_err() {
        return ExitCode::FAILURE;
    }
    let mut answer = String::new();
    if s.read_to_string(&mut answer).is_err() {
        return ExitCode::FAILURE;
    }
    let mut ok = true;
    for line in answer.lines() {
        if let Some(err) = line.strip_prefix("ERR ") {
            eprintln!("{err}");
            ok = false;
        } else {
            println!("{line}");
        }
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

struct Daemon {
    log: std::fs::File,
    percentage: String,
    pinned: BTreeMap<String, String>,
}

impl Daemon {
    fn record(&mut self, line: &str) {
        let _ = writeln!(self.log, "{line}");
        let _ = self.log.flush();
    }

    /// The answer to one command, and whether to quit.
    fn answer(&mut self, command: &str) -> (String, bool) {
        self.record(&format!("command {command}"));
        let words: Vec<&str> = command.split_whitespace().collect();
        match words.as_slice() {
            ["get_default_active_thread_percentage"] => (format!("{}\n", self.percentage), false),
            ["set_default_active_thread_percentage", n] => match n.parse::<f64>() {
                Ok(v) if v > 0.0 && v <= 100.0 => {
                    self.percentage = format!("{v:.1}");
                    (format!("{}\n", self.percentage), false)
                }
                _ => (format!("ERR invalid percentage {n}\n"), false),
            },
            ["set_default_device_pinned_mem_limit", dev, value]
                if dev.parse::<u32>().is_ok() && value.ends_with(['M', 'G']) =>
            {
                self.pinned.insert(dev.to_string(), value.to_string());
                (String::new(), false)
            }
            ["get_default_device_pinned_mem_limit", dev] => (
                format!("{}\n", self.pinned.get(*dev).map_or("0", String::as_str)),
                false,
            ),
            ["quit"] => (String::new(), true),
            _ => (
                format!("ERR unknown or malformed command {command:?}\n"),
                false,
            ),
        }
    }
}

fn daemon(multi_user: bool) -> ExitCode {
    let pipe = pipe_dir();
    let socket = pipe.join("control");
    if UnixStream::connect(&socket).is_ok() {
        eprintln!("An instance of this daemon is already running");
        return ExitCode::FAILURE;
    }
    let _ = std::fs::remove_file(&socket);
    let listener = match UnixListener::bind(&socket) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("{}: {e}", socket.display());
            return ExitCode::FAILURE;
        }
    };
    let pid = std::process::id();
    let _ = std::fs::write(pipe.join("nvidia-cuda-mps-control.pid"), format!("{pid}\n"));
    let log = match std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log_dir().join("control.log"))
    {
        Ok(f) => f,
        Err(e) => {
            eprintln!("{}: {e}", log_dir().display());
            return ExitCode::FAILURE;
        }
    };
    // Leave a mark in /dev/shm: the test finds it in the MPS shm directory
    // when that is what this process got as /dev/shm.
    let marker = format!("/dev/shm/mps-standin-{pid}");
    let shm = if std::fs::write(&marker, "").is_ok() {
        marker
    } else {
        "unwritable".to_string()
    };
    let mut d = Daemon {
        log,
        percentage: "100.0".into(),
        pinned: BTreeMap::new(),
    };
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_default();
    d.record(&format!(
        "start pid={pid} visible={visible} shm={shm} cwd={} multi_user={}",
        std::env::current_dir().map_or_else(|_| "?".into(), |p| p.display().to_string()),
        if multi_user { "yes" } else { "no" }
    ));
    eprintln!("MPS stand-in serving on {}", socket.display());
    for conn in listener.incoming() {
        let Ok(mut conn) = conn else { continue };
        let mut answers = String::new();
        let mut quit = false;
        let reader = BufReader::new(match conn.try_clone() {
            Ok(c) => c,
            Err(_) => continue,
        });
        for line in reader.lines() {
            let Ok(line) = line else { break };
            if line.trim().is_empty() {
                continue;
            }
            let (a, q) = d.answer(line.trim());
            answers.push_str(&a);
            quit |= q;
        }
        let _ = conn.write_all(answers.as_bytes());
        drop(conn);
        if quit {
            d.record("quit");
            let _ = std::fs::remove_file(&socket);
            let _ = std::fs::remove_file(pipe.join("nvidia-cuda-mps-control.pid"));
            return ExitCode::SUCCESS;
        }
    }
    ExitCode::SUCCESS
}
