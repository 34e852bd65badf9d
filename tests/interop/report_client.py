#!/usr/bin/env python3
"""An agent stand-in written with Python grpcio (not our code, not tonic).

It dials gpu-controller over TLS (trusting only the given CA) and tries the
report API the way a foreign client would:
  1. no token                   -> expects UNAUTHENTICATED
  2. a token for another node   -> expects PERMISSION_DENIED
  3. the right token: Hello, a snapshot with labels and health, reads the
     controller's first message (Desired), then a message out of sequence
                                -> expects INVALID_ARGUMENT
Prints one JSON object with the codes and details it got; exits 1 when a
step does not go as expected.

With --upgrade VERSION it plays a node in the cluster's driver rollout
instead: it reports driver 550.127.08 loaded and VERSION wanted
(upgrade-required), waits for the controller's go-ahead for VERSION, then
reports VERSION loaded and validated (upgrade-done) and keeps the stream
open for --hold seconds. Prints {"go_ahead": VERSION, "desired": [...]}.

With --upgrade VERSION --check-in it plays that node checking in instead of
holding a stream (every 0.3 s, following the answer's redirect to its
shard's replica; when a replica does not answer, the next of --target and
--also, as a Service's endpoints), and reports upgrade-done on the
go-ahead; it checks in for --hold seconds more. Prints {"go_ahead": VERSION, "via": HOST:PORT,
"desired": [...]} (via: the replica that gave the go-ahead).

With --check-in alone it tries the unary CheckIn the same way: no token, another
node's token, a change before any snapshot (the controller asks for one), a
snapshot with two health events, then a change on the answer's base with
those two events sent again and a third (each must be taken once), then a
check-in with both a snapshot and a change (refused). Prints what each
answer said.

Usage: report_client.py --proto PROTO --ca CA --target HOST:PORT --node NODE
         --token TOKEN (--other-token TOKEN [--check-in] | --upgrade VERSION [--check-in] [--hold SECS]
         [--also HOST:PORT])
"""
import argparse
import json
import os
import queue
import sys

import grpc

# The stubs are made the same way as for the kubelet stand-in.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from standin_common import load_stubs  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    for a in ("--proto", "--ca", "--target", "--node", "--token"):
        ap.add_argument(a, required=True)
    ap.add_argument("--other-token")
    ap.add_argument("--upgrade")
    ap.add_argument("--check-in", action="store_true")
    ap.add_argument("--hold", type=float, default=10.0)
    ap.add_argument("--also", action="append", default=[])
    args = ap.parse_args()
    pb, pb_grpc = load_stubs(args.proto)
    with open(args.ca, "rb") as f:
        creds = grpc.ssl_channel_credentials(root_certificates=f.read())
    channel = grpc.secure_channel(args.target, creds)
    stub = pb_grpc.ReportStub(channel)
    seen = {}

    def hello(seq=1):
        return pb.AgentMessage(seq=seq, hello=pb.Hello(node_name=args.node, agent_version="py-standin"))

    def call(msgs, token, read=1):
        q = queue.Queue()
        for m in msgs:
            q.put(m)

        def gen():
            while True:
                m = q.get()
                if m is None:
                    return
                yield m

        md = [("authorization", f"Bearer {token}")] if token else []
        it = stub.Attach(gen(), metadata=md, timeout=20)
        got = []
        try:
            for _ in range(read):
                got.append(next(it))
            return q, it, got, None
        except grpc.RpcError as e:
            q.put(None)
            return q, it, got, e

    if args.upgrade and args.check_in:
        sys.exit(upgrade_check_in(pb, pb_grpc, creds, args))
    if args.upgrade:
        sys.exit(upgrade(pb, call, hello, args))
    if args.check_in:
        sys.exit(check_in(pb, stub, args))
    # 1. No token.
    _, _, _, err = call([hello()], None)
    seen["no_token"] = [err.code().name, err.details()] if err else "accepted"
    # 2. Another node's token.
    _, _, _, err = call([hello()], args.other_token)
    seen["other_node"] = [err.code().name, err.details()] if err else "accepted"
    # 3. The right token.
    report = pb.NodeReport(
        labels=pb.Labels(labels={"nvidia.com/gpu.count": "1", "nvidia.com/gpu.product": "Python-Standin-GPU"}),
        health=pb.Health(gpus=[pb.GpuHealth(uuid="GPU-py", healthy=True)]),
        stages=pb.Stages(stages=[pb.Stage(name="plugin", state="done", validated=True, validation_message="ok")]),
    )
    q, it, got, err = call([hello(), pb.AgentMessage(seq=2, snapshot=report)], args.token)
    seen["first_down"] = got[0].WhichOneof("body") if got else repr(err)
    # Out of sequence: seq 7 where 3 is due.
    q.put(pb.AgentMessage(seq=7, repair=pb.Repair(stage="cdi", what="x")))
    try:
        next(it)
        seen["out_of_sequence"] = "accepted"
    except grpc.RpcError as e:
        seen["out_of_sequence"] = [e.code().name, e.details()]
    except StopIteration:
        seen["out_of_sequence"] = "stream ended without a status"
    q.put(None)
    print(json.dumps(seen))
    ok = (seen["no_token"][0] == "UNAUTHENTICATED"
          and seen["other_node"][0] == "PERMISSION_DENIED"
          and seen["first_down"] == "desired"
          and seen["out_of_sequence"][0] == "INVALID_ARGUMENT")
    sys.exit(0 if ok else 1)


