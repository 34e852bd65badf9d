//! What each NVML call costs: the fake waits as long as the real library
//! took on real hardware, so that a figure measured on the fake is not
//! flattered by a library that answers in nanoseconds.
//!
//! The table is a text file of measured per-call costs (see
//! `costs/README.md`): by default the one measured on a real H100
//! (`costs/h100-pcie-vm.txt`, built in); `FAKE_NVML_COSTS=off` charges
//! nothing; `FAKE_NVML_COSTS=<file>` reads another table. A table that cannot
//! be read fails `nvmlInit` (with the reason on stderr), never silently
//! charges nothing.
//!
//! Each call from C lasts at least its function's p50: the fake's own work
//! counts towards it and the rest is waited (a function that calls another
//! exported function is charged once, its own cost). Short waits spin; long
//! ones sleep, then spin the last [`SLEEP_MARGIN`], so a slow call does not
//! burn a core but still lasts at least its cost.

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The table measured on the captured real H100 node (issue 26).
pub const BUILT_IN: &str = include_str!("../costs/h100-pcie-vm.txt");
/// Where [`BUILT_IN`] came from, in messages.
pub const BUILT_IN_NAME: &str = "costs/h100-pcie-vm.txt (built in)";
/// Costs of calls [`BUILT_IN`] did not measure, each modelled on the
/// measured call most like it; built in beside it. A measured line always
/// wins, and these do not count in the median a call named nowhere costs.
pub const MODELLED: &str = include_str!("../costs/modelled.txt");
/// Where [`MODELLED`] came from, in messages.
pub const MODELLED_NAME: &str = "costs/modelled.txt (built in)";
/// The environment variable that turns the costs off or names a table.
pub const ENV: &str = "FAKE_NVML_COSTS";

/// Waits at least this long are slept, not spun.
const SLEEP_FROM: Duration = Duration::from_micros(200);
/// A sleep may start late or end late; it stops this much before the end
/// and the rest is spun, so the wait is not cut short.
const SLEEP_MARGIN: Duration = Duration::from_micros(100);

/// Table lines that time several calls together, and the one call that is
/// charged the whole (each of the others costs the default).
const COMBINED: &[(&str, &str)] = &[
    // An event set created, one GPU registered for two event types, freed:
    // the registration is where the driver does the work.
    ("event set create+register+free", "nvmlDeviceRegisterEvents"),
    ("GPM sample alloc+get+free", "nvmlGpmSampleGet"),
];

/// A cost table that cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum CostsError {
    #[error("{origin}: line {line}: {why}: {text:?}")]
    Line {
        origin: String,
        line: usize,
        text: String,
        why: &'static str,
    },
    #[error("{origin}: no per-call cost in it (lines `<name> p50 <number> <unit>`)")]
    Empty { origin: String },
    #[error("{ENV}={path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// Per-call costs, by NVML function name.
#[derive(Debug, Clone, PartialEq)]
pub struct Costs {
    calls: HashMap<String, Duration>,
    init_first: Duration,
    init_again: Duration,
    default: Duration,
    origin: String,
}

/// Reads `12.5 us` (the number and unit words) as a duration.
fn duration(number: &str, unit: &str) -> Option<Duration> {
    let n: f64 = number.parse().ok().filter(|n: &f64| n.is_finite())?;
    let scale = match unit {
        "ns" => 1e-9,
        "us" | "µs" => 1e-6,
        "ms" => 1e-3,
        "s" => 1.0,
        _ => return None,
    };
    (n >= 0.0).then(|| Duration::from_secs_f64(n * scale))
}

/// `nvmlDeviceGetClockInfo(SM)` → `nvmlDeviceGetClockInfo`.
fn bare_name(name: &str) -> &str {
    name.split('(').next().unwrap_or(name).trim()
}

