#!/usr/bin/env python3
"""A kubelet stand-in that restarts without letting go of its old streams
(Python grpcio: not our code, not tonic).

It serves the kubelet's Registration service on <dir>/kubelet.sock. For
each registration it dials the plugin's socket on a new channel (with a
connection of its own), as a stock grpcio client does, and holds a
ListAndWatch stream open, recording every list and the stream's end.
Channels are never closed: an old stream ends only when the plugin ends it.

Commands, one a line on stdin:
  hold     open one more ListAndWatch stream on the latest registration's
           socket, on a channel of its own (an abuser's: never cancelled)
  restart  what a restarting kubelet does to the directory: stop serving
           Registration, delete every socket in <dir>, serve Registration
           on a new kubelet.sock
It exits when stdin closes.

Everything it sees is printed to stdout as JSON lines, each with `t`, the
CLOCK_MONOTONIC time in seconds:
  {"event": "registered", "n": N, "endpoint": E}
  {"event": "list", "n": N, "who": "kubelet" | "abuser", "devices": K}
  {"event": "stream_end", "n": N, "who": ..., "code": "UNAVAILABLE" | ..., "details": D}
  {"event": "restarted", "removed": [names]}

Usage: kubelet_restart_standin.py --proto PROTO --dir DIR
"""
import argparse
import os
import queue
import stat
import sys
import threading
from concurrent import futures

import grpc
from standin_common import emit, load_stubs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--proto", required=True)
    ap.add_argument("--dir", required=True)
    args = ap.parse_args()
    pb, pb_grpc = load_stubs(args.proto)
    registrations = queue.Queue()
    ksock = os.path.join(args.dir, "kubelet.sock")
    # Every channel ever opened: none is closed, so no stream ends from here.
    channels = []
    latest = {}

    class Registration(pb_grpc.RegistrationServicer):
        def Register(self, request, context):
            registrations.put(request.endpoint)
            return pb.Empty()

    def serve_registration():
        if os.path.exists(ksock):
            os.unlink(ksock)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pb_grpc.add_RegistrationServicer_to_server(Registration(), server)
        server.add_insecure_port(f"unix:{ksock}")
        server.start()
        return server

    def watch(n, who, endpoint):
        # A connection of its own (grpcio would otherwise share one between
        # channels to the same socket).
        ch = grpc.insecure_channel(f"unix:{os.path.join(args.dir, endpoint)}",
                                   options=[("grpc.use_local_subchannel_pool", 1)])
        channels.append(ch)
        stub = pb_grpc.DevicePluginStub(ch)

        def run():
            code, details = "OK", ""
            try:
                for resp in stub.ListAndWatch(pb.Empty()):
                    emit("list", n=n, who=who, devices=len(resp.devices))
            except grpc.RpcError as e:
                code, details = e.code().name, e.details()
            emit("stream_end", n=n, who=who, code=code, details=details)

        threading.Thread(target=run, daemon=True).start()

    def serve_plugins():
        n = 0
        while True:
            endpoint = registrations.get()
            n += 1
            latest["n"], latest["endpoint"] = n, endpoint
            emit("registered", n=n, endpoint=endpoint)
            watch(n, "kubelet", endpoint)

    server = serve_registration()
    print("listening", file=sys.stderr, flush=True)
    threading.Thread(target=serve_plugins, daemon=True).start()
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "hold":
            watch(latest["n"], "abuser", latest["endpoint"])
        elif cmd == "restart":
            server.stop(None)
            removed = []
            for name in sorted(os.listdir(args.dir)):
                path = os.path.join(args.dir, name)
                try:
                    if stat.S_ISSOCK(os.lstat(path).st_mode):
                        os.unlink(path)
                        removed.append(name)
                except FileNotFoundError:
                    pass
            server = serve_registration()
            emit("restarted", removed=removed)
        elif cmd:
            sys.exit(f"unknown command {cmd!r}")
    server.stop(0)


if __name__ == "__main__":
    main()
