#!/usr/bin/env python3
"""Abuses gpu-agent's /metrics endpoint with raw sockets (no HTTP library):

  slow      --slow N connections that send a request head one byte a second
            (slowloris), and --deaf M connections that pipeline --pipeline
            requests and never read an answer. Prints {"opened": N+M} once
            they are all connected, keeps dribbling until --seconds have
            passed, then prints for each kind how many the server closed and
            when (seconds after they connected):
              {"slow": {"closed": [s...], "open": K},
               "deaf": {"closed": K, "open": K, "bytes": [n...]}}
            A deaf connection counts as closed when, read at the end, it
            reaches end-of-file (what the server wrote before closing is
            read first: "bytes", and "answers" counts the 200s in it). The
            kernel may take every answer into the client's receive buffer
            (tcp_rmem allows up to 32 MiB on many hosts): such a client was
            served in full and is left open until it goes idle.

  flood     --flood N connections opened at once, sending nothing. Prints
            {"opened": N, "closed_by_server": K, "open": N-K} --seconds
            after the last one connected, then holds them until stdin closes.

Usage: abuse_metrics.py --port PORT slow [--slow N] [--deaf M] [--pipeline R] [--seconds S]
       abuse_metrics.py --port PORT flood [--flood N] [--seconds S]
"""
import argparse
import json
import select
import socket
import sys
import time

REQUEST = b"GET /metrics HTTP/1.1\r\nHost: abuse\r\n\r\n"


def connect(port):
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.setblocking(False)
    return s


def closed_now(s):
    """True when the server closed `s` (end-of-file or a reset), reading and
    dropping whatever it sent before."""
    p = select.poll()
    p.register(s, select.POLLIN)
    try:
        while True:
            if not p.poll(0):
                return False
            data = s.recv(65536)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True


def slow(args):
    head = b"GET /metrics HTTP/1.1\r\nHost: abuse\r\nX-Slow: " + b"x" * 10_000
    slow = [(connect(args.port), time.monotonic()) for _ in range(args.slow)]
    deaf = []
    for _ in range(args.deaf):
        s = connect(args.port)
        s.setblocking(True)
        s.settimeout(0.2)
        sent = 0
        payload = REQUEST * args.pipeline
        try:
            while sent < len(payload):
                sent += s.send(payload[sent:])
        except (socket.timeout, BlockingIOError):
            pass  # the server stopped reading: its buffers and ours are full
        s.setblocking(False)
        deaf.append(s)
    print(json.dumps({"opened": len(slow) + len(deaf)}), flush=True)
    start = time.monotonic()
    closed_at = {}
    i = 0
    while time.monotonic() - start < args.seconds:
        for k, (s, t0) in enumerate(slow):
            if k in closed_at:
                continue
            if closed_now(s):
                closed_at[k] = round(time.monotonic() - t0, 1)
                continue
            try:
                s.send(head[i:i + 1] if i < len(head) else b"x")
            except (BrokenPipeError, ConnectionResetError, BlockingIOError):
                closed_at[k] = round(time.monotonic() - t0, 1)
        i += 1
        time.sleep(1)
    deaf_bytes, deaf_answers, deaf_eof = [], [], []
    for s in deaf:
        n, eof, answers, tail = 0, False, 0, b""
        s.setblocking(True)
        s.settimeout(1)
        try:
            while True:
                data = s.recv(1 << 20)
                if not data:
                    eof = True
                    break
                n += len(data)
                chunk = tail + data
                answers += chunk.count(b"HTTP/1.1 200 OK")
                tail = chunk[-15:]
        except socket.timeout:
            pass
        except (ConnectionResetError, BrokenPipeError):
            eof = True
        deaf_bytes.append(n)
        deaf_answers.append(answers)
        deaf_eof.append(eof)
    print(json.dumps({
        "slow": {"closed": sorted(closed_at.values()), "open": len(slow) - len(closed_at)},
        "deaf": {"closed": sum(deaf_eof), "open": len(deaf) - sum(deaf_eof), "eof": deaf_eof,
                 "bytes": deaf_bytes, "answers": deaf_answers},
    }), flush=True)


def flood(args):
    conns = []
    for _ in range(args.flood):
        try:
            conns.append(connect(args.port))
        except OSError:
            break
    time.sleep(args.seconds)
    closed = sum(closed_now(s) for s in conns)
    print(json.dumps({"opened": len(conns), "closed_by_server": closed, "open": len(conns) - closed}),
          flush=True)
    sys.stdin.read()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("mode", choices=["slow", "flood"])
    ap.add_argument("--slow", type=int, default=8)
    ap.add_argument("--deaf", type=int, default=8)
    ap.add_argument("--pipeline", type=int, default=2000)
    ap.add_argument("--flood", type=int, default=500)
    ap.add_argument("--seconds", type=float, default=15)
    args = ap.parse_args()
    slow(args) if args.mode == "slow" else flood(args)


if __name__ == "__main__":
    main()
