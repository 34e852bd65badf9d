//! One scrape's text: the last sample under dcgm-exporter's names and
//! labels, then the agent's own series, in Prometheus's text format 0.0.4.

use std::collections::BTreeMap;

use prometheus::proto::{Counter, Gauge, LabelPair, Metric, MetricFamily, MetricType};
use prometheus::{Encoder, TextEncoder};

use super::agent::AgentSeries;
use super::fields::{FIELDS, Field, FieldSet, Kind};
use super::pods::{PodMap, PodRef};
use gpu_model::backend::Sample;
use gpu_model::inventory::Inventory;

/// The content type of [`render`]'s output.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Everything one scrape shows.
#[derive(Debug)]
pub struct Scrape<'a> {
    pub sample: &'a Sample,
    pub inventory: &'a Inventory,
    pub pods: &'a PodMap,
    pub fields: &'a FieldSet,
    pub hostname: &'a str,
    pub agent: &'a AgentSeries,
}

fn pair(name: &str, value: &str) -> LabelPair {
    let mut l = LabelPair::default();
    l.set_name(name.to_string());
    l.set_value(value.to_string());
    l
}

/// A GPU's bus id in NVML's form (as dcgm-exporter prints it) and its model.
fn bus_and_model<'a>(inv: &'a Inventory, uuid: &str) -> Option<(String, Option<&'a str>)> {
    let g = inv.gpus.iter().find(|g| g.uuid.as_deref() == Some(uuid))?;
    Some((g.bus_id.nvml_bus_id(), g.model.as_deref()))
}

fn family(name: &str, help: &str, kind: MetricType, metrics: Vec<Metric>) -> MetricFamily {
    let mut f = MetricFamily::default();
    f.set_name(name.to_string());
    f.set_help(help.to_string());
    f.set_field_type(kind);
    f.set_metric(metrics);
    f
}

fn metric(labels: Vec<LabelPair>, kind: MetricType, value: f64) -> Metric {
    let mut m = Metric::default();
    m.set_label(labels);
    if kind == MetricType::COUNTER {
        let mut c = Counter::default();
        c.set_value(value);
        m.set_counter(c);
    } else {
        let mut g = Gauge::default();
        g.set_value(value);
        m.set_gauge(g);
    }
    m
}

/// One series' labels, per container using the device (one series with
/// no pod labels when none does).
fn with_pods(base: &[LabelPair], pods: &[PodRef]) -> Vec<Vec<LabelPair>> {
    if pods.is_empty() {
        return vec![base.to_vec()];
    }
    pods.iter()
        .map(|p| {
            let mut l = base.to_vec();
            l.push(pair("container", &p.container));
            l.push(pair("namespace", &p.namespace));
            l.push(pair("pod", &p.pod));
            l
        })
        .collect()
}

