//! Kill -9 anywhere: every writer of host files killed with SIGKILL at
//! points spread over its run (common::crash), each time on a host as it
//! was before. After each kill every file it writes is the original or the
//! complete new one (parsed, and compared byte for byte where the bytes are
//! known), and a temp file of an unfinished write, if one is left, is one no
//! consumer reads (a dot name that is not `*.json`/`*.yaml`); then one
//! normal run repairs the host: the desired files, and no temp file left.
//!
//! Writers: the CDI spec; the CDI hook program (a copy of gpu-agent); the
//! agent's run (NFD labels, the operator's validation files, the state
//! file); `driver install` (unpack and switch); MIG apply against the fake
//! NVML.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::crash::{Writer, leftovers, sigkill_trials};
use common::*;

const SPEC: &str = "var/run/cdi/gpu-agent-nvidia.com-gpu.json";
const HOOK: &str = "var/lib/gpu-agent/bin/gpu-agent";
const MANIFEST: &str = "var/lib/gpu-agent/backup/manifest.json";
const LABELS: &str = "etc/kubernetes/node-feature-discovery/features.d/gfd";
const DRIVER_READY: &str = "run/nvidia/validations/driver-ready";
const TOOLKIT_READY: &str = "run/nvidia/validations/toolkit-ready";

/// A copy of the tree `from` in a new temp dir.
fn copy_of(from: &Path) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let ok = Command::new("cp")
        .arg("-a")
        .arg(format!("{}/.", from.display()))
        .arg(dir.path())
        .status()
        .unwrap()
        .success();
    assert!(ok, "copying {}", from.display());
    dir
}

fn write_file(path: &Path, text: &str) {
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, text).unwrap();
}

fn read_optional(path: &Path) -> Option<Vec<u8>> {
    match fs::read(path) {
        Ok(b) => Some(b),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => panic!("{}: {e}", path.display()),
    }
}

/// Runs `cmd`, which must succeed.
fn succeed(cmd: &mut Command) -> Result<String, String> {
    let (code, out, err) = run(cmd);
    if code == 0 {
        Ok(out)
    } else {
        Err(format!("exit {code}: {err}"))
    }
}

/// The backup manifest parses (when there is one); its paths.
fn manifest_paths(host: &Path) -> Result<Vec<String>, String> {
    let Some(bytes) = read_optional(&host.join(MANIFEST)) else {
        return Ok(Vec::new());
    };
    let v: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| {
        format!(
            "{MANIFEST} does not parse ({e}): {:?}",
            String::from_utf8_lossy(&bytes)
        )
    })?;
    v["entries"]
        .as_array()
        .ok_or(format!("{MANIFEST}: no entries: {v}"))?
        .iter()
        .map(|e| {
            e["path"]
                .as_str()
                .map(str::to_string)
                .ok_or(format!("{MANIFEST}: an entry without a path: {e}"))
        })
        .collect()
}

/// After the repair: no unfinished work anywhere, and each of `paths` in
/// the manifest once.
fn clean_and_noted(host: &Path, paths: &[&str]) -> Result<(), String> {
    let left = leftovers(host);
    if !left.is_empty() {
        return Err(format!("left behind: {left:?}"));
    }
    let noted = manifest_paths(host)?;
    for p in paths {
        let n = noted.iter().filter(|n| n == p).count();
        if n != 1 {
            return Err(format!(
                "{p} is in the backup manifest {n} times: {noted:?}"
            ));
        }
    }
    Ok(())
}

/// A temp file a kill left is acceptable only where no consumer reads it:
/// a dot name (NFD skips those in features.d) that does not end in
/// `.json`/`.yaml` (what CDI loads from a spec dir). Returns " +temp" for
/// the tally when there is one.
fn temp_note(host: &Path) -> Result<&'static str, String> {
    let left = leftovers(host);
    for l in &left {
        let name = Path::new(l).file_name().unwrap().to_string_lossy();
        if !name.starts_with('.') || name.ends_with(".json") || name.ends_with(".yaml") {
            return Err(format!("{l}: a temp file a consumer would read"));
        }
    }
    Ok(if left.is_empty() { "" } else { " +temp" })
}

