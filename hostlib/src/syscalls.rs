//! Every privileged system call gpu-agent makes goes through [`Syscalls`].
//!
//! [`LinuxSyscalls`] makes them for real (through `nix`); [`RecordingSyscalls`]
//! records them so that tests assert the exact calls (path, type, mode,
//! major:minor, module parameters). The implementation is always passed in
//! explicitly; nothing switches on `cfg!(test)`.
//!
//! Paths given here are already resolved through [`crate::HostRoot`].

use std::collections::VecDeque;
use std::ffi::CString;
use std::fmt;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use nix::errno::Errno;
use nix::mount::{MntFlags, MsFlags};
use nix::sys::stat::{Mode, SFlag};

/// A failed system call, naming the call and what it was about.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{call} {target}: {errno}")]
pub struct SyscallError {
    /// The call, e.g. `mknod`.
    pub call: &'static str,
    /// The path or module it was about.
    pub target: String,
    /// The kernel's answer.
    pub errno: Errno,
}

impl SyscallError {
    fn new(call: &'static str, target: impl fmt::Display, errno: Errno) -> Self {
        SyscallError {
            call,
            target: target.to_string(),
            errno,
        }
    }
}

/// The privileged calls gpu-agent makes.
pub trait Syscalls: Send + Sync + fmt::Debug {
    /// `mknod(path, S_IFCHR | mode, makedev(major, minor))`. The umask applies;
    /// callers that need exact bits follow with [`Syscalls::chmod`].
    fn mknod_char(
        &self,
        path: &Path,
        mode: u32,
        major: u32,
        minor: u32,
    ) -> Result<(), SyscallError>;
    /// `finit_module` on the module file at `path` with the parameter string.
    fn finit_module(&self, path: &Path, params: &str) -> Result<(), SyscallError>;
    /// `delete_module(name, O_NONBLOCK)`: fails with `EWOULDBLOCK`/`EBUSY` while in use.
    fn delete_module(&self, name: &str) -> Result<(), SyscallError>;
    /// `mount(source, target, fstype, flags, data)`.
    fn mount(
        &self,
        source: Option<&Path>,
        target: &Path,
        fstype: Option<&str>,
        flags: MsFlags,
        data: Option<&str>,
    ) -> Result<(), SyscallError>;
    /// `umount2(target, MNT_DETACH if detach)`.
    fn umount(&self, target: &Path, detach: bool) -> Result<(), SyscallError>;
    /// `chown(path, uid, gid)`; `None` leaves that id unchanged.
    fn chown(&self, path: &Path, uid: Option<u32>, gid: Option<u32>) -> Result<(), SyscallError>;
    /// `fchown(file, uid, gid)` on an open file; `path` names it (for
    /// errors and records: a [`Call::Chown`]). Nothing resolves a path.
    fn fchown(
        &self,
        file: std::os::fd::BorrowedFd<'_>,
        path: &Path,
        uid: Option<u32>,
        gid: Option<u32>,
    ) -> Result<(), SyscallError>;
    /// `chmod(path, mode)`.
    fn chmod(&self, path: &Path, mode: u32) -> Result<(), SyscallError>;
    /// `unshare(CLONE_NEWNS)`: this process gets a mount namespace of its own.
    fn unshare_mount_namespace(&self) -> Result<(), SyscallError>;
    /// `chroot(path)`, then `chdir("/")` inside it.
    fn chroot(&self, path: &Path) -> Result<(), SyscallError>;
}

/// The real calls, through `nix`.
#[derive(Debug, Default, Clone, Copy)]
pub struct LinuxSyscalls;

fn cstring(call: &'static str, s: &str) -> Result<CString, SyscallError> {
    CString::new(s).map_err(|_| SyscallError::new(call, s, Errno::EINVAL))
}

impl Syscalls for LinuxSyscalls {
    fn mknod_char(
        &self,
        path: &Path,
        mode: u32,
        major: u32,
        minor: u32,
    ) -> Result<(), SyscallError> {
        let dev = nix::sys::stat::makedev(u64::from(major), u64::from(minor));
        nix::sys::stat::mknod(path, SFlag::S_IFCHR, Mode::from_bits_truncate(mode), dev)
            .map_err(|e| SyscallError::new("mknod", path.display(), e))
    }

