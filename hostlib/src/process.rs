//! Host programs that keep running (a daemon the agent supervises, waiting
//! on its exit) or that are talked to on stdin (a control client), behind
//! [`Spawner`]: [`HostSpawner`] runs them for real, [`FakeSpawner`]
//! records what would run and lets a test end a child when it likes.
//!
//! A [`Launch`] names a host program by its host path. [`HostSpawner`]
//! starts it through the agent's own binary (`gpu-agent host-exec`), which
//! does what a container runtime would before becoming the program
//! ([`enter`], then [`exec`]): with [`Launch::shm`], a mount namespace of
//! its own with a host directory bound over `/dev/shm`; then, when the host
//! root is not `/`, `chroot` into it — the same door as the host's
//! `systemctl` through `chroot`, so the program finds its own libraries and
//! the host's paths mean what they say. The pid the agent waits on is the
//! program's own (the wrapper execs it).

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use nix::mount::MsFlags;

use crate::command::CommandError;
use crate::{HostError, HostRoot, SyscallError, Syscalls};

/// A boxed future, for the object-safe traits here.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A host program to start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    /// A host path, `/usr/bin/nvidia-cuda-mps-control`.
    pub program: String,
    pub args: Vec<String>,
    /// Its whole environment (nothing is inherited from the agent).
    pub env: BTreeMap<String, String>,
    /// A host directory bound over `/dev/shm` in a mount namespace of the
    /// program's own; `None`: the host's `/dev/shm`.
    pub shm: Option<String>,
}

impl Launch {
    /// `program arg…`, for messages.
    pub fn command_line(&self) -> String {
        std::iter::once(self.program.as_str())
            .chain(self.args.iter().map(String::as_str))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// How a program ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Exit {
    pub code: Option<i32>,
    pub signal: Option<i32>,
}

impl Exit {
    pub fn success(&self) -> bool {
        self.code == Some(0)
    }

    fn from_status(status: std::process::ExitStatus) -> Self {
        use std::os::unix::process::ExitStatusExt;
        Exit {
            code: status.code(),
            signal: status.signal(),
        }
    }
}

impl fmt::Display for Exit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.code, self.signal) {
            (Some(c), _) => write!(f, "exit code {c}"),
            (None, Some(s)) => match nix::sys::signal::Signal::try_from(s) {
                Ok(sig) => write!(f, "killed by {sig}"),
                Err(_) => write!(f, "killed by signal {s}"),
            },
            (None, None) => f.write_str("ended"),
        }
    }
}

/// A started program.
pub trait Child: Send + fmt::Debug {
    /// Its process id, while it runs.
    fn id(&self) -> Option<u32>;
    /// Resolves when it exits (no polling: the kernel says so).
    fn wait(&mut self) -> BoxFuture<'_, Result<Exit, CommandError>>;
    /// Kills it (`SIGKILL`); nothing to do when it has exited.
    fn kill(&mut self) -> Result<(), CommandError>;
}

/// Starts host programs.
pub trait Spawner: Send + Sync + fmt::Debug {
    /// Starts `launch` and leaves it running; its output lines are logged.
    fn spawn(&self, launch: &Launch) -> Result<Box<dyn Child>, CommandError>;
    /// Runs `launch` to its end with `input` on stdin: its stdout when it
    /// exits 0, else an error carrying its stderr.
    fn output<'a>(
        &'a self,
        launch: &'a Launch,
        input: &'a str,
    ) -> BoxFuture<'a, Result<String, CommandError>>;
}

/// The `host-exec` wrapper could not become the program.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error(transparent)]
    Syscall(#[from] SyscallError),
    #[error(transparent)]
    Host(#[from] HostError),
    #[error("cannot run {program}: {source}")]
    Exec {
        program: String,
        #[source]
        source: std::io::Error,
    },
}

/// Runs host programs through `<wrapper> --host-root <root> host-exec`, the
/// wrapper being the agent's own binary.
#[derive(Clone, Debug)]
pub struct HostSpawner {
    wrapper: PathBuf,
    root: HostRoot,
}

impl HostSpawner {
    /// `wrapper`: the `gpu-agent` binary (this process's own, usually).
    pub fn new(wrapper: impl Into<PathBuf>, root: HostRoot) -> Self {
        HostSpawner {
            wrapper: wrapper.into(),
            root,
        }
    }

    /// The wrapper's argument list for `launch` (what runs, in order).
    pub fn argv(&self, launch: &Launch) -> Vec<String> {
        let mut argv = vec![
            self.wrapper.display().to_string(),
            "--host-root".into(),
            self.root.path().display().to_string(),
            "host-exec".into(),
        ];
        if let Some(shm) = &launch.shm {
            argv.push("--shm".into());
            argv.push(shm.clone());
        }
        argv.push("--".into());
        argv.push(launch.program.clone());
        argv.extend(launch.args.iter().cloned());
        argv
    }

    fn command(&self, launch: &Launch) -> tokio::process::Command {
        let argv = self.argv(launch);
        let mut c = tokio::process::Command::new(&argv[0]);
        c.args(&argv[1..])
            .env_clear()
            .envs(&launch.env)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true);
        c
    }
}

