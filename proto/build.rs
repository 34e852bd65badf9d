//! Compiles the .proto files in pure Rust (protox): no protoc needed.

fn main() {
    let protos = [
        "proto/deviceplugin_v1beta1.proto",
        "proto/podresources_v1.proto",
        "proto/cri_runtime_v1.proto",
        // Dynamic Resource Allocation (issue 31): plugin registration, the
        // DRA services v1 and v1beta1, and the health stream.
        "proto/pluginregistration_v1.proto",
        "proto/dra_v1.proto",
        "proto/dra_v1beta1.proto",
        "proto/dra_health_v1alpha1.proto",
    ];
    for p in protos.iter().chain(&[REPORT]) {
        println!("cargo:rerun-if-changed={p}");
    }
    let fds = protox::compile(protos, ["proto"]).expect("the .proto files compile");
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)
        .expect("tonic code generation");
    // The report API: one stream per node held open for days, thousands on
    // one controller: its codec keeps small buffers (see lean::LeanCodec).
    let fds = protox::compile([REPORT], ["proto"]).expect("report_v1.proto compiles");
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .codec_path("crate::lean::LeanCodec")
        .compile_fds(fds)
        .expect("tonic code generation (report)");
}

const REPORT: &str = "proto/report_v1.proto";
