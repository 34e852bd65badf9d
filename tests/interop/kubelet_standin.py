#!/usr/bin/env python3
"""A kubelet stand-in written with Python grpcio (not our code, not tonic).

It serves the kubelet's Registration service on <dir>/kubelet.sock, waits
for a device plugin to register, then dials the plugin's socket the way a
stock grpcio client does (no authority override: grpcio sends the socket
path, percent-encoded, as :authority) and calls every DevicePlugin RPC.
Prints one JSON object with what it saw; exits 1 on any RPC error.

Usage: kubelet_standin.py --proto PROTO --dir DIR [--timeout SECONDS]
"""
import argparse
import json
import os
import sys
import threading
import time
from concurrent import futures

import grpc
from standin_common import load_stubs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--proto", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--timeout", type=float, default=20)
    args = ap.parse_args()
    pb, pb_grpc = load_stubs(args.proto)

    registered = []
    got = threading.Event()

    class Registration(pb_grpc.RegistrationServicer):
        def Register(self, request, context):
            registered.append({
                "version": request.version,
                "endpoint": request.endpoint,
                "resource_name": request.resource_name,
                "preferred": request.options.get_preferred_allocation_available,
            })
            got.set()
            return pb.Empty()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_RegistrationServicer_to_server(Registration(), server)
    ksock = os.path.join(args.dir, "kubelet.sock")
    if os.path.exists(ksock):
        os.unlink(ksock)
    server.add_insecure_port(f"unix:{ksock}")
    server.start()
    print("listening", file=sys.stderr, flush=True)
    if not got.wait(args.timeout):
        sys.exit("no plugin registered")
    reg = registered[0]
    result = {"registrations": registered}
    target = f"unix:{os.path.join(args.dir, reg['endpoint'])}"
    with grpc.insecure_channel(target) as ch:
        stub = pb_grpc.DevicePluginStub(ch)
        t = args.timeout
        opts = stub.GetDevicePluginOptions(pb.Empty(), timeout=t)
        result["options"] = {"pre_start_required": opts.pre_start_required,
                             "preferred": opts.get_preferred_allocation_available}
        stream = stub.ListAndWatch(pb.Empty(), timeout=t)
        first = next(stream)
        stream.cancel()
        ids = [d.ID for d in first.devices]
        result["devices"] = [{"id": d.ID, "health": d.health,
                              "numa": [n.ID for n in d.topology.nodes]} for d in first.devices]
        pref = stub.GetPreferredAllocation(pb.PreferredAllocationRequest(container_requests=[
            pb.ContainerPreferredAllocationRequest(available_deviceIDs=ids, allocation_size=2)]), timeout=t)
        result["preferred"] = list(pref.container_responses[0].deviceIDs)
        start = time.monotonic()
        alloc = stub.Allocate(pb.AllocateRequest(container_requests=[
            pb.ContainerAllocateRequest(devices_ids=result["preferred"])]), timeout=t)
        result["allocate_ms"] = (time.monotonic() - start) * 1e3
        c = alloc.container_responses[0]
        result["allocate"] = {"envs": dict(c.envs), "annotations": dict(c.annotations),
                              "cdi": [d.name for d in c.cdi_devices],
                              "devices": [d.host_path for d in c.devices]}
        try:
            stub.Allocate(pb.AllocateRequest(container_requests=[
                pb.ContainerAllocateRequest(devices_ids=["no-such-gpu"])]), timeout=t)
            result["bad_allocate"] = "accepted"
        except grpc.RpcError as e:
            result["bad_allocate"] = {"code": e.code().name, "details": e.details()}
        stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=ids[:1]), timeout=t)
        result["prestart"] = "ok"
    server.stop(0)
    print(json.dumps(result))


if __name__ == "__main__":
    try:
        main()
    except grpc.RpcError as e:
        print(json.dumps({"rpc_error": {"code": e.code().name, "details": e.details()}}))
        sys.exit(1)