/// Logs each line `from` writes, as the program's.
fn log_lines<R>(from: R, program: String, pid: Option<u32>, stderr: bool)
where
    R: tokio::io::AsyncRead + Unpin + Send + 'static,
{
    use tokio::io::AsyncBufReadExt;
    tokio::spawn(async move {
        let mut lines = tokio::io::BufReader::new(from).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            if stderr {
                tracing::warn!(program = %program, pid, "{line}");
            } else {
                tracing::info!(program = %program, pid, "{line}");
            }
        }
    });
}

impl Spawner for HostSpawner {
    fn spawn(&self, launch: &Launch) -> Result<Box<dyn Child>, CommandError> {
        let mut child = self.command(launch).spawn().map_err(|e| CommandError {
            command: launch.command_line(),
            message: format!("cannot start {}: {e}", self.wrapper.display()),
        })?;
        let pid = child.id();
        tracing::info!(command = %launch.command_line(), pid, "started a host program");
        if let Some(out) = child.stdout.take() {
            log_lines(out, launch.program.clone(), pid, false);
        }
        if let Some(err) = child.stderr.take() {
            log_lines(err, launch.program.clone(), pid, true);
        }
        Ok(Box::new(HostChild {
            child,
            command: launch.command_line(),
        }))
    }

    fn output<'a>(
        &'a self,
        launch: &'a Launch,
        input: &'a str,
    ) -> BoxFuture<'a, Result<String, CommandError>> {
        Box::pin(async move {
            use tokio::io::AsyncWriteExt;
            let line = launch.command_line();
            let err = |message: String| CommandError {
                command: line.clone(),
                message,
            };
            let mut cmd = self.command(launch);
            cmd.stdin(std::process::Stdio::piped());
            let mut child = cmd
                .spawn()
                .map_err(|e| err(format!("cannot start {}: {e}", self.wrapper.display())))?;
            if let Some(mut stdin) = child.stdin.take() {
                // A program that exits without reading is answered by its exit.
                let _ = stdin.write_all(input.as_bytes()).await;
                drop(stdin);
            }
            let out = child
                .wait_with_output()
                .await
                .map_err(|e| err(e.to_string()))?;
            let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
            let exit = Exit::from_status(out.status);
            tracing::debug!(command = %line, input = %input.trim(), exit = %exit, stderr = %stderr, "ran a host program");
            if !exit.success() {
                // Some programs (nvidia-smi) say why on stdout only.
                let why = if stderr.is_empty() {
                    String::from_utf8_lossy(&out.stdout).trim().to_string()
                } else {
                    stderr
                };
                return Err(err(if why.is_empty() {
                    exit.to_string()
                } else {
                    format!("{why} ({exit})")
                }));
            }
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        })
    }
}

#[derive(Debug)]
struct HostChild {
    child: tokio::process::Child,
    command: String,
}

impl Child for HostChild {
    fn id(&self) -> Option<u32> {
        self.child.id()
    }

    fn wait(&mut self) -> BoxFuture<'_, Result<Exit, CommandError>> {
        Box::pin(async move {
            self.child
                .wait()
                .await
                .map(Exit::from_status)
                .map_err(|e| CommandError {
                    command: self.command.clone(),
                    message: e.to_string(),
                })
        })
    }

    fn kill(&mut self) -> Result<(), CommandError> {
        match self.child.start_kill() {
            Ok(()) => Ok(()),
            // Already reaped.
            Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => Ok(()),
            Err(e) => Err(CommandError {
                command: self.command.clone(),
                message: e.to_string(),
            }),
        }
    }
}

