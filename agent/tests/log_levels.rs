//! What the running agent writes to its log (docs/operations.md): INFO for
//! changes, WARN for what an operator must act on, nothing for a pass that
//! changes nothing.
//!
//! `gpu-agent run` on a simulated 8x H100 node with a containerd config, a
//! kubelet stand-in that registers and lists, and a FIFO for /dev/kmsg,
//! logging JSON (`GPU_AGENT_LOG=info,gpu_agent::supervisor=debug`: what the
//! default level writes, plus the supervisor's one DEBUG line per reconcile
//! that says a pass ran and how long it took).
//!
//! Proven: reconciles of the unchanged node, one a second, write nothing at
//! INFO or above (before: 19 lines a pass, 27,000 a day at the default 60 s
//! interval); a kubelet restart, again and again, is INFO, never WARN; "told
//! systemd" only where there is a systemd (`NOTIFY_SOCKET`) that was told;
//! an XID's pid and process are values (`pid=4242`, `process=python`), not
//! Rust's `Some(4242)`, and left out when the kernel does not know them.

mod common;

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use common::*;
use gpu_agent::plugin::kubelet::MockKubelet;
use serde_json::Value;

struct Agent {
    child: Child,
    host: tempfile::TempDir,
    log: PathBuf,
    kmsg: Option<fs::File>,
}

impl Drop for Agent {
    fn drop(&mut self) {
        if self.child.try_wait().unwrap().is_none() {
            let _ = sigterm(&mut self.child);
        }
    }
}

/// A simulated 8x H100 node whose every stage can be done: a containerd
/// config to patch (nothing to reload), the kubelet's directory, a FIFO for
/// the kernel log.
fn node() -> tempfile::TempDir {
    node_of(NODE)
}

/// The simulated node [`node`] and [`Agent::start`] use.
const NODE: &str = "h100-sxm-8";

/// [`node`], of another simulated node.
fn node_of(name: &str) -> tempfile::TempDir {
    let (host, _events) = plugin_host(name);
    fs::create_dir_all(host.path().join("etc/containerd")).unwrap();
    fs::write(
        host.path().join("etc/containerd/config.toml"),
        "version = 3\n\n[plugins.\"io.containerd.cri.v1.runtime\".containerd]\n  default_runtime_name = \"runc\"\n",
    )
    .unwrap();
    nix::unistd::mkfifo(
        &host.path().join("dev/kmsg"),
        nix::sys::stat::Mode::from_bits_truncate(0o600),
    )
    .unwrap();
    host
}

impl Agent {
    /// Starts the agent on `host`; `env` is added to its environment
    /// (`NOTIFY_SOCKET` is taken away unless `env` names it).
    fn start(host: tempfile::TempDir, env: &[(&str, &Path)]) -> Agent {
        Self::start_as(NODE, host, env)
    }

