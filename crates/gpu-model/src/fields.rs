//! The DCGM fields gpu-agent exports, under dcgm-exporter's names and types,
//! and the counters file (dcgm-exporter's CSV: `field, type, help`) that
//! picks which of them to export.

use std::collections::BTreeSet;
use std::path::Path;

/// A field NVML can give, named as DCGM names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Field {
    SmClock,
    MemClock,
    MemoryTemp,
    GpuTemp,
    PowerUsage,
    TotalEnergyConsumption,
    PcieReplayCounter,
    GpuUtil,
    MemCopyUtil,
    EncUtil,
    DecUtil,
    XidErrors,
    FbFree,
    FbUsed,
    FbReserved,
    FbTotal,
    NvlinkBandwidthTotal,
    UncorrectableRemappedRows,
    CorrectableRemappedRows,
    RowRemapFailure,
    DriverVersion,
    ProfGrEngineActive,
    ProfPipeTensorActive,
    ProfDramActive,
    ProfPcieTxBytes,
    ProfPcieRxBytes,
    EccSbeVolTotal,
    EccDbeVolTotal,
    EccSbeAggTotal,
    EccDbeAggTotal,
    RetiredSbe,
    RetiredDbe,
    RetiredPending,
    NvlinkCrcFlitErrorCountTotal,
    NvlinkCrcDataErrorCountTotal,
    NvlinkReplayErrorCountTotal,
    NvlinkRecoveryErrorCountTotal,
    NvlinkBandwidthL0,
    PowerViolation,
    ThermalViolation,
    SyncBoostViolation,
    BoardLimitViolation,
    LowUtilViolation,
    ReliabilityViolation,
    VgpuLicenseStatus,
    ProfSmActive,
    ProfSmOccupancy,
    ProfPipeFp64Active,
    ProfPipeFp32Active,
    ProfPipeFp16Active,
    NvmlVersion,
    Brand,
    Serial,
    OemInforomVer,
    EccInforomVer,
    PowerInforomVer,
    InforomImageVer,
    VbiosVersion,
}

/// How a field is exported.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Gauge,
    Counter,
    /// A label on every series (`DCGM_FI_DRIVER_VERSION="550.127.08"`).
    Label,
}

impl Kind {
    pub fn word(self) -> &'static str {
        match self {
            Kind::Gauge => "gauge",
            Kind::Counter => "counter",
            Kind::Label => "label",
        }
    }

    fn parse(s: &str) -> Option<Kind> {
        Some(match s {
            "gauge" => Kind::Gauge,
            "counter" => Kind::Counter,
            "label" => Kind::Label,
            _ => return None,
        })
    }
}

/// Every field: DCGM name, kind (dcgm-exporter's, from its counters files),
/// help text, and whether it is in dcgm-exporter's default set (the lines
/// default-counters.csv leaves uncommented).
///
/// The help text is dcgm-exporter's, which prints a field's `# HELP` from
/// the third column of its counters file's line: here the text of
/// default-counters.csv's uncommented line for the field, else of the line
/// of dcp-metrics-included.csv, else of the commented line (4.5.3-4.8.2;
/// the two files agree on every text). `DCGM_FI_DEV_FB_TOTAL`, in neither
/// file, has gpu-agent's own. A counters file in use gives its own texts
/// ([`FieldSet::help_of`]).
pub struct FieldInfo {
    pub field: Field,
    pub name: &'static str,
    pub kind: Kind,
    pub help: &'static str,
    /// In dcgm-exporter's default counters file.
    pub default: bool,
}

impl std::fmt::Debug for FieldInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name)
    }
}

macro_rules! fields {
    ($($field:ident $name:literal $kind:ident $default:literal $help:literal;)*) => {
        pub const FIELDS: &[FieldInfo] = &[
            $(FieldInfo { field: Field::$field, name: $name, kind: Kind::$kind, help: $help, default: $default },)*
        ];
    };
}