/// What `host-exec` does before it becomes the program: with `shm`, a
/// mount namespace of its own (mounts from the host still propagate in,
/// none go out) with the host directory `shm` bound over `/dev/shm`; then,
/// when the root is not `/`, `chroot` into it.
pub fn enter(root: &HostRoot, shm: Option<&str>, sys: &dyn Syscalls) -> Result<(), ProcessError> {
    if let Some(shm) = shm {
        let source = root.resolve(shm)?;
        let target = root.resolve("/dev/shm")?;
        sys.unshare_mount_namespace()?;
        sys.mount(
            None,
            Path::new("/"),
            None,
            MsFlags::MS_REC | MsFlags::MS_SLAVE,
            None,
        )?;
        sys.mount(Some(&source), &target, None, MsFlags::MS_BIND, None)?;
    }
    if !root.is_system() {
        sys.chroot(root.path())?;
    }
    Ok(())
}

/// Becomes `argv[0]` (a path in the root entered), with this process's
/// environment, in a session of its own; returns only when that fails.
pub fn exec(argv: &[String]) -> ProcessError {
    use std::os::unix::process::CommandExt;
    let Some((program, args)) = argv.split_first() else {
        return ProcessError::Exec {
            program: String::new(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "no program given"),
        };
    };
    // A session of its own: a signal to the agent's process group (a
    // terminal's Ctrl-C, `timeout`) is not the program's; the agent tells
    // it to stop its own way. Fails only for a group leader, which this
    // process (a child just started) is not.
    let _ = nix::unistd::setsid();
    let source = std::process::Command::new(program).args(args).exec();
    ProcessError::Exec {
        program: program.clone(),
        source,
    }
}

/// Answers a fake program's stdin: `(launch, input) -> stdout or error text`.
pub type Responder = dyn Fn(&Launch, &str) -> Result<String, String> + Send + Sync;

/// Records every launch; children run until [`FakeSpawner::exit`] (or a
/// kill) ends them; [`Spawner::output`] answers through a responder
/// (default: success, no output).
#[derive(Default)]
pub struct FakeSpawner {
    spawned: Mutex<Vec<FakeRecord>>,
    ran: Mutex<Vec<(Launch, String)>>,
    responder: Mutex<Option<Arc<Responder>>>,
    next_pid: Mutex<u32>,
}

struct FakeRecord {
    launch: Launch,
    pid: u32,
    exit: Arc<tokio::sync::watch::Sender<Option<Exit>>>,
}

impl fmt::Debug for FakeSpawner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FakeSpawner")
            .field("spawned", &self.spawned().len())
            .field("ran", &self.ran().len())
            .finish()
    }
}

impl FakeSpawner {
    pub fn new() -> Self {
        Self::default()
    }

    /// Every program started, in order.
    pub fn spawned(&self) -> Vec<Launch> {
        self.spawned
            .lock()
            .unwrap()
            .iter()
            .map(|r| r.launch.clone())
            .collect()
    }

    /// Every program run to its end, with its input, in order.
    pub fn ran(&self) -> Vec<(Launch, String)> {
        self.ran.lock().unwrap().clone()
    }

    /// The inputs given to programs run to their end, in order.
    pub fn inputs(&self) -> Vec<String> {
        self.ran().into_iter().map(|(_, i)| i).collect()
    }

    /// Answers later runs with `f`.
    pub fn respond(
        &self,
        f: impl Fn(&Launch, &str) -> Result<String, String> + Send + Sync + 'static,
    ) {
        *self.responder.lock().unwrap() = Some(Arc::new(f));
    }

    /// Ends the `n`th program started (from 0) with `exit`; false if no such one.
    pub fn exit(&self, n: usize, exit: Exit) -> bool {
        let spawned = self.spawned.lock().unwrap();
        match spawned.get(n) {
            Some(r) => {
                r.exit.send_replace(Some(exit));
                true
            }
            None => false,
        }
    }

    /// The children started that have not ended.
    pub fn running(&self) -> usize {
        self.spawned
            .lock()
            .unwrap()
            .iter()
            .filter(|r| r.exit.borrow().is_none())
            .count()
    }

    /// Whether the `n`th program started (from 0) still runs.
    pub fn is_running(&self, n: usize) -> bool {
        self.spawned
            .lock()
            .unwrap()
            .get(n)
            .is_some_and(|r| r.exit.borrow().is_none())
    }

