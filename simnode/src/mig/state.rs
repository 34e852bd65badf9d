//! The MIG state of a simulated node, and the operations NVML offers on it
//! with NVML's rules and error codes: MIG mode (current and pending), GPU
//! instances at placements, compute instances inside them, and the MIG
//! devices they make.
//!
//! The fake libnvidia-ml keeps one [`NodeMig`] (in memory or in a JSON
//! file shared by processes); the simulated backend can keep another.
//!
//! What NVML does that we copy:
//! - MIG mode: on Hopper and newer a change applies at once while no GPU
//!   instance exists (disabling with instances is `IN_USE`); on Ampere it
//!   stays pending until the GPU is reset. A reset destroys every instance.
//! - A GPU instance takes its profile's placement (memory slices); an
//!   overlap, a profile at its instance count, or a second media-extension
//!   instance (the GPU has one OFA) is `INSUFFICIENT_RESOURCES`; a start the
//!   profile does not list is `INVALID_ARGUMENT`; a profile the GPU lacks,
//!   or any instance call while MIG is disabled, is `NOT_SUPPORTED`.
//! - Without a placement NVML picks one in the driver's order
//!   ([`GpuMigFacts::default_order`]).
//! - GPU-instance IDs name the memory slices ([`GpuMigFacts::gi_id_for`]);
//!   compute-instance IDs are the lowest free in their GPU instance.
//! - Destroying a GPU instance that still has compute instances is `IN_USE`.
//! - MIG device UUIDs are derived from (GPU UUID, GI ID, CI ID), so the same
//!   instance made again has the same UUID.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::{CiProfile, GiProfile, GpuMigFacts, facts_for, fallback};
use crate::desc::{GpuDesc, MigDeviceDesc, MigEngines, NodeDescription};

/// GPU-instance IDs a GPU can have (`/proc/driver/nvidia-caps/mig-minors`
/// lists `gi0` to `gi14`).
pub const MAX_GPU_INSTANCE_IDS: u32 = 15;
/// Compute-instance IDs a GPU instance can have (`ci0` to `ci7`).
pub const MAX_COMPUTE_INSTANCE_IDS: u32 = 8;

/// Why an operation was refused, as NVML says it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MigError {
    #[error("not supported")]
    NotSupported,
    #[error("invalid argument")]
    InvalidArgument,
    #[error("not found")]
    NotFound,
    #[error("in use")]
    InUse,
    #[error("insufficient resources")]
    InsufficientResources,
}

impl MigError {
    /// The `nvmlReturn_t` value.
    pub fn nvml_return(self) -> u32 {
        match self {
            MigError::InvalidArgument => 2,
            MigError::NotSupported => 3,
            MigError::NotFound => 6,
            MigError::InUse => 19,
            MigError::InsufficientResources => 23,
        }
    }
}

/// Every GPU's MIG state, in NVML index order.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct NodeMig {
    pub gpus: Vec<GpuMig>,
}

/// One GPU's MIG state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct GpuMig {
    /// The GPU's UUID (`GPU-…`), which MIG device UUIDs derive from.
    pub uuid: String,
    /// PCI device ID: which model's facts apply.
    pub device_id: u16,
    /// The GPU's memory: which of a device ID's tables applies where it
    /// has two ([`super::facts_for`]); 0: the first.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub memory_mib: u64,
    pub capable: bool,
    /// Ampere: a mode change waits for a reset.
    pub mode_change_needs_reset: bool,
    pub current: bool,
    pub pending: bool,
    /// When the pending mode was set, ns since the Unix epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_since_ns: Option<u64>,
    /// The keeper's mark of the GPU's reset (the fake NVML: its sysfs reset
    /// file's mtime, ns, as last seen); the state machine leaves it alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reset_mark_ns: Option<u64>,
    /// By ID.
    #[serde(default)]
    pub gpu_instances: Vec<GpuInstance>,
}

/// A GPU instance.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct GpuInstance {
    pub id: u32,
    /// `nvmlGpuInstanceProfileInfo_t.id`.
    pub profile_id: u32,
    /// Placement in memory slices.
    pub start: u32,
    pub size: u32,
    /// By ID.
    #[serde(default)]
    pub compute_instances: Vec<ComputeInstance>,
}

/// A compute instance: one MIG device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ComputeInstance {
    pub id: u32,
    /// `NVML_COMPUTE_INSTANCE_PROFILE_*`.
    pub profile_id: u32,
    /// Placement within the GPU instance.
    pub start: u32,
    pub size: u32,
    /// `MIG-…`.
    pub uuid: String,
    /// The numbers a node description gave this device, which win over the
    /// table's (so a description's inventory stays what it says).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub described: Option<DescribedDevice>,
}

