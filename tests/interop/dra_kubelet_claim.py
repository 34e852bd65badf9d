#!/usr/bin/env python3
"""A kubelet stand-in (Python grpcio, not our code) for one claim end to
end: registers the DRA plugin it finds in --registry-dir as a kubelet's
plugin watcher does (GetInfo, NotifyRegistrationStatus accepted), then,
when the test says so, prepares and unprepares one ResourceClaim with the
DRA v1 API, as the kubelet does for a pod that uses it.

Steps, each on the test's word: a line on stdin ("prepare" or "unprepare"
or "quit"). Each answer is one JSON line on stdout (standin_common.emit):
"registered" (with GetInfo's answer), "prepared" (the claim's entry:
devices with their CDI IDs, or its error), "unprepared".

--host-root: the plugin runs with a host root (a test's temp dir); the
endpoint GetInfo names is a host path, dialled under that root.

Usage: dra_kubelet_claim.py --proto-dir DIR --registry-dir DIR
       --claim NAMESPACE/NAME/UID [--host-root DIR] [--timeout SECONDS]
"""
import argparse
import os
import sys
import time

import grpc
from standin_common import emit, load_stubs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--proto-dir", required=True)
    ap.add_argument("--registry-dir", required=True)
    ap.add_argument("--claim", required=True)
    ap.add_argument("--host-root", default="/")
    ap.add_argument("--timeout", type=float, default=60)
    args = ap.parse_args()
    ns, name, uid = args.claim.split("/")
    reg, reg_grpc = load_stubs(os.path.join(args.proto_dir, "pluginregistration_v1.proto"))
    pb, pb_grpc = load_stubs(os.path.join(args.proto_dir, "dra_v1.proto"))

    deadline = time.monotonic() + args.timeout
    sock = None
    while time.monotonic() < deadline:
        if os.path.isdir(args.registry_dir):
            socks = sorted(n for n in os.listdir(args.registry_dir) if n.endswith("-reg.sock"))
            if socks:
                sock = os.path.join(args.registry_dir, socks[0])
                break
        time.sleep(0.05)
    if sock is None:
        sys.exit(f"no registration socket in {args.registry_dir}")
    with grpc.insecure_channel(f"unix:{sock}") as ch:
        stub = reg_grpc.RegistrationStub(ch)
        info = stub.GetInfo(reg.InfoRequest(), timeout=10)
        if "v1.DRAPlugin" not in info.supported_versions:
            sys.exit(f"the plugin does not serve v1.DRAPlugin: {list(info.supported_versions)}")
        stub.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=True), timeout=10)
    emit("registered", type=info.type, name=info.name, endpoint=info.endpoint,
         versions=list(info.supported_versions))
    endpoint = os.path.join(args.host_root, info.endpoint.lstrip("/"))
    claim = pb.Claim(namespace=ns, name=name, uid=uid)
    with grpc.insecure_channel(f"unix:{endpoint}") as ch:
        stub = pb_grpc.DRAPluginStub(ch)
        for line in sys.stdin:
            word = line.strip()
            if word == "prepare":
                started = time.monotonic()
                resp = stub.NodePrepareResources(
                    pb.NodePrepareResourcesRequest(claims=[claim]), timeout=45)
                took = time.monotonic() - started
                entry = resp.claims.get(uid)
                if entry is None:
                    sys.exit(f"no entry for claim {uid} in {resp}")
                emit("prepared", seconds=took, error=entry.error, devices=[
                    {"requests": list(d.request_names), "pool": d.pool_name,
                     "device": d.device_name, "cdi": list(d.cdi_device_ids)}
                    for d in entry.devices])
            elif word == "unprepare":
                resp = stub.NodeUnprepareResources(
                    pb.NodeUnprepareResourcesRequest(claims=[claim]), timeout=45)
                entry = resp.claims.get(uid)
                if entry is None:
                    sys.exit(f"no entry for claim {uid} in {resp}")
                emit("unprepared", error=entry.error)
            elif word == "quit":
                return
            else:
                sys.exit(f"unknown step {word!r}")


if __name__ == "__main__":
    main()
