//! CDI specs read back (the validate stage reads the spec it wrote): a spec
//! parses or is refused; one that parses is written and read back the same.
//! Never a panic.
#![no_main]

use gpu_agent::cdi::Spec;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(spec) = serde_json::from_slice::<Spec>(data) else {
        return;
    };
    let text = serde_json::to_string_pretty(&spec).expect("a spec serialises");
    let back: Spec = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("a spec written back does not parse: {e}\n{text}"));
    assert_eq!(back, spec, "round trip changed the spec");
});