fields! {
    SmClock "DCGM_FI_DEV_SM_CLOCK" Gauge true "SM clock frequency (in MHz).";
    MemClock "DCGM_FI_DEV_MEM_CLOCK" Gauge true "Memory clock frequency (in MHz).";
    MemoryTemp "DCGM_FI_DEV_MEMORY_TEMP" Gauge true "Memory temperature (in C).";
    GpuTemp "DCGM_FI_DEV_GPU_TEMP" Gauge true "GPU temperature (in C).";
    PowerUsage "DCGM_FI_DEV_POWER_USAGE" Gauge true "Power draw (in W).";
    TotalEnergyConsumption "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION" Counter true "Total energy consumption since boot (in mJ).";
    PcieReplayCounter "DCGM_FI_DEV_PCIE_REPLAY_COUNTER" Counter true "Total number of PCIe retries.";
    GpuUtil "DCGM_FI_DEV_GPU_UTIL" Gauge true "GPU utilization (in %).";
    MemCopyUtil "DCGM_FI_DEV_MEM_COPY_UTIL" Gauge true "Memory utilization (in %).";
    EncUtil "DCGM_FI_DEV_ENC_UTIL" Gauge true "Encoder utilization (in %).";
    DecUtil "DCGM_FI_DEV_DEC_UTIL" Gauge true "Decoder utilization (in %).";
    XidErrors "DCGM_FI_DEV_XID_ERRORS" Gauge true "Value of the last XID error encountered.";
    FbFree "DCGM_FI_DEV_FB_FREE" Gauge true "Framebuffer memory free (in MiB).";
    FbUsed "DCGM_FI_DEV_FB_USED" Gauge true "Framebuffer memory used (in MiB).";
    FbReserved "DCGM_FI_DEV_FB_RESERVED" Gauge true "Framebuffer memory reserved (in MiB).";
    FbTotal "DCGM_FI_DEV_FB_TOTAL" Gauge false "Framebuffer memory in all (MiB).";
    NvlinkBandwidthTotal "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL" Counter true "Total number of NVLink bandwidth counters for all lanes.";
    UncorrectableRemappedRows "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS" Counter true "Number of remapped rows for uncorrectable errors";
    CorrectableRemappedRows "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS" Counter true "Number of remapped rows for correctable errors";
    RowRemapFailure "DCGM_FI_DEV_ROW_REMAP_FAILURE" Gauge true "Whether remapping of rows has failed";
    DriverVersion "DCGM_FI_DRIVER_VERSION" Label true "Driver Version";
    ProfGrEngineActive "DCGM_FI_PROF_GR_ENGINE_ACTIVE" Gauge true "Ratio of time the graphics engine is active.";
    ProfPipeTensorActive "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE" Gauge true "Ratio of cycles the tensor (HMMA) pipe is active.";
    ProfDramActive "DCGM_FI_PROF_DRAM_ACTIVE" Gauge true "Ratio of cycles the device memory interface is active sending or receiving data.";
    ProfPcieTxBytes "DCGM_FI_PROF_PCIE_TX_BYTES" Gauge true "The rate of data transmitted over the PCIe bus - including both protocol headers and data payloads - in bytes per second.";
    ProfPcieRxBytes "DCGM_FI_PROF_PCIE_RX_BYTES" Gauge true "The rate of data received over the PCIe bus - including both protocol headers and data payloads - in bytes per second.";
    EccSbeVolTotal "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL" Counter false "Total number of single-bit volatile ECC errors.";
    EccDbeVolTotal "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL" Counter false "Total number of double-bit volatile ECC errors.";
    EccSbeAggTotal "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL" Counter false "Total number of single-bit persistent ECC errors.";
    EccDbeAggTotal "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL" Counter false "Total number of double-bit persistent ECC errors.";
    RetiredSbe "DCGM_FI_DEV_RETIRED_SBE" Counter false "Total number of retired pages due to single-bit errors.";
    RetiredDbe "DCGM_FI_DEV_RETIRED_DBE" Counter false "Total number of retired pages due to double-bit errors.";
    RetiredPending "DCGM_FI_DEV_RETIRED_PENDING" Counter false "Total number of pages pending retirement.";
    NvlinkCrcFlitErrorCountTotal "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL" Counter false "Total number of NVLink flow-control CRC errors.";
    NvlinkCrcDataErrorCountTotal "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL" Counter false "Total number of NVLink data CRC errors.";
    NvlinkReplayErrorCountTotal "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL" Counter false "Total number of NVLink retries.";
    NvlinkRecoveryErrorCountTotal "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL" Counter false "Total number of NVLink recovery errors.";
    NvlinkBandwidthL0 "DCGM_FI_DEV_NVLINK_BANDWIDTH_L0" Counter false "The number of bytes of active NVLink rx or tx data including both header and payload.";
    PowerViolation "DCGM_FI_DEV_POWER_VIOLATION" Counter false "Throttling duration due to power constraints (in ns).";
    ThermalViolation "DCGM_FI_DEV_THERMAL_VIOLATION" Counter false "Throttling duration due to thermal constraints (in ns).";
    SyncBoostViolation "DCGM_FI_DEV_SYNC_BOOST_VIOLATION" Counter false "Throttling duration due to sync-boost constraints (in ns).";
    BoardLimitViolation "DCGM_FI_DEV_BOARD_LIMIT_VIOLATION" Counter false "Throttling duration due to board limit constraints (in ns).";
    LowUtilViolation "DCGM_FI_DEV_LOW_UTIL_VIOLATION" Counter false "Throttling duration due to low utilization (in ns).";
    ReliabilityViolation "DCGM_FI_DEV_RELIABILITY_VIOLATION" Counter false "Throttling duration due to reliability constraints (in ns).";
    VgpuLicenseStatus "DCGM_FI_DEV_VGPU_LICENSE_STATUS" Gauge true "vGPU License status";
    ProfSmActive "DCGM_FI_PROF_SM_ACTIVE" Gauge false "The ratio of cycles an SM has at least 1 warp assigned.";
    ProfSmOccupancy "DCGM_FI_PROF_SM_OCCUPANCY" Gauge false "The ratio of number of warps resident on an SM.";
    ProfPipeFp64Active "DCGM_FI_PROF_PIPE_FP64_ACTIVE" Gauge false "Ratio of cycles the fp64 pipes are active.";
    ProfPipeFp32Active "DCGM_FI_PROF_PIPE_FP32_ACTIVE" Gauge false "Ratio of cycles the fp32 pipes are active.";
    ProfPipeFp16Active "DCGM_FI_PROF_PIPE_FP16_ACTIVE" Gauge false "Ratio of cycles the fp16 pipes are active.";
    NvmlVersion "DCGM_FI_NVML_VERSION" Label false "NVML Version";
    Brand "DCGM_FI_DEV_BRAND" Label false "Device Brand";
    Serial "DCGM_FI_DEV_SERIAL" Label false "Device Serial Number";
    OemInforomVer "DCGM_FI_DEV_OEM_INFOROM_VER" Label false "OEM inforom version";
    EccInforomVer "DCGM_FI_DEV_ECC_INFOROM_VER" Label false "ECC inforom version";
    PowerInforomVer "DCGM_FI_DEV_POWER_INFOROM_VER" Label false "Power management object inforom version";
    InforomImageVer "DCGM_FI_DEV_INFOROM_IMAGE_VER" Label false "Inforom image version";
    VbiosVersion "DCGM_FI_DEV_VBIOS_VERSION" Label false "VBIOS version of the device";
}

