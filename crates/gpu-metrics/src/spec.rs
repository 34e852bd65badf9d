//! The policy's section the metrics front end owns: `spec.dcgmExporter`.
//! The agent's policy assembles it.

use serde::{Deserialize, Serialize};

fn yes() -> bool {
    true
}

/// `spec.dcgmExporter`: the Prometheus endpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct DcgmExporterSpec {
    #[serde(default = "yes")]
    pub enabled: bool,
    /// Where to listen: `host:port`, or `:port` for every IPv4 address;
    /// unset: `DCGM_EXPORTER_LISTEN` if set, else dcgm-exporter's `:9400`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub listen: Option<String>,
    /// A dcgm-exporter counters file (`field, type, help` lines) naming
    /// what to export; default: dcgm-exporter's default counters. The GPU
    /// Operator's shape, `{name: <ConfigMap>}`, is taken too: an agent on a
    /// node cannot read a ConfigMap, so gpu-controller reads it and sends
    /// its `dcgm-metrics.csv` as `inline`; a name without `inline` means no
    /// file here (under the cluster's ClusterPolicy it is named as left out).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "counters_file"
    )]
    pub config: Option<CountersConfig>,
    /// Milliseconds between samples while someone scrapes (dcgm-exporter: 30000).
    #[serde(default = "default_collect_interval")]
    pub collect_interval_ms: u64,
}

/// `spec.dcgmExporter.config`: where the counters file comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CountersConfig {
    /// A file on the host (a path).
    File(String),
    /// The file's text: `{name: <ConfigMap>, inline: <text>}`, as
    /// gpu-controller sends the ConfigMap the ClusterPolicy names.
    Inline { name: Option<String>, text: String },
}

impl CountersConfig {
    /// Where the counters come from, in words (errors and skipped lines
    /// name it).
    pub fn origin(&self) -> String {
        match self {
            CountersConfig::File(p) => p.clone(),
            CountersConfig::Inline { name: Some(n), .. } => {
                format!("ConfigMap {n}, dcgm-metrics.csv")
            }
            CountersConfig::Inline { name: None, .. } => "spec.dcgmExporter.config.inline".into(),
        }
    }
}

impl Serialize for CountersConfig {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            CountersConfig::File(p) => s.serialize_str(p),
            CountersConfig::Inline { name, text } => {
                use serde::ser::SerializeMap;
                let mut m = s.serialize_map(None)?;
                if let Some(n) = name {
                    m.serialize_entry("name", n)?;
                }
                m.serialize_entry("inline", text)?;
                m.end()
            }
        }
    }
}

fn default_collect_interval() -> u64 {
    1000
}

impl Default for DcgmExporterSpec {
    fn default() -> Self {
        DcgmExporterSpec {
            enabled: true,
            listen: None,
            config: None,
            collect_interval_ms: default_collect_interval(),
        }
    }
}

/// `spec.dcgmExporter.config`: a counters file (a host path), or the GPU
/// Operator's `{name: <ConfigMap>}`, which names no file here unless
/// gpu-controller sent the ConfigMap's file beside it (`inline`).
fn counters_file<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<CountersConfig>, D::Error> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct OperatorConfig {
        #[serde(default)]
        name: Option<String>,
        #[serde(default)]
        inline: Option<String>,
    }
    struct V;
    impl<'de> serde::de::Visitor<'de> for V {
        type Value = Option<CountersConfig>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a counters file (a host path) or the GPU Operator's {name: <ConfigMap>}")
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
            Ok(Some(CountersConfig::File(v.to_string())))
        }
        fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
            let c = OperatorConfig::deserialize(serde::de::value::MapAccessDeserializer::new(map))?;
            Ok(c.inline.map(|text| CountersConfig::Inline {
                name: c.name.filter(|n| !n.is_empty()),
                text,
            }))
        }
    }
    d.deserialize_any(V)
}
