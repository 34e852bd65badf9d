#!/usr/bin/env python3
"""A kubelet stand-in that outlives the device plugin (Python grpcio: not
our code, not tonic), for a rolling update of the agent.

It serves the kubelet's Registration service on <dir>/kubelet.sock and
keeps serving while device plugins come and go. For each registration it
dials the plugin's socket as a stock grpcio client does, keeps its
ListAndWatch stream open (as the kubelet does) and records every list and
the stream's end. At the first registration it asks for a preferred
allocation of --size devices and allocates them (the pod's devices); at
every later one it allocates the same device IDs again.

Everything it sees is printed to stdout as JSON lines, each with `t`, the
CLOCK_MONOTONIC time in seconds:
  {"event": "registered", "n": N, "request": {...}}
  {"event": "list", "n": N, "devices": [{"id", "health"}]}
  {"event": "stream_end", "n": N, "code": "CANCELLED" | ... | "OK"}
  {"event": "allocated", "n": N, "ids": [...], "response": {...}}
  {"event": "error", "n": N, "code": ..., "details": ...}
It exits when stdin closes.

Usage: kubelet_rolling_standin.py --proto PROTO --dir DIR [--size N] [--timeout S]
"""
import argparse
import os
import queue
import sys
import threading
from concurrent import futures

import grpc
from google.protobuf import json_format
from standin_common import emit, load_stubs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--proto", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--size", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=20)
    args = ap.parse_args()
    pb, pb_grpc = load_stubs(args.proto)
    registrations = queue.Queue()

    class Registration(pb_grpc.RegistrationServicer):
        def Register(self, request, context):
            registrations.put(json_format.MessageToDict(request, preserving_proto_field_name=True))
            return pb.Empty()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_RegistrationServicer_to_server(Registration(), server)
    ksock = os.path.join(args.dir, "kubelet.sock")
    if os.path.exists(ksock):
        os.unlink(ksock)
    server.add_insecure_port(f"unix:{ksock}")
    server.start()
    print("listening", file=sys.stderr, flush=True)

    def serve_plugins():
        held = None
        n = 0
        while True:
            request = registrations.get()
            n += 1
            emit("registered", n=n, request=request)
            target = f"unix:{os.path.join(args.dir, request['endpoint'])}"
            ch = grpc.insecure_channel(target)
            stub = pb_grpc.DevicePluginStub(ch)
            first = threading.Event()
            ids = []

            def watch(n=n, stub=stub, first=first, ids=ids):
                code = "OK"
                try:
                    for resp in stub.ListAndWatch(pb.Empty()):
                        devices = [{"id": d.ID, "health": d.health} for d in resp.devices]
                        emit("list", n=n, devices=devices)
                        if not first.is_set():
                            ids.extend(d["id"] for d in devices)
                            first.set()
                except grpc.RpcError as e:
                    code = e.code().name
                emit("stream_end", n=n, code=code)
                first.set()

            threading.Thread(target=watch, daemon=True).start()
            try:
                if not first.wait(args.timeout) or not ids:
                    emit("error", n=n, code="NO_LIST", details="no device list")
                    continue
                if held is None:
                    pref = stub.GetPreferredAllocation(pb.PreferredAllocationRequest(
                        container_requests=[pb.ContainerPreferredAllocationRequest(
                            available_deviceIDs=ids, allocation_size=args.size)]),
                        timeout=args.timeout)
                    held = list(pref.container_responses[0].deviceIDs)
                alloc = stub.Allocate(pb.AllocateRequest(container_requests=[
                    pb.ContainerAllocateRequest(devices_ids=held)]), timeout=args.timeout)
                emit("allocated", n=n, ids=held,
                     response=json_format.MessageToDict(alloc, preserving_proto_field_name=True))
            except grpc.RpcError as e:
                emit("error", n=n, code=e.code().name, details=e.details())

    threading.Thread(target=serve_plugins, daemon=True).start()
    sys.stdin.read()
    server.stop(0)


if __name__ == "__main__":
    main()