/// "original", "complete", or an error naming what the file is instead.
fn one_of(
    host: &Path,
    rel: &str,
    original: Option<&[u8]>,
    complete: &[u8],
) -> Result<&'static str, String> {
    let now = read_optional(&host.join(rel));
    if now.as_deref() == original {
        Ok("original")
    } else if now.as_deref() == Some(complete) {
        Ok("complete")
    } else {
        Err(match now {
            None => format!("{rel} is gone"),
            Some(b) => format!(
                "{rel} is neither the original nor the complete new file ({} bytes; original {:?} bytes, complete {} bytes)",
                b.len(),
                original.map(<[u8]>::len),
                complete.len()
            ),
        })
    }
}

/// A policy file in its own temp dir.
fn policy_file(text: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("policy.yaml");
    fs::write(&p, text).unwrap();
    (dir, p)
}

// --- The CDI spec -------------------------------------------------------------

/// `cdi generate --write` for the 8x H100 node over a host whose spec is
/// the A10G node's; the hooks name a program already on the host, so the
/// run writes the spec (and the backup manifest) only.
struct CdiSpec {
    template: tempfile::TempDir,
    _policy_dir: tempfile::TempDir,
    policy: PathBuf,
    original: Vec<u8>,
    complete: Vec<u8>,
}

