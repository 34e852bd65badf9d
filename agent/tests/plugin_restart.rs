//! A kubelet restart does not leave the old plugin server behind.
//!
//! `gpu-agent run` (the fake libnvidia-ml on a 4x T4 node) serves its
//! device plugin to a kubelet stand-in we did not write (Python grpcio,
//! tests/interop/kubelet_restart_standin.py) that never closes a channel:
//! its old `ListAndWatch` streams, and an abuser's, stay open from the
//! client's side across the restart, as a kubelet's or any client's may.
//! Three times the stand-in restarts as a kubelet does (every socket in the
//! directory deleted, a new `kubelet.sock`), then the agent gets SIGTERM.
//!
//! Proven, each within 5 s: every old stream (the kubelet's, the abuser's)
//! ends with `Unavailable` and the agent's words; the agent registers again
//! and the new stream gets the devices; the agent logs "plugin server for
//! <socket> stopped" (gracefully) once per replaced server; its open
//! sockets are fewer than before the first restart (the old kubelet
//! connection replaced by the new one, the abuser's gone: no connection of
//! an old server is left). At SIGTERM the last stream ends with the same status,
//! the last server's stop is logged, and the agent exits.
//!
//! And a client that will not let a graceful shutdown finish (raw HTTP/2:
//! an Allocate whose request never ends, no PING ever answered) neither
//! delays the re-registration nor keeps the old server: its connection is
//! cut after `STOP_GRACE`, the stop logged as "connections cut" within
//! `STOP_GRACE + CUT_GRACE`.

mod common;

use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;
use gpu_agent::plugin::manager::{CUT_GRACE, STOP_GRACE};
use loona_hpack::Encoder;
use serde_json::Value;

/// How long each sign of a restart (or of the shutdown) may take.
const BOUND: Duration = Duration::from_secs(5);

struct Agent {
    child: Child,
    host: tempfile::TempDir,
    log: PathBuf,
    _lib_dir: tempfile::TempDir,
}

impl Agent {
    fn start() -> Agent {
        let (host, events) = plugin_host("t4-4");
        // A port of our own for the metrics, beside other tests' agents.
        let metrics_port = free_port();
        let policy = host.path().join("policy.yaml");
        fs::write(
            &policy,
            format!("spec:\n  dcgmExporter:\n    listen: 127.0.0.1:{metrics_port}\n"),
        )
        .unwrap();
        let log = host.path().join("agent.log");
        let (lib_dir, lib) = fake_nvml();
        let child = at(host.path())
            .arg("--nvml-lib")
            .arg(&lib)
            .arg("--policy")
            .arg(&policy)
            .args(["--log-format", "json", "run", "--heartbeat", "1"])
            .env("FAKE_NVML_NODE", "t4-4")
            .env("FAKE_NVML_EVENTS", &events)
            .stderr(fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Agent {
            child,
            host,
            log,
            _lib_dir: lib_dir,
        }
    }

    fn plugin_dir(&self) -> PathBuf {
        self.host.path().join("var/lib/kubelet/device-plugins")
    }

    fn logs(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The "plugin server for <socket> stopped" records so far.
    fn stops(&self) -> Vec<Value> {
        self.logs()
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|v| {
                v["fields"]["message"]
                    .as_str()
                    .is_some_and(|m| m.starts_with("plugin server for ") && m.ends_with(" stopped"))
            })
            .collect()
    }

    /// The agent's open sockets (its /proc/<pid>/fd links to `socket:[..]`).
    fn sockets(&self) -> usize {
        fs::read_dir(format!("/proc/{}/fd", self.child.id()))
            .unwrap()
            .filter_map(|e| fs::read_link(e.ok()?.path()).ok())
            .filter(|l| l.to_string_lossy().starts_with("socket:"))
            .count()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if self.child.try_wait().unwrap().is_none() {
            let _ = sigterm(&mut self.child);
        }
    }
}

/// The Python kubelet stand-in and the events it printed.
struct Kubelet {
    child: Child,
    stdin: Option<ChildStdin>,
    events: mpsc::Receiver<Value>,
    seen: Vec<Value>,
}

impl Kubelet {
    fn start(dir: &Path) -> Kubelet {
        let proto = repo().join("proto/proto/deviceplugin_v1beta1.proto");
        let mut child = Command::new(python())
            .arg(repo().join("tests/interop/kubelet_restart_standin.py"))
            .arg("--proto")
            .arg(&proto)
            .arg("--dir")
            .arg(dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        let (tx, events) = mpsc::channel();
        std::thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                if tx.send(json(&line)).is_err() {
                    break;
                }
            }
        });
        Kubelet {
            stdin: child.stdin.take(),
            child,
            events,
            seen: Vec::new(),
        }
    }

    fn send(&mut self, cmd: &str) {
        writeln!(self.stdin.as_mut().unwrap(), "{cmd}").unwrap();
    }

    /// The first event (seen before, or within `timeout`) with `event`,
    /// registration `n` (0: none) and, where given, `who`.
    fn wait(
        &mut self,
        timeout: Duration,
        event: &str,
        n: u64,
        who: Option<&str>,
        logs: &dyn Fn() -> String,
    ) -> Value {
        let matches = |v: &Value| {
            v["event"] == event
                && (v["n"] == n || n == 0 && v["n"].is_null())
                && who.is_none_or(|w| v["who"] == w)
        };
        if let Some(v) = self.seen.iter().find(|v| matches(v)) {
            return v.clone();
        }
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.events.recv_timeout(left) {
                Ok(v) => {
                    self.seen.push(v.clone());
                    if matches(&v) {
                        return v;
                    }
                }
                Err(_) => panic!(
                    "no {event} n={n} who={who:?} within {timeout:?}; the stand-in saw {:#?}\nagent log:\n{}",
                    self.seen,
                    logs()
                ),
            }
        }
    }
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `stream` ended with the agent's `Unavailable`.
fn assert_ended_by_agent(stream: &Value) {
    assert_eq!(stream["code"], "UNAVAILABLE", "{stream}");
    let details = stream["details"].as_str().unwrap();
    assert!(
        details.contains("nvidia.com/gpu") && details.contains("device-plugin server is stopping"),
        "{stream}"
    );
}