/// Series dcgm-exporter's counters files name that gpu-agent does not
/// export, each with why: named so that a counters file listing them gets
/// one plain warning, not an error. Every `DCGM_FI_` field of those files
/// is in [`FIELDS`]; these four are dcgm-exporter's own.
const NOT_EXPORTED: &[(&str, &str)] = &[
    (
        "DCGM_EXP_CLOCK_EVENTS_COUNT",
        "dcgm-exporter's own count of DCGM clock events over its collection window, not a DCGM field; gpu-agent does not compute it",
    ),
    (
        "DCGM_EXP_XID_ERRORS_COUNT",
        "dcgm-exporter's own count of XIDs over its collection window, not a DCGM field; gpu-agent counts XIDs in gpu_agent_health_events_total",
    ),
    (
        "DCGM_EXP_GPU_HEALTH_STATUS",
        "the verdict of DCGM's health watches, which need a DCGM host engine",
    ),
    (
        "DCGM_EXP_P2P_STATUS",
        "dcgm-exporter's own series from DCGM's NVLink peer-to-peer status, not a DCGM field; gpu-agent does not compute it",
    ),
];

/// Why a DCGM field gpu-agent does not know is left out.
pub const UNKNOWN_FIELD: &str = "not a field gpu-agent reads through NVML: it exports those of dcgm-exporter's default-counters.csv and dcp-metrics-included.csv";