impl CdiSpec {
    fn new() -> Self {
        let (_policy_dir, policy) =
            policy_file("spec:\n  cdi:\n    hookPath: /usr/bin/nvidia-cdi-hook\n");
        let template = tempfile::tempdir().unwrap();
        let hook = template.path().join("usr/bin/nvidia-cdi-hook");
        write_file(&hook, "#!/bin/sh\n");
        fs::set_permissions(&hook, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        let gen_at = |node: &str, write: bool| {
            let mut c = at(template.path());
            c.arg("--policy")
                .arg(&policy)
                .args(["--simulate", node, "cdi", "generate"]);
            if write {
                c.arg("--write");
            }
            succeed(&mut c).unwrap()
        };
        gen_at("a10g-1", true);
        let original = fs::read(template.path().join(SPEC)).unwrap();
        // What `--write` writes is what it prints.
        let complete = gen_at("h100-sxm-8", false).into_bytes();
        assert_ne!(original, complete);
        CdiSpec {
            template,
            _policy_dir,
            policy,
            original,
            complete,
        }
    }
}

impl Writer for CdiSpec {
    type Host = tempfile::TempDir;
    fn prepare(&mut self, _: usize) -> Self::Host {
        copy_of(self.template.path())
    }
    fn command(&mut self, host: &Self::Host) -> Command {
        let mut c = at(host.path());
        c.arg("--policy").arg(&self.policy).args([
            "--simulate",
            "h100-sxm-8",
            "cdi",
            "generate",
            "--write",
        ]);
        c
    }
    fn check(&mut self, host: &Self::Host) -> Result<String, String> {
        let what = one_of(host.path(), SPEC, Some(&self.original), &self.complete)?;
        let spec: gpu_agent::cdi::Spec =
            serde_json::from_slice(&fs::read(host.path().join(SPEC)).unwrap())
                .map_err(|e| format!("{SPEC} does not parse as a CDI spec: {e}"))?;
        if spec.devices.is_empty() {
            return Err(format!("{SPEC} has no devices"));
        }
        manifest_paths(host.path())?;
        Ok(format!("{what}{}", temp_note(host.path())?))
    }
    fn repair(&mut self, host: &Self::Host) -> Result<(), String> {
        succeed(&mut self.command(host))?;
        one_of(host.path(), SPEC, None, &self.complete)?;
        clean_and_noted(host.path(), &["/var/run/cdi/gpu-agent-nvidia.com-gpu.json"])
    }
}

/// 120 kills, a repair after every 4th: one run takes 10 to 30 times a
/// `runtime configure` (200 kills in runtime.rs), most of it the simulated
/// node's tree being made; the spec is written near its end.
#[test]
fn cdi_spec_killed_anywhere_is_whole_and_the_next_run_repairs() {
    let mut w = CdiSpec::new();
    let tally = sigkill_trials(&mut w, 120, 4);
    eprintln!("cdi spec: {tally}");
    assert_eq!(tally.seen.values().sum::<usize>(), 120);
}

// --- The CDI hook program -----------------------------------------------------

/// `cdi generate --write` at the default hook path: the run copies this
/// build of gpu-agent (hundreds of MB unoptimised) over an older program
/// there, then writes the spec.
struct HookCopy {
    template: tempfile::TempDir,
    old: Vec<u8>,
    /// The gpu-agent that runs: a copy of this build, which the runs copy
    /// (a build beside this test may relink target/'s while it runs).
    _bin_dir: tempfile::TempDir,
    bin: PathBuf,
    exe: Vec<u8>,
    spec: Vec<u8>,
}

impl HookCopy {
    fn new() -> Self {
        let template = tempfile::tempdir().unwrap();
        // The "old build": any other program.
        let old = fs::read("/bin/true").unwrap();
        write_file(&template.path().join(HOOK), "");
        fs::write(template.path().join(HOOK), &old).unwrap();
        fs::set_permissions(
            template.path().join(HOOK),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .unwrap();
        let bin_dir = tempfile::tempdir().unwrap();
        let bin = bin_dir.path().join("gpu-agent");
        fs::copy(env!("CARGO_BIN_EXE_gpu-agent"), &bin).unwrap();
        let mut w = HookCopy {
            template,
            old,
            _bin_dir: bin_dir,
            exe: fs::read(&bin).unwrap(),
            bin,
            spec: Vec::new(),
        };
        w.spec =
            succeed(
                w.at(w.template.path())
                    .args(["--simulate", "h100-sxm-8", "cdi", "generate"]),
            )
            .unwrap()
            .into_bytes();
        w
    }

    /// `at(host)` with the copy.
    fn at(&self, host: &Path) -> Command {
        let mut c = Command::new(&self.bin);
        c.env("DCGM_EXPORTER_LISTEN", "127.0.0.1:0")
            .arg("--host-root")
            .arg(host);
        c
    }
}

impl Writer for HookCopy {
    type Host = tempfile::TempDir;
    fn prepare(&mut self, _: usize) -> Self::Host {
        copy_of(self.template.path())
    }
    fn command(&mut self, host: &Self::Host) -> Command {
        let mut c = self.at(host.path());
        c.args(["--simulate", "h100-sxm-8", "cdi", "generate", "--write"]);
        c
    }
    fn check(&mut self, host: &Self::Host) -> Result<String, String> {
        let hook = one_of(host.path(), HOOK, Some(&self.old), &self.exe)?;
        let spec = match read_optional(&host.path().join(SPEC)) {
            None => "no spec",
            Some(s) if s == self.spec => "spec",
            Some(s) => return Err(format!("{SPEC}: a partial spec ({} bytes)", s.len())),
        };
        if hook == "original" && spec == "spec" {
            return Err("the spec names a hook program that is not there yet".into());
        }
        manifest_paths(host.path())?;
        Ok(format!("hook {hook}, {spec}{}", temp_note(host.path())?))
    }
    fn repair(&mut self, host: &Self::Host) -> Result<(), String> {
        succeed(&mut self.command(host))?;
        one_of(host.path(), HOOK, None, &self.exe)?;
        one_of(host.path(), SPEC, None, &self.spec)?;
        clean_and_noted(
            host.path(),
            &[
                "/var/lib/gpu-agent/bin/gpu-agent",
                "/var/run/cdi/gpu-agent-nvidia.com-gpu.json",
            ],
        )
    }
}

/// 20 kills, a repair after every 4th: one run copies the unoptimised
/// binary (over 200 MB, most of a second), and every check reads it back.
#[test]
fn hook_program_copy_killed_anywhere_is_old_or_whole_and_the_next_run_repairs() {
    let mut w = HookCopy::new();
    let tally = sigkill_trials(&mut w, 20, 4);
    eprintln!("cdi hook program: {tally}");
    assert_eq!(tally.seen.values().sum::<usize>(), 20);
}

// --- The agent's run: labels, validation files, state file ----------------------

/// `run --once` for the 8x H100 node over the host an A10G run left: it
/// rewrites NFD's labels, the operator's `driver-ready` (which names the
/// host root, so a copy of the host has it to rewrite) and the state file
/// (at the start and at the end). CDI and the runtime are off, so nothing
/// else is written (no `toolkit-ready`: nothing checked the toolkit).
struct AgentRun {
    template: tempfile::TempDir,
    _policy_dir: tempfile::TempDir,
    policy: PathBuf,
    labels_original: Vec<u8>,
    labels_complete: Vec<u8>,
}

const RUN_POLICY: &str = "spec:\n  cdi:\n    enabled: false\n  toolkit:\n    enabled: false\n  dcgmExporter:\n    enabled: false\n";

impl AgentRun {
    fn new() -> Self {
        let (_policy_dir, policy) = policy_file(RUN_POLICY);
        let template = tempfile::tempdir().unwrap();
        let once = |host: &Path, node: &str| {
            succeed(at(host).arg("--policy").arg(&policy).args([
                "--simulate",
                node,
                "run",
                "--once",
            ]))
            .unwrap();
        };
        once(template.path(), "a10g-1");
        let labels_original = fs::read(template.path().join(LABELS)).unwrap();
        let scratch = tempfile::tempdir().unwrap();
        once(scratch.path(), "h100-sxm-8");
        let labels_complete = fs::read(scratch.path().join(LABELS)).unwrap();
        assert_ne!(labels_original, labels_complete);
        AgentRun {
            template,
            _policy_dir,
            policy,
            labels_original,
            labels_complete,
        }
    }

