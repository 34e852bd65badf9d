//! Logging to a real journal: systemd-journald started in a private mount
//! namespace (tmpfs over /run and /var/log/journal), `gpu-agent
//! --log-format journald` logging to it, and the fields read back with
//! `journalctl -o json`. Needs root, `unshare` and systemd-journald, so it is
//! ignored by a plain `cargo test`; scripts/test runs it where it can.

mod common;

use common::*;

#[test]
#[ignore = "needs root, unshare and systemd-journald (scripts/test runs it as root)"]
fn events_reach_the_journal_with_their_fields() {
    let host = tempfile::tempdir().unwrap();
    let script = r#"
set -eu
mount -t tmpfs tmpfs /run
mkdir -p /run/systemd/journal /var/log/journal
mount -t tmpfs tmpfs /var/log/journal
/lib/systemd/systemd-journald &
journald=$!
for _ in $(seq 100); do [ -S /run/systemd/journal/socket ] && break; sleep 0.05; done
"$AGENT" --host-root "$HOST" --simulate a10g-1 --log-format journald run --once
journalctl --sync 2>/dev/null || sleep 0.5
journalctl -o json --no-pager SYSLOG_IDENTIFIER=gpu-agent
kill "$journald"
"#;
    let (code, out, err) = run(std::process::Command::new("unshare")
        .args(["--mount", "--propagation", "private", "bash", "-c", script])
        .env("AGENT", env!("CARGO_BIN_EXE_gpu-agent"))
        .env("HOST", host.path()));
    assert_eq!(code, 0, "{out}\n{err}");
    let records: Vec<serde_json::Value> = out.lines().map(json).collect();
    let found = records
        .iter()
        .find(|r| r["MESSAGE"] == "found GPU")
        .unwrap_or_else(|| panic!("no `found GPU` event in the journal:\n{out}"));
    assert_eq!(found["STAGE"], "discover");
    assert_eq!(
        found["GPU_UUID"],
        "GPU-3f6e1b2a-8c4d-4b7e-9a15-6d2c8e0f4a11"
    );
    assert_eq!(found["BUS_ID"], "0000:00:1e.0");
    assert!(
        records.iter().any(
            |r| r["MESSAGE"] == "1 GPU(s): 1x NVIDIA A10G; driver 550.127.05"
                && r["STATE"] == "done"
        ),
        "{out}"
    );
}