impl Costs {
    /// Reads a table (`origin` names it in errors).
    pub fn parse(text: &str, origin: &str) -> Result<Costs, CostsError> {
        let mut calls: HashMap<String, Duration> = HashMap::new();
        let mut init_first = None;
        let mut init_again = None;
        for (i, raw) in text.lines().enumerate() {
            let line = raw.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let bad = |why| CostsError::Line {
                origin: origin.to_string(),
                line: i + 1,
                text: raw.to_string(),
                why,
            };
            let words: Vec<&str> = line.split_whitespace().collect();
            let (name, cost) = match words.iter().position(|w| *w == "p50") {
                Some(at) => {
                    let name = words[..at].join(" ");
                    let cost = match (words.get(at + 1), words.get(at + 2)) {
                        (Some(n), Some(u)) => duration(n, u),
                        _ => None,
                    };
                    (
                        name,
                        cost.ok_or_else(|| bad("p50 is not `<number> <unit>`"))?,
                    )
                }
                None if words.len() >= 3 => {
                    let n = words.len();
                    let cost = duration(words[n - 2], words[n - 1])
                        .ok_or_else(|| bad("no p50, and it does not end in `<number> <unit>`"))?;
                    (words[..n - 2].join(" "), cost)
                }
                None => return Err(bad("not `<name> p50 <number> <unit>`")),
            };
            match name.as_str() {
                "nvmlInit (first)" => init_first = Some(cost),
                "nvmlInit (again)" => init_again = Some(cost),
                _ => {
                    let key = COMBINED
                        .iter()
                        .find(|(line, _)| *line == name)
                        .map_or_else(|| bare_name(&name), |(_, call)| call);
                    if key.is_empty() {
                        return Err(bad("no function name"));
                    }
                    // The first line of a name counts (ClockInfo(SM) before (MEM)).
                    calls.entry(key.to_string()).or_insert(cost);
                }
            }
        }
        if calls.is_empty() {
            return Err(CostsError::Empty {
                origin: origin.to_string(),
            });
        }
        let mut p50s: Vec<Duration> = calls.values().copied().collect();
        p50s.sort();
        let mid = p50s.len() / 2;
        let default = if p50s.len().is_multiple_of(2) {
            (p50s[mid - 1] + p50s[mid]) / 2
        } else {
            p50s[mid]
        };
        // Without init lines, initialising costs what nvmlInit's line says,
        // else the default.
        let plain_init = calls.get("nvmlInit").copied();
        let init_first = init_first.or(plain_init).unwrap_or(default);
        let init_again = init_again.or(plain_init).unwrap_or(init_first);
        Ok(Costs {
            calls,
            init_first,
            init_again,
            default,
            origin: origin.to_string(),
        })
    }

    /// The built-in table: the real H100's, and the modelled costs of the
    /// calls it did not measure.
    pub fn built_in() -> Costs {
        let mut c = Costs::parse(BUILT_IN, BUILT_IN_NAME).expect("the built-in cost table parses");
        let m = Costs::parse(MODELLED, MODELLED_NAME).expect("the modelled cost table parses");
        for (name, cost) in m.calls {
            c.calls.entry(name).or_insert(cost);
        }
        c
    }

    /// What `function` costs: its line (a versioned name such as
    /// `nvmlDeviceGetPciInfo_v3` by its unversioned line too), else the
    /// default.
    pub fn of(&self, function: &str) -> Duration {
        if let Some(c) = self.calls.get(function) {
            return *c;
        }
        let unversioned = match function.rsplit_once("_v") {
            Some((base, v)) if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) => base,
            _ => function,
        };
        self.calls.get(unversioned).copied().unwrap_or(self.default)
    }

    /// What `nvmlInit` costs: the first in a process, or again.
    pub fn init(&self, first: bool) -> Duration {
        if first {
            self.init_first
        } else {
            self.init_again
        }
    }

    /// What a function the table does not name costs: the median of its
    /// per-call p50s.
    pub fn default_cost(&self) -> Duration {
        self.default
    }

    /// Where the table came from.
    pub fn origin(&self) -> &str {
        &self.origin
    }
}

/// The table `FAKE_NVML_COSTS` asks for (`value`): `None` for `off`.
pub fn from_setting(value: Option<&str>) -> Result<Option<Costs>, CostsError> {
    match value.map(str::trim) {
        None | Some("" | "on" | "h100-pcie-vm") => Ok(Some(Costs::built_in())),
        Some("off" | "0" | "none") => Ok(None),
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|source| CostsError::Read {
                path: path.to_string(),
                source,
            })?;
            Costs::parse(&text, path).map(Some)
        }
    }
}

/// The process's table, read from the environment once.
fn active() -> &'static Result<Option<Costs>, String> {
    static ACTIVE: OnceLock<Result<Option<Costs>, String>> = OnceLock::new();
    ACTIVE
        .get_or_init(|| from_setting(std::env::var(ENV).ok().as_deref()).map_err(|e| e.to_string()))
}

/// Time charged so far in this process (all threads), in nanoseconds.
static CHARGED_NS: AtomicU64 = AtomicU64::new(0);
/// Whether `nvmlInit` was charged before in this process.
static INIT_SEEN: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// Inside a charged call on this thread (its nested calls are free).
    static IN_CALL: Cell<bool> = const { Cell::new(false) };
}

/// Time charged so far in this process: the sum of the charged calls'
/// costs.
pub fn charged() -> Duration {
    Duration::from_nanos(CHARGED_NS.load(Ordering::Relaxed))
}

