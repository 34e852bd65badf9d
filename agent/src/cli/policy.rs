//! `gpu-agent policy check`: a policy file, the files it names, and which
//! stages it turns on.

use std::path::Path;
use std::process::ExitCode;

use gpu_agent::render;
use gpu_agent::stages::Stage;

use super::{Failure, bad_input, load_policy};

pub(crate) fn policy_check(file: &Path, effective: bool) -> Result<ExitCode, Failure> {
    let policy = load_policy(Some(file))?;
    let settings = gpu_agent::plugin::settings(&policy.device_plugin, policy.mig.strategy)
        .map_err(bad_input)?;
    // The other files the policy names, read as the running agent reads
    // them: a file that is missing or does not parse fails the check.
    let mut mig_warning = None;
    if policy.mig_manager.enabled {
        let (config, origin) =
            gpu_agent::mig::load_config(&policy.mig_manager).map_err(bad_input)?;
        if let Some(layout) = policy.mig_manager.selected_layout()
            && let Err(e) = config.layout(layout, &origin, "spec.migManager.default")
        {
            // The built-in layouts are one list for every GPU model gpu-agent
            // knows, and `all-<profile>`, `all-balanced` derived for the
            // others at run time; another name missing there may still be a
            // model's it does not know: a warning. A file's or inline
            // layouts are the user's: an error.
            if config.builtin {
                mig_warning = Some(
                    if gpu_agent::mig::derive::Generic::parse(layout).is_some() {
                        format!(
                            "note: layout {layout:?} is not in gpu-agent's built-in MIG config: each GPU gets it derived from the MIG profiles NVML lists for it"
                        )
                    } else {
                        format!("warning: {e}")
                    },
                );
            } else {
                return Err(bad_input(e));
            }
        }
    }
    let counters = if policy.dcgm_exporter.enabled {
        Some(
            gpu_agent::metrics::server::ExporterConfig::from_spec(&policy.dcgm_exporter)
                .map_err(bad_input)?
                .fields,
        )
    } else {
        None
    };
    println!("{}: valid policy", file.display());
    if let Some(w) = &mig_warning {
        println!("{w}");
    }
    for u in &settings.unacted {
        println!(
            "{}: device-plugin config key not acted on: {u}",
            if u.warn { "warning" } else { "note" }
        );
    }
    for s in counters.iter().flat_map(|c| &c.skipped) {
        println!("warning: counters file: not exported: {s}");
    }
    for n in counters.iter().flat_map(|c| &c.notes) {
        println!("note: counters file: {n}");
    }
    let rows: Vec<Vec<String>> = Stage::ALL
        .iter()
        .map(|s| {
            let state = match s.disabled_by(&policy) {
                Some(why) => format!("off ({why})"),
                None => "on".into(),
            };
            vec![s.name().to_string(), state]
        })
        .collect();
    print!("{}", render::table(&["STAGE", "BY THIS POLICY"], &rows));
    if effective {
        println!(
            "---\n{}",
            serde_yaml_ng::to_string(&serde_json::json!({ "spec": policy }))?
        );
    }
    Ok(ExitCode::SUCCESS)
}