    /// Process ids of the children started, in order.
    pub fn pids(&self) -> Vec<u32> {
        self.spawned.lock().unwrap().iter().map(|r| r.pid).collect()
    }
}

impl Spawner for FakeSpawner {
    fn spawn(&self, launch: &Launch) -> Result<Box<dyn Child>, CommandError> {
        let pid = {
            let mut n = self.next_pid.lock().unwrap();
            *n += 1;
            1000 + *n
        };
        let (tx, rx) = tokio::sync::watch::channel(None);
        let tx = Arc::new(tx);
        self.spawned.lock().unwrap().push(FakeRecord {
            launch: launch.clone(),
            pid,
            exit: tx.clone(),
        });
        Ok(Box::new(FakeChild {
            pid,
            exit: rx,
            kill: tx,
        }))
    }

    fn output<'a>(
        &'a self,
        launch: &'a Launch,
        input: &'a str,
    ) -> BoxFuture<'a, Result<String, CommandError>> {
        self.ran
            .lock()
            .unwrap()
            .push((launch.clone(), input.to_string()));
        let responder = self.responder.lock().unwrap().clone();
        let answer = match responder {
            Some(f) => f(launch, input),
            None => Ok(String::new()),
        };
        Box::pin(async move {
            answer.map_err(|message| CommandError {
                command: launch.command_line(),
                message,
            })
        })
    }
}

#[derive(Debug)]
struct FakeChild {
    pid: u32,
    exit: tokio::sync::watch::Receiver<Option<Exit>>,
    kill: Arc<tokio::sync::watch::Sender<Option<Exit>>>,
}

impl Child for FakeChild {
    fn id(&self) -> Option<u32> {
        self.exit.borrow().is_none().then_some(self.pid)
    }

