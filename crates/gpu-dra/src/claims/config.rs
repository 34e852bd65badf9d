//! The opaque configurations of a claim's allocation (NVIDIA's `GpuConfig`
//! / `MigDeviceConfig`, `resource.nvidia.com/v1beta1`): which are
//! understood, and refusing what this node cannot apply rather than
//! preparing without it.
//!
//! Sharing, as NVIDIA's driver reads it (`sharing.strategy`):
//! - `TimeSlicing` with the `Default` interval (or none): taken. The GPU's
//!   own time-slicing is what shares it between the containers of the
//!   claim's pods; nothing is changed on the GPU.
//! - `TimeSlicing` with `Short`, `Medium` or `Long` (`GpuConfig`): the
//!   time slice of the claim's GPUs is set before its spec is written
//!   (NVIDIA's driver runs `nvidia-smi compute-policy --set-timeslice`,
//!   [`super::timeslice`]) and set back to `Default` on unprepare. A
//!   claim's configurations must agree on the interval. On MIG devices
//!   (`MigDeviceConfig`), which take no time slice: refused, naming why.
//! - `MPS` (`GpuConfig` and `MigDeviceConfig`): a control daemon per
//!   claim, with the claim's `mpsConfig` ([`super::sharing`]), over all of
//!   its devices' UUIDs (GPUs and MIG devices alike, as NVIDIA's driver
//!   does). The claim's configurations must agree: one daemon serves all
//!   of its devices.

use serde_json::Value;

use super::allocation::OpaqueConfig;
use super::interval::TimeSliceInterval;
use super::sharing::{self, MpsSettings};

/// The API version of NVIDIA's configuration kinds.
pub const CONFIG_API_VERSION: &str = "resource.nvidia.com/v1beta1";
const KINDS: &[&str] = &["GpuConfig", "MigDeviceConfig"];
const FIELDS: &[&str] = &["apiVersion", "kind", "sharing"];
const SHARING_FIELDS: &[&str] = &["strategy", "timeSlicingConfig", "mpsConfig"];

/// How a claim's devices are shared, as its configuration says.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Sharing {
    /// No sharing configured.
    #[default]
    None,
    /// Time-slicing at this interval (`Default`: the GPU's own, nothing
    /// changed).
    TimeSlicing { interval: TimeSliceInterval },
    /// An MPS control daemon for the claim's GPUs, with these settings.
    Mps(MpsSettings),
}

/// Checks every configuration and says how the claim is shared: `Err`
/// says which configuration and why.
pub fn check(configs: &[OpaqueConfig]) -> Result<Sharing, String> {
    let mut sharing = Sharing::None;
    let mut mps: Option<(usize, MpsSettings)> = None;
    let mut others: Option<usize> = None;
    let mut sliced: Option<(usize, TimeSliceInterval)> = None;
    for (i, c) in configs.iter().enumerate() {
        let at = |why: String| format!("opaque configuration #{i} ({:?}): {why}", c.source);
        let Some(obj) = c.parameters.as_object() else {
            return Err(at("parameters are not an object".into()));
        };
        let api = obj.get("apiVersion").and_then(|v| v.as_str()).unwrap_or("");
        let kind = obj.get("kind").and_then(|v| v.as_str()).unwrap_or("");
        if api != CONFIG_API_VERSION || !KINDS.contains(&kind) {
            return Err(at(format!(
                "{api:?} {kind:?} is not {CONFIG_API_VERSION} {}",
                KINDS.join(" or ")
            )));
        }
        if let Some(unknown) = obj.keys().find(|k| !FIELDS.contains(&k.as_str())) {
            return Err(at(format!("unknown field {unknown:?} in {kind}")));
        }
        match obj.get("sharing") {
            None | Some(Value::Null) => {
                others.get_or_insert(i);
            }
            Some(s) => match sharing_of(kind, s).map_err(at)? {
                Sharing::Mps(m) => match &mps {
                    Some((first, seen)) if *seen != m => {
                        return Err(at(format!(
                            "its mpsConfig differs from configuration #{first}'s; gpu-agent runs one MPS control daemon per claim, so a claim's configurations must agree"
                        )));
                    }
                    Some(_) => {}
                    None => mps = Some((i, m)),
                },
                other => {
                    others.get_or_insert(i);
                    if let Sharing::TimeSlicing { interval } = other {
                        match sliced {
                            Some((first, seen)) if seen != interval => {
                                return Err(at(format!(
                                    "it asks for time-slicing with interval {interval} and configuration #{first} with {seen}; a GPU has one time slice, so a claim's configurations must agree"
                                )));
                            }
                            Some(_) => {}
                            None => sliced = Some((i, interval)),
                        }
                        sharing = other;
                    }
                }
            },
        }
    }
    match (mps, others) {
        (Some((m, _)), Some(o)) => Err(format!(
            "opaque configuration #{m} asks for MPS and #{o} does not; gpu-agent runs one MPS control daemon for all of a claim's devices, so a claim's configurations must agree"
        )),
        (Some((_, settings)), None) => Ok(Sharing::Mps(settings)),
        (None, _) => Ok(sharing),
    }
}