/// A described MIG device's own numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct DescribedDevice {
    pub memory_mib: u64,
    pub multiprocessors: u32,
    pub engines: MigEngines,
}

/// A MIG device as NVML describes it (`nvmlDeviceGetAttributes` and the
/// GI/CI IDs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MigDevice {
    pub uuid: String,
    pub gi_id: u32,
    pub ci_id: u32,
    /// `nvmlGpuInstanceProfileInfo_t.id` of its GPU instance (what
    /// `nvmlGpuInstanceGetInfo` says as `profileId`).
    pub gi_profile_id: u32,
    /// Its GPU instance's placement start, in memory slices
    /// (`nvmlGpuInstanceGetInfo`'s `placement.start`).
    pub placement_start: u32,
    pub ci_profile_id: u32,
    pub gi_slices: u32,
    pub ci_slices: u32,
    pub memory_mib: u64,
    pub multiprocessors: u32,
    pub engines: MigEngines,
}

/// The UUID of the MIG device made of compute instance `ci` of GPU
/// instance `gi` on the GPU `gpu_uuid`: `MIG-` and a version-5-shaped UUID
/// from a hash of the three.
pub fn mig_uuid(gpu_uuid: &str, gi: u32, ci: u32) -> String {
    let d = Sha256::digest(format!("{gpu_uuid}/gi{gi}/ci{ci}").as_bytes());
    let mut b = [0u8; 16];
    b.copy_from_slice(&d[..16]);
    b[6] = (b[6] & 0x0f) | 0x50;
    b[8] = (b[8] & 0x3f) | 0x80;
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "MIG-{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Memory slices `start..start+size` as a bit mask.
fn mask(start: u32, size: u32) -> u32 {
    ((1u32 << size) - 1) << start
}

/// Starts for `profiles` (in their order) such that no two overlap, none
/// exceeds its profile's instance count and at most the GPU's OFAs are
/// taken; `None` when no such layout exists. Tries each profile's starts in
/// the driver's order, biggest instances first.
pub fn fit_layout(facts: &GpuMigFacts, profiles: &[&GiProfile]) -> Option<Vec<u32>> {
    for p in profiles {
        let same = profiles.iter().filter(|q| q.id == p.id).count() as u32;
        if same > p.instances {
            return None;
        }
    }
    let ofa: u32 = profiles.iter().map(|p| p.engines.ofa).sum();
    if ofa > facts.full().engines.ofa {
        return None;
    }
    let mut order: Vec<usize> = (0..profiles.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(profiles[i].placement_size));
    let mut starts = vec![0; profiles.len()];
    fn go(
        facts: &GpuMigFacts,
        profiles: &[&GiProfile],
        order: &[usize],
        used: u32,
        starts: &mut [u32],
    ) -> bool {
        let Some((&i, rest)) = order.split_first() else {
            return true;
        };
        let p = profiles[i];
        for s in facts.default_order(p) {
            let m = mask(s, p.placement_size);
            if used & m == 0 {
                starts[i] = s;
                if go(facts, profiles, rest, used | m, starts) {
                    return true;
                }
            }
        }
        false
    }
    go(facts, profiles, &order, 0, &mut starts).then_some(starts)
}

/// The profile a described MIG device is: its `profile` name when the
/// model has it, else the profile with its slices and the nearest memory
/// (without media extensions when both are as near).
fn described_profile(facts: &GpuMigFacts, m: &MigDeviceDesc) -> Option<&'static GiProfile> {
    if let Some(p) = m.profile.as_deref().and_then(|n| facts.by_name(n))
        && p.slices == m.gi_slices
    {
        return Some(p);
    }
    facts
        .profiles
        .iter()
        .filter(|p| p.slices == m.gi_slices)
        .min_by_key(|p| (p.memory_mib.abs_diff(m.memory_mib), !p.is_plain()))
}

impl NodeMig {
    /// The state a node description starts in.
    pub fn from_description(node: &NodeDescription) -> Result<Self, String> {
        node.gpus
            .iter()
            .enumerate()
            .map(|(i, g)| GpuMig::from_desc(g).map_err(|e| format!("gpus[{i}].mig.{e}")))
            .collect::<Result<Vec<_>, _>>()
            .map(|gpus| NodeMig { gpus })
    }

    /// Whether this state is about the GPUs of `node` (same UUIDs, same order).
    pub fn describes(&self, node: &NodeDescription) -> bool {
        self.gpus.len() == node.gpus.len()
            && self
                .gpus
                .iter()
                .zip(&node.gpus)
                .all(|(a, b)| a.uuid == b.uuid)
    }
}