/// Renders a scrape.
pub fn render(s: &Scrape<'_>) -> String {
    let driver = s
        .fields
        .wants(Field::DriverVersion)
        .then(|| s.inventory.backend.driver_version.clone())
        .flatten();
    // Each GPU's (and MIG device's) label sets, with its values.
    struct Series {
        labels: Vec<Vec<LabelPair>>,
        values: BTreeMap<Field, f64>,
    }
    let mut series: Vec<Series> = Vec::new();
    for g in &s.sample.gpus {
        let (bus, model) = bus_and_model(s.inventory, &g.uuid).unwrap_or_default();
        let mut base = vec![
            pair("gpu", &g.index.to_string()),
            pair("UUID", &g.uuid),
            pair("pci_bus_id", &bus),
            pair("device", &format!("nvidia{}", g.index)),
            pair("modelName", model.unwrap_or_default()),
            // `Hostname`, as every dcgm-exporter release up to 4.5.3-4.8.2
            // writes it on GPU series (internal/pkg/rendermetrics). Upstream
            // renamed it `hostname` after that release (#655, d5e5f51, not
            // in a release yet); dashboard 12239 filters on neither.
            pair("Hostname", s.hostname),
        ];
        if let Some(v) = &driver {
            base.push(pair("DCGM_FI_DRIVER_VERSION", v));
        }
        // The other label fields, in dcgm-exporter's order; one the GPU
        // does not give is absent, as dcgm-exporter leaves a blank out.
        for info in FIELDS {
            if info.kind != Kind::Label || !s.fields.wants(info.field) {
                continue;
            }
            if let Some((_, v)) = g.labels.iter().find(|(f, _)| *f == info.field) {
                base.push(pair(info.name, v));
            }
        }
        let mut values: BTreeMap<Field, f64> = g.values.iter().copied().collect();
        if s.fields.wants(Field::XidErrors) {
            let last = s.agent.last_xid.get(&g.uuid).copied().unwrap_or(0);
            values.insert(Field::XidErrors, last as f64);
        }
        series.push(Series {
            labels: with_pods(&base, s.pods.of(&g.uuid)),
            values,
        });
        for m in &g.mig {
            let mut mb = base[..6].to_vec();
            mb.push(pair("GPU_I_PROFILE", &m.profile));
            mb.push(pair(
                "GPU_I_ID",
                &m.gpu_instance_id.map(|i| i.to_string()).unwrap_or_default(),
            ));
            mb.extend(base[6..].iter().cloned());
            series.push(Series {
                labels: with_pods(&mb, s.pods.of(&m.uuid)),
                values: m.values.iter().copied().collect(),
            });
        }
    }
    let mut families = Vec::new();
    for info in FIELDS {
        if info.kind == Kind::Label || !s.fields.wants(info.field) {
            continue;
        }
        let kind = if s.fields.kind_of(info.field) == Kind::Counter {
            MetricType::COUNTER
        } else {
            MetricType::GAUGE
        };
        let metrics: Vec<Metric> = series
            .iter()
            .filter_map(|x| x.values.get(&info.field).map(|v| (x, *v)))
            .flat_map(|(x, v)| x.labels.iter().map(move |l| metric(l.clone(), kind, v)))
            .collect();
        if !metrics.is_empty() {
            families.push(family(
                info.name,
                s.fields.help_of(info.field),
                kind,
                metrics,
            ));
        }
    }
    families.extend(agent_families(s.agent));
    let mut out = Vec::with_capacity(64 * 1024);
    // Encoding into memory fails only on a family without metrics (none here).
    if let Err(e) = TextEncoder::new().encode(&families, &mut out) {
        tracing::error!(stage = "metrics", error = %e, "cannot encode metrics");
    }
    String::from_utf8(out).unwrap_or_default()
}

