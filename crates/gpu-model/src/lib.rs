//! The model of a GPU node, at the bottom of gpu-agent's layers: what the
//! node has (the inventory), what a GPU backend is and reports, MIG as NVML
//! sees it, the DCGM fields the metrics export, the agent's own series and
//! the XID catalogue.
//! No I/O of its own; every other crate reads GPUs through it.

pub mod backend;
pub mod cdi;
pub mod config;
pub mod fields;
pub mod health;
pub mod inventory;
pub mod mig;
pub mod nvlib;
pub mod series;
pub mod util;
pub mod xid;

pub use inventory::Inventory;
