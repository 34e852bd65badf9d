//! Compiles the .proto files in pure Rust (protox): no protoc needed.

fn main() {
    let protos = [
        "proto/deviceplugin_v1beta1.proto",
        "proto/podresources_v1.proto",
        "proto/cri_runtime_v1.proto",
        "proto/report_v1.proto",
    ];
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    let fds = protox::compile(protos, ["proto"]).expect("the .proto files compile");
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)
        .expect("tonic code generation");
}