    /// [`Agent::start`] of the simulated node `name` (made by [`node_of`]).
    fn start_as(name: &str, host: tempfile::TempDir, env: &[(&str, &Path)]) -> Agent {
        let policy = host.path().join("policy.yaml");
        fs::write(
            &policy,
            "spec:\n  reconcileIntervalSeconds: 1\n  toolkit:\n    reload: none\n",
        )
        .unwrap();
        let log = host.path().join("agent.log");
        let mut cmd = at(host.path());
        cmd.arg("--policy")
            .arg(&policy)
            .args(["--simulate", name, "--log-format", "json", "run"])
            .env("GPU_AGENT_LOG", "info,gpu_agent::supervisor=debug")
            .env_remove("NOTIFY_SOCKET")
            .env_remove("WATCHDOG_USEC")
            .stderr(fs::File::create(&log).unwrap());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().unwrap();
        // The kernel log's write end (opening it waits for the agent's read end).
        let kmsg = host.path().join("dev/kmsg");
        let deadline = Instant::now() + Duration::from_secs(10);
        let kmsg = loop {
            use std::os::unix::fs::OpenOptionsExt;
            match fs::OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_NONBLOCK)
                .open(&kmsg)
            {
                Ok(f) => break Some(f),
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Err(e) => panic!(
                    "the agent never opened /dev/kmsg: {e}\n{}",
                    fs::read_to_string(&log).unwrap_or_default()
                ),
            }
        };
        Agent {
            child,
            host,
            log,
            kmsg,
        }
    }

    fn text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Every record so far (a line that is not JSON is a defect too).
    fn records(&self) -> Vec<Value> {
        self.text()
            .lines()
            .map(|l| {
                serde_json::from_str(l)
                    .unwrap_or_else(|e| panic!("a log line that is not JSON ({e}): {l}"))
            })
            .collect()
    }

    /// Waits (up to `secs`) until `f` holds for the records.
    fn until(&self, secs: u64, what: &str, f: impl Fn(&[Value]) -> bool) -> Vec<Value> {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let r = self.records();
            if f(&r) {
                return r;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: not within {secs} s\nlog:\n{}",
                self.text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn plugin_dir(&self) -> PathBuf {
        self.host.path().join("var/lib/kubelet/device-plugins")
    }
}

fn message(r: &Value) -> &str {
    r["fields"]["message"].as_str().unwrap_or("")
}

fn level(r: &Value) -> &str {
    r["level"].as_str().unwrap_or("")
}

/// INFO, WARN or ERROR: what the default level writes.
fn shown(r: &Value) -> bool {
    matches!(level(r), "INFO" | "WARN" | "ERROR")
}

/// The supervisor's line at the end of an interval reconcile.
fn interval_reconcile(r: &Value) -> bool {
    message(r) == "reconciled" && r["span"]["trigger"] == "interval"
}

fn lines(records: &[&Value]) -> String {
    records
        .iter()
        .map(|r| r.to_string())
        .collect::<Vec<_>>()
        .join("\n")
}

/// The agent on simulated node `name`, registered with a kubelet stand-in,
/// and its log records up to its `passes`th interval reconcile.
async fn registered_then_idle(name: &str, passes: usize) -> (Agent, MockKubelet, Vec<Value>) {
    let host = node_of(name);
    let kubelet = MockKubelet::start(
        &host
            .path()
            .join("var/lib/kubelet/device-plugins/kubelet.sock"),
    )
    .unwrap()
    .list_devices();
    let a = Agent::start_as(name, host, &[]);
    assert!(
        kubelet.wait_for(1, Duration::from_secs(10)).await,
        "the agent did not register:\n{}",
        a.text()
    );
    let records = a.until(5 + 2 * passes as u64, "interval reconciles", |r| {
        r.iter().filter(|r| interval_reconcile(r)).count() >= passes
    });
    (a, kubelet, records)
}

/// An idle node's reconciles log nothing: not the GPUs found again, not
/// each stage's unchanged state, not a warning already given. Each
/// reconcile leaves one DEBUG line with its duration. A pass writes the
/// same lines every time on an unchanged node, so none in these passes is
/// none in an hour's (60 at the default interval); before, each wrote 19.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_agent_logs_nothing_between_changes() {
    const PASSES: usize = 5;
    let (a, kubelet, records) = registered_then_idle(NODE, PASSES).await;
    // Startup (up to the first reconcile) said what the agent found and did.
    let first = records
        .iter()
        .position(|r| {
            interval_reconcile(r)
                || r["spans"]
                    .as_array()
                    .is_some_and(|s| s.iter().any(|s| s["name"] == "reconcile"))
        })
        .unwrap();
    let startup = &records[..first];
    let found = startup.iter().filter(|r| message(r) == "found GPU").count();
    assert_eq!(found, 8, "{}", a.text());
    assert!(
        startup
            .iter()
            .any(|r| message(r) == "registered with the kubelet"),
        "{}",
        a.text()
    );
    // Then the passes of the unchanged node.
    let idle: Vec<&Value> = records[first..].iter().filter(|r| shown(r)).collect();
    assert!(
        idle.is_empty(),
        "{} line(s) at INFO or above in {PASSES} reconciles of an unchanged node:\n{}",
        idle.len(),
        lines(&idle)
    );
    // One DEBUG line a pass, with how long it took.
    for r in records.iter().filter(|r| interval_reconcile(r)) {
        assert_eq!(level(r), "DEBUG", "{r}");
        assert!(r["fields"]["ms"].is_number(), "{r}");
    }
    // No systemd here: nothing says it was told anything.
    let told: Vec<&Value> = records
        .iter()
        .filter(|r| message(r).contains("systemd"))
        .collect();
    assert!(told.is_empty(), "{}", lines(&told));
    // Fields are values, not Rust's debug text.
    let text = a.text();
    assert!(!text.contains("Some("), "{text}");
    assert!(!text.contains("\"None\""), "{text}");
    kubelet.stop().await;
}