    /// `driver-ready` as a run on `host` writes it: the template's, with
    /// the host root's path in place of the template's.
    fn driver_ready(&self, host: &Path) -> Vec<u8> {
        String::from_utf8(fs::read(self.template.path().join(DRIVER_READY)).unwrap())
            .unwrap()
            .replace(
                &self.template.path().display().to_string(),
                &host.display().to_string(),
            )
            .into_bytes()
    }
}

/// Every line `key=value`, as NFD takes a feature file: a key with an
/// optional DNS prefix and a name of at most 63 characters, a value of at
/// most 63 (`[A-Za-z0-9]` at both ends, `-_.` within).
fn labels_well_formed(text: &[u8]) -> Result<(), String> {
    let text = std::str::from_utf8(text).map_err(|e| format!("labels: not UTF-8: {e}"))?;
    if !text.is_empty() && !text.ends_with('\n') {
        return Err(format!("labels: the last line is cut: {text:?}"));
    }
    let part = |s: &str, max: usize| {
        s.len() <= max
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            && (s.is_empty()
                || (s.starts_with(|c: char| c.is_ascii_alphanumeric())
                    && s.ends_with(|c: char| c.is_ascii_alphanumeric())))
    };
    for line in text.lines() {
        let ok = line.split_once('=').is_some_and(|(key, value)| {
            let (prefix, name) = key.rsplit_once('/').unwrap_or(("", key));
            !name.is_empty()
                && part(name, 63)
                && part(value, 63)
                && (prefix.is_empty() || (prefix.len() <= 253 && part(prefix, 253)))
        });
        if !ok {
            return Err(format!("labels: a malformed line {line:?}"));
        }
    }
    Ok(())
}

impl Writer for AgentRun {
    type Host = tempfile::TempDir;
    fn prepare(&mut self, _: usize) -> Self::Host {
        copy_of(self.template.path())
    }
    fn command(&mut self, host: &Self::Host) -> Command {
        let mut c = at(host.path());
        c.arg("--policy")
            .arg(&self.policy)
            .args(["--simulate", "h100-sxm-8", "run", "--once"]);
        c
    }
    fn check(&mut self, host: &Self::Host) -> Result<String, String> {
        let h = host.path();
        let labels = one_of(
            h,
            LABELS,
            Some(&self.labels_original),
            &self.labels_complete,
        )?;
        labels_well_formed(&fs::read(h.join(LABELS)).unwrap())?;
        let template_ready = fs::read(self.template.path().join(DRIVER_READY)).unwrap();
        let ready = one_of(
            h,
            DRIVER_READY,
            Some(&template_ready),
            &self.driver_ready(h),
        )?;
        // With the runtime and CDI off nothing checks the toolkit: no run
        // writes toolkit-ready (issue 27: it was written, empty, unchecked).
        if h.join(TOOLKIT_READY).exists() {
            return Err(format!("{TOOLKIT_READY} written without a check"));
        }
        let hr = hostlib::HostRoot::new(h).unwrap();
        let state = gpu_agent::state::AgentState::read(&hr)
            .map_err(|e| format!("the state file: {e}"))?
            .ok_or("the state file is gone")?;
        let node = match state.simulated.as_deref() {
            Some("1x A10G") => "A10G",
            Some("8x H100 SXM") => "H100",
            other => return Err(format!("the state file names {other:?}")),
        };
        manifest_paths(h)?;
        Ok(format!(
            "labels {labels}, driver-ready {ready}, state {node}{}",
            temp_note(h)?
        ))
    }
    fn repair(&mut self, host: &Self::Host) -> Result<(), String> {
        let h = host.path();
        succeed(&mut self.command(host))?;
        one_of(h, LABELS, None, &self.labels_complete)?;
        one_of(h, DRIVER_READY, None, &self.driver_ready(h))?;
        let hr = hostlib::HostRoot::new(h).unwrap();
        let state = gpu_agent::state::AgentState::read(&hr)
            .map_err(|e| format!("the state file: {e}"))?
            .ok_or("the state file is gone")?;
        if state.simulated.as_deref() != Some("8x H100 SXM") || state.stopped_at.is_none() {
            return Err(format!(
                "the state file says {:?}, stopped at {:?}",
                state.simulated, state.stopped_at
            ));
        }
        clean_and_noted(
            h,
            &["/etc/kubernetes/node-feature-discovery/features.d/gfd"],
        )
    }
}

/// One trial for the three files the agent's run writes (labels,
/// validations, state: one process writes them in one pass, so a kill
/// anywhere in it is a kill before, between or after each). 120 kills, a
/// repair after every 4th: one run is as slow as the CDI trial's.
#[test]
fn agent_run_killed_anywhere_leaves_whole_labels_validations_and_state() {
    let mut w = AgentRun::new();
    let tally = sigkill_trials(&mut w, 120, 4);
    eprintln!("labels, validations, state: {tally}");
    assert_eq!(tally.seen.values().sum::<usize>(), 120);
}

// --- Driver bundle install and switch ---------------------------------------------

const KERNEL: &str = "6.1.0-27-amd64";
const OLD_DRIVER: &str = "550.127.08";
const NEW_DRIVER: &str = "560.35.03";

/// A bundle of `version` (five modules of 128 KiB that do not compress) in
/// `dir`, with its `.sha256` beside it. Returns its path and its files.
fn bundle(dir: &Path, version: &str) -> (PathBuf, Vec<(String, Vec<u8>, u32)>) {
    let mut seed: u64 = version.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    let files: Vec<(String, Vec<u8>, u32)> = [
        "nvidia",
        "nvidia-uvm",
        "nvidia-modeset",
        "nvidia-drm",
        "nvidia-peermem",
    ]
    .iter()
    .map(|m| {
        let bytes = (0..1 << 14)
            .flat_map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed.to_le_bytes()
            })
            .collect();
        (format!("modules/{KERNEL}/open/{m}.ko"), bytes, 0o644)
    })
    .collect();
    let mut tgz = Vec::new();
    kmod::bundle::build(
        &mut tgz,
        version,
        &[KERNEL],
        &[kmod::bundle::Flavour::Open],
        &files,
    )
    .unwrap();
    let path = dir.join(format!("{version}.tar.gz"));
    write_bundle(&path, &tgz);
    (path, files)
}

