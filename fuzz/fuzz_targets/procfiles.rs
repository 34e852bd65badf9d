//! The /proc files gpu-agent reads through its own parsers
//! (`hostlib::procfiles`): `/proc/modules`, `/proc/devices`, the driver's
//! capability files and params. Never a panic; every non-empty line of
//! /proc/modules is either a module or a bad line with its number; a line
//! that reads as a module reads the same alone; a module's used-by list is
//! sorted; a capability's mode is a permission mode.
#![no_main]

use hostlib::procfiles;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let parsed = procfiles::parse_modules(text);
    let lines: Vec<&str> = text.lines().collect();
    let non_empty = lines.iter().filter(|l| !l.trim().is_empty()).count();
    assert!(parsed.bad_lines.len() <= non_empty);
    for bad in &parsed.bad_lines {
        assert!(bad.line >= 1 && bad.line <= lines.len(), "{bad}");
        assert!(procfiles::parse_module_line(lines[bad.line - 1]).is_err());
    }
    for m in parsed.modules.values() {
        assert!(m.used_by.windows(2).all(|w| w[0] <= w[1]));
        // The last line naming the module that reads is the one kept (a
        // later bad line of the same name is a bad line, nothing more).
        let kept = lines
            .iter()
            .rev()
            .filter(|l| l.split_ascii_whitespace().next() == Some(m.name.as_str()))
            .find_map(|l| procfiles::parse_module_line(l).ok())
            .expect("a module comes from a line naming it");
        assert_eq!(&kept, m);
    }
    let devices = procfiles::parse_devices(text);
    assert!(devices.bad_lines.len() <= non_empty);
    if let Ok(c) = procfiles::parse_capability(text) {
        assert!(c.mode <= 0o7777);
    }
    if let Ok(p) = procfiles::parse_params(text) {
        assert!(p.mode <= 0o7777);
    }
});
