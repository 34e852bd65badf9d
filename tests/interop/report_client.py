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

Usage: report_client.py --proto PROTO --ca CA --target HOST:PORT --node NODE
         --token TOKEN --other-token TOKEN
"""
import argparse
import json
import os
import queue
import sys

import grpc

# The stubs are made the same way as for the kubelet stand-in.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kubelet_standin import load_stubs  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    for a in ("--proto", "--ca", "--target", "--node", "--token", "--other-token"):
        ap.add_argument(a, required=True)
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


if __name__ == "__main__":
    main()