impl Field {
    pub fn info(self) -> &'static FieldInfo {
        FIELDS
            .iter()
            .find(|f| f.field == self)
            .expect("every field is in FIELDS")
    }

    pub fn by_name(name: &str) -> Option<Field> {
        FIELDS.iter().find(|f| f.name == name).map(|f| f.field)
    }
}

/// What to export: dcgm-exporter's default set, or a counters file's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldSet {
    pub fields: BTreeSet<Field>,
    /// Help text from the counters file, where it gives one.
    pub help: Vec<(Field, String)>,
    /// Lines left out, each with its file, line and why: fields gpu-agent
    /// does not export (dcgm-exporter's own `DCGM_EXP_` series, DCGM fields
    /// outside its two counters files), lines that do not read, a field
    /// listed again (logged once, shown in the metrics stage). Never a
    /// reason to export nothing.
    pub skipped: Vec<String>,
    /// Fields the file gives another Prometheus type than dcgm-exporter's
    /// own list (a gauge as `counter`): exported as the file says.
    pub kinds: Vec<(Field, Kind)>,
    /// Lines exported other than as dcgm-exporter's list has them (the
    /// type), with file and line.
    pub notes: Vec<String>,
}

impl Default for FieldSet {
    fn default() -> Self {
        FieldSet {
            fields: FIELDS
                .iter()
                .filter(|f| f.default)
                .map(|f| f.field)
                .collect(),
            help: Vec::new(),
            skipped: Vec::new(),
            kinds: Vec::new(),
            notes: Vec::new(),
        }
    }
}

/// A counters file that cannot be used; names the file and line.
#[derive(Debug, thiserror::Error)]
pub enum CountersError {
    #[error("{path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

impl FieldSet {
    /// Every field gpu-agent exports (all of dcgm-exporter's counters
    /// files, commented lines too, and `DCGM_FI_DEV_FB_TOTAL`).
    pub fn every() -> FieldSet {
        FieldSet {
            fields: FIELDS.iter().map(|f| f.field).collect(),
            ..FieldSet::default()
        }
    }

    pub fn wants(&self, f: Field) -> bool {
        self.fields.contains(&f)
    }

    /// Reads a dcgm-exporter counters file (`# comments`, blank lines, and
    /// `DCGM_FI_…, gauge|counter|label, help`).
    pub fn from_file(path: &Path) -> Result<FieldSet, CountersError> {
        let text = std::fs::read_to_string(path).map_err(|source| CountersError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&text, &path.display().to_string())
    }

    /// Reads the file's lines. A line that does not read, names a field
    /// gpu-agent does not export or lists a field again is left out and named in
    /// [`FieldSet::skipped`]; a field given another type than dcgm-exporter's
    /// list gives it is exported as the file says and named in
    /// [`FieldSet::notes`]. One line never costs the others their series.
    pub fn parse(text: &str, path: &str) -> Result<FieldSet, CountersError> {
        let mut set = FieldSet {
            fields: BTreeSet::new(),
            help: Vec::new(),
            skipped: Vec::new(),
            kinds: Vec::new(),
            notes: Vec::new(),
        };
        let mut listed: Vec<(String, usize)> = Vec::new();
        for (n, raw) in text.lines().enumerate() {
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let at = format!("{path}:{}", n + 1);
            let mut parts = line.splitn(3, ',').map(str::trim);
            let name = parts.next().unwrap_or_default();
            let Some(kind) = parts.next() else {
                set.skipped.push(format!(
                    "{at}: expected `FIELD, type, help`, found {line:?}"
                ));
                continue;
            };
            let help = parts.next().unwrap_or_default();
            if !name.starts_with("DCGM_") || name.contains(char::is_whitespace) {
                set.skipped
                    .push(format!("{at}: {name:?} is not a DCGM field name"));
                continue;
            }
            let Some(kind) = Kind::parse(kind) else {
                set.skipped.push(format!(
                    "{at}: {name}: type {kind:?} is not gauge, counter or label"
                ));
                continue;
            };
            if let Some((_, first)) = listed.iter().find(|(g, _)| g == name) {
                set.skipped.push(format!(
                    "{at}: {name} is listed already at line {first}; this line is left out"
                ));
                continue;
            }
            listed.push((name.to_string(), n + 1));
            let Some(f) = Field::by_name(name) else {
                let why = NOT_EXPORTED
                    .iter()
                    .find(|(n, _)| *n == name)
                    .map_or(UNKNOWN_FIELD, |(_, why)| why);
                set.skipped.push(format!("{at}: {name} ({why})"));
                continue;
            };
            let own = f.info().kind;
            if own != kind {
                if own == Kind::Label || kind == Kind::Label {
                    // A value cannot become a label, nor a label a value.
                    set.skipped.push(format!(
                        "{at}: {name} is a {}, it cannot be exported as a {}",
                        own.word(),
                        kind.word()
                    ));
                    continue;
                }
                set.kinds.push((f, kind));
                set.notes.push(format!(
                    "{at}: {name} is a {} in dcgm-exporter's list; exported as a {}, as the file says",
                    own.word(),
                    kind.word()
                ));
            }
            set.fields.insert(f);
            if !help.is_empty() {
                set.help.push((f, help.to_string()));
            }
        }
        Ok(set)
    }