def rollout_node(pb, args, driver, state, detail):
    """The node's report in the driver rollout."""
    return pb.NodeReport(
        inventory=pb.Inventory(driver_version=driver, gpus=[pb.Gpu(uuid="GPU-py", model="Python Standin")]),
        stages=pb.Stages(
            stages=[pb.Stage(name="driver", state="done", validated=True, validation_message=f"driver {driver}")],
            ready=True,
        ),
        upgrade=pb.UpgradeState(state=state, driver_version=args.upgrade, detail=detail),
    )


def upgrade_check_in(pb, pb_grpc, creds, args):
    """A node in the driver rollout that checks in; returns the exit code."""
    import time

    hello = pb.Hello(node_name=args.node, agent_version="py-standin", boot_id="py-boot", agent_started_at=1)
    md = [("authorization", f"Bearer {args.token}")]
    target = args.target
    stub = pb_grpc.ReportStub(grpc.secure_channel(target, creds))
    report = rollout_node(pb, args, "550.127.08", "upgrade-required", "driver 550.127.08 loaded")
    base, version, snapshot, change, tried = "", 0, True, None, 0
    desired, errors, went, done_at = [], [], None, None
    deadline = time.time() + 60
    while time.time() < deadline and not (done_at and time.time() - done_at > args.hold):
        req = pb.CheckInRequest(hello=hello, base=base, desired_version=version)
        if snapshot:
            req.snapshot.CopyFrom(report)
        elif change is not None:
            req.change.CopyFrom(change)
        try:
            a = stub.CheckIn(req, metadata=md, timeout=10)
        except grpc.RpcError as e:
            # Turned away (the replica stopped serving the node, or is
            # gone): through the next address, with a snapshot.
            errors.append([target, e.code().name, e.details()])
            endpoints = [args.target] + args.also
            tried += 1
            target, snapshot = endpoints[tried % len(endpoints)], True
            stub = pb_grpc.ReportStub(grpc.secure_channel(target, creds))
            time.sleep(0.3)
            continue
        if a.redirect:
            target, snapshot = a.redirect.split("://", 1)[-1], True
            stub = pb_grpc.ReportStub(grpc.secure_channel(target, creds))
            time.sleep(0.05)
            continue
        if a.send_snapshot:
            snapshot = True
            continue
        base, version, snapshot, change = a.base, a.desired_version, False, None
        if a.HasField("desired"):
            d = a.desired
            desired.append({"driver_version": d.driver_version, "upgrade_go_ahead": d.upgrade_go_ahead, "via": target})
            if d.upgrade_go_ahead and d.driver_version == args.upgrade and went is None:
                went, done_at = target, time.time()
                report = rollout_node(pb, args, args.upgrade, "upgrade-done", f"upgraded to {args.upgrade}")
                change = report
                continue
        time.sleep(0.3)
    print(json.dumps({"go_ahead": args.upgrade if went else None, "via": went,
                      "desired": desired, "errors": errors[-5:]}), flush=True)
    return 0 if went else 1