    fn wait(&mut self) -> BoxFuture<'_, Result<Exit, CommandError>> {
        Box::pin(async move {
            match self.exit.wait_for(Option::is_some).await {
                Ok(e) => Ok(e.expect("waited for Some")),
                Err(_) => Err(CommandError {
                    command: format!("pid {}", self.pid),
                    message: "the fake spawner is gone".into(),
                }),
            }
        })
    }

    fn kill(&mut self) -> Result<(), CommandError> {
        self.kill.send_if_modified(|e| {
            if e.is_none() {
                *e = Some(Exit {
                    code: None,
                    signal: Some(9),
                });
                true
            } else {
                false
            }
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Call, RecordingSyscalls};

    fn launch(shm: Option<&str>) -> Launch {
        Launch {
            program: "/usr/bin/nvidia-cuda-mps-control".into(),
            args: vec!["-f".into()],
            env: BTreeMap::from([("CUDA_MPS_PIPE_DIRECTORY".into(), "/run/p".into())]),
            shm: shm.map(str::to_string),
        }
    }

    #[test]
    fn the_wrapper_is_told_the_root_the_shm_and_the_program() {
        let dir = tempfile::tempdir().unwrap();
        let s = HostSpawner::new("/opt/gpu-agent", HostRoot::new(dir.path()).unwrap());
        let root = dir.path().display().to_string();
        assert_eq!(
            s.argv(&launch(Some("/run/nvidia/mps/shm"))),
            [
                "/opt/gpu-agent",
                "--host-root",
                &root,
                "host-exec",
                "--shm",
                "/run/nvidia/mps/shm",
                "--",
                "/usr/bin/nvidia-cuda-mps-control",
                "-f"
            ]
        );
        assert_eq!(
            s.argv(&launch(None))[3..],
            ["host-exec", "--", "/usr/bin/nvidia-cuda-mps-control", "-f"]
        );
    }

    #[test]
    fn entering_a_host_root_with_its_own_shm() {
        let dir = tempfile::tempdir().unwrap();
        let root = HostRoot::new(dir.path()).unwrap();
        let sys = RecordingSyscalls::new();
        enter(&root, Some("/run/nvidia/mps/shm"), &sys).unwrap();
        assert_eq!(
            sys.calls(),
            [
                Call::Unshare,
                Call::Mount {
                    source: None,
                    target: "/".into(),
                    fstype: None,
                    flags: MsFlags::MS_REC | MsFlags::MS_SLAVE,
                    data: None
                },
                Call::Mount {
                    source: Some(dir.path().join("run/nvidia/mps/shm")),
                    target: dir.path().join("dev/shm"),
                    fstype: None,
                    flags: MsFlags::MS_BIND,
                    data: None
                },
                Call::Chroot {
                    path: dir.path().to_path_buf()
                },
            ]
        );
        // On the host itself, without shm: nothing to do.
        let sys = RecordingSyscalls::new();
        enter(&HostRoot::system(), None, &sys).unwrap();
        assert!(sys.calls().is_empty());
        // A failed call stops it, naming the call.
        let sys = RecordingSyscalls::new();
        sys.fail_next("unshare", nix::errno::Errno::EPERM);
        let err = enter(&root, Some("/run/nvidia/mps/shm"), &sys).unwrap_err();
        assert!(err.to_string().starts_with("unshare"), "{err}");
        assert_eq!(sys.calls().len(), 1);
    }

    #[test]
    fn exec_of_a_missing_program_names_it() {
        let err = exec(&["/nonexistent/mps-control".into()]);
        assert!(
            err.to_string()
                .starts_with("cannot run /nonexistent/mps-control: No such file"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn host_spawner_runs_waits_and_kills() {
        // `sh` stands in for the wrapper: it gets the wrapper's arguments
        // and runs the last one as a script.
        let dir = tempfile::tempdir().unwrap();
        let wrapper = dir.path().join("wrapper");
        std::fs::write(
            &wrapper,
            "#!/bin/sh\n# the program and its arguments are after --\nwhile [ \"$1\" != -- ]; do shift; done; shift\nexec \"$@\"\n",
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
        let s = HostSpawner::new(&wrapper, HostRoot::system());
        let cat = Launch {
            program: "/bin/sh".into(),
            args: vec!["-c".into(), "read x; echo \"got $x $GREETING\"".into()],
            env: BTreeMap::from([("GREETING".into(), "hello".into())]),
            shm: None,
        };
        assert_eq!(s.output(&cat, "quit\n").await.unwrap(), "got quit hello\n");
        let failing = Launch {
            args: vec!["-c".into(), "echo nope >&2; exit 3".into()],
            ..cat.clone()
        };
        let err = s.output(&failing, "").await.unwrap_err();
        assert_eq!(err.message, "nope (exit code 3)");
        // nvidia-smi says why on stdout only.
        let stdout_only = Launch {
            args: vec![
                "-c".into(),
                "echo 'Failed to set: Insufficient Permissions'; exit 4".into(),
            ],
            ..cat.clone()
        };
        let err = s.output(&stdout_only, "").await.unwrap_err();
        assert_eq!(
            err.message,
            "Failed to set: Insufficient Permissions (exit code 4)"
        );
        let sleeper = Launch {
            args: vec!["-c".into(), "exec sleep 30".into()],
            ..cat.clone()
        };
        let mut child = s.spawn(&sleeper).unwrap();
        assert!(child.id().is_some());
        child.kill().unwrap();
        let exit = child.wait().await.unwrap();
        assert_eq!(exit.to_string(), "killed by SIGKILL");
        let quick = Launch {
            args: vec!["-c".into(), "exit 7".into()],
            ..cat
        };
        let mut child = s.spawn(&quick).unwrap();
        assert_eq!(child.wait().await.unwrap().code, Some(7));
        // Killing one that has exited is no error.
        child.kill().unwrap();
    }

    #[tokio::test]
    async fn fake_spawner_records_and_ends_children_on_demand() {
        let f = FakeSpawner::new();
        f.respond(|_, input| match input.trim() {
            "get_default_active_thread_percentage" => Ok("25.0\n".into()),
            other => Err(format!("unknown command {other}")),
        });
        let mut child = f.spawn(&launch(None)).unwrap();
        assert_eq!(f.running(), 1);
        assert_eq!(
            f.output(&launch(None), "get_default_active_thread_percentage\n")
                .await
                .unwrap(),
            "25.0\n"
        );
        assert!(f.output(&launch(None), "bogus\n").await.is_err());
        assert_eq!(
            f.inputs(),
            ["get_default_active_thread_percentage\n", "bogus\n"]
        );
        assert!(f.exit(
            0,
            Exit {
                code: Some(1),
                signal: None
            }
        ));
        assert_eq!(child.wait().await.unwrap().code, Some(1));
        assert_eq!(f.running(), 0);
        assert_eq!(f.spawned(), [launch(None)]);
    }
}