/// A node with a lasting condition an operator should know of (two GPU
/// models: labelled as one) says it once, then nothing while it lasts.
/// Before, each reconcile repeated it (and each report to the controller
/// did too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lasting_warning_is_said_once() {
    const PASSES: usize = 5;
    let (a, kubelet, records) = registered_then_idle("a100-h100-mixed", PASSES).await;
    let models: Vec<&Value> = records
        .iter()
        .filter(|r| message(r).starts_with("multiple GPU models"))
        .collect();
    assert_eq!(models.len(), 1, "{}", a.text());
    assert_eq!(level(models[0]), "WARN");
    assert!(models[0]["fields"]["models"].is_string(), "{}", models[0]);
    let first = records.iter().position(interval_reconcile).unwrap();
    let idle: Vec<&Value> = records[first..].iter().filter(|r| shown(r)).collect();
    assert!(
        idle.is_empty(),
        "{} line(s) at INFO or above in {PASSES} reconciles of an unchanged node:\n{}",
        idle.len(),
        lines(&idle)
    );
    kubelet.stop().await;
}

/// The kubelet deletes every socket in its directory when it starts, then
/// creates `kubelet.sock`: the agent serves on a new socket and registers
/// again, which is routine (INFO), however the deletion and the creation
/// interleave with the agent's reading of them. Before, most restarts
/// logged "our socket was removed; serving on a new one" as a WARN.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubelet_restart_is_not_a_warning() {
    const RESTARTS: usize = 6;
    let host = node();
    let socket = host
        .path()
        .join("var/lib/kubelet/device-plugins/kubelet.sock");
    let mut kubelet = MockKubelet::start(&socket).unwrap();
    let a = Agent::start(host, &[]);
    assert!(
        kubelet.wait_for(1, Duration::from_secs(10)).await,
        "the agent did not register:\n{}",
        a.text()
    );
    let before = a.records().len();
    for round in 1..=RESTARTS {
        // The old kubelet goes (its socket with it), the new one deletes
        // what is left in the directory and listens.
        kubelet.stop().await;
        for e in fs::read_dir(a.plugin_dir()).unwrap().flatten() {
            let _ = fs::remove_file(e.path());
        }
        kubelet = MockKubelet::start(&socket).unwrap();
        assert!(
            kubelet.wait_for(1, Duration::from_secs(5)).await,
            "restart {round}: the agent did not register again:\n{}",
            a.text()
        );
        a.until(5, "the registration's log", |r| {
            r[before..]
                .iter()
                .filter(|r| message(r) == "registered with the kubelet")
                .count()
                >= round
        });
    }
    // A moment for anything the last restart would still say.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        kubelet.registrations().len(),
        1,
        "registered twice with one kubelet"
    );
    let records = a.records();
    let after: Vec<&Value> = records[before..].iter().collect();
    let warned: Vec<&&Value> = after
        .iter()
        .filter(|r| matches!(level(r), "WARN" | "ERROR"))
        .collect();
    assert!(
        warned.is_empty(),
        "{RESTARTS} kubelet restarts logged {} warning(s):\n{}",
        warned.len(),
        warned
            .iter()
            .map(|r| r.to_string())
            .collect::<Vec<_>>()
            .join("\n")
    );
    let said = after
        .iter()
        .filter(|r| message(r).starts_with("kubelet restarted"))
        .inspect(|r| assert_eq!(level(r), "INFO", "{r}"))
        .count();
    assert_eq!(said, RESTARTS, "one line a restart:\n{}", lines(&after));
    kubelet.stop().await;
}

/// Under systemd (`NOTIFY_SOCKET`), READY=1 is sent once the host is ready
/// and the log says so; without it (the idle test above) nothing is said.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn told_systemd_only_when_systemd_was_told() {
    let host = node();
    let notify = host.path().join("notify.sock");
    let sd = std::os::unix::net::UnixDatagram::bind(&notify).unwrap();
    sd.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    let kubelet = MockKubelet::start(
        &host
            .path()
            .join("var/lib/kubelet/device-plugins/kubelet.sock"),
    )
    .unwrap()
    .list_devices();
    let a = Agent::start(host, &[("NOTIFY_SOCKET", &notify)]);
    let mut buf = [0u8; 4096];
    let ready = loop {
        let n = sd
            .recv(&mut buf)
            .unwrap_or_else(|e| panic!("no READY=1 ({e}):\n{}", a.text()));
        let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
        if msg.lines().any(|l| l == "READY=1") {
            break msg;
        }
    };
    let told = a.until(5, "the log's word of it", |r| {
        r.iter()
            .any(|r| message(r) == "told systemd the agent is ready")
    });
    let r = told
        .iter()
        .find(|r| message(r) == "told systemd the agent is ready")
        .unwrap();
    assert_eq!(level(r), "INFO");
    let status = ready
        .lines()
        .find_map(|l| l.strip_prefix("STATUS="))
        .unwrap();
    assert_eq!(r["fields"]["status"], status, "{ready}");
    kubelet.stop().await;
}

