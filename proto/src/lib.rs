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
//! - [`pluginregistration`]: the kubelet's plugin registration API
//!   (`pluginregistration.Registration`), served by a DRA plugin.
//! - [`dra::v1`], [`dra::v1beta1`]: the kubelet DRA plugin API
//!   (`NodePrepareResources` / `NodeUnprepareResources`).
//! - [`dra_health::v1alpha1`]: the DRA health stream (`NodeWatchResources`).
//! - [`dra_names`]: DRA device names, which the agent's plugin and the
//!   controller's ResourceSlices must spell alike (not generated).
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

pub mod pluginregistration {
    tonic::include_proto!("pluginregistration");

    /// The plugin type a DRA plugin registers as (`PluginInfo.type`).
    pub const DRA_PLUGIN: &str = "DRAPlugin";
}

pub mod dra {
    pub mod v1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");

        /// The registration string of this API (not its gRPC service name).
        pub const SERVICE: &str = "v1.DRAPlugin";
    }

    pub mod v1beta1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1beta1");

        /// The registration string of this API (not its gRPC service name).
        pub const SERVICE: &str = "v1beta1.DRAPlugin";
    }
}

pub mod dra_names;

pub mod dra_health {
    pub mod v1alpha1 {
        tonic::include_proto!("v1alpha1");

        /// The registration string of this API (its gRPC service name).
        pub const SERVICE: &str = "v1alpha1.DRAResourceHealth";
    }
}

/// The report API's codec: prost with 1 KiB starting buffers instead of
/// tonic's 8 KiB, one encoder and one decoder per stream. A controller holds
/// one stream per node open, and those two buffers were a quarter of each
/// connection's memory; the buffers grow for a large message as before.
pub mod lean {
    use tonic::codec::{BufferSettings, Codec};
    use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

    fn settings() -> BufferSettings {
        BufferSettings::new(1024, 32 * 1024)
    }

    #[derive(Debug, Clone, Copy, Default)]
    pub struct LeanCodec<T, U>(std::marker::PhantomData<(T, U)>);

    impl<T, U> Codec for LeanCodec<T, U>
    where
        T: prost::Message + Send + 'static,
        U: prost::Message + Default + Send + 'static,
    {
        type Encode = T;
        type Decode = U;
        type Encoder = ProstEncoder<T>;
        type Decoder = ProstDecoder<U>;

        fn encoder(&mut self) -> Self::Encoder {
            ProstCodec::<T, U>::raw_encoder(settings())
        }

        fn decoder(&mut self) -> Self::Decoder {
            ProstCodec::<T, U>::raw_decoder(settings())
        }
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
