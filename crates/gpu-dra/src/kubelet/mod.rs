//! The kubelet's side of DRA: plugin registration and the DRA gRPC services.
