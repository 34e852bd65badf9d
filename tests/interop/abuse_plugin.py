#!/usr/bin/env python3
"""Abuses a gpu-agent device-plugin socket the way a broken or hostile
kubelet-side client could (Python grpcio: not our code, not tonic).

  allocate  Allocate with 100,000 device IDs of the advertised shape (larger
            than the server's message limit), with 100,000 short duplicate IDs
            (under it), with one ID of 512 KiB, with one ID twice, with
            100,000 container requests; GetPreferredAllocation with 100,000
            available IDs; then a normal Allocate of one advertised device.
            Prints one JSON object: for each case the status code and details
            (or "OK" and the response's NVIDIA_VISIBLE_DEVICES).

  streams   Opens --streams ListAndWatch streams at once over --channels
            connections (asyncio grpcio). A stream is "served" when its first
            device list arrives, "refused" when it ends with a status first.
            Prints {"served": N, "refused": {CODE: N}, "details": [...],
            "devices": N} as soon as every stream has one or the other, keeps
            the served ones open (reading whatever comes) until stdin closes,
            then cancels them and prints {"closed": N}.

Usage: abuse_plugin.py --proto PROTO --socket SOCK allocate
       abuse_plugin.py --proto PROTO --socket SOCK streams [--streams N] [--channels C]
"""
import argparse
import asyncio
import json
import os
import sys
import threading

import grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from standin_common import load_stubs  # noqa: E402

# Separate connections for separate channels (grpcio shares one per target
# unless told not to), and no client-side cap on what we send.
OPTIONS = [
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", 64 << 20),
]


def outcome(call):
    try:
        resp = call()
    except grpc.RpcError as e:
        return {"code": e.code().name, "details": e.details()}
    return {"code": "OK", "response": resp}


def allocate(pb, pb_grpc, target):
    ch = grpc.insecure_channel(target, options=OPTIONS)
    stub = pb_grpc.DevicePluginStub(ch)
    first = next(stub.ListAndWatch(pb.Empty(), timeout=10))
    ids = [d.ID for d in first.devices]
    seen = {"devices": len(ids)}

    def alloc(*containers):
        req = pb.AllocateRequest(container_requests=[
            pb.ContainerAllocateRequest(devices_ids=c) for c in containers])
        r = outcome(lambda: stub.Allocate(req, timeout=30))
        if r["code"] == "OK":
            r["response"] = dict(r["response"].container_responses[0].envs).get("NVIDIA_VISIBLE_DEVICES")
        r["request_bytes"] = req.ByteSize()
        return r

    # 100,000 IDs shaped like ours (the advertised ones, over and over).
    seen["hundred_thousand_ids"] = alloc([ids[i % len(ids)] + f"::{i}" for i in range(100_000)])
    # 100,000 one-byte IDs, all the same: under the byte limit.
    seen["hundred_thousand_short_ids"] = alloc(["x"] * 100_000)
    seen["long_id"] = alloc(["G" * (512 << 10)])
    seen["duplicate_id"] = alloc([ids[0], ids[0]])
    seen["hundred_thousand_containers"] = alloc(*([["x"]] * 100_000))
    pref = pb.PreferredAllocationRequest(container_requests=[pb.ContainerPreferredAllocationRequest(
        available_deviceIDs=["x"] * 100_000, allocation_size=1)])
    r = outcome(lambda: stub.GetPreferredAllocation(pref, timeout=30))
    r.pop("response", None)
    seen["preferred_hundred_thousand_ids"] = r
    seen["normal"] = alloc([ids[0]])
    seen["normal_id"] = ids[0]
    print(json.dumps(seen), flush=True)


async def streams(pb, pb_grpc, target, n, channels):
    chans = [grpc.aio.insecure_channel(target, options=OPTIONS) for _ in range(channels)]
    stubs = [pb_grpc.DevicePluginStub(c) for c in chans]
    served, refused, details, devices = 0, {}, set(), 0
    calls = []
    decided = asyncio.Event()
    pending = n

    async def one(i):
        nonlocal served, pending, devices
        call = stubs[i % channels].ListAndWatch(pb.Empty())
        calls.append(call)
        first = True
        try:
            async for resp in call:
                if first:
                    first = False
                    served += 1
                    devices = len(resp.devices)
                    pending -= 1
                    if pending == 0:
                        decided.set()
        except grpc.aio.AioRpcError as e:
            if first:
                code = e.code().name
                refused[code] = refused.get(code, 0) + 1
                details.add(e.details())
                pending -= 1
                if pending == 0:
                    decided.set()
        except asyncio.CancelledError:
            pass

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    try:
        await asyncio.wait_for(decided.wait(), timeout=60)
    except asyncio.TimeoutError:
        pass
    print(json.dumps({"served": served, "refused": refused, "undecided": pending,
                      "details": sorted(details), "devices": devices}), flush=True)
    # Hold until stdin closes.
    closed = asyncio.Event()
    loop = asyncio.get_running_loop()
    threading.Thread(target=lambda: (sys.stdin.read(), loop.call_soon_threadsafe(closed.set)),
                     daemon=True).start()
    await closed.wait()
    for c in calls:
        c.cancel()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for c in chans:
        await c.close()
    print(json.dumps({"closed": served}), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--proto", required=True)
    ap.add_argument("--socket", required=True)
    ap.add_argument("mode", choices=["allocate", "streams"])
    ap.add_argument("--streams", type=int, default=2000)
    ap.add_argument("--channels", type=int, default=20)
    args = ap.parse_args()
    pb, pb_grpc = load_stubs(args.proto)
    target = f"unix:{args.socket}"
    if args.mode == "allocate":
        allocate(pb, pb_grpc, target)
    else:
        asyncio.run(streams(pb, pb_grpc, target, args.streams, args.channels))


if __name__ == "__main__":
    main()
