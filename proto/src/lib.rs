//! Generated gRPC code for the APIs gpu-agent speaks.
//!
//! - [`deviceplugin::v1beta1`]: the kubelet device-plugin API (our servers,
//!   and the kubelet's `Registration` service we call).
//! - [`podresources::v1`]: the kubelet pod-resources API (read for metrics).
//! - [`cri::v1`]: the part of the CRI API (`runtime.v1`) gpu-agent calls:
//!   `Status` and `Version` (which runtime answers, and its effective
//!   configuration as it reports it), and the pod sandbox, container and
//!   image calls of the validator's workload check (one short-lived
//!   container with a GPU injected by CDI).
//! - [`report::v1`]: gpu-agent's own report API: each agent's stream to the
//!   cluster controller (`gpu-controller`).

#![allow(missing_debug_implementations, clippy::all, clippy::pedantic)]

pub mod deviceplugin {
    pub mod v1beta1 {
        tonic::include_proto!("v1beta1");

        /// The API version a plugin registers with.
        pub const VERSION: &str = "v1beta1";
        /// Device health values.
        pub const HEALTHY: &str = "Healthy";
        pub const UNHEALTHY: &str = "Unhealthy";
    }
}

pub mod podresources {
    pub mod v1 {
        tonic::include_proto!("v1");
    }
}

pub mod cri {
    pub mod v1 {
        tonic::include_proto!("runtime.v1");
    }
}

pub mod report {
    pub mod v1 {
        tonic::include_proto!("gpuagent.report.v1");

        /// The audience of the projected service-account token an agent
        /// proves itself with.
        pub const TOKEN_AUDIENCE: &str = "gpu-controller";
    }
}