/// Waits `d`: spins short waits, sleeps long ones (all but the last
/// [`SLEEP_MARGIN`], which is spun). Never returns early.
pub fn wait(d: Duration) {
    if d.is_zero() {
        return;
    }
    let deadline = Instant::now() + d;
    if d >= SLEEP_FROM {
        std::thread::sleep(d - SLEEP_MARGIN);
    }
    while Instant::now() < deadline {
        std::hint::spin_loop();
    }
}

/// A charged call in progress. When it ends (the guard drops) it has
/// lasted at least its cost: the fake's own work counts towards it, the
/// rest is waited. Calls it makes to other exported functions are not
/// charged again.
#[must_use = "the call is charged when the guard drops"]
pub struct Call {
    outer: bool,
    started: Instant,
    cost: Duration,
}

impl Drop for Call {
    fn drop(&mut self) {
        if !self.outer {
            return;
        }
        if !self.cost.is_zero() {
            wait(self.cost.saturating_sub(self.started.elapsed()));
            CHARGED_NS.fetch_add(
                u64::try_from(self.cost.as_nanos()).unwrap_or(u64::MAX),
                Ordering::Relaxed,
            );
        }
        IN_CALL.with(|c| c.set(false));
    }
}

/// Marks this thread inside a call costing `cost` (charged only when it is
/// the outermost).
fn enter(cost: impl FnOnce() -> Duration) -> Call {
    let outer = IN_CALL.with(|c| !c.replace(true));
    Call {
        outer,
        started: Instant::now(),
        cost: if outer { cost() } else { Duration::ZERO },
    }
}

/// Charges the exported function `name` its cost when the returned guard
/// drops (nothing when nested in another charged call, or when the costs
/// are off or unreadable).
pub fn charge(name: &str) -> Call {
    enter(|| match active() {
        Ok(Some(costs)) => costs.of(name),
        _ => Duration::ZERO,
    })
}

/// Charges one call the sum of what the functions `names` cost (a
/// field-values call: each field what the call that gives the same figure
/// costs), as [`charge`] does.
pub fn charge_all<'a>(names: impl IntoIterator<Item = &'a str>) -> Call {
    enter(|| match active() {
        Ok(Some(costs)) => names.into_iter().map(|n| costs.of(n)).sum(),
        _ => Duration::ZERO,
    })
}