def upgrade(pb, call, hello, args):
    """A node in the driver rollout; returns the exit code."""
    import time

    def node(driver, state, detail):
        return rollout_node(pb, args, driver, state, detail)

    q, it, got, err = call(
        [hello(), pb.AgentMessage(seq=2, snapshot=node("550.127.08", "upgrade-required", "driver 550.127.08 loaded"))],
        args.token,
        read=0,
    )
    desired = []
    deadline = time.time() + 30
    try:
        for m in it:
            d = m.desired
            desired.append({"driver_version": d.driver_version, "upgrade_go_ahead": d.upgrade_go_ahead})
            if d.upgrade_go_ahead and d.driver_version == args.upgrade:
                break
            if time.time() > deadline:
                break
    except grpc.RpcError as e:
        print(json.dumps({"error": [e.code().name, e.details()], "desired": desired}))
        return 1
    went = [d for d in desired if d["upgrade_go_ahead"]]
    if not went:
        print(json.dumps({"go_ahead": None, "desired": desired}))
        return 1
    q.put(pb.AgentMessage(seq=3, change=node(args.upgrade, "upgrade-done", f"upgraded to {args.upgrade}")))
    print(json.dumps({"go_ahead": went[0]["driver_version"], "desired": desired}), flush=True)
    time.sleep(args.hold)
    q.put(None)
    return 0


def check_in(pb, stub, args):
    """The unary CheckIn, tried as a foreign client; returns the exit code."""
    seen = {}

    def call(req, token):
        md = [("authorization", f"Bearer {token}")] if token else []
        try:
            return stub.CheckIn(req, metadata=md, timeout=20), None
        except grpc.RpcError as e:
            return None, [e.code().name, e.details()]

    hello = pb.Hello(node_name=args.node, agent_version="py-standin", boot_id="py-boot", agent_started_at=1)
    labels = {"nvidia.com/gpu.count": "1", "nvidia.com/gpu.product": "Python-Standin-GPU"}
    report = pb.NodeReport(
        labels=pb.Labels(labels=labels),
        health=pb.Health(gpus=[pb.GpuHealth(uuid="GPU-py", healthy=True)]),
        stages=pb.Stages(stages=[pb.Stage(name="plugin", state="done", validated=True, validation_message="ok")]),
    )

    def event(n):
        return pb.Happening(health_event=pb.HealthEvent(
            gpu_uuid="GPU-py", xid=94, reason=f"XID 94 from the Python stand-in (#{n})",
            advice="restart the application", unhealthy=False, at_unix_ms=1))

    _, seen["no_token"] = call(pb.CheckInRequest(hello=hello, snapshot=report), None)
    _, seen["other_node"] = call(pb.CheckInRequest(hello=hello, snapshot=report), args.other_token)
    a, err = call(pb.CheckInRequest(hello=hello, change=report), args.token)
    seen["change_first"] = err or {"send_snapshot": a.send_snapshot}
    a, err = call(pb.CheckInRequest(hello=hello, snapshot=report, first_seq=1,
                                    happenings=[event(1), event(2)]), args.token)
    if err:
        seen["snapshot"] = err
    else:
        seen["snapshot"] = {"acked_seq": a.acked_seq, "desired": a.HasField("desired"),
                            "interval_seconds": a.interval_seconds, "base": bool(a.base),
                            "send_snapshot": a.send_snapshot}
        labels2 = dict(labels)
        labels2["nvidia.com/gpu.product"] = "Python-Standin-GPU-2"
        b, err = call(pb.CheckInRequest(
            hello=hello, base=a.base, change=pb.NodeReport(labels=pb.Labels(labels=labels2)),
            first_seq=1, happenings=[event(1), event(2), event(3)],
            desired_version=a.desired_version), args.token)
        seen["change"] = err or {"acked_seq": b.acked_seq, "desired": b.HasField("desired"),
                                 "send_snapshot": b.send_snapshot}
    _, seen["both"] = call(pb.CheckInRequest(hello=hello, snapshot=report, change=report), args.token)
    print(json.dumps(seen))
    ok = (seen["no_token"] and seen["no_token"][0] == "UNAUTHENTICATED"
          and seen["other_node"] and seen["other_node"][0] == "PERMISSION_DENIED"
          and seen["change_first"] == {"send_snapshot": True}
          and isinstance(seen["snapshot"], dict) and seen["snapshot"]["acked_seq"] == 2
          and seen["snapshot"]["desired"] and seen["snapshot"]["interval_seconds"] > 0
          and seen.get("change") == {"acked_seq": 3, "desired": False, "send_snapshot": False}
          and seen["both"] and seen["both"][0] == "INVALID_ARGUMENT")
    return 0 if ok else 1


if __name__ == "__main__":
    main()
