//! The one door to the host.
//!
//! Every host path gpu-agent reads or writes goes through [`HostRoot`]; every
//! privileged system call goes through the [`Syscalls`] trait. Tests build a
//! fake `/sys`, `/proc`, `/dev` and `/etc` in a temp dir and run the real code
//! over it, with [`RecordingSyscalls`] standing in for the kernel.

pub mod command;
pub mod driver;
pub mod fsutil;
pub mod managed;
pub mod pci;
pub mod pcie_root;
pub mod process;
pub mod procfiles;
pub mod root;
pub mod strict;
pub mod syscalls;
pub mod unreadable;
pub mod vgpu;

pub use driver::{DriverFlavour, DriverState, LoadedModule, Unreadable};
pub use pci::{PciAddress, PciFunction};
pub use root::{HostError, HostRoot};
pub use syscalls::{Call, LinuxSyscalls, RecordingSyscalls, SyscallError, Syscalls};