/// `driver install` of 560.35.03 on a host (no driver loaded) where
/// 550.127.08 is unpacked and current: it verifies and unpacks the bundle
/// into a staging directory, renames it into place, and switches
/// `current` (and `previous`) by renaming new links over the old.
struct DriverInstall {
    template: tempfile::TempDir,
    _bundles: tempfile::TempDir,
    new_bundle: PathBuf,
    old_files: Vec<(String, Vec<u8>, u32)>,
    new_files: Vec<(String, Vec<u8>, u32)>,
}

fn driver_dir(version: &str) -> String {
    format!("{version}-{KERNEL}")
}

impl DriverInstall {
    fn new() -> Self {
        let bundles = tempfile::tempdir().unwrap();
        let (old_bundle, old_files) = bundle(bundles.path(), OLD_DRIVER);
        let (new_bundle, new_files) = bundle(bundles.path(), NEW_DRIVER);
        let template = tempfile::tempdir().unwrap();
        let t = template.path();
        write_file(&t.join("proc/sys/kernel/osrelease"), &format!("{KERNEL}\n"));
        write_file(&t.join("proc/modules"), "");
        write_file(
            &t.join("proc/devices"),
            "Character devices:\n  1 mem\n\nBlock devices:\n  8 sd\n",
        );
        let out = succeed(at(t).args(["driver", "install"]).arg(&old_bundle)).unwrap();
        assert!(out.contains("is now the current driver"), "{out}");
        DriverInstall {
            template,
            _bundles: bundles,
            new_bundle,
            old_files,
            new_files,
        }
    }

