#!/usr/bin/env python3
"""A kubelet stand-in for DRA plugins, written with Python grpcio (not our
code, not tonic).

Does what a kubelet's plugin watcher and DRA manager do with a DRA plugin:
finds the plugin's registration socket in --registry-dir, calls GetInfo,
checks its answer, picks the first version in the plugin's list that this
"kubelet" knows (v1.DRAPlugin, v1beta1.DRAPlugin: what kubelets 1.34-1.36
know), calls NotifyRegistrationStatus (once refusing, to see the refusal
answered with an error carrying its text, then accepting), dials the
endpoint the way a stock grpcio client does, and calls NodePrepareResources
/ NodeUnprepareResources with both v1 and v1beta1: a prepare, the same
prepare again, a batch where one claim fails, unprepares, an unprepare of a
claim never prepared, and an unprepare repeated.

Health (v1alpha1.DRAResourceHealth/NodeWatchResources, on the same endpoint,
as a kubelet with ResourceHealthStatus on): opens the stream right after
registration, opens a second watch, reads its first list and cancels it (a
kubelet retry that went away), reads the first stream's first list (event
"health" step "first"), does the DRA calls, then reads the first stream
until a device is not Healthy (step "unhealthy": the test makes a GPU
unhealthy when it sees "first") and then until every device is Healthy again
(step "healthy": the test heals it when it sees "unhealthy"). Every list
must name the same devices as the first (the plugin sends its complete list
each time).

Prints one JSON line per step on stdout (standin_common.emit); exits non-zero
with a message when an answer breaks the protocol (a missing or extra claim
entry, a wrong GetInfo string, an RPC error where none is due).

Usage: dra_kubelet_standin.py --proto-dir DIR --registry-dir DIR [--timeout SECONDS]
       [--no-health]
"""
import argparse
import os
import stat
import sys
import time

import grpc
from standin_common import emit, load_stubs

# What kubelets 1.34-1.36 know, in their terms (servicesSupportedByKubelet).
KUBELET_KNOWS = ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
REFUSAL = "stand-in kubelet: checking that a refusal is answered"
# The health service's registration string (and gRPC service name).
HEALTH_SERVICE = "v1alpha1.DRAResourceHealth"


def fail(msg):
    emit("failed", error=msg)
    sys.exit(msg)