/// An XID from the kernel log: its pid and process are logged as values,
/// and left out where the kernel wrote `<unknown>`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_xids_fields_are_values() {
    let host = node();
    let kubelet = MockKubelet::start(
        &host
            .path()
            .join("var/lib/kubelet/device-plugins/kubelet.sock"),
    )
    .unwrap();
    let mut a = Agent::start(host, &[]);
    a.until(10, "the kernel log watched", |r| {
        r.iter()
            .any(|r| message(r) == "watching the kernel log for XIDs")
    });
    let kmsg = a.kmsg.as_mut().unwrap();
    // XID 13 (logged only) and 79 (the GPU is lost), on GPUs 0 and 3.
    kmsg.write_all(b"4,9001,0,-;NVRM: Xid (PCI:0000:18:00): 13, pid=4242, name=python, Graphics SM Warp Exception\n")
        .unwrap();
    kmsg.write_all(b"3,9002,0,-;NVRM: Xid (PCI:0000:5d:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n")
        .unwrap();
    let records = a.until(5, "both XIDs logged", |r| {
        r.iter().filter(|r| message(r) == "NVIDIA XID").count() == 2
    });
    let xids: Vec<&Value> = records
        .iter()
        .filter(|r| message(r) == "NVIDIA XID")
        .collect();
    let known = xids.iter().find(|r| r["fields"]["xid"] == 13).unwrap();
    assert_eq!(known["fields"]["pid"], 4242, "{known}");
    assert_eq!(known["fields"]["process"], "python", "{known}");
    let unknown = xids.iter().find(|r| r["fields"]["xid"] == 79).unwrap();
    assert_eq!(level(unknown), "WARN", "{unknown}");
    let fields = unknown["fields"].as_object().unwrap();
    assert!(
        !fields.contains_key("pid") && !fields.contains_key("process"),
        "{unknown}"
    );
    kubelet.stop().await;
}

/// No kubelet (bare metal with the device plugin left on, or a kubelet
/// down): the failed registration is a WARN once, after a second, and not
/// again while the kubelet's answer stays the same (before: one a retry,
/// at 1, 2, 4, 8, 16 s, then every 30 s); the kubelet coming up is INFO.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_kubelet_is_said_once() {
    let host = node();
    let socket = host
        .path()
        .join("var/lib/kubelet/device-plugins/kubelet.sock");
    let a = Agent::start(host, &[]);
    let failed = |r: &Value| message(r) == "registration failed" && level(r) == "WARN";
    a.until(5, "the failed registration", |r| r.iter().any(failed));
    // The retries after 2 and 4 s (1 and 3 s from the first word).
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let records = a.records();
    let warned: Vec<&Value> = records.iter().filter(|r| failed(r)).collect();
    assert_eq!(warned.len(), 1, "{}", lines(&warned));
    let kubelet = MockKubelet::start(&socket).unwrap();
    assert!(
        kubelet.wait_for(1, Duration::from_secs(5)).await,
        "the agent did not register:\n{}",
        a.text()
    );
    a.until(5, "the registration's word", |r| {
        r.iter()
            .any(|r| message(r) == "registered with the kubelet" && level(r) == "INFO")
    });
    kubelet.stop().await;
}

/// The message of every `warn!`/`error!` in `src` (file, line, message):
/// the first string literal among the macro's own arguments that is not a
/// field's value. Test modules (`#[cfg(test)] mod tests` to the end of a
/// file, files named `tests.rs`) are left out.
fn warn_and_error_messages(src: &Path) -> Vec<(String, usize, String)> {
    let mut out = Vec::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for e in fs::read_dir(&dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "rs")
                && p.file_name().is_some_and(|n| n != "tests.rs")
            {
                let text = fs::read_to_string(&p).unwrap();
                let code = match text.find("#[cfg(test)]\nmod tests") {
                    Some(at) => &text[..at],
                    None => &text,
                };
                for (line, msg) in macro_messages(code) {
                    out.push((p.display().to_string(), line, msg));
                }
            }
        }
    }
    out
}

