//! A GPU's brand and architecture from NVML (`nvmlDeviceGetBrand`,
//! `nvmlDeviceGetArchitecture`), spelled as NVIDIA's DRA driver publishes
//! them (gpu-model's [`nvlib`](gpu_model::nvlib) tables, go-nvlib's).
//!
//! Neither is needed to use the GPU: a call that fails, or a code with no
//! name, leaves the fact out and says so in the GPU's notes (discovery's
//! warnings), never failing the GPU.

use gpu_model::nvlib::{architecture_name, brand_name};
use nvml_wrapper::error::NvmlError;

/// The GPU's brand and architecture; what could not be read is `None`, with
/// a note.
pub(super) fn brand_and_architecture(
    device: &nvml_wrapper::Device<'_>,
    notes: &mut Vec<String>,
) -> (Option<String>, Option<String>) {
    let brand = named(
        "brand",
        "nvmlDeviceGetBrand",
        device.brand().map(|b| b.as_c()),
        brand_name,
        notes,
    );
    let architecture = named(
        "architecture",
        "nvmlDeviceGetArchitecture",
        device.architecture().map(|a| a.as_c()),
        architecture_name,
        notes,
    );
    (brand, architecture)
}

/// The name of the code NVML answered `call` with.
fn named(
    what: &str,
    call: &str,
    answer: Result<u32, NvmlError>,
    name: fn(u32) -> Option<&'static str>,
    notes: &mut Vec<String>,
) -> Option<String> {
    let code = match answer {
        Ok(code) => code,
        // nvml-wrapper's enums know fewer codes than NVML (its architectures
        // stop at Blackwell, without Orin): the code it could not place.
        Err(NvmlError::UnexpectedVariant(code)) => code,
        Err(e) => {
            notes.push(format!(
                "NVML did not give the GPU's {what} ({call}: {e}): its DRA device has no {what} attribute"
            ));
            return None;
        }
    };
    match name(code) {
        Some(n) => Some(n.to_string()),
        None => {
            notes.push(format!(
                "NVML's {what} code {code} ({call}) has no name in NVIDIA's DRA driver: its DRA device has no {what} attribute"
            ));
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name_of(
        what: &str,
        answer: Result<u32, NvmlError>,
        name: fn(u32) -> Option<&'static str>,
    ) -> (Option<String>, Vec<String>) {
        let mut notes = Vec::new();
        let n = named(what, "nvmlDeviceGetX", answer, name, &mut notes);
        (n, notes)
    }

    #[test]
    fn codes_are_named_as_nvidias_dra_driver_names_them() {
        use nvml_wrapper::enum_wrappers::device::Brand;
        use nvml_wrapper::enums::device::DeviceArchitecture;
        assert_eq!(
            name_of("brand", Ok(Brand::Nvidia.as_c()), brand_name),
            (Some("Nvidia".into()), vec![])
        );
        assert_eq!(
            name_of("brand", Ok(Brand::Tesla.as_c()), brand_name),
            (Some("Tesla".into()), vec![])
        );
        assert_eq!(
            name_of(
                "architecture",
                Ok(DeviceArchitecture::Hopper.as_c()),
                architecture_name
            ),
            (Some("Hopper".into()), vec![])
        );
        // nvml-wrapper spells it "Ada"; NVIDIA's driver "Ada Lovelace".
        assert_eq!(
            name_of(
                "architecture",
                Ok(DeviceArchitecture::Ada.as_c()),
                architecture_name
            ),
            (Some("Ada Lovelace".into()), vec![])
        );
        // NVML_DEVICE_ARCH_T23X, which nvml-wrapper cannot place.
        assert_eq!(
            name_of(
                "architecture",
                Err(NvmlError::UnexpectedVariant(11)),
                architecture_name
            ),
            (Some("Orin".into()), vec![])
        );
    }

    #[test]
    fn what_cannot_be_named_is_a_note_not_a_failure() {
        let (n, notes) = name_of("architecture", Err(NvmlError::GpuLost), architecture_name);
        assert_eq!(n, None);
        assert_eq!(
            notes,
            [
                "NVML did not give the GPU's architecture (nvmlDeviceGetX: device fell off the bus or has otherwise become inacessible): its DRA device has no architecture attribute"
            ]
        );
        let (n, notes) = name_of("brand", Err(NvmlError::UnexpectedVariant(17)), brand_name);
        assert_eq!(n, None);
        assert_eq!(
            notes,
            [
                "NVML's brand code 17 (nvmlDeviceGetX) has no name in NVIDIA's DRA driver: its DRA device has no brand attribute"
            ]
        );
    }
}