impl GpuMig {
    /// The state a described GPU starts in: its MIG mode, and its MIG
    /// devices as GPU instances (one compute instance each) at placements
    /// that fit, keeping the description's UUIDs, IDs and numbers.
    /// Errors name the field (`devices[2]: …`).
    pub fn from_desc(g: &GpuDesc) -> Result<Self, String> {
        let mut gpu = GpuMig {
            uuid: g.uuid.clone(),
            device_id: g.device_id.0,
            memory_mib: g.memory_mib,
            capable: g.mig.capable,
            mode_change_needs_reset: g.compute_capability().is_none_or(|(major, _)| major < 9),
            current: g.mig.enabled,
            pending: g.mig.enabled,
            pending_since_ns: None,
            reset_mark_ns: None,
            gpu_instances: Vec::new(),
        };
        if !g.mig.enabled || g.mig.devices.is_empty() {
            return Ok(gpu);
        }
        let facts = gpu.facts();
        let known = facts_for(g.device_id.0, g.memory_mib).is_some();
        let mut profiles = Vec::new();
        let mut cis = Vec::new();
        for (k, m) in g.mig.devices.iter().enumerate() {
            if known
                && let Some(name) = &m.profile
                && facts.by_name(name).is_none_or(|p| p.slices != m.gi_slices)
            {
                return Err(format!(
                    "devices[{k}].profile: {name} with {} slices is not a profile of the {}",
                    m.gi_slices, facts.model
                ));
            }
            let p = described_profile(facts, m).ok_or_else(|| {
                format!(
                    "devices[{k}].giSlices: the {} has no {}-slice GPU instance",
                    facts.model, m.gi_slices
                )
            })?;
            let ci = facts
                .ci_profiles(p)
                .into_iter()
                .find(|c| c.slices == m.ci_slices())
                .ok_or_else(|| {
                    format!(
                        "devices[{k}].ciSlices: a {} GPU instance has no {}-slice compute instance",
                        p.name,
                        m.ci_slices()
                    )
                })?;
            profiles.push(p);
            cis.push(ci);
        }
        let starts = fit_layout(facts, &profiles).ok_or_else(|| {
            let names: Vec<&str> = profiles.iter().map(|p| p.name).collect();
            format!(
                "devices: {} do not fit on one {} together",
                names.join(" + "),
                facts.model
            )
        })?;
        for (k, ((m, p), (ci, start))) in g
            .mig
            .devices
            .iter()
            .zip(&profiles)
            .zip(cis.iter().zip(starts))
            .enumerate()
        {
            gpu.gpu_instances.push(GpuInstance {
                id: m.gi_id(k),
                profile_id: p.id,
                start,
                size: p.placement_size,
                compute_instances: vec![ComputeInstance {
                    id: m.ci_id(),
                    profile_id: ci.index,
                    start: ci.placements[0],
                    size: ci.placement_size,
                    uuid: m.uuid.clone(),
                    described: Some(DescribedDevice {
                        memory_mib: m.memory_mib,
                        multiprocessors: m.multiprocessors,
                        engines: m.engines(),
                    }),
                }],
            });
        }
        gpu.gpu_instances.sort_by_key(|gi| gi.id);
        Ok(gpu)
    }

