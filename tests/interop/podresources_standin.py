#!/usr/bin/env python3
"""The kubelet's side of a node, written with Python grpcio (not our code).

- Serves the pod-resources API (v1.PodResourcesLister) on
  <host><root-dir>/pod-resources/kubelet.sock (root-dir: --root-dir, as the
  kubelet's flag, default /var/lib/kubelet): List answers the pods
  given in --pods (a JSON file: [{"name", "namespace", "container",
  "resource", "ids": [...]}, ...]); GetAllocatableResources and Get answer
  from the same list.
- Serves the Registration service on
  <host><root-dir>/device-plugins/kubelet.sock: each device plugin
  that registers is dialled back, its first device list read, and one
  container given its first device (Allocate), as the kubelet does when a
  pod starts.

Runs until killed. Writes "listening" to stderr once both sockets are up,
and one line per registration and allocation.

Usage: podresources_standin.py --proto-dir DIR --host ROOT --pods FILE [--root-dir DIR]
"""
import argparse
import importlib
import json
import os
import sys
import tempfile
import threading
from concurrent import futures

import grpc
from grpc_tools import protoc


def load_stubs(proto_dir, name):
    out = tempfile.mkdtemp(prefix="pr-stubs-")
    grpc_inc = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    rc = protoc.main(["protoc", f"-I{proto_dir}", f"-I{grpc_inc}", f"--python_out={out}",
                      f"--grpc_python_out={out}", os.path.join(proto_dir, f"{name}.proto")])
    if rc != 0:
        sys.exit(f"protoc failed on {name}.proto")
    sys.path.insert(0, out)
    return importlib.import_module(f"{name}_pb2"), importlib.import_module(f"{name}_pb2_grpc")


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--proto-dir", required=True)
    ap.add_argument("--host", required=True)
    ap.add_argument("--pods", required=True)
    ap.add_argument("--root-dir", default="/var/lib/kubelet",
                    help="the kubelet's --root-dir (a host path)")
    args = ap.parse_args()
    pr, pr_grpc = load_stubs(args.proto_dir, "podresources_v1")
    dp, dp_grpc = load_stubs(args.proto_dir, "deviceplugin_v1beta1")
    with open(args.pods) as f:
        pods = json.load(f)

    def pod_resources():
        return [pr.PodResources(
            name=p["name"], namespace=p["namespace"],
            containers=[pr.ContainerResources(
                name=p["container"],
                devices=[pr.ContainerDevices(resource_name=p["resource"], device_ids=p["ids"])])])
            for p in pods]

    class Lister(pr_grpc.PodResourcesListerServicer):
        def List(self, request, context):
            return pr.ListPodResourcesResponse(pod_resources=pod_resources())

        def GetAllocatableResources(self, request, context):
            return pr.AllocatableResourcesResponse(devices=[
                pr.ContainerDevices(resource_name=p["resource"], device_ids=p["ids"]) for p in pods])

        def Get(self, request, context):
            for p in pod_resources():
                if p.name == request.pod_name and p.namespace == request.pod_namespace:
                    return pr.GetPodResourcesResponse(pod_resources=p)
            context.abort(grpc.StatusCode.NOT_FOUND, "no such pod")

    root = args.root_dir.strip("/")
    plugins_dir = os.path.join(args.host, root, "device-plugins")

    def allocate_one(endpoint, resource):
        # What the kubelet does for a pod asking for one device.
        try:
            with grpc.insecure_channel(f"unix:{os.path.join(plugins_dir, endpoint)}") as ch:
                stub = dp_grpc.DevicePluginStub(ch)
                stream = stub.ListAndWatch(dp.Empty(), timeout=20)
                first = next(stream)
                stream.cancel()
                ids = [d.ID for d in first.devices][:1]
                stub.Allocate(dp.AllocateRequest(container_requests=[
                    dp.ContainerAllocateRequest(devices_ids=ids)]), timeout=20)
                log(f"allocated {resource} {ids}")
        except grpc.RpcError as e:
            log(f"allocating {resource} failed: {e.code().name} {e.details()}")

    class Registration(dp_grpc.RegistrationServicer):
        def Register(self, request, context):
            log(f"registered {request.resource_name} at {request.endpoint}")
            threading.Thread(target=allocate_one, args=(request.endpoint, request.resource_name),
                             daemon=True).start()
            return dp.Empty()

    socks = []
    for sub, add, servicer in [
        (f"{root}/pod-resources", pr_grpc.add_PodResourcesListerServicer_to_server, Lister()),
        (f"{root}/device-plugins", dp_grpc.add_RegistrationServicer_to_server, Registration()),
    ]:
        d = os.path.join(args.host, sub)
        os.makedirs(d, exist_ok=True)
        sock = os.path.join(d, "kubelet.sock")
        if os.path.exists(sock):
            os.unlink(sock)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        add(servicer, server)
        server.add_insecure_port(f"unix:{sock}")
        server.start()
        socks.append(server)
    log("listening")
    threading.Event().wait()


if __name__ == "__main__":
    main()
