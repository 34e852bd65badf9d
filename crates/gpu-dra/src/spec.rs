//! The policy's section DRA owns: `spec.dra`, and which of the node's GPUs
//! it selects. The agent's policy assembles it; nothing here reads the host.

use gpu_model::inventory::{Gpu, Inventory};
use hostlib::pci::PciAddress;
use serde::{Deserialize, Serialize};

/// `spec.dra`: the DRA kubelet plugin (issue 31).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct DraSpec {
    /// Serve the kubelet's DRA plugin API for driver `gpu.nvidia.com`
    /// (default false).
    #[serde(default)]
    pub enabled: bool,
    /// The GPUs DRA hands out, each by index (`"0"`), UUID or PCI bus ID;
    /// the device plugin keeps the others. Unset: every GPU, and then the
    /// device plugin must be off (`spec.devicePlugin.enabled: false`): the
    /// two never hand out the same GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpus: Option<Vec<String>>,
}

/// Why `spec.dra` cannot be used with the rest of the policy: the key and
/// the words.
pub fn check(spec: &DraSpec, device_plugin_enabled: bool) -> Result<(), (&'static str, String)> {
    if let Some(gpus) = &spec.gpus {
        if gpus.is_empty() {
            return Err((
                "spec.dra.gpus",
                "is empty: name the GPUs DRA hands out, or leave it unset for all of them".into(),
            ));
        }
        if let Some(bad) = gpus.iter().find(|s| s.trim().is_empty()) {
            return Err(("spec.dra.gpus", format!("{bad:?} names no GPU")));
        }
    }
    if spec.enabled && device_plugin_enabled && spec.gpus.is_none() {
        return Err((
            "spec.dra.enabled",
            "DRA and the device plugin would both hand out every GPU: turn the device plugin off (spec.devicePlugin.enabled: false), or give DRA its GPUs with spec.dra.gpus".into(),
        ));
    }
    Ok(())
}

/// Whether `selector` (an index, a UUID or a PCI bus ID) names `gpu`. PCI
/// bus IDs are compared as addresses (`00000000:2A:00.0` is `0000:2a:00.0`).
fn names(selector: &str, gpu: &Gpu) -> bool {
    let s = selector.trim();
    if let Ok(i) = s.parse::<u32>() {
        return gpu.index == Some(i);
    }
    if gpu
        .uuid
        .as_deref()
        .is_some_and(|u| u.eq_ignore_ascii_case(s))
    {
        return true;
    }
    s.parse::<PciAddress>().is_ok_and(|a| a == gpu.bus_id)
}

/// Which of `inv`'s GPUs are DRA's, by PCI address: none while DRA is off;
/// all when `spec.dra.gpus` is unset; else those a selector names.
/// Selectors that name no GPU of `inv` are returned too, to be reported.
pub fn dra_gpus(spec: &DraSpec, inv: &Inventory) -> (Vec<PciAddress>, Vec<String>) {
    if !spec.enabled {
        return (Vec::new(), Vec::new());
    }
    let Some(selectors) = &spec.gpus else {
        return (inv.gpus.iter().map(|g| g.bus_id).collect(), Vec::new());
    };
    let picked = inv
        .gpus
        .iter()
        .filter(|g| selectors.iter().any(|s| names(s, g)))
        .map(|g| g.bus_id)
        .collect();
    let unmatched = selectors
        .iter()
        .filter(|s| !inv.gpus.iter().any(|g| names(s, g)))
        .cloned()
        .collect();
    (picked, unmatched)
}

/// `inv` with only DRA's GPUs (`keep`) or only the others (`!keep`).
pub fn split(inv: &Inventory, dra: &[PciAddress], keep: bool) -> Inventory {
    let mut out = inv.clone();
    out.gpus.retain(|g| dra.contains(&g.bus_id) == keep);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inv() -> Inventory {
        let mut a = crate::claims::tests_support::gpu(0, "GPU-0aaa");
        a.bus_id = "0000:18:00.0".parse().unwrap();
        let mut b = crate::claims::tests_support::gpu(1, "GPU-1aaa");
        b.bus_id = "0000:2a:00.0".parse().unwrap();
        crate::claims::tests_support::inventory(vec![a, b])
    }

    fn addr(s: &str) -> PciAddress {
        s.parse().unwrap()
    }

    fn spec(gpus: Option<&[&str]>) -> DraSpec {
        DraSpec {
            enabled: true,
            gpus: gpus.map(|g| g.iter().map(|s| s.to_string()).collect()),
        }
    }

    #[test]
    fn dra_and_the_device_plugin_never_both_take_every_gpu() {
        let (key, why) = check(&spec(None), true).unwrap_err();
        assert_eq!(key, "spec.dra.enabled");
        assert!(why.contains("spec.dra.gpus"), "{why}");
        assert!(check(&spec(None), false).is_ok());
        assert!(check(&spec(Some(&["1"])), true).is_ok());
        assert_eq!(
            check(&spec(Some(&[])), true).unwrap_err().0,
            "spec.dra.gpus"
        );
        assert_eq!(
            check(&spec(Some(&[" "])), false).unwrap_err().0,
            "spec.dra.gpus"
        );
        // Off: nothing to split.
        assert!(check(&DraSpec::default(), true).is_ok());
    }

    #[test]
    fn selectors_name_gpus_by_index_uuid_or_pci_address() {
        let inv = inv();
        for sel in [
            "1",
            "GPU-1aaa",
            "gpu-1AAA",
            "00000000:2A:00.0",
            "0000:2a:00.0",
        ] {
            let (picked, unmatched) = dra_gpus(&spec(Some(&[sel])), &inv);
            assert_eq!(picked, vec![addr("0000:2a:00.0")], "{sel}");
            assert!(unmatched.is_empty(), "{sel}");
        }
        let (picked, unmatched) = dra_gpus(&spec(Some(&["0", "GPU-9"])), &inv);
        assert_eq!(picked, vec![addr("0000:18:00.0")]);
        assert_eq!(unmatched, vec!["GPU-9".to_string()]);
        assert_eq!(dra_gpus(&spec(None), &inv).0.len(), 2);
        let off = DraSpec {
            enabled: false,
            ..spec(None)
        };
        assert!(dra_gpus(&off, &inv).0.is_empty());
    }

    #[test]
    fn split_gives_each_side_only_its_gpus() {
        let inv = inv();
        let dra = split(&inv, &[addr("0000:2a:00.0")], true);
        let plugin = split(&inv, &[addr("0000:2a:00.0")], false);
        assert_eq!(
            dra.gpus.iter().map(|g| g.index).collect::<Vec<_>>(),
            [Some(1)]
        );
        assert_eq!(
            plugin.gpus.iter().map(|g| g.index).collect::<Vec<_>>(),
            [Some(0)]
        );
    }
}