    /// Every unpacked driver is whole (each file the bundle's bytes); the
    /// links name whole drivers. Returns (current, previous, unpacked).
    fn whole(&self, host: &Path) -> Result<(String, Option<String>, Vec<String>), String> {
        let hr = hostlib::HostRoot::new(host).unwrap();
        let list = kmod::bundle::list(&hr).map_err(|e| format!("driver list: {e}"))?;
        let mut names = Vec::new();
        for e in &list {
            let files = if e.name == driver_dir(OLD_DRIVER) {
                &self.old_files
            } else if e.name == driver_dir(NEW_DRIVER) {
                &self.new_files
            } else {
                return Err(format!("an unpacked driver {} of no bundle", e.name));
            };
            for (rel, bytes, _) in files {
                let p = host
                    .join(kmod::bundle::DRIVERS_DIR.trim_start_matches('/'))
                    .join(&e.name)
                    .join(rel);
                if fs::read(&p).ok().as_ref() != Some(bytes) {
                    return Err(format!("{}: {rel} is not the bundle's", e.name));
                }
            }
            names.push(e.name.clone());
        }
        let current = kmod::bundle::current(&hr)
            .map_err(|e| e.to_string())?
            .ok_or("no current driver")?;
        let previous = kmod::bundle::previous(&hr).map_err(|e| e.to_string())?;
        for link in std::iter::once(&current).chain(previous.iter()) {
            if !names.contains(link) {
                return Err(format!("a link names {link}, which is not unpacked whole"));
            }
        }
        Ok((current, previous, names))
    }
}

impl Writer for DriverInstall {
    type Host = tempfile::TempDir;
    fn prepare(&mut self, _: usize) -> Self::Host {
        copy_of(self.template.path())
    }
    fn command(&mut self, host: &Self::Host) -> Command {
        let mut c = at(host.path());
        c.args(["driver", "install"]).arg(&self.new_bundle);
        c
    }
    fn check(&mut self, host: &Self::Host) -> Result<String, String> {
        let (current, previous, names) = self.whole(host.path())?;
        let old = driver_dir(OLD_DRIVER);
        let what = match (current == old, previous.is_some(), names.len()) {
            (true, false, 1) => "550 current",
            (true, false, 2) => "560 unpacked, 550 current",
            // Killed between the two links: previous first, then current.
            (true, true, 2) => "560 unpacked, 550 current and previous",
            (false, true, 2) if previous.as_deref() == Some(old.as_str()) => {
                "560 current, 550 previous"
            }
            _ => {
                return Err(format!(
                    "current {current}, previous {previous:?}, unpacked {names:?}"
                ));
            }
        };
        Ok(format!("{what}{}", temp_note(host.path())?))
    }
    fn repair(&mut self, host: &Self::Host) -> Result<(), String> {
        succeed(&mut self.command(host))?;
        let (current, previous, _) = self.whole(host.path())?;
        if current != driver_dir(NEW_DRIVER) || previous != Some(driver_dir(OLD_DRIVER)) {
            return Err(format!("current {current}, previous {previous:?}"));
        }
        clean_and_noted(host.path(), &[])
    }
}