/// Charges `nvmlInit`: the cold cost the first time in the process, the
/// warm one after. `Err` (why) when the table named by `FAKE_NVML_COSTS`
/// cannot be read.
pub fn charge_init() -> Result<Call, String> {
    let costs = match active() {
        Err(e) => return Err(e.clone()),
        Ok(c) => c.as_ref(),
    };
    Ok(enter(|| match costs {
        Some(c) => c.init(!INIT_SEEN.swap(true, Ordering::SeqCst)),
        None => Duration::ZERO,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn us(n: f64) -> Duration {
        Duration::from_secs_f64(n * 1e-6)
    }

    #[test]
    fn the_built_in_table_is_the_real_h100s() {
        let c = Costs::built_in();
        assert_eq!(c.init(true), us(10_700.0));
        assert_eq!(c.init(false), us(2_100.0));
        assert_eq!(c.of("nvmlDeviceGetMigMode"), us(163.8));
        assert_eq!(c.of("nvmlDeviceGetPcieReplayCounter"), us(173.4));
        assert_eq!(c.of("nvmlDeviceGetViolationStatus"), us(741.2));
        assert_eq!(c.of("nvmlDeviceGetTotalEnergyConsumption"), us(3181.2));
        // Versioned exports by their unversioned lines.
        assert_eq!(c.of("nvmlDeviceGetPciInfo_v3"), us(1.8));
        assert_eq!(c.of("nvmlDeviceGetCount_v2"), us(1.1));
        // Arguments dropped; the first line of a name counts.
        assert_eq!(c.of("nvmlDeviceGetNvLinkState"), us(9.8));
        assert_eq!(c.of("nvmlDeviceGetClockInfo"), us(2.3));
        assert_eq!(c.of("nvmlEventSetWait_v2"), us(5.0));
        // Combined lines charged to the call that does the work.
        assert_eq!(c.of("nvmlDeviceRegisterEvents"), us(2103.1));
        assert_eq!(c.of("nvmlGpmSampleGet"), us(54.9));
        // Not in the table: the median p50 of the 38 named calls (2.6 and 2.9 µs).
        assert_eq!(c.default_cost(), Duration::from_nanos(2750));
        assert_eq!(c.of("nvmlDeviceGetFieldValues"), c.default_cost());
        assert_eq!(c.of("nvmlEventSetCreate"), c.default_cost());
        assert_eq!(c.origin(), BUILT_IN_NAME);
        // Modelled on measured calls: what the real table lacks.
        assert_eq!(c.of("nvmlDeviceGetInforomVersion"), us(2.9));
        assert_eq!(c.of("nvmlGpmMigSampleGet"), us(54.9));
        assert_eq!(c.of("nvmlDeviceGetNvLinkErrorCounter"), us(9.8));
        // The modelled lines never replace a measured one, nor move the median.
        let m = Costs::parse(MODELLED, MODELLED_NAME).unwrap();
        let measured = Costs::parse(BUILT_IN, BUILT_IN_NAME).unwrap();
        for name in m.calls.keys() {
            assert!(
                !measured.calls.contains_key(name),
                "{name} is measured; modelled.txt must not name it"
            );
        }
    }

    #[test]
    fn a_field_values_call_costs_its_fields() {
        let c = Costs::built_in();
        let violation = c.of("nvmlDeviceGetViolationStatus");
        let t = Instant::now();
        drop(charge_all([
            "nvmlDeviceGetViolationStatus",
            "nvmlDeviceGetTemperature",
        ]));
        assert!(t.elapsed() >= violation + us(2.1), "{:?}", t.elapsed());
    }

    #[test]
    fn the_setting_turns_costs_off_or_reads_a_file() {
        assert_eq!(from_setting(None).unwrap(), Some(Costs::built_in()));
        assert_eq!(from_setting(Some("on")).unwrap(), Some(Costs::built_in()));
        assert_eq!(from_setting(Some("off")).unwrap(), None);
        let dir = std::env::temp_dir().join(format!("fake-nvml-costs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("t.txt");
        std::fs::write(
            &file,
            "# mine\nnvmlInit 1 ms\nnvmlDeviceGetName p50 40 us max 50 us\n",
        )
        .unwrap();
        let c = from_setting(file.to_str()).unwrap().unwrap();
        assert_eq!(c.of("nvmlDeviceGetName"), us(40.0));
        assert_eq!(c.init(true), us(1000.0));
        assert_eq!(c.init(false), us(1000.0));
        let missing = dir.join("missing.txt");
        let e = from_setting(missing.to_str()).unwrap_err().to_string();
        assert!(e.starts_with("FAKE_NVML_COSTS="), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_bad_line_is_named_with_its_number() {
        let e = Costs::parse(
            "nvmlDeviceGetName p50 1.0 us\nnvmlDeviceGetUUID p50 fast\n",
            "t",
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "t: line 2: p50 is not `<number> <unit>`: \"nvmlDeviceGetUUID p50 fast\""
        );
        let e = Costs::parse("nvmlDeviceGetName p50 1.0 parsecs\n", "t").unwrap_err();
        assert!(matches!(e, CostsError::Line { line: 1, .. }), "{e}");
        let e = Costs::parse("nvmlDeviceGetName p50 -1 us\n", "t").unwrap_err();
        assert!(matches!(e, CostsError::Line { line: 1, .. }), "{e}");
        let e = Costs::parse("# nothing\n\n", "t").unwrap_err();
        assert!(matches!(e, CostsError::Empty { .. }), "{e}");
    }

    #[test]
    fn a_wait_lasts_at_least_its_cost_spun_or_slept() {
        for d in [us(3.0), us(150.0), us(3181.2)] {
            let t = Instant::now();
            wait(d);
            assert!(t.elapsed() >= d, "{d:?} took {:?}", t.elapsed());
        }
    }

    #[test]
    fn a_call_lasts_its_cost_and_a_nested_one_is_not_charged_again() {
        // FAKE_NVML_COSTS is not set in the tests: the built-in table.
        let energy = Costs::built_in().of("nvmlDeviceGetTotalEnergyConsumption");
        let before = charged();
        let t = Instant::now();
        let outer = charge("nvmlDeviceGetTotalEnergyConsumption");
        assert!(outer.outer);
        let inner = charge("nvmlDeviceGetTotalEnergyConsumption");
        assert!(!inner.outer);
        assert_eq!(inner.cost, Duration::ZERO);
        drop(inner);
        assert!(IN_CALL.with(Cell::get));
        // The call's own work counts towards its cost.
        std::thread::sleep(us(1000.0));
        drop(outer);
        assert!(!IN_CALL.with(Cell::get));
        let took = t.elapsed();
        assert!(took >= energy, "took {took:?}");
        assert!(charged() - before >= energy);
    }
}