fn poll(what: &str, timeout: Duration, logs: &dyn Fn() -> String, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(
            Instant::now() < deadline,
            "{what}: not within {timeout:?}; agent log:\n{}",
            logs()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn kubelet_restarts_end_the_old_streams_and_stop_the_old_servers() {
    let mut agent = Agent::start();
    let dir = agent.plugin_dir();
    let socket = dir.join("nvidia-gpu.sock");
    let mut kubelet = Kubelet::start(&dir);
    let log_path = agent.log.clone();
    let logs = move || fs::read_to_string(&log_path).unwrap_or_default();

    kubelet.wait(Duration::from_secs(60), "registered", 1, None, &logs);
    let first = kubelet.wait(BOUND, "list", 1, Some("kubelet"), &logs);
    assert_eq!(first["devices"], 4, "{first}");
    // An abuser's stream on the same socket, never cancelled.
    kubelet.send("hold");
    kubelet.wait(BOUND, "list", 1, Some("abuser"), &logs);
    let sockets_before = agent.sockets();
    // (A server may have been replaced already: the agent started before
    // kubelet.sock existed, and registers again when it appears.)
    let stops_before = agent.stops().len() as u64;

    for round in 1..=3u64 {
        let restarted_at = Instant::now();
        kubelet.send("restart");
        let restarted = kubelet.wait(BOUND, "restarted", 0, None, &logs);
        assert!(
            restarted["removed"]
                .as_array()
                .unwrap()
                .contains(&Value::from("nvidia-gpu.sock")),
            "{restarted}"
        );
        // "restarted" has no n: forget it, so the next round waits for its own.
        kubelet.seen.retain(|v| v["event"] != "restarted");

        let old = kubelet.wait(BOUND, "stream_end", round, Some("kubelet"), &logs);
        assert_ended_by_agent(&old);
        if round == 1 {
            let abuser = kubelet.wait(BOUND, "stream_end", 1, Some("abuser"), &logs);
            assert_ended_by_agent(&abuser);
        }
        kubelet.wait(BOUND, "registered", round + 1, None, &logs);
        let list = kubelet.wait(BOUND, "list", round + 1, Some("kubelet"), &logs);
        assert_eq!(list["devices"], 4, "{list}");
        poll("the old server's stop logged", BOUND, &logs, || {
            agent.stops().len() as u64 == stops_before + round
        });
        let stop = agent.stops().pop().unwrap();
        assert_eq!(
            stop["fields"]["message"],
            format!("plugin server for {} stopped", socket.display()),
            "{stop}"
        );
        assert_eq!(stop["fields"]["how"], "gracefully", "{stop}");
        // The kubelet's old connection is replaced by its new one; the
        // abuser's is gone.
        poll("the old server's connections closed", BOUND, &logs, || {
            agent.sockets() < sockets_before
        });
        let took = restarted_at.elapsed();
        assert!(took < BOUND, "restart {round} took {took:?}");
        eprintln!(
            "restart {round}: old streams ended, re-registered, old server stopped in {} ms, all within {took:?}; agent sockets {} (before: {sockets_before})",
            stop["fields"]["elapsed_ms"],
            agent.sockets()
        );
    }

    // SIGTERM: the current stream ends with the agent's status, not a
    // broken connection, and the agent exits promptly.
    let stopping = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(agent.child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let last = kubelet.wait(BOUND, "stream_end", 4, Some("kubelet"), &logs);
    assert_ended_by_agent(&last);
    poll("the agent's exit", BOUND, &logs, || {
        agent.child.try_wait().unwrap().is_some()
    });
    let stops = agent.stops();
    assert_eq!(stops.len() as u64, stops_before + 4, "{stops:?}");
    assert_eq!(
        stops.last().unwrap()["fields"]["how"],
        "gracefully",
        "{stops:?}"
    );
    assert!(!socket.exists(), "the agent left {}", socket.display());
    eprintln!(
        "SIGTERM: stream ended, agent exited in {:?}",
        stopping.elapsed()
    );
}

/// Opens an HTTP/2 connection on `socket` and starts an Allocate whose
/// request never ends (HEADERS without END_STREAM, no DATA); reads what the
/// server sends, answers nothing (not its SETTINGS, not its PINGs). Returns
/// when the server closed the connection.
fn stalled_allocate(socket: &Path) -> mpsc::Receiver<Instant> {
    let mut s = UnixStream::connect(socket).unwrap();
    s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").unwrap();
    let frame = |s: &mut UnixStream, kind: u8, flags: u8, stream: u32, payload: &[u8]| {
        let len = (payload.len() as u32).to_be_bytes();
        let mut f = vec![len[1], len[2], len[3], kind, flags];
        f.extend(stream.to_be_bytes());
        f.extend(payload);
        s.write_all(&f).unwrap();
    };
    // SETTINGS (empty), then HEADERS with END_HEADERS only.
    frame(&mut s, 0x4, 0, 0, &[]);
    let headers: Vec<(&[u8], &[u8])> = vec![
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (b":path", b"/v1beta1.DevicePlugin/Allocate"),
        (b":authority", b"localhost"),
        (b"content-type", b"application/grpc"),
        (b"te", b"trailers"),
    ];
    let block = Encoder::new().encode(headers);
    frame(&mut s, 0x1, 0x4, 1, &block);
    let (tx, closed) = mpsc::channel();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        // EOF or an error (a reset): closed either way.
        while s.read(&mut buf).is_ok_and(|n| n > 0) {}
        let _ = tx.send(Instant::now());
    });
    closed
}

#[test]
fn a_client_that_stalls_the_graceful_shutdown_is_cut_off() {
    let mut agent = Agent::start();
    let dir = agent.plugin_dir();
    let socket = dir.join("nvidia-gpu.sock");
    let mut kubelet = Kubelet::start(&dir);
    let log_path = agent.log.clone();
    let logs = move || fs::read_to_string(&log_path).unwrap_or_default();

    kubelet.wait(Duration::from_secs(60), "registered", 1, None, &logs);
    kubelet.wait(BOUND, "list", 1, Some("kubelet"), &logs);
    let stops_before = agent.stops().len() as u64;
    let closed = stalled_allocate(&socket);
    // The stalled call is being served (its connection stays open).
    assert!(
        closed.recv_timeout(Duration::from_millis(300)).is_err(),
        "the agent closed the stalled client's connection before any restart"
    );

    let restarted_at = Instant::now();
    kubelet.send("restart");
    kubelet.wait(BOUND, "restarted", 0, None, &logs);
    let old = kubelet.wait(BOUND, "stream_end", 1, Some("kubelet"), &logs);
    assert_ended_by_agent(&old);
    kubelet.wait(BOUND, "registered", 2, None, &logs);
    kubelet.wait(BOUND, "list", 2, Some("kubelet"), &logs);
    let reregistered = restarted_at.elapsed();
    assert!(
        reregistered < STOP_GRACE,
        "re-registration waited on the old server: {reregistered:?}"
    );

    let closed_at = closed.recv_timeout(BOUND).unwrap_or_else(|_| {
        panic!(
            "the stalled client's connection was never closed; agent log:\n{}",
            logs()
        )
    });
    let cut_after = closed_at - restarted_at;
    assert!(
        cut_after >= STOP_GRACE && cut_after < STOP_GRACE + CUT_GRACE + Duration::from_secs(1),
        "the stalled client was cut {cut_after:?} after the restart"
    );
    poll("the old server's stop logged", BOUND, &logs, || {
        agent.stops().len() as u64 == stops_before + 1
    });
    let stop = agent.stops().pop().unwrap();
    assert_eq!(stop["fields"]["how"], "connections cut", "{stop}");
    let ms = stop["fields"]["elapsed_ms"].as_u64().unwrap();
    assert!(
        u128::from(ms) >= STOP_GRACE.as_millis()
            && u128::from(ms) < (STOP_GRACE + CUT_GRACE).as_millis(),
        "{stop}"
    );
    eprintln!(
        "stalled client: re-registered in {reregistered:?}, its connection cut after {cut_after:?}, the old server stopped in {ms} ms"
    );
    assert!(
        agent.child.try_wait().unwrap().is_none(),
        "the agent exited"
    );
}