    fn finit_module(&self, path: &Path, params: &str) -> Result<(), SyscallError> {
        let file = fs::File::open(path).map_err(|e| {
            SyscallError::new(
                "finit_module",
                path.display(),
                Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO)),
            )
        })?;
        let params = cstring("finit_module", params)?;
        nix::kmod::finit_module(&file, &params, nix::kmod::ModuleInitFlags::empty())
            .map_err(|e| SyscallError::new("finit_module", path.display(), e))
    }

    fn delete_module(&self, name: &str) -> Result<(), SyscallError> {
        let cname = cstring("delete_module", name)?;
        nix::kmod::delete_module(&cname, nix::kmod::DeleteModuleFlags::O_NONBLOCK)
            .map_err(|e| SyscallError::new("delete_module", name, e))
    }

    fn mount(
        &self,
        source: Option<&Path>,
        target: &Path,
        fstype: Option<&str>,
        flags: MsFlags,
        data: Option<&str>,
    ) -> Result<(), SyscallError> {
        nix::mount::mount(source, target, fstype, flags, data)
            .map_err(|e| SyscallError::new("mount", target.display(), e))
    }

    fn umount(&self, target: &Path, detach: bool) -> Result<(), SyscallError> {
        let flags = if detach {
            MntFlags::MNT_DETACH
        } else {
            MntFlags::empty()
        };
        nix::mount::umount2(target, flags)
            .map_err(|e| SyscallError::new("umount", target.display(), e))
    }

    fn chown(&self, path: &Path, uid: Option<u32>, gid: Option<u32>) -> Result<(), SyscallError> {
        nix::unistd::chown(
            path,
            uid.map(nix::unistd::Uid::from_raw),
            gid.map(nix::unistd::Gid::from_raw),
        )
        .map_err(|e| SyscallError::new("chown", path.display(), e))
    }

    fn fchown(
        &self,
        file: std::os::fd::BorrowedFd<'_>,
        path: &Path,
        uid: Option<u32>,
        gid: Option<u32>,
    ) -> Result<(), SyscallError> {
        nix::unistd::fchown(
            file,
            uid.map(nix::unistd::Uid::from_raw),
            gid.map(nix::unistd::Gid::from_raw),
        )
        .map_err(|e| SyscallError::new("chown", path.display(), e))
    }

    fn chmod(&self, path: &Path, mode: u32) -> Result<(), SyscallError> {
        fs::set_permissions(path, fs::Permissions::from_mode(mode)).map_err(|e| {
            SyscallError::new(
                "chmod",
                path.display(),
                Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO)),
            )
        })
    }

    fn unshare_mount_namespace(&self) -> Result<(), SyscallError> {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS)
            .map_err(|e| SyscallError::new("unshare", "CLONE_NEWNS", e))
    }

    fn chroot(&self, path: &Path) -> Result<(), SyscallError> {
        nix::unistd::chroot(path).map_err(|e| SyscallError::new("chroot", path.display(), e))?;
        nix::unistd::chdir("/").map_err(|e| SyscallError::new("chdir", "/", e))
    }
}

/// One recorded call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    MknodChar {
        path: PathBuf,
        mode: u32,
        major: u32,
        minor: u32,
    },
    FinitModule {
        path: PathBuf,
        params: String,
    },
    DeleteModule {
        name: String,
    },
    Mount {
        source: Option<PathBuf>,
        target: PathBuf,
        fstype: Option<String>,
        flags: MsFlags,
        data: Option<String>,
    },
    Umount {
        target: PathBuf,
        detach: bool,
    },
    Chown {
        path: PathBuf,
        uid: Option<u32>,
        gid: Option<u32>,
    },
    Chmod {
        path: PathBuf,
        mode: u32,
    },
    /// `unshare(CLONE_NEWNS)`.
    Unshare,
    Chroot {
        path: PathBuf,
    },
}

