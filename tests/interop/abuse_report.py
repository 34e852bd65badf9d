#!/usr/bin/env python3
"""Sends gpu-controller report messages larger than it takes (Python grpcio
over TLS: not our code, not tonic), and checks that it still serves.

With --token (bound to --node) it tries, each on its own stream:
  huge_hello     a Hello of --mib MiB (its agent_version)
  huge_snapshot  Hello, then a snapshot of --mib MiB (one label's value)
  normal         Hello and a small snapshot: the controller's first message
                 down the stream (Desired) must come; then the stream is
                 half-closed and read to its end
and prints one JSON object: for each, the status code and details or the
kinds of the messages that came down before it ("down"), plus the size
sent in bytes.

Usage: abuse_report.py --proto PROTO --ca CA --target HOST:PORT --node NODE --token TOKEN [--mib N]
"""
import argparse
import json
import os
import queue
import sys

import grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from standin_common import load_stubs  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    for a in ("--proto", "--ca", "--target", "--node", "--token"):
        ap.add_argument(a, required=True)
    ap.add_argument("--mib", type=int, default=8)
    args = ap.parse_args()
    pb, pb_grpc = load_stubs(args.proto)
    with open(args.ca, "rb") as f:
        creds = grpc.ssl_channel_credentials(root_certificates=f.read())
    options = [("grpc.max_send_message_length", -1), ("grpc.use_local_subchannel_pool", 1)]
    stub = pb_grpc.ReportStub(grpc.secure_channel(args.target, creds, options=options))
    big = "x" * (args.mib << 20)

    def attempt(msgs, until_error=True):
        q = queue.Queue()
        for m in msgs:
            q.put(m)

        def gen():
            while True:
                m = q.get()
                if m is None:
                    return
                yield m

        it = stub.Attach(gen(), metadata=[("authorization", f"Bearer {args.token}")], timeout=30)
        out = {"bytes": sum(m.ByteSize() for m in msgs)}
        out["down"] = []
        try:
            for m in it:
                out["down"].append(m.WhichOneof("body"))
                if not until_error:
                    # Half-close and read to the end: the controller ends
                    # the stream once it has taken every message before
                    # (a cancel here could discard the unread snapshot).
                    q.put(None)
            out["code"] = "OK"
        except grpc.RpcError as e:
            out["code"] = e.code().name
            out["details"] = e.details()
        except StopIteration:
            out["code"] = "ended without a status"
        q.put(None)
        it.cancel()
        return out

    def hello(version="abuse"):
        return pb.AgentMessage(seq=1, hello=pb.Hello(node_name=args.node, agent_version=version))

    def snapshot(value):
        return pb.AgentMessage(seq=2, snapshot=pb.NodeReport(
            labels=pb.Labels(labels={"nvidia.com/gpu.product": value})))

    seen = {
        "huge_hello": attempt([hello(big)]),
        "huge_snapshot": attempt([hello(), snapshot(big)]),
        "normal": attempt([hello(), snapshot("Python-Abuse-GPU")], until_error=False),
    }
    print(json.dumps(seen), flush=True)


if __name__ == "__main__":
    main()
