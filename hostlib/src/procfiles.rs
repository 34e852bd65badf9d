//! Parsers of our own for the `/proc` files gpu-agent reads, for the few
//! fields it uses, tolerant of what real kernels print.
//!
//! procfs-core 0.18's `KernelModules` is wrong on real input: a kernel
//! built without `CONFIG_MODULE_UNLOAD` prints `-` as every module's
//! reference count (`nvidia_uvm 1830912 - - Live 0xffffffffc080c000 (O)`,
//! captured on a real H100 host: `tests/fixtures/hosts/h100-pcie-vm`), and
//! procfs-core fails the whole file ("Failed to parse ("-") as a i32"),
//! which took discovery, and with it the whole node, down. Here one line
//! that cannot be read is reported with its number and the other lines
//! still count.
//!
//! `/proc/modules` (kernel/module/procfs.c, `m_show`): name, size, the
//! reference count (`-` without module unloading; negative while a module
//! is being unloaded or torn down), the modules using it (`a,b,` or `-`),
//! the state (`Live`, `Loading`, `Unloading`), the address, and the taint
//! flags in parentheses.
//!
//! `/proc/driver/nvidia/capabilities/**` and `/proc/driver/nvidia/params`:
//! `Key: value` lines; the device node minor, mode, owner and whether the
//! driver lets the node be changed (`DeviceFileModify`,
//! `ModifyDeviceFiles`), as nvidia-modprobe reads them.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

/// A module's reference count as `/proc/modules` shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", tag = "kind", content = "value")]
pub enum RefCount {
    /// A count (negative while the module is going away).
    Count(i32),
    /// `-`: the kernel does not count (built without module unloading, so
    /// no module can ever be unloaded).
    Untracked,
}

impl RefCount {
    /// The count, where the kernel keeps one.
    pub fn count(self) -> Option<i32> {
        match self {
            RefCount::Count(n) => Some(n),
            RefCount::Untracked => None,
        }
    }
}

impl fmt::Display for RefCount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RefCount::Count(n) => write!(f, "{n}"),
            RefCount::Untracked => f.write_str("-"),
        }
    }
}

/// A module's state column.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModuleState {
    Live,
    Loading,
    Unloading,
    /// A word this parser does not know (kept, not refused).
    Other(String),
}

/// One line of `/proc/modules`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcModule {
    pub name: String,
    pub size: u64,
    pub refcount: RefCount,
    /// Modules using this one, sorted.
    pub used_by: Vec<String>,
    pub state: ModuleState,
}

/// A line that could not be read, by its 1-based number.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BadLine {
    pub line: usize,
    pub message: String,
}

impl fmt::Display for BadLine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}: {}", self.line, self.message)
    }
}

/// `/proc/modules`, read line by line: the modules that could be read, by
/// name, and the lines that could not.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProcModules {
    pub modules: BTreeMap<String, ProcModule>,
    pub bad_lines: Vec<BadLine>,
}

/// Parses the whole of `/proc/modules`. Never fails: a line that cannot be
/// read is in [`ProcModules::bad_lines`].
pub fn parse_modules(text: &str) -> ProcModules {
    let mut out = ProcModules::default();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match parse_module_line(line) {
            Ok(m) => {
                out.modules.insert(m.name.clone(), m);
            }
            Err(message) => out.bad_lines.push(BadLine {
                line: i + 1,
                message,
            }),
        }
    }
    out
}

/// Parses one line of `/proc/modules`; the error says which field is wrong.
pub fn parse_module_line(line: &str) -> Result<ProcModule, String> {
    let mut fields = line.split_ascii_whitespace();
    let mut next = |what: &str| {
        fields
            .next()
            .ok_or_else(|| format!("{} has no {what} field", shorten(line)))
    };
    let name = next("name")?;
    if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    {
        return Err(format!("{:?} is not a module name", shorten(name)));
    }
    let size_text = next("size")?;
    let size = size_text
        .parse::<u64>()
        .map_err(|_| format!("{name}: size {:?} is not a number", shorten(size_text)))?;
    let refcount_text = next("reference count")?;
    let refcount = if refcount_text == "-" {
        RefCount::Untracked
    } else {
        RefCount::Count(refcount_text.parse::<i32>().map_err(|_| {
            format!(
                "{name}: reference count {:?} is neither a number nor \"-\"",
                shorten(refcount_text)
            )
        })?)
    };
    let used_text = next("used-by")?;
    let mut used_by: Vec<String> = if used_text == "-" {
        Vec::new()
    } else {
        used_text
            .split(',')
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect()
    };
    used_by.sort();
    // The state is there since Linux 2.6; be lenient where it is not.
    let state = match fields.next() {
        None | Some("Live") => ModuleState::Live,
        Some("Loading") => ModuleState::Loading,
        Some("Unloading") => ModuleState::Unloading,
        Some(other) => ModuleState::Other(shorten(other)),
    };
    Ok(ProcModule {
        name: name.to_string(),
        size,
        refcount,
        used_by,
        state,
    })
}

