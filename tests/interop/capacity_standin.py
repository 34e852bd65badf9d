#!/usr/bin/env python3
"""The kubelet's device manager, as far as capacity goes, written with
Python grpcio (not our code).

Serves the Registration service on <dir>/kubelet.sock. Every device plugin
that registers is dialled back and its ListAndWatch stream kept open, as the
kubelet does; each list it sends replaces what the node advertises for that
resource. When a stream ends (the plugin stopped serving it), the resource's
devices are no longer allocatable: the kubelet keeps the name with 0 devices.
A new registration of the same resource replaces the old stream.

After every change, <out> (JSON, replaced atomically) holds the node's view:
{"<resource>": {"devices": {"<id>": "Healthy"|"Unhealthy"}, "open": bool,
"lists": n}}, and one line goes to stderr.

Usage: capacity_standin.py --proto PROTO --dir DIR --out FILE
"""
import argparse
import json
import os
import sys
import threading
from concurrent import futures

import grpc

from standin_common import load_stubs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--proto", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    pb, pb_grpc = load_stubs(args.proto)
    lock = threading.Lock()
    node = {}
    generation = {}

    def publish(why):
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(node, f, sort_keys=True)
        os.replace(tmp, args.out)
        print(why, file=sys.stderr, flush=True)

    def watch(resource, endpoint, gen):
        channel = grpc.insecure_channel("unix://" + os.path.join(args.dir, endpoint))
        stub = pb_grpc.DevicePluginStub(channel)
        try:
            for resp in stub.ListAndWatch(pb.Empty()):
                with lock:
                    if generation.get(resource) != gen:
                        return
                    entry = node.setdefault(resource, {"devices": {}, "open": True, "lists": 0})
                    entry["devices"] = {d.ID: d.health for d in resp.devices}
                    entry["open"] = True
                    entry["lists"] += 1
                    publish(f"list {resource}: {len(resp.devices)} device(s)")
        except grpc.RpcError as e:
            print(f"stream {resource} ended: {e.code().name}", file=sys.stderr, flush=True)
        finally:
            channel.close()
        with lock:
            if generation.get(resource) == gen:
                entry = node.setdefault(resource, {"devices": {}, "open": False, "lists": 0})
                entry["devices"] = {}
                entry["open"] = False
                publish(f"closed {resource}")

    class Registration(pb_grpc.RegistrationServicer):
        def Register(self, request, context):
            with lock:
                gen = generation.get(request.resource_name, 0) + 1
                generation[request.resource_name] = gen
            threading.Thread(target=watch, args=(request.resource_name, request.endpoint, gen),
                             daemon=True).start()
            print(f"registered {request.resource_name} at {request.endpoint}", file=sys.stderr,
                  flush=True)
            return pb.Empty()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    pb_grpc.add_RegistrationServicer_to_server(Registration(), server)
    server.add_insecure_port("unix://" + os.path.join(args.dir, "kubelet.sock"))
    server.start()
    with lock:
        publish("listening")
    server.wait_for_termination()


if __name__ == "__main__":
    main()
