//! The time slices of DRA claims' GPUs ([`DraTimeSlice`]): gpu-dra's
//! [`TimeSlicePort`] done as NVIDIA's DRA driver does it. For each GPU:
//! the compute mode DEFAULT first (through the node's backend, as the MPS
//! daemons' GPUs are set back; `nvidia-smi -i <uuid> -c DEFAULT` when the
//! backend cannot), then the host's `nvidia-smi compute-policy -i <uuid>
//! --set-timeslice <n>`, run through `host-exec` (chrooted into the host
//! root). A failure names the GPU, the command and what it said.

use std::sync::Arc;
use std::time::Duration;

use gpu_dra::claims::{TimeSliceInterval, TimeSlicePort};
use hostlib::process::{Launch, Spawner};

use crate::backend::{BackendError, ComputeMode, GpuBackend};

/// The host's `nvidia-smi` (a host path, as the MPS control program's).
pub const NVIDIA_SMI: &str = "/usr/bin/nvidia-smi";
/// How long one `nvidia-smi` may run (a prepare has 45 s in all).
const RUN_WAIT: Duration = Duration::from_secs(15);

/// What the port runs with.
pub struct DraTimeSlice {
    /// Runs the host's `nvidia-smi` (through `host-exec`).
    spawner: Arc<dyn Spawner>,
    /// Sets the compute modes.
    backend: Arc<dyn GpuBackend>,
    /// The host path of `nvidia-smi`.
    program: String,
    /// Capabilities `nvidia-smi` needs that this process lacks: every
    /// call fails naming them.
    missing_caps: Vec<String>,
    /// The runtime the spawner's futures run on (the port's callers are
    /// blocking threads).
    rt: tokio::runtime::Handle,
}

impl std::fmt::Debug for DraTimeSlice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DraTimeSlice")
            .field("program", &self.program)
            .field("missing_caps", &self.missing_caps)
            .finish_non_exhaustive()
    }
}

impl DraTimeSlice {
    /// A port on the current runtime (call it from within one).
    pub fn new(
        spawner: Arc<dyn Spawner>,
        backend: Arc<dyn GpuBackend>,
        program: impl Into<String>,
        missing_caps: Vec<String>,
    ) -> Self {
        DraTimeSlice {
            spawner,
            backend,
            program: program.into(),
            missing_caps,
            rt: tokio::runtime::Handle::current(),
        }
    }

    /// Runs `nvidia-smi args…` to its end; `Err` is the command and what
    /// it said.
    fn run(&self, args: &[String]) -> Result<(), String> {
        let launch = Launch {
            program: self.program.clone(),
            args: args.to_vec(),
            env: [(
                "PATH".to_string(),
                "/usr/sbin:/usr/bin:/sbin:/bin".to_string(),
            )]
            .into(),
            shm: None,
        };
        let line = launch.command_line();
        let r = self.rt.block_on(async {
            tokio::time::timeout(RUN_WAIT, self.spawner.output(&launch, "")).await
        });
        match r {
            Ok(Ok(_)) => {
                tracing::debug!(command = %line, "ran nvidia-smi");
                Ok(())
            }
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!(
                "`{line}` did not end within {} s",
                RUN_WAIT.as_secs()
            )),
        }
    }

    /// GPU `uuid` in the DEFAULT compute mode: the backend, or nvidia-smi
    /// when the backend cannot set compute modes.
    fn default_compute_mode(&self, uuid: &str) -> Result<(), String> {
        match self.backend.set_compute_mode(uuid, ComputeMode::Default) {
            Ok(()) => Ok(()),
            Err(BackendError::Unavailable(why)) => {
                tracing::debug!(gpu = %uuid, reason = %why, "compute mode set through nvidia-smi");
                self.run(&[
                    "-i".into(),
                    uuid.into(),
                    "-c".into(),
                    ComputeMode::Default.as_str().into(),
                ])
            }
            Err(e) => Err(format!("setting its compute mode DEFAULT: {e}")),
        }
    }
}