    /// The Prometheus type `f` is exported as: the file's, else
    /// dcgm-exporter's.
    pub fn kind_of(&self, f: Field) -> Kind {
        self.kinds
            .iter()
            .find(|(g, _)| *g == f)
            .map_or(f.info().kind, |(_, k)| *k)
    }

    /// The help text to print for `f`.
    pub fn help_of(&self, f: Field) -> &str {
        self.help
            .iter()
            .find(|(g, _)| *g == f)
            .map_or(f.info().help, |(_, h)| h.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_set_is_dcgm_exporters() {
        let d = FieldSet::default();
        assert_eq!(d.fields.len(), 26);
        assert!(d.wants(Field::VgpuLicenseStatus));
        assert!(!d.wants(Field::PowerViolation));
        assert!(d.wants(Field::TotalEnergyConsumption));
        assert!(!d.wants(Field::FbTotal));
    }

    /// Each field's `# HELP` with no counters file is dcgm-exporter's: the
    /// third column of its line in upstream's counters files, unchanged
    /// (`../shared/upstream/dcgm-exporter` beside the checkout, dcgm-exporter 4.5.3-4.8.2).
    #[test]
    fn built_in_help_is_dcgm_exporters() {
        let dir = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../../shared/upstream/dcgm-exporter"
        );
        // name -> help of its uncommented line, and of its commented line.
        let lines = |file: &str| {
            let text = std::fs::read_to_string(format!("{dir}/{file}")).unwrap_or_else(|e| {
                panic!("{dir}/{file}: {e} (CI has ../shared beside the checkout)")
            });
            let mut on = std::collections::BTreeMap::new();
            let mut off = std::collections::BTreeMap::new();
            for l in text.lines() {
                let commented = l.trim_start().starts_with('#');
                let mut cols = l
                    .trim_start_matches(['#', ' '])
                    .splitn(3, ',')
                    .map(str::trim);
                let (Some(name), Some(_), Some(help)) = (cols.next(), cols.next(), cols.next())
                else {
                    continue;
                };
                if name.starts_with("DCGM_") {
                    let map = if commented { &mut off } else { &mut on };
                    map.entry(name.to_string()).or_insert(help.to_string());
                }
            }
            (on, off)
        };
        let (default_on, default_off) = lines("default-counters.csv");
        let (dcp_on, dcp_off) = lines("dcp-metrics-included.csv");
        let mut checked = 0;
        for info in FIELDS {
            let upstream = [&default_on, &dcp_on, &default_off, &dcp_off]
                .iter()
                .find_map(|m| m.get(info.name));
            match upstream {
                Some(help) => {
                    assert_eq!(info.help, help, "{}", info.name);
                    // And what a scrape without a counters file prints.
                    assert_eq!(FieldSet::every().help_of(info.field), help);
                    checked += 1;
                }
                None => assert_eq!(
                    info.field,
                    Field::FbTotal,
                    "{} is in neither file",
                    info.name
                ),
            }
        }
        assert_eq!(checked, FIELDS.len() - 1);
    }

    #[test]
    fn a_counters_file_picks_fields_and_names_bad_lines() {
        let text = "# Format\n# DCGM FIELD, Prometheus metric type, help message\n\n\
                    DCGM_FI_DEV_GPU_TEMP, gauge, GPU temperature (in C).\n\
                    DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION, counter, Total energy (mJ).\n\
                    DCGM_FI_DEV_VGPU_LICENSE_STATUS, gauge, vGPU License status\n\
                    DCGM_EXP_GPU_HEALTH_STATUS, counter, DCGM reported health status\n\
                    DCGM_FI_DEV_CLOCKS_EVENT_REASONS, gauge, x\n\
                    DCGM_FI_DRIVER_VERSION, label, Driver Version\n";
        let s = FieldSet::parse(text, "/etc/dcgm/c.csv").unwrap();
        assert_eq!(
            s.fields.iter().copied().collect::<Vec<_>>(),
            [
                Field::GpuTemp,
                Field::TotalEnergyConsumption,
                Field::DriverVersion,
                Field::VgpuLicenseStatus,
            ]
        );
        assert_eq!(s.help_of(Field::GpuTemp), "GPU temperature (in C).");
        assert_eq!(
            s.skipped,
            [
                "/etc/dcgm/c.csv:7: DCGM_EXP_GPU_HEALTH_STATUS (the verdict of DCGM's health watches, which need a DCGM host engine)"
                    .to_string(),
                format!("/etc/dcgm/c.csv:8: DCGM_FI_DEV_CLOCKS_EVENT_REASONS ({UNKNOWN_FIELD})"),
            ]
        );
        // A line that does not read is left out, named; the others stay.
        let s = FieldSet::parse(
            "DCGM_FI_DEV_GPU_TEMP gauge\n# x\nDCGM_FI_DEV_SM_CLOCK, histogram, t\nDCGM_FI_DEV_POWER_USAGE, gauge, p\nnot a field, gauge, x\n",
            "f.csv",
        )
        .unwrap();
        assert_eq!(
            s.fields.iter().copied().collect::<Vec<_>>(),
            [Field::PowerUsage]
        );
        assert_eq!(
            s.skipped,
            [
                "f.csv:1: expected `FIELD, type, help`, found \"DCGM_FI_DEV_GPU_TEMP gauge\"",
                "f.csv:3: DCGM_FI_DEV_SM_CLOCK: type \"histogram\" is not gauge, counter or label",
                "f.csv:5: \"not a field\" is not a DCGM field name",
            ]
        );
        // Another type than dcgm-exporter's: exported as the file says.
        let s = FieldSet::parse("DCGM_FI_DEV_GPU_TEMP, counter, t\n", "f.csv").unwrap();
        assert!(s.wants(Field::GpuTemp));
        assert_eq!(s.kind_of(Field::GpuTemp), Kind::Counter);
        assert_eq!(
            s.notes,
            [
                "f.csv:1: DCGM_FI_DEV_GPU_TEMP is a gauge in dcgm-exporter's list; exported as a counter, as the file says"
            ]
        );
        // A value as a label cannot be: left out, named.
        let s = FieldSet::parse(
            "DCGM_FI_DEV_GPU_TEMP, label, t\nDCGM_FI_DRIVER_VERSION, gauge, d\n",
            "f.csv",
        )
        .unwrap();
        assert!(s.fields.is_empty());
        assert_eq!(s.skipped.len(), 2, "{:?}", s.skipped);
        // A field listed twice: the first line counts.
        let s = FieldSet::parse(
            "DCGM_FI_DEV_GPU_TEMP, counter, t\nDCGM_FI_DEV_GPU_TEMP, gauge, t2\n",
            "f.csv",
        )
        .unwrap();
        assert_eq!(s.kind_of(Field::GpuTemp), Kind::Counter);
        assert_eq!(
            s.skipped,
            ["f.csv:2: DCGM_FI_DEV_GPU_TEMP is listed already at line 1; this line is left out"]
        );
        // A file of comments exports no GPU field (the agent's own series
        // are still served).
        assert!(
            FieldSet::parse("# nothing\n", "f.csv")
                .unwrap()
                .fields
                .is_empty()
        );
    }
}
