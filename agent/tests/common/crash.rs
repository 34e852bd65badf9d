//! Crash trials: a command that changes host files, killed with SIGKILL at
//! points spread over its run, each time on a host as it was before the
//! run. After every kill a checker looks at what the kill left (every file
//! the original or the complete new one, never a part) and names what it
//! saw; a normal run then has to repair the host to the desired state.

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// One writer under trial.
pub trait Writer {
    /// A host as it is before the run (its temp dirs live as long as it).
    type Host;
    /// The host for trial `trial` (a fresh copy, or one put back).
    fn prepare(&mut self, trial: usize) -> Self::Host;
    /// The run that is killed (stdio is set by the trials).
    fn command(&mut self, host: &Self::Host) -> Command;
    /// What a kill left: `Ok(what was seen)`, counted by name in the
    /// tally, or `Err(why it is wrong)`.
    fn check(&mut self, host: &Self::Host) -> Result<String, String>;
    /// Runs the writer normally on a killed host and checks that it reached
    /// the desired state, with nothing of the killed run left over.
    fn repair(&mut self, host: &Self::Host) -> Result<(), String>;
}

/// What the trials saw.
#[derive(Debug, Default)]
pub struct Tally {
    /// One normal run (the slower of two), as measured before the kills.
    pub span: Duration,
    pub kills: usize,
    /// Runs that had exited before their kill came.
    pub finished: usize,
    pub repairs: usize,
    /// The checker's names for what the kills left, counted.
    pub seen: BTreeMap<String, usize>,
}

impl std::fmt::Display for Tally {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} SIGKILLs over {} ms runs ({} after the run had exited), {} repairs; seen:",
            self.kills,
            self.span.as_millis(),
            self.finished,
            self.repairs
        )?;
        for (what, n) in &self.seen {
            write!(f, " {what} x{n};")?;
        }
        Ok(())
    }
}

/// Runs `w` to the end on a prepared host, checks it, and returns how long it took.
fn probe<W: Writer>(w: &mut W) -> Duration {
    let host = w.prepare(0);
    let started = Instant::now();
    let out = w.command(&host).stdin(Stdio::null()).output().unwrap();
    let took = started.elapsed();
    assert!(
        out.status.success(),
        "the run without a kill failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    if let Err(why) = w.check(&host) {
        panic!("after a whole run: {why}");
    }
    took
}

/// `kills` runs of `w`, each on a prepared host and killed with SIGKILL
/// after a delay: the delays cover 0 to 1.2 times one run (the slower of
/// two runs without a kill, which must succeed and pass the check), one in
/// each of `kills` equal slices at a random point of it, so that some kills
/// come after the end. After each kill `check` must pass; after every
/// `repair_every`-th kill and after the last, `repair` must.
pub fn sigkill_trials<W: Writer>(w: &mut W, kills: usize, repair_every: usize) -> Tally {
    assert!(kills > 0 && repair_every > 0);
    let span = probe(w).max(probe(w));
    let window = span.as_micros().max(1000) as u64 * 12 / 10;
    let mut tally = Tally {
        span,
        ..Tally::default()
    };
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    for trial in 0..kills {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let slice = window / kills as u64;
        let delay = trial as u64 * window / kills as u64 + (seed >> 33) % slice.max(1);
        let host = w.prepare(trial);
        let mut child = w
            .command(&host)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_micros(delay));
        if child.try_wait().unwrap().is_some() {
            tally.finished += 1;
        }
        // SIGKILL (a no-op if it has exited; it is not reaped yet).
        child.kill().unwrap();
        child.wait().unwrap();
        tally.kills += 1;
        match w.check(&host) {
            Ok(what) => *tally.seen.entry(what).or_default() += 1,
            Err(why) => panic!("trial {trial} (SIGKILL after {delay} µs): {why}"),
        }
        if (trial + 1) % repair_every == 0 || trial + 1 == kills {
            if let Err(why) = w.repair(&host) {
                panic!("trial {trial} (SIGKILL after {delay} µs): the run after it: {why}");
            }
            tally.repairs += 1;
        }
    }
    tally
}

/// Files under `root` (relative paths) whose names say they are a writer's
/// unfinished work: temp files of an atomic write, a bundle's staging
/// directory, a link about to be renamed.
pub fn leftovers(root: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries {
            let e = e.unwrap();
            let name = e.file_name().to_string_lossy().into_owned();
            let path = e.path();
            if name.contains(".gpu-agent-tmp.")
                || (name.starts_with('.') && (name.ends_with(".partial") || name.ends_with(".new")))
            {
                out.push(path.strip_prefix(root).unwrap().display().to_string());
            } else if e.file_type().unwrap().is_dir() {
                stack.push(path);
            }
        }
    }
    out.sort();
    out
}