    /// This GPU's model facts (an H100 80GB's when the table lacks the model).
    pub fn facts(&self) -> &'static GpuMigFacts {
        facts_for(self.device_id, self.memory_mib).unwrap_or_else(fallback)
    }

    fn need_capable(&self) -> Result<(), MigError> {
        if self.capable {
            Ok(())
        } else {
            Err(MigError::NotSupported)
        }
    }

    fn need_enabled(&self) -> Result<(), MigError> {
        self.need_capable()?;
        if self.current {
            Ok(())
        } else {
            Err(MigError::NotSupported)
        }
    }

    /// `nvmlDeviceSetMigMode`: `Ok(true)` when the mode is now `enable`,
    /// `Ok(false)` when it waits for a reset (NVML's activation status
    /// `RESET_REQUIRED`). `now_ns`: the time, kept to tell a later reset.
    pub fn set_mode(&mut self, enable: bool, now_ns: u64) -> Result<bool, MigError> {
        self.need_capable()?;
        if !self.mode_change_needs_reset {
            if enable != self.current && !self.gpu_instances.is_empty() {
                return Err(MigError::InUse);
            }
            self.current = enable;
            self.pending = enable;
            self.pending_since_ns = None;
            return Ok(true);
        }
        self.pending = enable;
        if self.pending == self.current {
            self.pending_since_ns = None;
            return Ok(true);
        }
        self.pending_since_ns = Some(now_ns);
        Ok(false)
    }

    /// A GPU reset: the pending mode applies and every instance is gone.
    pub fn reset(&mut self) {
        self.current = self.pending;
        self.pending_since_ns = None;
        self.gpu_instances.clear();
    }

    /// A mode change waits for a reset.
    pub fn reset_pending(&self) -> bool {
        self.current != self.pending
    }

    pub fn gpu_instance(&self, id: u32) -> Option<&GpuInstance> {
        self.gpu_instances.iter().find(|g| g.id == id)
    }

    fn gi_profile(&self, profile_id: u32) -> Result<&'static GiProfile, MigError> {
        self.facts().by_id(profile_id).ok_or(MigError::NotSupported)
    }

    /// Memory slices taken by GPU instances.
    fn used(&self) -> u32 {
        self.gpu_instances
            .iter()
            .fold(0, |m, g| m | mask(g.start, g.size))
    }

    /// Why a GPU instance of `p` at `start` cannot be made now, if it cannot.
    fn check_gi(&self, p: &GiProfile, start: u32) -> Result<(), MigError> {
        let facts = self.facts();
        let same = self
            .gpu_instances
            .iter()
            .filter(|g| g.profile_id == p.id)
            .count() as u32;
        let ofa: u32 = self
            .gpu_instances
            .iter()
            .filter_map(|g| facts.by_id(g.profile_id))
            .map(|q| q.engines.ofa)
            .sum();
        if same >= p.instances
            || self.used() & mask(start, p.placement_size) != 0
            || ofa + p.engines.ofa > facts.full().engines.ofa
        {
            return Err(MigError::InsufficientResources);
        }
        Ok(())
    }

    /// `nvmlDeviceCreateGpuInstance(WithPlacement)`: the new instance's ID.
    pub fn create_gpu_instance(
        &mut self,
        profile_id: u32,
        start: Option<u32>,
    ) -> Result<u32, MigError> {
        self.need_enabled()?;
        let p = self.gi_profile(profile_id)?;
        let start = match start {
            Some(s) => {
                if !p.placements.contains(&s) {
                    return Err(MigError::InvalidArgument);
                }
                self.check_gi(p, s)?;
                s
            }
            None => self
                .facts()
                .default_order(p)
                .into_iter()
                .find(|&s| self.check_gi(p, s).is_ok())
                .ok_or(MigError::InsufficientResources)?,
        };
        let taken = |id: u32| self.gpu_instances.iter().any(|g| g.id == id);
        let preferred = self.facts().gi_id_for(start, p.placement_size);
        let id = if !taken(preferred) {
            preferred
        } else {
            (0..MAX_GPU_INSTANCE_IDS)
                .find(|&i| !taken(i))
                .ok_or(MigError::InsufficientResources)?
        };
        self.gpu_instances.push(GpuInstance {
            id,
            profile_id,
            start,
            size: p.placement_size,
            compute_instances: Vec::new(),
        });
        self.gpu_instances.sort_by_key(|g| g.id);
        Ok(id)
    }

    /// `nvmlGpuInstanceDestroy`.
    pub fn destroy_gpu_instance(&mut self, id: u32) -> Result<(), MigError> {
        self.need_enabled()?;
        let k = self
            .gpu_instances
            .iter()
            .position(|g| g.id == id)
            .ok_or(MigError::NotFound)?;
        if !self.gpu_instances[k].compute_instances.is_empty() {
            return Err(MigError::InUse);
        }
        self.gpu_instances.remove(k);
        Ok(())
    }

    /// `nvmlDeviceGetGpuInstanceRemainingCapacity`: how many more instances
    /// of the profile could be made, one after another, from here.
    pub fn gpu_instance_capacity(&self, profile_id: u32) -> Result<u32, MigError> {
        self.need_enabled()?;
        self.gi_profile(profile_id)?;
        let mut probe = self.clone();
        let mut n = 0;
        while probe.create_gpu_instance(profile_id, None).is_ok() {
            n += 1;
        }
        Ok(n)
    }

    /// `profile`'s placements that are free now.
    pub fn free_placements(&self, profile_id: u32) -> Result<Vec<u32>, MigError> {
        let p = self.gi_profile(profile_id)?;
        Ok(p.placements
            .iter()
            .copied()
            .filter(|&s| self.check_gi(p, s).is_ok())
            .collect())
    }

    /// The compute-instance profiles of GPU instance `gi`.
    pub fn ci_profiles(&self, gi: u32) -> Result<Vec<CiProfile>, MigError> {
        self.need_enabled()?;
        let g = self.gpu_instance(gi).ok_or(MigError::NotFound)?;
        let p = self.gi_profile(g.profile_id)?;
        Ok(self.facts().ci_profiles(p))
    }

    fn ci_profile(&self, gi: u32, ci_profile_id: u32) -> Result<CiProfile, MigError> {
        self.ci_profiles(gi)?
            .into_iter()
            .find(|c| c.index == ci_profile_id)
            .ok_or(MigError::NotSupported)
    }

    fn check_ci(&self, gi: &GpuInstance, c: &CiProfile, start: u32) -> Result<(), MigError> {
        let same = gi
            .compute_instances
            .iter()
            .filter(|x| x.profile_id == c.index)
            .count() as u32;
        let used = gi
            .compute_instances
            .iter()
            .fold(0, |m, x| m | mask(x.start, x.size));
        let facts = self.facts();
        let slices_used: u32 = self
            .ci_profiles(gi.id)
            .unwrap_or_default()
            .iter()
            .map(|p| {
                p.slices
                    * gi.compute_instances
                        .iter()
                        .filter(|x| x.profile_id == p.index)
                        .count() as u32
            })
            .sum();
        let gi_slices = facts.by_id(gi.profile_id).map_or(0, |p| p.slices);
        if same >= c.instances
            || used & mask(start, c.placement_size) != 0
            || slices_used + c.slices > gi_slices
        {
            return Err(MigError::InsufficientResources);
        }
        Ok(())
    }

    /// `nvmlGpuInstanceCreateComputeInstance(WithPlacement)`: the new
    /// compute instance's ID within GPU instance `gi`.
    pub fn create_compute_instance(
        &mut self,
        gi: u32,
        ci_profile_id: u32,
        start: Option<u32>,
    ) -> Result<u32, MigError> {
        let c = self.ci_profile(gi, ci_profile_id)?;
        let g = self.gpu_instance(gi).ok_or(MigError::NotFound)?;
        let start = match start {
            Some(s) => {
                if !c.placements.contains(&s) {
                    return Err(MigError::InvalidArgument);
                }
                self.check_ci(g, &c, s)?;
                s
            }
            None => c
                .placements
                .iter()
                .copied()
                .find(|&s| self.check_ci(g, &c, s).is_ok())
                .ok_or(MigError::InsufficientResources)?,
        };
        let id = (0..MAX_COMPUTE_INSTANCE_IDS)
            .find(|i| g.compute_instances.iter().all(|x| x.id != *i))
            .ok_or(MigError::InsufficientResources)?;
        let uuid = mig_uuid(&self.uuid, gi, id);
        let g = self
            .gpu_instances
            .iter_mut()
            .find(|g| g.id == gi)
            .expect("found above");
        g.compute_instances.push(ComputeInstance {
            id,
            profile_id: ci_profile_id,
            start,
            size: c.placement_size,
            uuid,
            described: None,
        });
        g.compute_instances.sort_by_key(|c| c.id);
        Ok(id)
    }

    /// `nvmlComputeInstanceDestroy`.
    pub fn destroy_compute_instance(&mut self, gi: u32, ci: u32) -> Result<(), MigError> {
        self.need_enabled()?;
        let g = self
            .gpu_instances
            .iter_mut()
            .find(|g| g.id == gi)
            .ok_or(MigError::NotFound)?;
        let k = g
            .compute_instances
            .iter()
            .position(|c| c.id == ci)
            .ok_or(MigError::NotFound)?;
        g.compute_instances.remove(k);
        Ok(())
    }

    /// `nvmlGpuInstanceGetComputeInstanceRemainingCapacity`.
    pub fn compute_instance_capacity(&self, gi: u32, ci_profile_id: u32) -> Result<u32, MigError> {
        self.ci_profile(gi, ci_profile_id)?;
        let mut probe = self.clone();
        let mut n = 0;
        while probe
            .create_compute_instance(gi, ci_profile_id, None)
            .is_ok()
        {
            n += 1;
        }
        Ok(n)
    }

    /// The MIG devices (compute instances), ordered by GPU-instance ID then
    /// compute-instance ID; none while MIG is disabled.
    pub fn mig_devices(&self) -> Vec<MigDevice> {
        if !self.capable || !self.current {
            return Vec::new();
        }
        let facts = self.facts();
        let mut out = Vec::new();
        for g in &self.gpu_instances {
            let Some(gp) = facts.by_id(g.profile_id) else {
                continue;
            };
            let cps = facts.ci_profiles(gp);
            for c in &g.compute_instances {
                let Some(cp) = cps.iter().find(|p| p.index == c.profile_id) else {
                    continue;
                };
                let (memory_mib, multiprocessors, engines) = match c.described {
                    Some(d) => (d.memory_mib, d.multiprocessors, d.engines),
                    None => (gp.memory_mib, cp.multiprocessors, gp.engines),
                };
                out.push(MigDevice {
                    uuid: c.uuid.clone(),
                    gi_id: g.id,
                    ci_id: c.id,
                    gi_profile_id: gp.id,
                    placement_start: g.start,
                    ci_profile_id: cp.index,
                    gi_slices: gp.slices,
                    ci_slices: cp.slices,
                    memory_mib,
                    multiprocessors,
                    engines,
                });
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h100() -> GpuMig {
        let node = NodeDescription::load("h100-sxm-8").unwrap();
        GpuMig::from_desc(&node.gpus[0]).unwrap()
    }

    fn a100() -> GpuMig {
        let mut g = h100();
        g.device_id = 0x20b0;
        g.mode_change_needs_reset = true;
        g
    }

    fn id(g: &GpuMig, name: &str) -> u32 {
        g.facts().by_name(name).unwrap().id
    }

    #[test]
    fn hopper_mode_changes_at_once_unless_instances_exist() {
        let mut g = h100();
        assert!(!g.current);
        // No instance calls while MIG is disabled.
        assert_eq!(
            g.create_gpu_instance(id(&g, "1g.10gb"), None),
            Err(MigError::NotSupported)
        );
        assert_eq!(g.set_mode(true, 1), Ok(true));
        assert!(g.current && g.pending && !g.reset_pending());
        g.create_gpu_instance(id(&g, "1g.10gb"), None).unwrap();
        assert_eq!(g.set_mode(false, 2), Err(MigError::InUse));
        assert!(g.current);
        // Enabling again is no change.
        assert_eq!(g.set_mode(true, 3), Ok(true));
        let gi = g.gpu_instances[0].id;
        g.destroy_gpu_instance(gi).unwrap();
        assert_eq!(g.set_mode(false, 4), Ok(true));
        assert!(!g.current);
        let mut t4 = h100();
        t4.capable = false;
        assert_eq!(t4.set_mode(true, 1), Err(MigError::NotSupported));
    }

    #[test]
    fn ampere_mode_waits_for_a_reset_which_clears_instances() {
        let mut g = a100();
        assert_eq!(g.set_mode(true, 10), Ok(false));
        assert!(!g.current && g.pending && g.reset_pending());
        assert_eq!(g.pending_since_ns, Some(10));
        assert_eq!(
            g.create_gpu_instance(id(&g, "1g.5gb"), None),
            Err(MigError::NotSupported)
        );
        g.reset();
        assert!(g.current && g.pending && g.pending_since_ns.is_none());
        g.create_gpu_instance(id(&g, "3g.20gb"), None).unwrap();
        // Asking for the mode it has is no change; disabling waits.
        assert_eq!(g.set_mode(true, 11), Ok(true));
        assert_eq!(g.set_mode(false, 12), Ok(false));
        assert!(g.current && !g.pending);
        assert_eq!(g.gpu_instances.len(), 1);
        g.reset();
        assert!(!g.current && g.gpu_instances.is_empty());
        // Changing its mind before the reset: nothing pending.
        assert_eq!(g.set_mode(true, 13), Ok(false));
        assert_eq!(g.set_mode(false, 14), Ok(true));
        assert!(!g.reset_pending() && g.pending_since_ns.is_none());
    }

    #[test]
    fn gpu_instances_by_placement_with_nvmls_errors() {
        let mut g = h100();
        g.set_mode(true, 0).unwrap();
        let three = id(&g, "3g.40gb");
        // A start the profile does not list.
        assert_eq!(
            g.create_gpu_instance(three, Some(2)),
            Err(MigError::InvalidArgument)
        );
        // A profile the GPU does not have (A30's 2g.12gb+me is ID 6).
        assert_eq!(g.create_gpu_instance(6, None), Err(MigError::NotSupported));
        assert_eq!(g.create_gpu_instance(three, Some(0)), Ok(1));
        // Overlap.
        let four = id(&g, "4g.40gb");
        assert_eq!(
            g.create_gpu_instance(four, Some(0)),
            Err(MigError::InsufficientResources)
        );
        assert_eq!(g.gpu_instance_capacity(four), Ok(0));
        assert_eq!(g.gpu_instance_capacity(three), Ok(1));
        assert_eq!(g.create_gpu_instance(three, None), Ok(2));
        // Instance count reached (and no room).
        assert_eq!(
            g.create_gpu_instance(three, None),
            Err(MigError::InsufficientResources)
        );
        assert_eq!(g.gpu_instance(2).unwrap().start, 4);
        assert_eq!(g.free_placements(id(&g, "1g.10gb")), Ok(vec![]));
        assert_eq!(g.destroy_gpu_instance(9), Err(MigError::NotFound));
    }

    #[test]
    fn default_placements_and_ids_as_the_driver_picks_them() {
        // The user guide's A100 examples: `-cgi 19,14,5` gives GI 13 at 6:1,
        // GI 5 at 4:2, GI 1 at 0:4; `-cgi 9,19,14,19` gives 2, 7, 4, 8.
        let mut g = a100();
        g.set_mode(true, 0).unwrap();
        g.reset();
        let got: Vec<u32> = ["1g.5gb", "2g.10gb", "4g.20gb"]
            .iter()
            .map(|n| g.create_gpu_instance(id(&g, n), None).unwrap())
            .collect();
        assert_eq!(got, [13, 5, 1]);
        let placed: Vec<(u32, u32)> = g.gpu_instances.iter().map(|x| (x.start, x.size)).collect();
        assert_eq!(placed, [(0, 4), (4, 2), (6, 1)]);
        let mut g = a100();
        g.set_mode(true, 0).unwrap();
        g.reset();
        let got: Vec<u32> = ["3g.20gb", "1g.5gb", "2g.10gb", "1g.5gb"]
            .iter()
            .map(|n| g.create_gpu_instance(id(&g, n), None).unwrap())
            .collect();
        assert_eq!(got, [2, 7, 4, 8]);
        // `-cgi 19,19,14,9` fails at the 3g: the 1g went to 6 and 4.
        let mut g = a100();
        g.set_mode(true, 0).unwrap();
        g.reset();
        for n in ["1g.5gb", "1g.5gb", "2g.10gb"] {
            g.create_gpu_instance(id(&g, n), None).unwrap();
        }
        assert_eq!(
            g.create_gpu_instance(id(&g, "3g.20gb"), None),
            Err(MigError::InsufficientResources)
        );
        // Seven 1g on an empty GPU: 13, 11, 12, 7, 8, 9, 10.
        let mut g = h100();
        g.set_mode(true, 0).unwrap();
        let ids: Vec<u32> = (0..7)
            .map(|_| g.create_gpu_instance(19, None).unwrap())
            .collect();
        assert_eq!(ids, [13, 11, 12, 7, 8, 9, 10]);
        assert_eq!(g.gpu_instance_capacity(19), Ok(0));
    }

    #[test]
    fn one_media_extension_instance_per_gpu() {
        let mut g = h100();
        g.set_mode(true, 0).unwrap();
        let me = id(&g, "1g.10gb+me");
        assert_eq!(g.gpu_instance_capacity(me), Ok(1));
        g.create_gpu_instance(me, None).unwrap();
        assert_eq!(g.gpu_instance_capacity(me), Ok(0));
        assert_eq!(
            g.create_gpu_instance(me, None),
            Err(MigError::InsufficientResources)
        );
        // The A30's two +me profiles share its one OFA.
        let mut a30 = a100();
        a30.device_id = 0x20b7;
        a30.set_mode(true, 0).unwrap();
        a30.reset();
        a30.create_gpu_instance(21, None).unwrap();
        assert_eq!(a30.gi_profile(6).unwrap().name, "2g.12gb+me");
        assert_eq!(
            a30.create_gpu_instance(6, None),
            Err(MigError::InsufficientResources)
        );
        assert_eq!(a30.create_gpu_instance(5, None), Ok(2));
    }

    #[test]
    fn compute_instances_fill_their_gpu_instance() {
        let mut g = h100();
        g.set_mode(true, 0).unwrap();
        let gi = g.create_gpu_instance(id(&g, "3g.40gb"), None).unwrap();
        let cps = g.ci_profiles(gi).unwrap();
        let names: Vec<&str> = cps.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["1c.3g.40gb", "2c.3g.40gb", "3g.40gb"]);
        assert_eq!(g.compute_instance_capacity(gi, 0), Ok(3));
        assert_eq!(g.create_compute_instance(gi, 1, None), Ok(0));
        // 2 of 3 slices taken: the whole-GI profile no longer fits.
        assert_eq!(
            g.create_compute_instance(gi, 2, None),
            Err(MigError::InsufficientResources)
        );
        assert_eq!(g.compute_instance_capacity(gi, 0), Ok(1));
        assert_eq!(
            g.create_compute_instance(gi, 0, Some(0)),
            Err(MigError::InsufficientResources)
        );
        assert_eq!(
            g.create_compute_instance(gi, 0, Some(5)),
            Err(MigError::InvalidArgument)
        );
        assert_eq!(g.create_compute_instance(gi, 0, None), Ok(1));
        // A 4c is not offered in a 3g.
        assert_eq!(
            g.create_compute_instance(gi, 3, None),
            Err(MigError::NotSupported)
        );
        assert_eq!(
            g.create_compute_instance(99, 0, None),
            Err(MigError::NotFound)
        );
        assert_eq!(g.destroy_gpu_instance(gi), Err(MigError::InUse));
        g.destroy_compute_instance(gi, 0).unwrap();
        assert_eq!(g.destroy_compute_instance(gi, 0), Err(MigError::NotFound));
        // The lowest free ID again.
        assert_eq!(g.create_compute_instance(gi, 0, None), Ok(0));
        let devs = g.mig_devices();
        assert_eq!(devs.len(), 2);
        assert_eq!(
            (devs[0].ci_id, devs[0].ci_slices, devs[0].multiprocessors),
            (0, 1, 16)
        );
        assert_eq!(devs[0].uuid, mig_uuid(&g.uuid, gi, 0));
        g.destroy_compute_instance(gi, 0).unwrap();
        g.destroy_compute_instance(gi, 1).unwrap();
        g.destroy_gpu_instance(gi).unwrap();
    }

    #[test]
    fn mig_devices_are_ordered_and_described_as_nvml_would() {
        let mut g = h100();
        g.set_mode(true, 0).unwrap();
        for n in ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"] {
            let gi = g.create_gpu_instance(id(&g, n), None).unwrap();
            let full = g.ci_profiles(gi).unwrap().pop().unwrap();
            g.create_compute_instance(gi, full.index, None).unwrap();
        }
        let devs = g.mig_devices();
        let ids: Vec<(u32, u32, u32)> = devs
            .iter()
            .map(|d| (d.gi_id, d.ci_id, d.gi_slices))
            .collect();
        // 3g at 4:4 (GI 2), 2g at 0:2 (GI 3), 1g at 2 and 3 (GI 9, 10).
        assert_eq!(ids, [(2, 0, 3), (3, 0, 2), (9, 0, 1), (10, 0, 1)]);
        let three = &devs[0];
        assert_eq!(three.memory_mib, 40448);
        assert_eq!(three.multiprocessors, 60);
        assert_eq!(three.engines, MigEngines::h100(3));
        assert!(three.uuid.starts_with("MIG-") && three.uuid.len() == 40);
        assert_eq!(&three.uuid[18..19], "5");
        assert_ne!(devs[2].uuid, devs[3].uuid);
        let mut off = g.clone();
        off.current = false;
        assert!(off.mig_devices().is_empty());
    }

    #[test]
    fn descriptions_keep_their_devices() {
        let node = NodeDescription::load("h100-mig-2").unwrap();
        let state = NodeMig::from_description(&node).unwrap();
        assert!(state.describes(&node));
        let devs = state.gpus[0].mig_devices();
        let described: Vec<(String, u32, u64, u32)> = node.gpus[0]
            .mig
            .devices
            .iter()
            .enumerate()
            .map(|(k, m)| (m.uuid.clone(), m.gi_id(k), m.memory_mib, m.multiprocessors))
            .collect();
        let got: Vec<(String, u32, u64, u32)> = devs
            .iter()
            .map(|d| (d.uuid.clone(), d.gi_id, d.memory_mib, d.multiprocessors))
            .collect();
        assert_eq!(got, described);
        let placed: Vec<(u32, u32)> = state.gpus[0]
            .gpu_instances
            .iter()
            .map(|g| (g.start, g.size))
            .collect();
        assert_eq!(placed, [(4, 4), (0, 2), (2, 1), (3, 1)]);
        // Each device says its GPU instance's profile ID and placement start.
        let at: Vec<(u32, u32)> = devs
            .iter()
            .map(|d| (d.gi_profile_id, d.placement_start))
            .collect();
        assert_eq!(at, [(9, 4), (14, 0), (19, 2), (19, 3)]);
        assert_eq!(state.gpus[1].mig_devices().len(), 7);
        // A full GPU: nothing more fits; the IDs the description gave are kept.
        assert_eq!(state.gpus[1].gpu_instance_capacity(19), Ok(0));
        // The state round-trips through JSON.
        let text = serde_json::to_string(&state).unwrap();
        assert_eq!(serde_json::from_str::<NodeMig>(&text).unwrap(), state);
    }

    #[test]
    fn gi_ids_taken_by_a_description_are_not_reused() {
        let node = NodeDescription::load("h100-mig-2").unwrap();
        let mut g = NodeMig::from_description(&node).unwrap().gpus.remove(0);
        // GI 2 is the described 1g at slice 2; remove the 3g (GI 0) and
        // make a 3g again at 4:4, whose own ID would be 2.
        g.gpu_instances[0].compute_instances.clear();
        g.destroy_gpu_instance(0).unwrap();
        let id = g.create_gpu_instance(9, Some(4)).unwrap();
        assert_eq!(id, 0, "the lowest free ID when the placement's ID is taken");
    }
}