impl Call {
    /// The call's name, as in [`SyscallError::call`].
    pub fn name(&self) -> &'static str {
        match self {
            Call::MknodChar { .. } => "mknod",
            Call::FinitModule { .. } => "finit_module",
            Call::DeleteModule { .. } => "delete_module",
            Call::Mount { .. } => "mount",
            Call::Umount { .. } => "umount",
            Call::Chown { .. } => "chown",
            Call::Chmod { .. } => "chmod",
            Call::Unshare => "unshare",
            Call::Chroot { .. } => "chroot",
        }
    }

    fn target(&self) -> String {
        match self {
            Call::MknodChar { path, .. }
            | Call::FinitModule { path, .. }
            | Call::Chown { path, .. }
            | Call::Chmod { path, .. }
            | Call::Chroot { path } => path.display().to_string(),
            Call::Unshare => "CLONE_NEWNS".to_string(),
            Call::DeleteModule { name } => name.clone(),
            Call::Mount { target, .. } | Call::Umount { target, .. } => {
                target.display().to_string()
            }
        }
    }
}

/// Records every call instead of making it. Failures can be scripted with
/// [`RecordingSyscalls::fail_next`]; a failed call is recorded too.
#[derive(Debug, Default)]
pub struct RecordingSyscalls {
    calls: Mutex<Vec<Call>>,
    failures: Mutex<VecDeque<(&'static str, Errno)>>,
}

impl RecordingSyscalls {
    /// A recorder with no calls and no scripted failures.
    pub fn new() -> Self {
        Self::default()
    }

    /// The next call named `call` (e.g. `"delete_module"`) fails with `errno`.
    /// Several scripted failures are used in order.
    pub fn fail_next(&self, call: &'static str, errno: Errno) {
        self.failures.lock().unwrap().push_back((call, errno));
    }

    /// Every call so far, in order.
    pub fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    /// Forgets the calls recorded so far.
    pub fn clear(&self) {
        self.calls.lock().unwrap().clear();
    }

    fn record(&self, call: Call) -> Result<(), SyscallError> {
        let name = call.name();
        let target = call.target();
        self.calls.lock().unwrap().push(call);
        let mut failures = self.failures.lock().unwrap();
        if let Some(pos) = failures.iter().position(|(c, _)| *c == name) {
            let (_, errno) = failures.remove(pos).expect("position is in range");
            return Err(SyscallError::new(name, target, errno));
        }
        Ok(())
    }
}

impl Syscalls for RecordingSyscalls {
    fn mknod_char(
        &self,
        path: &Path,
        mode: u32,
        major: u32,
        minor: u32,
    ) -> Result<(), SyscallError> {
        self.record(Call::MknodChar {
            path: path.to_path_buf(),
            mode,
            major,
            minor,
        })
    }

    fn finit_module(&self, path: &Path, params: &str) -> Result<(), SyscallError> {
        self.record(Call::FinitModule {
            path: path.to_path_buf(),
            params: params.to_string(),
        })
    }

    fn delete_module(&self, name: &str) -> Result<(), SyscallError> {
        self.record(Call::DeleteModule {
            name: name.to_string(),
        })
    }

    fn mount(
        &self,
        source: Option<&Path>,
        target: &Path,
        fstype: Option<&str>,
        flags: MsFlags,
        data: Option<&str>,
    ) -> Result<(), SyscallError> {
        self.record(Call::Mount {
            source: source.map(Path::to_path_buf),
            target: target.to_path_buf(),
            fstype: fstype.map(str::to_string),
            flags,
            data: data.map(str::to_string),
        })
    }

    fn umount(&self, target: &Path, detach: bool) -> Result<(), SyscallError> {
        self.record(Call::Umount {
            target: target.to_path_buf(),
            detach,
        })
    }

    fn chown(&self, path: &Path, uid: Option<u32>, gid: Option<u32>) -> Result<(), SyscallError> {
        self.record(Call::Chown {
            path: path.to_path_buf(),
            uid,
            gid,
        })
    }

