//! dcgm-exporter's counters CSV (`FIELD, type, help`): a field set, or an
//! error naming the file (and the line). Never a panic.
#![no_main]

use gpu_agent::metrics::fields::{CountersError, FieldSet};
use libfuzzer_sys::fuzz_target;

const PATH: &str = "fuzz/counters.csv";

fuzz_target!(|data: &[u8]| {
    let Some(text) = gpu_agent_fuzz::text(data) else {
        return;
    };
    match FieldSet::parse(text, PATH) {
        Ok(set) => {
            for line in text.lines() {
                let name = line.split(',').next().unwrap_or_default().trim();
                if let Some(f) = gpu_agent::metrics::fields::Field::by_name(name)
                    && set.wants(f)
                {
                    let _ = set.help_of(f);
                }
            }
        }
        Err(e) => {
            let shown = e.to_string();
            assert!(
                shown.starts_with(PATH),
                "error does not name the file: {shown}"
            );
            if let CountersError::Line { line, .. } = e {
                assert!(
                    line >= 1 && line <= text.lines().count(),
                    "line {line} is not in the file"
                );
            }
        }
    }
});
