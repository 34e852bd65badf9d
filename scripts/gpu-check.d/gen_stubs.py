#!/usr/bin/env python3
"""Generates the Python gRPC stubs of one .proto with grpcio-tools, as
tests/interop/standin_common.py does at each start, but once, into a
directory that can travel (scripts/gpu-check bundle).

Usage: gen_stubs.py OUTDIR PROTO
Writes OUTDIR/<name>_pb2.py, OUTDIR/<name>_pb2_grpc.py and OUTDIR/VERSIONS
(the grpcio and protobuf versions the stubs need at least).
"""
import os
import sys


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: gen_stubs.py OUTDIR PROTO")
    out, proto = sys.argv[1], os.path.abspath(sys.argv[2])
    try:
        import grpc
        import google.protobuf
        from grpc_tools import protoc
    except ImportError as e:
        sys.exit(f"error: {sys.executable} cannot import grpcio-tools ({e}); "
                 "make the venv: python3 -m venv target/pyvenv && "
                 "target/pyvenv/bin/pip install grpcio==1.85.1 grpcio-tools==1.85.1 "
                 "(scripts/test does), or name another Python with --python")
    if not os.path.isfile(proto):
        sys.exit(f"error: {proto}: no such .proto file")
    os.makedirs(out, exist_ok=True)
    grpc_inc = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    rc = protoc.main(["protoc", f"-I{os.path.dirname(proto)}", f"-I{grpc_inc}",
                      f"--python_out={out}", f"--grpc_python_out={out}", proto])
    if rc != 0:
        sys.exit(f"error: protoc failed on {proto}")
    with open(os.path.join(out, "VERSIONS"), "w") as f:
        f.write(f"grpcio {grpc.__version__}\nprotobuf {google.protobuf.__version__}\n")


if __name__ == "__main__":
    main()