/// 80 kills, a repair after every 2nd: one run verifies and unpacks the
/// bundle (gunzip and sha256 twice, unoptimised), 10 times a `runtime
/// configure`.
#[test]
fn driver_install_killed_anywhere_leaves_whole_drivers_and_links() {
    let mut w = DriverInstall::new();
    let tally = sigkill_trials(&mut w, 80, 2);
    eprintln!("driver install and switch: {tally}");
    assert_eq!(tally.seen.values().sum::<usize>(), 80);
}

// --- MIG apply (fake NVML) -----------------------------------------------------------

const MIG_NODE: &str = "h100-mig-2";
const MIG_LAYOUT: &str = "all-2g.20gb";

/// `run --once` on the two MIG H100s (GPU 0 as 3g+2g+2x1g, GPU 1 as 7x1g)
/// with the layout all-2g.20gb: the agent destroys every instance and
/// makes three 2g.20gb on each GPU, through the real NVML path against the
/// fake libnvidia-ml, which keeps the MIG state in a file. Each trial
/// starts the fake from the description again; the host is kept.
struct MigApply {
    host: tempfile::TempDir,
    _dirs: Vec<tempfile::TempDir>,
    nvml: PathBuf,
    mig_state: PathBuf,
    conditions: PathBuf,
    policy: PathBuf,
    original: Vec<GpuLayout>,
    desired: Vec<GpuLayout>,
}

/// One GPU's MIG mode and its GPU instances (profile ID, compute instances).
type GpuLayout = (bool, Vec<(u32, usize)>);

fn layouts(mig: &simnode::mig::state::NodeMig) -> Vec<GpuLayout> {
    mig.gpus
        .iter()
        .map(|g| {
            let mut gis: Vec<(u32, usize)> = g
                .gpu_instances
                .iter()
                .map(|gi| (gi.profile_id, gi.compute_instances.len()))
                .collect();
            gis.sort_unstable();
            (g.current, gis)
        })
        .collect()
}

impl MigApply {
    fn new() -> Self {
        let host = tempfile::tempdir().unwrap();
        let desc = simnode::NodeDescription::load(MIG_NODE).unwrap();
        desc.materialize(host.path()).unwrap();
        // A copy of the fake library: a build beside this test (another
        // crate's tests) may replace the one in target/ while it runs.
        let (nvml_dir, built) = fake_nvml();
        let nvml = nvml_dir.path().join("copy/libnvidia-ml.so.1");
        fs::create_dir_all(nvml.parent().unwrap()).unwrap();
        fs::copy(fs::canonicalize(&built).unwrap(), &nvml).unwrap();
        let state = tempfile::tempdir().unwrap();
        let conditions = state.path().join("conditions");
        fs::write(&conditions, "").unwrap();
        let (policy_dir, policy) = policy_file(&format!(
            "spec:\n  toolkit:\n    enabled: false\n  cdi:\n    enabled: false\n  dcgmExporter:\n    enabled: false\n  mig:\n    strategy: mixed\n  migManager:\n    default: {MIG_LAYOUT}\n    gpuClientsTimeoutSeconds: 2\n"
        ));
        let original = layouts(&simnode::mig::state::NodeMig::from_description(&desc).unwrap());
        let mut w = MigApply {
            host,
            _dirs: vec![nvml_dir, state, policy_dir],
            nvml,
            mig_state: Path::new("/nonexistent").to_path_buf(),
            conditions,
            policy,
            original,
            desired: Vec::new(),
        };
        w.mig_state = w._dirs[1].path().join("mig.json");
        // The layout as the agent sees it through NVML after a whole run.
        succeed(&mut w.command(&())).unwrap();
        // No agent runs: `status` inspects the host (exit 3).
        let (code, out, err) = run(w.agent().args(["status", "-o", "json"]));
        assert_eq!(code, 3, "{err}");
        let st = json(&out);
        for g in st["inventory"]["gpus"].as_array().unwrap() {
            let profiles: Vec<&str> = g["mig_devices"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| m["profile"].as_str().unwrap())
                .collect();
            assert_eq!(profiles, ["2g.20gb"; 3], "{g:#}");
        }
        w.desired = w.file_layouts().unwrap().unwrap();
        assert_ne!(w.original, w.desired);
        w
    }