def find_socket(registry, timeout):
    """The first socket in the registry directory, as the plugin watcher
    finds it (any socket file; here the first by name)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        socks = sorted(
            os.path.join(registry, n) for n in os.listdir(registry)
            if stat.S_ISSOCK(os.lstat(os.path.join(registry, n)).st_mode))
        if socks:
            return socks[0]
        time.sleep(0.02)
    fail(f"no registration socket appeared in {registry}")


def device_dict(d, v1):
    out = {"request_names": list(d.request_names), "pool_name": d.pool_name,
           "device_name": d.device_name, "cdi_device_ids": list(d.cdi_device_ids)}
    if v1:
        out["share_id"] = d.share_id if d.HasField("share_id") else None
    return out


def health_list(resp, hpb):
    """A list as (device, health name, message, pool, timeout) dicts."""
    return [{"pool": d.device.pool_name, "device": d.device.device_name,
             "health": hpb.HealthStatus.Name(d.health), "message": d.message,
             "last_updated_time": d.last_updated_time,
             "timeout": d.health_check_timeout_seconds} for d in resp.devices]


class HealthWatch:
    """One NodeWatchResources stream, read list by list."""

    def __init__(self, ch, hpb, hpb_grpc, deadline):
        stub = hpb_grpc.DRAResourceHealthStub(ch)
        self.hpb = hpb
        self.call = stub.NodeWatchResources(hpb.NodeWatchResourcesRequest(), timeout=deadline)
        self.names = None
        self.count = 0

    def next(self, what):
        try:
            resp = next(self.call)
        except grpc.RpcError as e:
            fail(f"health stream, waiting for {what}: RPC error {e.code().name}: {e.details()}")
        except StopIteration:
            fail(f"health stream ended while waiting for {what}")
        self.count += 1
        devices = health_list(resp, self.hpb)
        names = sorted(d["device"] for d in devices)
        if len(set(names)) != len(names):
            fail(f"health list names a device twice: {names}")
        if self.names is None:
            self.names = names
        elif names != self.names:
            fail(f"health list {names} is not the complete list {self.names}")
        return devices

    def until(self, what, pred):
        """Reads lists until `pred(devices)`; returns it and how many lists
        it took."""
        start = self.count
        while True:
            devices = self.next(what)
            if pred(devices):
                return devices, self.count - start


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--proto-dir", required=True)
    ap.add_argument("--registry-dir", required=True)
    ap.add_argument("--timeout", type=float, default=20)
    ap.add_argument("--no-health", action="store_true",
                    help="do not watch health (a kubelet without ResourceHealthStatus)")
    args = ap.parse_args()
    t = args.timeout
    reg, reg_grpc = load_stubs(os.path.join(args.proto_dir, "pluginregistration_v1.proto"))
    apis = {
        "v1": load_stubs(os.path.join(args.proto_dir, "dra_v1.proto")),
        "v1beta1": load_stubs(os.path.join(args.proto_dir, "dra_v1beta1.proto")),
    }
    hpb, hpb_grpc = load_stubs(os.path.join(args.proto_dir, "dra_health_v1alpha1.proto"))

    # Registration, as the plugin watcher does it.
    sock = find_socket(args.registry_dir, t)
    emit("found", socket=sock)
    with grpc.insecure_channel(f"unix:{sock}") as ch:
        stub = reg_grpc.RegistrationStub(ch)
        info = stub.GetInfo(reg.InfoRequest(), timeout=t)
        versions = list(info.supported_versions)
        emit("info", type=info.type, name=info.name, endpoint=info.endpoint,
             supported_versions=versions)
        if info.type != "DRAPlugin":
            fail(f"GetInfo type {info.type!r}, not 'DRAPlugin'")
        if info.name != "gpu.nvidia.com":
            fail(f"GetInfo name {info.name!r}, not 'gpu.nvidia.com'")
        if not os.path.isabs(info.endpoint):
            fail(f"GetInfo endpoint {info.endpoint!r} is not absolute")
        # The kubelet walks the plugin's list in the plugin's order.
        chosen = next((v for v in versions if v in KUBELET_KNOWS), None)
        if chosen is None:
            stub.NotifyRegistrationStatus(reg.RegistrationStatus(
                plugin_registered=False, error=f"no supported version in {versions}"), timeout=t)
            fail(f"no version this kubelet knows in {versions}")
        emit("chosen", version=chosen)
        try:
            stub.NotifyRegistrationStatus(reg.RegistrationStatus(
                plugin_registered=False, error=REFUSAL), timeout=t)
            fail("a refusal was answered without an error")
        except grpc.RpcError as e:
            emit("refused", code=e.code().name, details=e.details())
        stub.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=True), timeout=t)
        emit("registered")

    # The DRA calls, on the endpoint GetInfo named.
    with grpc.insecure_channel(f"unix:{info.endpoint}") as ch:
        watch = None
        if not args.no_health:
            emit("health_listed", listed=HEALTH_SERVICE in versions)
            # As the kubelet: the stream opened after registration, held.
            watch = HealthWatch(ch, hpb, hpb_grpc, deadline=6 * t)
            # A second watcher that reads one list and goes away (before
            # "first": the test changes health on that line).
            other = HealthWatch(ch, hpb, hpb_grpc, deadline=t)
            emit("health", step="second_watcher", devices=other.next("the first list"))
            other.call.cancel()
            emit("health", step="first", devices=watch.next("the first list"))
        for api, (pb, pb_grpc) in apis.items():
            stub = pb_grpc.DRAPluginStub(ch)
            v1 = api == "v1"

            def claims(*names):
                return [pb.Claim(namespace="team-a", uid=f"{api}-{n}-uid", name=n) for n in names]

            def call(step, method, requested):
                start = time.monotonic()
                try:
                    if method == "prepare":
                        resp = stub.NodePrepareResources(
                            pb.NodePrepareResourcesRequest(claims=requested), timeout=t)
                        answers = {uid: {"devices": [device_dict(d, v1) for d in r.devices],
                                         "error": r.error} for uid, r in resp.claims.items()}
                    else:
                        resp = stub.NodeUnprepareResources(
                            pb.NodeUnprepareResourcesRequest(claims=requested), timeout=t)
                        answers = {uid: {"error": r.error} for uid, r in resp.claims.items()}
                except grpc.RpcError as e:
                    fail(f"{api} {step}: RPC error {e.code().name}: {e.details()}")
                ms = (time.monotonic() - start) * 1e3
                uids = sorted({c.uid for c in requested})
                if sorted(answers) != uids:
                    fail(f"{api} {step}: entries for {sorted(answers)}, asked about {uids}")
                emit("call", api=api, step=step, method=method, requested=uids,
                     claims=answers, ms=ms)

            call("prepare", "prepare", claims("gpu-claim", "shared-claim"))
            call("prepare_again", "prepare", claims("gpu-claim"))
            call("batch_with_failure", "prepare", claims("other-claim", "broken-claim"))
            call("unprepare", "unprepare",
                 claims("gpu-claim", "shared-claim", "other-claim", "broken-claim"))
            call("unprepare_unknown", "unprepare", claims("never-prepared"))
            call("unprepare_again", "unprepare", claims("gpu-claim"))
            emit("api_done", api=api,
                 device_fields=sorted(pb.Device.DESCRIPTOR.fields_by_name))
        if watch is not None:
            devices, lists = watch.until(
                "a device not Healthy", lambda ds: any(d["health"] != "HEALTHY" for d in ds))
            emit("health", step="unhealthy", devices=devices, lists=lists)
            devices, lists = watch.until(
                "every device Healthy", lambda ds: all(d["health"] == "HEALTHY" for d in ds))
            emit("health", step="healthy", devices=devices, lists=lists)
            watch.call.cancel()
    emit("done", chosen=chosen)


if __name__ == "__main__":
    main()