fn agent_families(a: &AgentSeries) -> Vec<MetricFamily> {
    let mut f = Vec::new();
    let mut push = |name: &str, help: &str, kind: MetricType, rows: Vec<(Vec<LabelPair>, f64)>| {
        if !rows.is_empty() {
            let metrics = rows.into_iter().map(|(l, v)| metric(l, kind, v)).collect();
            f.push(family(name, help, kind, metrics));
        }
    };
    push(
        "gpu_agent_stage_state",
        "Each stage's state (1 for the state it is in).",
        MetricType::GAUGE,
        a.stages
            .iter()
            .map(|(st, state)| (vec![pair("stage", st), pair("state", state)], 1.0))
            .collect(),
    );
    push(
        "gpu_agent_repairs_total",
        "Drift on the host that reconciles put right, by stage.",
        MetricType::COUNTER,
        a.repairs
            .iter()
            .map(|(st, n)| (vec![pair("stage", st)], *n as f64))
            .collect(),
    );
    push(
        "gpu_agent_plugin_registrations_total",
        "Registrations of a device-plugin resource with the kubelet.",
        MetricType::COUNTER,
        a.registrations
            .iter()
            .map(|(r, n)| (vec![pair("resource", r)], *n as f64))
            .collect(),
    );
    push(
        "gpu_agent_allocations_total",
        "Containers the kubelet gave devices of a resource.",
        MetricType::COUNTER,
        a.allocations
            .iter()
            .map(|(r, n)| (vec![pair("resource", r)], *n as f64))
            .collect(),
    );
    push(
        "gpu_agent_health_events_total",
        "GPU health events (XID errors), by XID.",
        MetricType::COUNTER,
        a.xid_events
            .iter()
            .map(|(x, n)| (vec![pair("xid", &x.to_string())], *n as f64))
            .collect(),
    );
    push(
        "gpu_agent_reconciles_total",
        "Passes of the stages (the first and every reconcile).",
        MetricType::COUNTER,
        vec![(Vec::new(), a.passes as f64)],
    );
    if let Some(d) = a.last_pass_seconds {
        push(
            "gpu_agent_reconcile_duration_seconds",
            "How long the last pass of the stages took.",
            MetricType::GAUGE,
            vec![(Vec::new(), d)],
        );
    }
    if let Some(d) = a.last_validation_seconds {
        push(
            "gpu_agent_validation_duration_seconds",
            "How long the last validation took.",
            MetricType::GAUGE,
            vec![(Vec::new(), d)],
        );
    }
    f
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpu_model::backend::GpuBackend;

    #[test]
    fn a_type_the_counters_file_gives_is_the_type_exported() {
        let (_d, sys, backend) = crate::test_support::sim_node("t4-4");
        let inv = gpu_backend::discover::discover(&sys, &backend);
        let fields = FieldSet::parse(
            "DCGM_FI_DEV_GPU_TEMP, counter, t\nDCGM_FI_DEV_POWER_USAGE, gauge, p\nbad line\n",
            "c.csv",
        )
        .unwrap();
        let sample = backend.sampler().unwrap().sample(&fields).unwrap();
        let text = render(&Scrape {
            sample: &sample,
            inventory: &inv,
            pods: &PodMap::default(),
            fields: &fields,
            hostname: "node-1",
            agent: &AgentSeries::default(),
        });
        assert!(
            text.contains("# TYPE DCGM_FI_DEV_GPU_TEMP counter\n"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE DCGM_FI_DEV_POWER_USAGE gauge\n"),
            "{text}"
        );
        assert_eq!(text.matches("\nDCGM_FI_DEV_GPU_TEMP{").count(), 4, "{text}");
    }

    #[test]
    fn label_fields_ride_on_every_series_and_gpu_instances_have_their_gpm() {
        let (_d, sys, backend) = crate::test_support::sim_node("h100-mig-2");
        let inv = gpu_backend::discover::discover(&sys, &backend);
        let fields = FieldSet::parse(
            "DCGM_FI_DEV_GPU_TEMP, gauge, t\nDCGM_FI_PROF_SM_ACTIVE, gauge, s\n\
             DCGM_FI_PROF_PCIE_TX_BYTES, gauge, p\nDCGM_FI_DEV_VBIOS_VERSION, label, v\n\
             DCGM_FI_DEV_SERIAL, label, s\nDCGM_FI_DEV_POWER_INFOROM_VER, label, p\n",
            "c.csv",
        )
        .unwrap();
        let sample = backend.sampler().unwrap().sample(&fields).unwrap();
        let text = render(&Scrape {
            sample: &sample,
            inventory: &inv,
            pods: &PodMap::default(),
            fields: &fields,
            hostname: "node-1",
            agent: &AgentSeries::default(),
        });
        let g = &inv.gpus[0];
        let uuid = g.uuid.clone().unwrap();
        let node = simnode::NodeDescription::load("h100-mig-2").unwrap();
        let board = node.gpus[0].board();
        // The labels the file asks for on the GPU's series; the power
        // InfoROM object, which a Hopper board lacks, is absent.
        let temp = text
            .lines()
            .find(|l| l.starts_with("DCGM_FI_DEV_GPU_TEMP{") && l.contains(&uuid))
            .unwrap_or_else(|| panic!("{text}"));
        assert!(
            temp.contains(&format!(
                ",DCGM_FI_DEV_SERIAL=\"{}\",DCGM_FI_DEV_VBIOS_VERSION=\"{}\"}}",
                board.serial, board.vbios
            )),
            "{temp}"
        );
        assert!(!text.contains("DCGM_FI_DEV_POWER_INFOROM_VER"), "{text}");
        assert!(
            !text.contains("DCGM_FI_DRIVER_VERSION"),
            "not asked: {text}"
        );
        // Each GPU instance its own SM activity, with the parent's labels;
        // PCIe traffic only per GPU.
        let mig = &g.mig_devices[0];
        let want = node.gpus[0]
            .instance_gpm(mig.gpu_instance_id.unwrap())
            .unwrap()
            .sm_util_pct
            / 100.0;
        let line = text
            .lines()
            .find(|l| {
                l.starts_with("DCGM_FI_PROF_SM_ACTIVE{")
                    && l.contains(&format!("GPU_I_ID=\"{}\"", mig.gpu_instance_id.unwrap()))
            })
            .unwrap_or_else(|| panic!("{text}"));
        assert!(
            line.contains(&format!("GPU_I_PROFILE=\"{}\"", mig.profile)),
            "{line}"
        );
        assert!(line.contains("DCGM_FI_DEV_VBIOS_VERSION="), "{line}");
        assert!(line.ends_with(&format!(" {want}")), "{line} (want {want})");
        assert!(
            !text
                .lines()
                .any(|l| l.starts_with("DCGM_FI_PROF_PCIE_TX_BYTES{") && l.contains("GPU_I_ID")),
            "{text}"
        );
    }

    #[test]
    fn series_carry_dcgm_exporters_names_labels_and_pods() {
        let (_d, sys, backend) = crate::test_support::sim_node("h100-mig-2");
        let inv = gpu_backend::discover::discover(&sys, &backend);
        let fields = FieldSet::default();
        let sample = backend.sampler().unwrap().sample(&fields).unwrap();
        let gpu0 = inv.gpus[0].uuid.clone().unwrap();
        let mig = inv.gpus[0].mig_devices[0].clone();
        let mut pods = PodMap::default();
        let p = |n: &str| PodRef {
            pod: n.into(),
            namespace: "ml".into(),
            container: "c".into(),
        };
        pods.by_uuid.insert(mig.uuid.clone(), vec![p("train")]);
        let mut agent = AgentSeries::default();
        agent.last_xid.insert(gpu0.clone(), 79);
        agent.xid_events.insert(79, 1);
        let text = render(&Scrape {
            sample: &sample,
            inventory: &inv,
            pods: &pods,
            fields: &fields,
            hostname: "node-1",
            agent: &agent,
        });
        let base = format!(
            "gpu=\"0\",UUID=\"{gpu0}\",pci_bus_id=\"00000000:18:00.0\",device=\"nvidia0\",modelName=\"NVIDIA H100 80GB HBM3\",Hostname=\"node-1\""
        );
        assert!(
            text.contains("# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter\n"),
            "{text}"
        );
        assert!(
            text.contains(&format!(
                "DCGM_FI_DEV_GPU_TEMP{{{base},DCGM_FI_DRIVER_VERSION=\"550.127.08\"}} 30\n"
            )),
            "{text}"
        );
        assert!(
            text.contains(&format!(
                "DCGM_FI_DEV_XID_ERRORS{{{base},DCGM_FI_DRIVER_VERSION=\"550.127.08\"}} 79\n"
            )),
            "{text}"
        );
        assert!(text.contains(&format!(
            "DCGM_FI_DEV_FB_FREE{{{base},GPU_I_PROFILE=\"3g.40gb\",GPU_I_ID=\"{}\",DCGM_FI_DRIVER_VERSION=\"550.127.08\",container=\"c\",namespace=\"ml\",pod=\"train\"}} 40192\n",
            mig.gpu_instance_id.unwrap()
        )), "{text}");
        assert!(
            text.contains("gpu_agent_health_events_total{xid=\"79\"} 1\n"),
            "{text}"
        );
        // No DCGM counter is renamed.
        assert!(!text.contains("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION_total"));
    }
}