/// `/proc/devices`' character majors, by name, and the lines of that
/// section that could not be read. A name may have several majors (real
/// hosts list `infiniband_verbs` twice); the first is kept, as the tools
/// that look majors up by name do.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProcDevices {
    pub char_majors: BTreeMap<String, u32>,
    pub bad_lines: Vec<BadLine>,
}

/// Parses `/proc/devices`: the `Character devices:` section, `<major>
/// <name>` per line, up to the next section.
pub fn parse_devices(text: &str) -> ProcDevices {
    let mut out = ProcDevices::default();
    let mut in_char = false;
    for (i, line) in text.lines().enumerate() {
        let t = line.trim();
        if t.is_empty() {
            continue;
        }
        if t.ends_with(':') {
            in_char = t == "Character devices:";
            continue;
        }
        if !in_char {
            continue;
        }
        let parsed = t
            .split_once(char::is_whitespace)
            .and_then(|(m, n)| Some((m.parse::<u32>().ok()?, n.trim())));
        match parsed {
            Some((major, name)) if !name.is_empty() => {
                out.char_majors.entry(name.to_string()).or_insert(major);
            }
            _ => out.bad_lines.push(BadLine {
                line: i + 1,
                message: format!("{:?} is not `<major> <name>`", shorten(t)),
            }),
        }
    }
    out
}

/// One file of `/proc/driver/nvidia/capabilities/**` (or
/// `nvidia-nvlink/capabilities/*`): the device node the driver means for
/// the capability.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CapabilityFile {
    /// `/dev/nvidia-caps/nvidia-cap<minor>`.
    pub minor: u32,
    /// Permission bits (`DeviceFileMode: 256` is 0400).
    pub mode: u32,
    /// `DeviceFileModify: 0`: the driver leaves the node to the
    /// administrator; nothing may create or change it.
    pub modify: bool,
}

/// Parses a capability file; the error names the missing or bad key.
pub fn parse_capability(text: &str) -> Result<CapabilityFile, String> {
    let kv = key_values(text);
    let num = |k: &str| -> Result<u32, String> {
        let v = kv.get(k).ok_or_else(|| format!("no {k} line"))?;
        v.parse::<u32>()
            .map_err(|_| format!("{k}: {:?} is not a number", shorten(v)))
    };
    let mode = num("DeviceFileMode")?;
    if mode > 0o7777 {
        return Err(format!("DeviceFileMode: {mode} is not a permission mode"));
    }
    Ok(CapabilityFile {
        minor: num("DeviceFileMinor")?,
        mode,
        // nvidia-modprobe treats a missing key as "may modify".
        modify: kv.get("DeviceFileModify").is_none_or(|v| v.trim() != "0"),
    })
}

/// What `/proc/driver/nvidia/params` says of `/dev/nvidia*` and
/// `/dev/nvidiactl`: their mode and owner, and whether anyone but the
/// administrator may make or change them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceFileParams {
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// `ModifyDeviceFiles: 0`: leave the nodes alone.
    pub modify: bool,
}

impl Default for DeviceFileParams {
    /// The driver's defaults (`NVreg_DeviceFileMode=0666`, root:root,
    /// `NVreg_ModifyDeviceFiles=1`), for a driver that publishes no params.
    fn default() -> Self {
        DeviceFileParams {
            mode: 0o666,
            uid: 0,
            gid: 0,
            modify: true,
        }
    }
}

/// Parses `/proc/driver/nvidia/params`. A key that is missing keeps the
/// driver's default; one that is there but not a number is an error naming it.
pub fn parse_params(text: &str) -> Result<DeviceFileParams, String> {
    let kv = key_values(text);
    let mut p = DeviceFileParams::default();
    let num = |k: &str| -> Result<Option<u32>, String> {
        kv.get(k)
            .map(|v| {
                v.parse::<u32>()
                    .map_err(|_| format!("{k}: {:?} is not a number", shorten(v)))
            })
            .transpose()
    };
    if let Some(m) = num("DeviceFileMode")? {
        if m > 0o7777 {
            return Err(format!("DeviceFileMode: {m} is not a permission mode"));
        }
        p.mode = m;
    }
    if let Some(u) = num("DeviceFileUID")? {
        p.uid = u;
    }
    if let Some(g) = num("DeviceFileGID")? {
        p.gid = g;
    }
    if let Some(m) = num("ModifyDeviceFiles")? {
        p.modify = m != 0;
    }
    Ok(p)
}