    fn fchown(
        &self,
        _file: std::os::fd::BorrowedFd<'_>,
        path: &Path,
        uid: Option<u32>,
        gid: Option<u32>,
    ) -> Result<(), SyscallError> {
        self.chown(path, uid, gid)
    }

    fn chmod(&self, path: &Path, mode: u32) -> Result<(), SyscallError> {
        self.record(Call::Chmod {
            path: path.to_path_buf(),
            mode,
        })
    }

    fn unshare_mount_namespace(&self) -> Result<(), SyscallError> {
        self.record(Call::Unshare)
    }

    fn chroot(&self, path: &Path) -> Result<(), SyscallError> {
        self.record(Call::Chroot {
            path: path.to_path_buf(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{FileTypeExt, MetadataExt};

    #[test]
    fn recorder_keeps_exact_calls_in_order() {
        let rec = RecordingSyscalls::new();
        let sys: &dyn Syscalls = &rec;
        sys.mknod_char(Path::new("/r/dev/nvidiactl"), 0o666, 195, 255)
            .unwrap();
        sys.chmod(Path::new("/r/dev/nvidiactl"), 0o666).unwrap();
        sys.finit_module(
            Path::new("/m/nvidia.ko"),
            "NVreg_OpenRmEnableUnsupportedGpus=1",
        )
        .unwrap();
        sys.delete_module("nvidia_uvm").unwrap();
        assert_eq!(
            rec.calls(),
            vec![
                Call::MknodChar {
                    path: "/r/dev/nvidiactl".into(),
                    mode: 0o666,
                    major: 195,
                    minor: 255
                },
                Call::Chmod {
                    path: "/r/dev/nvidiactl".into(),
                    mode: 0o666
                },
                Call::FinitModule {
                    path: "/m/nvidia.ko".into(),
                    params: "NVreg_OpenRmEnableUnsupportedGpus=1".into()
                },
                Call::DeleteModule {
                    name: "nvidia_uvm".into()
                },
            ]
        );
    }

    #[test]
    fn scripted_failure_names_call_and_target() {
        let rec = RecordingSyscalls::new();
        rec.fail_next("delete_module", Errno::EBUSY);
        rec.mknod_char(Path::new("/x"), 0o600, 1, 2).unwrap();
        let err = rec.delete_module("nvidia").unwrap_err();
        assert_eq!(err.errno, Errno::EBUSY);
        assert_eq!(
            err.to_string(),
            "delete_module nvidia: EBUSY: Device or resource busy"
        );
        // Used once only.
        rec.delete_module("nvidia").unwrap();
        assert_eq!(rec.calls().len(), 3);
    }

    /// The real implementation against a temp dir. mknod needs CAP_MKNOD; the
    /// machines this runs on are root. Without it, the error must name the path.
    #[test]
    fn linux_mknod_chmod_chown_in_a_temp_dir() {
        let dir = tempfile::tempdir().unwrap();
        let node = dir.path().join("nvidia0");
        let sys = LinuxSyscalls;
        match sys.mknod_char(&node, 0o600, 195, 0) {
            Ok(()) => {
                let meta = fs::metadata(&node).unwrap();
                assert!(meta.file_type().is_char_device());
                assert_eq!(meta.rdev(), nix::sys::stat::makedev(195, 0));
                sys.chmod(&node, 0o666).unwrap();
                assert_eq!(fs::metadata(&node).unwrap().mode() & 0o777, 0o666);
                sys.chown(&node, Some(0), Some(0)).unwrap();
            }
            Err(e) => {
                assert_eq!(e.errno, Errno::EPERM, "{e}");
                assert!(e.to_string().contains("nvidia0"), "{e}");
            }
        }
    }

    #[test]
    fn linux_finit_module_on_missing_file_names_it() {
        let err = LinuxSyscalls
            .finit_module(Path::new("/nonexistent/nvidia.ko"), "")
            .unwrap_err();
        assert_eq!(err.errno, Errno::ENOENT);
        assert_eq!(
            err.to_string(),
            "finit_module /nonexistent/nvidia.ko: ENOENT: No such file or directory"
        );
    }
}