impl TimeSlicePort for DraTimeSlice {
    fn set_time_slice(&self, gpus: &[String], interval: TimeSliceInterval) -> Result<(), String> {
        if !self.missing_caps.is_empty() {
            return Err(format!(
                "{} needs {}, which this agent does not hold",
                self.program,
                self.missing_caps.join(", ")
            ));
        }
        for uuid in gpus {
            self.default_compute_mode(uuid)
                .map_err(|why| format!("GPU {uuid}: {why}"))?;
            self.run(&[
                "compute-policy".into(),
                "-i".into(),
                uuid.clone(),
                "--set-timeslice".into(),
                interval.int().to_string(),
            ])
            .map_err(|why| format!("GPU {uuid}: {why}"))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use hostlib::process::FakeSpawner;

    use super::*;
    use crate::backend::sim::SimulatedBackend;

    /// A backend that cannot set compute modes (the trait's default).
    #[derive(Debug)]
    struct NoModes;

    impl GpuBackend for NoModes {
        fn name(&self) -> &'static str {
            "none"
        }
        fn snapshot(&self) -> Result<crate::backend::BackendSnapshot, BackendError> {
            Err(BackendError::Unavailable("none".into()))
        }
    }

    fn argv(f: &FakeSpawner) -> Vec<String> {
        f.ran().into_iter().map(|(l, _)| l.command_line()).collect()
    }

    fn port(
        f: &Arc<FakeSpawner>,
        backend: Arc<dyn GpuBackend>,
        missing: Vec<String>,
    ) -> Arc<DraTimeSlice> {
        let spawner: Arc<dyn Spawner> = f.clone();
        Arc::new(DraTimeSlice::new(spawner, backend, NVIDIA_SMI, missing))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn compute_mode_default_then_the_slice_per_gpu() {
        let f = Arc::new(FakeSpawner::new());
        let backend: Arc<dyn GpuBackend> = Arc::new(SimulatedBackend::new(
            simnode::NodeDescription::load("t4-4").unwrap(),
        ));
        let p = port(&f, backend.clone(), Vec::new());
        backend
            .set_compute_mode(&uuid(&backend, 0), ComputeMode::ExclusiveProcess)
            .unwrap();
        let gpus = vec![uuid(&backend, 0), uuid(&backend, 1)];
        let (p2, g2) = (p.clone(), gpus.clone());
        tokio::task::spawn_blocking(move || p2.set_time_slice(&g2, TimeSliceInterval::Long))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            argv(&f),
            [
                format!(
                    "/usr/bin/nvidia-smi compute-policy -i {} --set-timeslice 3",
                    gpus[0]
                ),
                format!(
                    "/usr/bin/nvidia-smi compute-policy -i {} --set-timeslice 3",
                    gpus[1]
                ),
            ]
        );
        assert_eq!(
            backend.compute_mode(&gpus[0]).unwrap(),
            ComputeMode::Default
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn nvidia_smi_sets_the_mode_when_the_backend_cannot_and_failures_name_the_gpu() {
        let f = Arc::new(FakeSpawner::new());
        f.respond(|l, _| {
            if l.args.contains(&"GPU-b".to_string()) && l.args[0] == "compute-policy" {
                Err("Unable to set the timeslice for GPU 00000000:02:00.0: Insufficient Permissions (exit code 4)".into())
            } else {
                Ok(String::new())
            }
        });
        let p = port(&f, Arc::new(NoModes), Vec::new());
        let gpus = vec![
            "GPU-a".to_string(),
            "GPU-b".to_string(),
            "GPU-c".to_string(),
        ];
        let err =
            tokio::task::spawn_blocking(move || p.set_time_slice(&gpus, TimeSliceInterval::Short))
                .await
                .unwrap()
                .unwrap_err();
        assert_eq!(
            argv(&f),
            [
                "/usr/bin/nvidia-smi -i GPU-a -c DEFAULT",
                "/usr/bin/nvidia-smi compute-policy -i GPU-a --set-timeslice 1",
                "/usr/bin/nvidia-smi -i GPU-b -c DEFAULT",
                "/usr/bin/nvidia-smi compute-policy -i GPU-b --set-timeslice 1",
            ],
            "stops at the GPU that failed"
        );
        assert!(
            err.starts_with("GPU GPU-b: `/usr/bin/nvidia-smi compute-policy -i GPU-b --set-timeslice 1` failed: Unable to set the timeslice")
                && err.contains("Insufficient Permissions"),
            "{err}"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn missing_capabilities_are_named_and_nothing_runs() {
        let f = Arc::new(FakeSpawner::new());
        let p = port(&f, Arc::new(NoModes), vec!["CAP_SYS_CHROOT".into()]);
        let err = tokio::task::spawn_blocking(move || {
            p.set_time_slice(&["GPU-a".to_string()], TimeSliceInterval::Default)
        })
        .await
        .unwrap()
        .unwrap_err();
        assert_eq!(
            err,
            "/usr/bin/nvidia-smi needs CAP_SYS_CHROOT, which this agent does not hold"
        );
        assert!(f.ran().is_empty());
    }

    fn uuid(b: &Arc<dyn GpuBackend>, i: usize) -> String {
        b.snapshot().unwrap().gpus[i].uuid.clone()
    }
}