/// `Key: value` lines; the first of a repeated key wins.
fn key_values(text: &str) -> BTreeMap<&str, &str> {
    let mut kv = BTreeMap::new();
    for line in text.lines() {
        if let Some((k, v)) = line.split_once(':') {
            kv.entry(k.trim()).or_insert(v.trim());
        }
    }
    kv
}

/// At most 64 characters of `s`, for messages about hostile input.
fn shorten(s: &str) -> String {
    if s.chars().count() <= 64 {
        s.to_string()
    } else {
        let mut t: String = s.chars().take(61).collect();
        t.push_str("...");
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The real H100 host's `/proc/modules` (kernel without module unloading).
    const REAL: &str = "nvidia_uvm 1830912 - - Live 0xffffffffc080c000 (O)\nnvidia 14299136 - - Live 0xffffffffc0400000 (O)\n";

    #[test]
    fn a_kernel_without_module_unloading() {
        let m = parse_modules(REAL);
        assert!(m.bad_lines.is_empty(), "{:?}", m.bad_lines);
        assert_eq!(m.modules["nvidia"].refcount, RefCount::Untracked);
        assert_eq!(m.modules["nvidia_uvm"].size, 1830912);
        assert!(m.modules["nvidia"].used_by.is_empty());
        assert_eq!(m.modules["nvidia"].state, ModuleState::Live);
    }

    #[test]
    fn counts_users_states_and_negative_counts() {
        let text = "nvidia 56524800 2 nvidia_uvm,nvidia_modeset, Live 0x0000000000000000 (POE)\n\
                    nvidia_drm 90112 -1 - Unloading 0x0\n\
                    gone 4096 -2 - Unloading 0x0 (E)\n\
                    new 4096 0 - Loading 0x0\n\
                    odd 4096 0 - Weird 0x0\n";
        let m = parse_modules(text);
        assert!(m.bad_lines.is_empty(), "{:?}", m.bad_lines);
        assert_eq!(m.modules["nvidia"].refcount, RefCount::Count(2));
        assert_eq!(
            m.modules["nvidia"].used_by,
            ["nvidia_modeset", "nvidia_uvm"]
        );
        assert_eq!(m.modules["nvidia_drm"].refcount, RefCount::Count(-1));
        assert_eq!(m.modules["nvidia_drm"].state, ModuleState::Unloading);
        assert_eq!(m.modules["gone"].refcount.count(), Some(-2));
        assert_eq!(m.modules["new"].state, ModuleState::Loading);
        assert_eq!(m.modules["odd"].state, ModuleState::Other("Weird".into()));
    }

    #[test]
    fn a_bad_line_is_named_and_the_others_still_count() {
        let text = "ext4 1003520 1 - Live 0x0\nnvidia 14299136 x - Live 0x0\n\nbroken\nnvidia_uvm 1830912 - - Live 0x0\n";
        let m = parse_modules(text);
        assert_eq!(m.modules.keys().collect::<Vec<_>>(), ["ext4", "nvidia_uvm"]);
        assert_eq!(m.bad_lines.len(), 2);
        assert_eq!(m.bad_lines[0].line, 2);
        assert!(
            m.bad_lines[0].message.contains("reference count \"x\""),
            "{}",
            m.bad_lines[0]
        );
        assert_eq!(m.bad_lines[1].line, 4);
        assert!(m.bad_lines[1].message.contains("no size field"));
    }

    #[test]
    fn devices_with_repeated_majors_and_names() {
        let text = "Character devices:\n  1 mem\n  4 /dev/vc/0\n195 nvidia\n195 nvidiactl\n231 infiniband_verbs\n238 nvidia-uvm\n244 infiniband_verbs\nnonsense\n\nBlock devices:\n  7 loop\n259 blkext\n";
        let d = parse_devices(text);
        assert_eq!(d.char_majors["nvidia"], 195);
        assert_eq!(d.char_majors["nvidiactl"], 195);
        assert_eq!(d.char_majors["nvidia-uvm"], 238);
        assert_eq!(d.char_majors["infiniband_verbs"], 231);
        assert_eq!(d.char_majors["/dev/vc/0"], 4);
        assert!(!d.char_majors.contains_key("loop"));
        assert_eq!(d.bad_lines.len(), 1);
        assert_eq!(d.bad_lines[0].line, 9);
    }

    #[test]
    fn capability_files() {
        let c = parse_capability("DeviceFileMinor: 1\nDeviceFileMode: 256\nDeviceFileModify: 1\n")
            .unwrap();
        assert_eq!(
            c,
            CapabilityFile {
                minor: 1,
                mode: 0o400,
                modify: true
            }
        );
        let c = parse_capability("DeviceFileMinor: 2\nDeviceFileMode: 292\nDeviceFileModify: 0\n")
            .unwrap();
        assert_eq!((c.mode, c.modify), (0o444, false));
        let e = parse_capability("DeviceFileMode: 256\n").unwrap_err();
        assert_eq!(e, "no DeviceFileMinor line");
        let e = parse_capability("DeviceFileMinor: 1\nDeviceFileMode: 99999\n").unwrap_err();
        assert!(e.contains("not a permission mode"), "{e}");
    }

    #[test]
    fn params_and_their_defaults() {
        let p = parse_params("ModifyDeviceFiles: 1\nDeviceFileUID: 0\nDeviceFileGID: 44\nDeviceFileMode: 432\nRegistryDwords: \"\"\n").unwrap();
        assert_eq!(
            p,
            DeviceFileParams {
                mode: 0o660,
                uid: 0,
                gid: 44,
                modify: true
            }
        );
        assert_eq!(parse_params("").unwrap(), DeviceFileParams::default());
        assert!(!parse_params("ModifyDeviceFiles: 0\n").unwrap().modify);
        assert!(
            parse_params("DeviceFileGID: video\n")
                .unwrap_err()
                .contains("DeviceFileGID")
        );
    }

    /// Why this parser exists: procfs-core refuses the real host's file
    /// whole. When this starts failing, procfs-core reads it, and the
    /// parser here may go.
    #[test]
    fn procfs_core_refuses_the_real_hosts_proc_modules() {
        use procfs_core::FromRead;
        let err = procfs_core::KernelModules::from_read(REAL.as_bytes()).unwrap_err();
        assert!(err.to_string().contains("\"-\""), "{err}");
    }

    fn count() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("-".to_string()),
            (-3i32..100_000).prop_map(|n| n.to_string()),
        ]
    }

    proptest! {
        /// Every well-formed line is read back exactly, `-` and negative
        /// counts included, whatever the other lines hold.
        #[test]
        fn well_formed_lines_read_back(
            mods in proptest::collection::vec(("[a-z_][a-z0-9_]{0,20}", 0u64..u64::MAX, count(), proptest::collection::vec("[a-z_]{1,8}", 0..4), prop_oneof![Just("Live"), Just("Loading"), Just("Unloading")]), 0..8),
            junk in proptest::collection::vec("[ -~]{0,40}", 0..4),
        ) {
            let mut text = String::new();
            for (i, (name, size, rc, users, state)) in mods.iter().enumerate() {
                let used = if users.is_empty() { "-".to_string() } else { format!("{},", users.join(",")) };
                text.push_str(&format!("{name} {size} {rc} {used} {state} 0xffffffffc0400000 (O)\n"));
                if let Some(j) = junk.get(i) {
                    text.push_str(j);
                    text.push('\n');
                }
            }
            let parsed = parse_modules(&text);
            for (name, size, rc, users, _) in &mods {
                // A junk line may itself read as a module of the same name.
                if text.lines().filter(|l| l.split_ascii_whitespace().next() == Some(name.as_str())).count() > 1 {
                    continue;
                }
                let m = parsed.modules.get(name).expect("a well-formed line is read");
                prop_assert_eq!(m.size, *size);
                prop_assert_eq!(m.refcount.to_string(), rc.clone());
                let mut u = users.clone();
                u.sort();
                prop_assert_eq!(&m.used_by, &u);
            }
        }

        /// Nothing panics, and every line is either a module or a bad line.
        #[test]
        fn any_text_is_read_without_panicking(text in "[ -~\n\t]{0,400}") {
            let p = parse_modules(&text);
            let lines = text.lines().filter(|l| !l.trim().is_empty()).count();
            prop_assert!(p.modules.len() + p.bad_lines.len() <= lines);
            prop_assert!(p.bad_lines.len() <= lines);
            let _ = parse_devices(&text);
            let _ = parse_capability(&text);
            let _ = parse_params(&text);
        }
    }
}