/// (line, message) of each `warn!(`/`error!(` call in `code`, outside
/// comments and strings.
fn macro_messages(code: &str) -> Vec<(usize, String)> {
    let b = code.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    // Skips a string literal starting at `i` (at its quote); returns the
    // index after it and its text.
    let string_at = |mut i: usize| -> (usize, String) {
        let start = i + 1;
        i += 1;
        while i < b.len() && b[i] != b'"' {
            if b[i] == b'\\' {
                i += 1;
            }
            i += 1;
        }
        (i + 1, code[start..i].to_string())
    };
    while i < b.len() {
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                i = b[i..]
                    .windows(2)
                    .position(|w| w == b"*/")
                    .map_or(b.len(), |j| i + j + 2);
            }
            b'"' => i = string_at(i).0,
            // A char literal ('"', '\''), not a lifetime.
            b'\'' if b.get(i + 2) == Some(&b'\'') => i += 3,
            b'\'' if b.get(i + 1) == Some(&b'\\') && b.get(i + 3) == Some(&b'\'') => i += 4,
            _ => {
                let rest = &b[i..];
                let name = ["warn!(", "error!("]
                    .into_iter()
                    .find(|m| rest.starts_with(m.as_bytes()));
                let ident_before = i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_');
                let Some(name) = name.filter(|_| !ident_before) else {
                    i += 1;
                    continue;
                };
                let line = b[..i].iter().filter(|c| **c == b'\n').count() + 1;
                let mut j = i + name.len();
                let mut depth = 1;
                let mut message = None;
                while j < b.len() && depth > 0 {
                    match b[j] {
                        b'(' | b'[' | b'{' => depth += 1,
                        b')' | b']' | b'}' => depth -= 1,
                        b'"' => {
                            let (next, text) = string_at(j);
                            let value = b[..j].trim_ascii_end().ends_with(b"=");
                            if depth == 1 && !value && message.is_none() {
                                message = Some(text);
                            }
                            j = next;
                            continue;
                        }
                        _ => {}
                    }
                    j += 1;
                }
                out.push((line, message.unwrap_or_default()));
                i = j;
            }
        }
    }
    out
}

/// docs/operations.md names every WARN and ERROR line the agent can write
/// (the agent, and the host and driver libraries it logs through) and
/// gpu-controller's, each with what to do: a new one without its row fails
/// here.
/// The crates whose WARN and ERROR lines docs/operations.md lists: these,
/// and every crate under `crates/` (the agent's layers).
const LOGGING_CRATES: [&str; 4] = ["agent", "hostlib", "kmod", "controller"];

/// The `src` directories of [`LOGGING_CRATES`] and of every `crates/*`.
fn logging_sources() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = LOGGING_CRATES
        .into_iter()
        .map(|k| repo().join(k).join("src"))
        .collect();
    if let Ok(entries) = fs::read_dir(repo().join("crates")) {
        let mut more: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path().join("src"))
            .filter(|p| p.is_dir())
            .collect();
        more.sort();
        dirs.extend(more);
    }
    dirs
}

#[test]
fn every_warn_and_error_line_is_in_the_operations_doc() {
    let doc = fs::read_to_string(repo().join("docs/operations.md")).unwrap();
    let mut found = 0;
    let mut missing = Vec::new();
    for src in logging_sources() {
        for (file, line, msg) in warn_and_error_messages(&src) {
            assert!(
                !msg.is_empty(),
                "{file}:{line}: a warn!/error! without a message"
            );
            found += 1;
            if !doc.contains(&msg) {
                missing.push(format!("{file}:{line}: {msg}"));
            }
        }
    }
    assert!(found > 50, "the scan found only {found} lines");
    assert!(
        missing.is_empty(),
        "docs/operations.md does not list {} WARN/ERROR line(s):\n{}",
        missing.len(),
        missing.join("\n")
    );
    // And every line it lists is one the agent can write.
    let messages: Vec<String> = logging_sources()
        .iter()
        .flat_map(|src| warn_and_error_messages(src))
        .map(|(_, _, m)| m)
        .collect();
    let table = &doc[doc.find("## WARN and ERROR lines").unwrap()..];
    let stale: Vec<&str> = table
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .map(|cell| match cell.strip_prefix('`') {
            Some(rest) => rest[..rest.find("``").unwrap()].trim(),
            None => &cell[..cell.find('`').unwrap()],
        })
        .filter(|m| !messages.iter().any(|x| x == m))
        .collect();
    assert!(
        stale.is_empty(),
        "docs/operations.md lists lines the agent no longer writes:\n{}",
        stale.join("\n")
    );
}