    fn agent(&self) -> Command {
        let mut c = at(self.host.path());
        c.arg("--policy")
            .arg(&self.policy)
            .arg("--nvml-lib")
            .arg(&self.nvml)
            .env("FAKE_NVML_NODE", MIG_NODE)
            .env("FAKE_NVML_MIG", &self.mig_state)
            .env("FAKE_NVML_SYSFS", self.host.path().join("sys"))
            .env("FAKE_NVML_STATE", &self.conditions);
        c
    }

    /// The fake's MIG state, when it has written one.
    fn file_layouts(&self) -> Result<Option<Vec<GpuLayout>>, String> {
        let Some(bytes) = read_optional(&self.mig_state) else {
            return Ok(None);
        };
        let mig: simnode::mig::state::NodeMig = serde_json::from_slice(&bytes)
            .map_err(|e| format!("the fake NVML's MIG state does not parse: {e}"))?;
        Ok(Some(layouts(&mig)))
    }
}

impl Writer for MigApply {
    type Host = ();
    fn prepare(&mut self, _: usize) {
        // The GPUs as described: what a node boots with.
        let _ = fs::remove_file(&self.mig_state);
    }
    fn command(&mut self, _: &()) -> Command {
        let mut c = self.agent();
        c.args(["run", "--once"]);
        c
    }
    fn check(&mut self, _: &()) -> Result<String, String> {
        let now = self
            .file_layouts()?
            .unwrap_or_else(|| self.original.clone());
        let each: Vec<&str> = now
            .iter()
            .zip(self.original.iter().zip(&self.desired))
            .map(|(n, (o, d))| {
                if n == o {
                    "as before"
                } else if n == d {
                    "done"
                } else {
                    "in between"
                }
            })
            .collect();
        let h = self.host.path();
        labels_well_formed(&read_optional(&h.join(LABELS)).unwrap_or_default())?;
        let hr = hostlib::HostRoot::new(h).unwrap();
        gpu_agent::state::AgentState::read(&hr).map_err(|e| format!("the state file: {e}"))?;
        Ok(format!(
            "GPU 0 {}, GPU 1 {}{}",
            each[0],
            each[1],
            temp_note(h)?
        ))
    }
    fn repair(&mut self, _: &()) -> Result<(), String> {
        succeed(&mut self.command(&()))?;
        let now = self.file_layouts()?;
        if now.as_ref() != Some(&self.desired) {
            return Err(format!("MIG is {now:?}, not {:?}", self.desired));
        }
        let state =
            json(&fs::read_to_string(self.host.path().join("run/gpu-agent/state.json")).unwrap());
        if state["mig"]["layout"] != MIG_LAYOUT || state["mig"]["state"] != "success" {
            return Err(format!("the state file's MIG: {}", state["mig"]));
        }
        clean_and_noted(self.host.path(), &[])
    }
}

/// 40 kills, a repair after each (the point of this trial): one run
/// destroys and makes 10 instances through NVML, with the fake writing its
/// state file at each call.
#[test]
fn mig_apply_killed_anywhere_is_repaired_by_the_next_run() {
    let mut w = MigApply::new();
    let tally = sigkill_trials(&mut w, 40, 1);
    eprintln!("MIG apply: {tally}");
    assert_eq!(tally.seen.values().sum::<usize>(), 40);
}
