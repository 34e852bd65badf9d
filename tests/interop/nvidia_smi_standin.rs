//! A stand-in for NVIDIA's `nvidia-smi`, for tests without a GPU. It is not
//! gpu-agent: it is what gpu-agent runs. agent/tests/dra_timeslice.rs
//! compiles it statically with `rustc` and puts it at the test host root's
//! `/usr/bin/nvidia-smi`, so that it runs chrooted there exactly as the
//! host's would.
//!
//! It appends its arguments, one line per run, to `/var/log/nvidia-smi.argv`
//! (a path in the root it runs in: the record is found there only when it
//! ran chrooted). When `/etc/nvidia-smi.fail` exists and its first line is
//! a word among the arguments (a GPU's UUID), it prints the file's second
//! line on stdout and on stderr and exits 4, as nvidia-smi does when the
//! driver refuses; otherwise it prints what nvidia-smi prints and exits 0.

use std::io::Write;
use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let line = args.join(" ");
    let mut log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open("/var/log/nvidia-smi.argv")
        .expect("open /var/log/nvidia-smi.argv");
    writeln!(log, "{line}").expect("record the arguments");
    if let Ok(fail) = std::fs::read_to_string("/etc/nvidia-smi.fail") {
        let mut lines = fail.lines();
        let gpu = lines.next().unwrap_or_default();
        let words = lines.next().unwrap_or("failed");
        if args.iter().any(|a| a == gpu) {
            println!("{words}");
            eprintln!("{words}");
            return ExitCode::from(4);
        }
    }
    match args.first().map(String::as_str) {
        Some("compute-policy") => println!("Set timeslice for GPU {}.", args[2]),
        _ => println!("Compute mode is already set to DEFAULT for GPU {}.", args[1]),
    }
    ExitCode::SUCCESS
}
