//! Prometheus metrics under dcgm-exporter's names (the `metrics` stage):
//! one NVML pass samples every GPU (every second while someone scrapes); a
//! scrape renders the last sample with the pods that hold each device and
//! the agent's own series, and never waits on NVML.

pub mod pods;
pub mod render;
pub mod server;
pub mod spec;

#[cfg(test)]
use gpu_backend::test_support;

/// The agent's own series and the field table are the model's.
pub use gpu_model::{fields, series as agent};
