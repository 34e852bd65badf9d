#!/usr/bin/env python3
"""A timing kubelet stand-in for scripts/gpu-check (Python grpcio: not our
code, not tonic), after tests/interop/kubelet_standin.py.

It serves the kubelet's Registration service on <dir>/kubelet.sock. For each
registration it dials the plugin's socket as a stock grpcio client does,
asks for its options, opens ListAndWatch (and holds it open, as the kubelet
does), asks for a preferred allocation and times Allocate. Agents may come
and go: each new registration is numbered and handled the same way. It
exits when stdin closes.

Everything it sees is one JSON line on stdout, each with `t`, the
CLOCK_MONOTONIC time in seconds (the clock gpu-check starts the agent by):
  {"event": "listening"}
  {"event": "registered", "n": N, "endpoint": E, "resource": R, "version": V}
  {"event": "list", "n": N, "devices": K, "healthy": H, "ids": [...]}   (every list)
  {"event": "allocated", "n": N, "calls": C, "p50_ms": .., "p90_ms": .., "max_ms": .., "envs": {...}}
  {"event": "error", "n": N, "where": W, "code": C, "details": D}

Stubs: --stubs DIR holds deviceplugin_v1beta1_pb2{,_grpc}.py (gpu-check
generates them from proto/ once, or brings them in its bundle).

Usage: kubelet_timed.py --stubs DIR --dir DIR [--allocations N]
"""
import argparse
import importlib
import json
import os
import queue
import sys
import threading
import time
from concurrent import futures

_lock = threading.Lock()


def emit(event, **fields):
    fields = {"event": event, "t": time.clock_gettime(time.CLOCK_MONOTONIC), **fields}
    with _lock:
        print(json.dumps(fields), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stubs", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--allocations", type=int, default=50)
    ap.add_argument("--timeout", type=float, default=20)
    args = ap.parse_args()
    try:
        import grpc
    except ImportError as e:
        sys.exit(f"kubelet stand-in: cannot import grpc ({e}); gpu-check brings grpcio wheels in its bundle")
    sys.path.insert(0, os.path.abspath(args.stubs))
    pb = importlib.import_module("deviceplugin_v1beta1_pb2")
    pb_grpc = importlib.import_module("deviceplugin_v1beta1_pb2_grpc")

    registrations = queue.Queue()

    class Registration(pb_grpc.RegistrationServicer):
        def Register(self, request, context):
            t = time.clock_gettime(time.CLOCK_MONOTONIC)
            registrations.put((t, request.endpoint, request.resource_name, request.version))
            return pb.Empty()

    ksock = os.path.join(args.dir, "kubelet.sock")
    if os.path.exists(ksock):
        os.unlink(ksock)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_RegistrationServicer_to_server(Registration(), server)
    server.add_insecure_port(f"unix:{ksock}")
    server.start()
    emit("listening", socket=ksock)

    channels = []

    def serve(n, endpoint):
        t = args.timeout
        where = "dial"
        try:
            ch = grpc.insecure_channel(f"unix:{os.path.join(args.dir, endpoint)}",
                                       options=[("grpc.use_local_subchannel_pool", 1)])
            channels.append(ch)
            stub = pb_grpc.DevicePluginStub(ch)
            where = "GetDevicePluginOptions"
            opts = stub.GetDevicePluginOptions(pb.Empty(), timeout=t)
            where = "ListAndWatch"
            stream = stub.ListAndWatch(pb.Empty())
            first = queue.Queue()

            def watch():
                try:
                    for resp in stream:
                        ids = [d.ID for d in resp.devices]
                        healthy = sum(1 for d in resp.devices if d.health == "Healthy")
                        emit("list", n=n, devices=len(ids), healthy=healthy, ids=ids)
                        first.put(ids)
                except grpc.RpcError as e:
                    if e.code() != grpc.StatusCode.CANCELLED:
                        emit("stream_end", n=n, code=e.code().name, details=e.details())
                    first.put(None)

            threading.Thread(target=watch, daemon=True).start()
            ids = first.get(timeout=t)
            if not ids:
                emit("error", n=n, where=where, code="NO_DEVICES", details="the first list was empty or the stream ended")
                return
            preferred = ids[:1]
            if opts.get_preferred_allocation_available:
                where = "GetPreferredAllocation"
                pref = stub.GetPreferredAllocation(pb.PreferredAllocationRequest(container_requests=[
                    pb.ContainerPreferredAllocationRequest(available_deviceIDs=ids, allocation_size=1)]),
                    timeout=t)
                preferred = list(pref.container_responses[0].deviceIDs) or preferred
            where = "Allocate"
            times = []
            envs = {}
            for i in range(max(1, args.allocations)):
                dev = preferred if i == 0 else [ids[i % len(ids)]]
                start = time.perf_counter()
                alloc = stub.Allocate(pb.AllocateRequest(container_requests=[
                    pb.ContainerAllocateRequest(devices_ids=dev)]), timeout=t)
                times.append((time.perf_counter() - start) * 1e3)
                if i == 0:
                    envs = dict(alloc.container_responses[0].envs)
            times.sort()
            emit("allocated", n=n, calls=len(times), p50_ms=times[len(times) // 2],
                 p90_ms=times[min(len(times) - 1, (len(times) * 9) // 10)], max_ms=times[-1],
                 preferred=preferred, envs=envs,
                 preferred_available=opts.get_preferred_allocation_available)
        except grpc.RpcError as e:
            emit("error", n=n, where=where, code=e.code().name, details=e.details())
        except queue.Empty:
            emit("error", n=n, where=where, code="TIMEOUT", details=f"no list within {args.timeout} s")

    def registered():
        n = 0
        while True:
            t, endpoint, resource, version = registrations.get()
            n += 1
            emit("registered", n=n, at=t, endpoint=endpoint, resource=resource, version=version)
            threading.Thread(target=serve, args=(n, endpoint), daemon=True).start()

    threading.Thread(target=registered, daemon=True).start()
    for _ in sys.stdin:
        pass
    server.stop(0)


if __name__ == "__main__":
    main()
