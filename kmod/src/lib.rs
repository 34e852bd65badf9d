//! The NVIDIA driver's kernel side on the host.
//!
//! - [`modules`]: load `nvidia`, `nvidia-uvm`, `nvidia-modeset` (and by
//!   policy `nvidia-drm`, `nvidia-peermem`) in dependency order through
//!   `finit_module` with per-module parameters; read their state from
//!   `/proc/modules` and `/sys/module`; unload in reverse, refusing while in
//!   use and naming who holds them.
//! - [`bundle`]: driver bundles (tar.gz + manifest of sha256s), verified
//!   before and while unpacking, installed beside the previous one.
//! - [`devnodes`]: `/dev/nvidia*` with majors read from `/proc/devices`,
//!   NVIDIA's modes, and `/dev/char/MAJ:MIN` links.
//!
//! Every privileged call goes through [`hostlib::Syscalls`]; every path
//! through [`hostlib::HostRoot`].

mod at;
pub mod bundle;
pub mod devnodes;
pub mod modules;
