//! Writes a node description's sysfs/procfs tree into a directory.
//! The host fixtures under tests/fixtures/hosts are made with it:
//! `cargo run -p simnode --example materialize -- h100-sxm-8 tests/fixtures/hosts/h100-sxm-8`

use std::path::Path;
use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [node, dir] = args.as_slice() else {
        eprintln!("usage: materialize NODE|FILE DIR");
        return ExitCode::from(2);
    };
    let desc = match simnode::NodeDescription::load(node) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    if let Err(e) = desc.materialize(Path::new(dir)) {
        eprintln!("error: {dir}: {e}");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