/// `sharing` of a `kind` configuration.
fn sharing_of(kind: &str, s: &Value) -> Result<Sharing, String> {
    let Some(obj) = s.as_object() else {
        return Err(format!("{kind}.sharing is not an object"));
    };
    if let Some(unknown) = obj.keys().find(|k| !SHARING_FIELDS.contains(&k.as_str())) {
        return Err(format!("unknown field {unknown:?} in {kind}.sharing"));
    }
    let strategy = obj.get("strategy").and_then(|v| v.as_str()).unwrap_or("");
    match strategy {
        "TimeSlicing" => {
            if obj.get("mpsConfig").is_some_and(|v| !v.is_null()) {
                return Err(format!(
                    "{kind}.sharing.mpsConfig cannot go with strategy TimeSlicing"
                ));
            }
            let name = match obj.get("timeSlicingConfig") {
                None | Some(Value::Null) => "Default",
                Some(t) => {
                    let Some(t) = t.as_object() else {
                        return Err(format!("{kind}.sharing.timeSlicingConfig is not an object"));
                    };
                    if let Some(unknown) = t.keys().find(|k| k.as_str() != "interval") {
                        return Err(format!(
                            "unknown field {unknown:?} in {kind}.sharing.timeSlicingConfig"
                        ));
                    }
                    match t.get("interval") {
                        None | Some(Value::Null) => "Default",
                        Some(v) => v.as_str().unwrap_or("?"),
                    }
                }
            };
            let Some(interval) = TimeSliceInterval::parse(name) else {
                let all: Vec<&str> = TimeSliceInterval::ALL.iter().map(|i| i.name()).collect();
                return Err(format!(
                    "{kind}.sharing.timeSlicingConfig.interval {name:?} is not one of {}",
                    all.join(", ")
                ));
            };
            if kind == "MigDeviceConfig" && interval != TimeSliceInterval::Default {
                return Err(format!(
                    "{kind} asks for time-slicing with interval {interval}, and MIG devices take no time slice (only full GPUs do): use interval Default"
                ));
            }
            Ok(Sharing::TimeSlicing { interval })
        }
        "MPS" => {
            if obj.get("timeSlicingConfig").is_some_and(|v| !v.is_null()) {
                return Err(format!(
                    "{kind}.sharing.timeSlicingConfig cannot go with strategy MPS"
                ));
            }
            Ok(Sharing::Mps(sharing::parse_mps_config(
                kind,
                obj.get("mpsConfig"),
            )?))
        }
        other => Err(format!(
            "{kind}.sharing.strategy {other:?} is not TimeSlicing or MPS"
        )),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::super::allocation::ConfigSource;
    use super::*;

    fn cfg(parameters: serde_json::Value) -> OpaqueConfig {
        OpaqueConfig {
            source: ConfigSource::FromClaim,
            requests: Vec::new(),
            parameters,
        }
    }

    fn gpu(sharing: serde_json::Value) -> OpaqueConfig {
        cfg(json!({"apiVersion": CONFIG_API_VERSION, "kind": "GpuConfig", "sharing": sharing}))
    }

    #[test]
    fn plain_configs_pass_and_strangers_fail() {
        assert_eq!(check(&[]), Ok(Sharing::None));
        let plain = cfg(json!({"apiVersion": CONFIG_API_VERSION, "kind": "GpuConfig"}));
        assert_eq!(check(&[plain]), Ok(Sharing::None));
        let other = cfg(json!({"apiVersion": "example.com/v1", "kind": "GpuConfig"}));
        assert!(check(&[other]).unwrap_err().contains("example.com/v1"));
        let extra =
            cfg(json!({"apiVersion": CONFIG_API_VERSION, "kind": "MigDeviceConfig", "x": 1}));
        assert!(check(&[extra]).unwrap_err().contains("unknown field \"x\""));
        assert!(check(&[cfg(json!("text"))]).is_err());
    }

    #[test]
    fn time_slicing_at_the_default_interval_is_taken() {
        // NVIDIA's examples: no config, an empty one, Default spelled out.
        for s in [
            json!({"strategy": "TimeSlicing"}),
            json!({"strategy": "TimeSlicing", "timeSlicingConfig": {}}),
            json!({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Default"}}),
        ] {
            assert_eq!(
                check(&[gpu(s.clone())]),
                Ok(Sharing::TimeSlicing {
                    interval: TimeSliceInterval::Default
                }),
                "{s}"
            );
        }
        let mig = cfg(
            json!({"apiVersion": CONFIG_API_VERSION, "kind": "MigDeviceConfig",
            "sharing": {"strategy": "TimeSlicing"}}),
        );
        assert_eq!(
            check(&[mig]),
            Ok(Sharing::TimeSlicing {
                interval: TimeSliceInterval::Default
            })
        );
    }

    #[test]
    fn other_intervals_are_taken_on_gpus_and_must_agree() {
        for (name, interval) in [
            ("Short", TimeSliceInterval::Short),
            ("Medium", TimeSliceInterval::Medium),
            ("Long", TimeSliceInterval::Long),
        ] {
            let c =
                gpu(json!({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": name}}));
            assert_eq!(
                check(&[c.clone(), c]),
                Ok(Sharing::TimeSlicing { interval }),
                "{name}"
            );
        }
        assert_eq!(
            [
                TimeSliceInterval::Default,
                TimeSliceInterval::Short,
                TimeSliceInterval::Medium,
                TimeSliceInterval::Long
            ]
            .map(TimeSliceInterval::int),
            [0, 1, 2, 3]
        );
        let short =
            gpu(json!({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Short"}}));
        let long =
            gpu(json!({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}));
        let e = check(&[short, long]).unwrap_err();
        assert!(
            e.contains("#1") && e.contains("interval Long and configuration #0 with Short"),
            "{e}"
        );
        let mig_long = check(&[cfg(
            json!({"apiVersion": CONFIG_API_VERSION, "kind": "MigDeviceConfig",
            "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}}),
        )])
        .unwrap_err();
        assert!(
            mig_long.contains("MigDeviceConfig asks for time-slicing with interval Long, and MIG devices take no time slice"),
            "{mig_long}"
        );
    }

    #[test]
    fn what_is_not_built_or_not_understood_is_refused_naming_it() {
        let bad = check(&[gpu(
            json!({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Forever"}}),
        )])
        .unwrap_err();
        assert!(
            bad.contains("\"Forever\" is not one of Default, Short, Medium, Long"),
            "{bad}"
        );
        let mps_ts =
            check(&[gpu(json!({"strategy": "MPS", "timeSlicingConfig": {}}))]).unwrap_err();
        assert!(
            mps_ts.contains("timeSlicingConfig cannot go with strategy MPS"),
            "{mps_ts}"
        );
        let mixed = check(&[gpu(json!({"strategy": "TimeSlicing", "mpsConfig": {}}))]).unwrap_err();
        assert!(
            mixed.contains("mpsConfig cannot go with strategy TimeSlicing"),
            "{mixed}"
        );
        let unknown = check(&[gpu(json!({"strategy": "Spatial"}))]).unwrap_err();
        assert!(
            unknown.contains("\"Spatial\" is not TimeSlicing or MPS"),
            "{unknown}"
        );
        let typo =
            check(&[gpu(json!({"strategy": "TimeSlicing", "timeSlicing": {}}))]).unwrap_err();
        assert!(
            typo.contains("unknown field \"timeSlicing\" in GpuConfig.sharing"),
            "{typo}"
        );
    }

    #[test]
    fn mps_is_taken_with_its_settings_when_the_configs_agree() {
        let mps =
            gpu(json!({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 30}}));
        let want = Sharing::Mps(MpsSettings {
            default_active_thread_percentage: Some(30),
            ..Default::default()
        });
        assert_eq!(check(std::slice::from_ref(&mps)), Ok(want.clone()));
        assert_eq!(check(&[mps.clone(), mps.clone()]), Ok(want));
        assert_eq!(
            check(&[gpu(json!({"strategy": "MPS"}))]),
            Ok(Sharing::Mps(MpsSettings::default()))
        );
        let other =
            gpu(json!({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 60}}));
        let e = check(&[mps.clone(), other]).unwrap_err();
        assert!(
            e.contains("#1") && e.contains("differs from configuration #0's"),
            "{e}"
        );
        let plain = cfg(json!({"apiVersion": CONFIG_API_VERSION, "kind": "GpuConfig"}));
        let e = check(&[plain, mps.clone()]).unwrap_err();
        assert!(e.contains("#1 asks for MPS and #0 does not"), "{e}");
        let e = check(&[mps, gpu(json!({"strategy": "TimeSlicing"}))]).unwrap_err();
        assert!(e.contains("#0 asks for MPS and #1 does not"), "{e}");
    }

    #[test]
    fn mps_on_mig_devices_and_multi_user_are_taken() {
        let sharing = json!({"strategy": "MPS",
            "mpsConfig": {"multiUser": true, "defaultActiveThreadPercentage": 50}});
        let mig = cfg(
            json!({"apiVersion": CONFIG_API_VERSION, "kind": "MigDeviceConfig",
            "sharing": sharing.clone()}),
        );
        let want = Sharing::Mps(MpsSettings {
            default_active_thread_percentage: Some(50),
            multi_user: true,
            ..Default::default()
        });
        assert_eq!(check(std::slice::from_ref(&mig)), Ok(want.clone()));
        // A claim of GPUs and MIG devices: one daemon over all of them.
        assert_eq!(check(&[gpu(sharing), mig.clone()]), Ok(want));
        let single =
            gpu(json!({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}}));
        let e = check(&[mig, single]).unwrap_err();
        assert!(
            e.contains("its mpsConfig differs from configuration #0's"),
            "{e}"
        );
    }
}
