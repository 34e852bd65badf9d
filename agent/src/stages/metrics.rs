//! The `metrics` stage: what the exporter will serve (fields, address,
//! interval), checked against the policy; the running agent's exporter task
//! (`metrics::server`) then reports that it serves.

use super::status::StageState;
use crate::inventory::Inventory;
use crate::metrics::server::ExporterConfig;
use crate::policy::Policy;

/// What the exporter will serve, or why it cannot (a bad address or
/// counters file, named).
pub(super) fn metrics_plan(inv: &Inventory, policy: &Policy) -> (StageState, String) {
    if !inv.gpus.is_empty()
        && !inv
            .gpus
            .iter()
            .any(|g| g.uuid.is_some() && g.index.is_some())
    {
        return (
            StageState::Waiting,
            super::context::undescribed(inv, "sampled"),
        );
    }
    match ExporterConfig::from_spec(&policy.dcgm_exporter) {
        Err(e) => (StageState::Failed, e.to_string()),
        Ok(cfg) => {
            let mut skipped = if cfg.fields.skipped.is_empty() {
                String::new()
            } else {
                format!("; not exported: {}", cfg.fields.skipped.join(", "))
            };
            if !cfg.fields.notes.is_empty() {
                skipped.push_str(&format!(
                    "; exported as the counters file says: {}",
                    cfg.fields.notes.join(", ")
                ));
            }
            (
                StageState::Ready,
                format!(
                    "{} field(s) of {} GPU(s) on {}, sampled every {} ms while scraped{skipped}",
                    cfg.fields.fields.len(),
                    inv.gpus.len(),
                    cfg.listen,
                    cfg.interval.as_millis()
                ),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_counters_line_is_named_and_costs_no_other_field() {
        let (dir, sys, backend) = crate::test_support::sim_node("t4-4");
        let inv = crate::inventory::discover(&sys, &backend);
        let (state, detail) = metrics_plan(&inv, &Policy::default());
        assert_eq!(state, StageState::Ready);
        assert_eq!(
            detail,
            "26 field(s) of 4 GPU(s) on 0.0.0.0:9400, sampled every 1000 ms while scraped"
        );
        let csv = dir.path().join("counters.csv");
        std::fs::write(
            &csv,
            "DCGM_FI_DEV_GPU_TEMP, gauge, t\nDCGM_FI_DEV_SM_CLOCK gauge\n",
        )
        .unwrap();
        let policy = Policy::from_yaml(
            &format!("spec:\n  dcgmExporter:\n    config: {}\n", csv.display()),
            "p",
        )
        .unwrap();
        let (state, detail) = metrics_plan(&inv, &policy);
        // One bad line is named, and costs no other field its series.
        assert_eq!(state, StageState::Ready);
        assert_eq!(
            detail,
            format!(
                "1 field(s) of 4 GPU(s) on 0.0.0.0:9400, sampled every 1000 ms while scraped; not exported: {}:2: expected `FIELD, type, help`, found \"DCGM_FI_DEV_SM_CLOCK gauge\"",
                csv.display()
            )
        );
        let policy = Policy::from_yaml("spec:\n  dcgmExporter:\n    listen: nine\n", "p").unwrap();
        assert_eq!(
            metrics_plan(&inv, &policy).1,
            "spec.dcgmExporter.listen: \"nine\" is not host:port or :port"
        );
    }
}
