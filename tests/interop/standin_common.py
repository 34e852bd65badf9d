"""What the kubelet stand-ins share: gRPC stubs compiled from a .proto
with grpcio-tools at start, and JSON event lines on stdout."""
import importlib
import json
import os
import sys
import tempfile
import threading
import time

from grpc_tools import protoc

_out_lock = threading.Lock()


def emit(event, **fields):
    """One JSON line on stdout with `event` and `t`, CLOCK_MONOTONIC in
    seconds, then the fields."""
    fields = {"event": event, "t": time.clock_gettime(time.CLOCK_MONOTONIC), **fields}
    with _out_lock:
        print(json.dumps(fields), flush=True)


def load_stubs(proto):
    """The (messages, services) modules protoc makes of `proto`."""
    out = tempfile.mkdtemp(prefix="dp-stubs-")
    inc = os.path.dirname(os.path.abspath(proto))
    grpc_inc = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    rc = protoc.main(["protoc", f"-I{inc}", f"-I{grpc_inc}", f"--python_out={out}",
                      f"--grpc_python_out={out}", os.path.abspath(proto)])
    if rc != 0:
        sys.exit(f"protoc failed on {proto}")
    sys.path.insert(0, out)
    base = os.path.splitext(os.path.basename(proto))[0]
    return importlib.import_module(f"{base}_pb2"), importlib.import_module(f"{base}_pb2_grpc")
