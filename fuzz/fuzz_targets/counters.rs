//! dcgm-exporter's counters CSV (`FIELD, type, help`): a field set whose
//! left-out lines and notes each name the file and a line that is in it.
//! Never a panic, never an error for what a line says (one line never
//! costs the others their series).
#![no_main]

use gpu_agent::metrics::fields::{Field, FieldSet};
use libfuzzer_sys::fuzz_target;

const PATH: &str = "fuzz/counters.csv";

fuzz_target!(|data: &[u8]| {
    let Some(text) = gpu_agent_fuzz::text(data) else {
        return;
    };
    let set = match FieldSet::parse(text, PATH) {
        Ok(set) => set,
        Err(e) => panic!("a text that was read is never refused whole: {e}"),
    };
    let lines = text.lines().count();
    for said in set.skipped.iter().chain(&set.notes) {
        let rest = said
            .strip_prefix(PATH)
            .and_then(|r| r.strip_prefix(':'))
            .unwrap_or_else(|| panic!("does not name the file: {said}"));
        let n: usize = rest
            .split(':')
            .next()
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("does not name a line: {said}"));
        assert!(n >= 1 && n <= lines, "line {n} is not in the file: {said}");
    }
    for line in text.lines() {
        let name = line.split(',').next().unwrap_or_default().trim();
        if let Some(f) = Field::by_name(name)
            && set.wants(f)
        {
            let _ = set.help_of(f);
            let _ = set.kind_of(f);
        }
    }
});
