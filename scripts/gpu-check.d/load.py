#!/usr/bin/env python3
"""A short CUDA load for scripts/gpu-check: bf16 matrix products on one GPU
with PyTorch for a given time. It only computes: no GPU setting is changed.

Usage: load.py SECONDS [--device N]
Prints {"event": "started"} when the first products ran (warm), then one
JSON line with what it did: {"event": "done", "tflops": .., "seconds": ..,
"device": name}. Exits 3 when PyTorch or CUDA is not there (saying why).
"""
import argparse
import json
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("seconds", type=float)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--size", type=int, default=8192)
    args = ap.parse_args()
    try:
        import torch
    except ImportError as e:
        print(json.dumps({"event": "skipped", "why": f"PyTorch is not importable ({e})"}), flush=True)
        return 3
    if not torch.cuda.is_available():
        print(json.dumps({"event": "skipped", "why": f"PyTorch {torch.__version__} sees no CUDA device"}), flush=True)
        return 3
    dev = torch.device(f"cuda:{args.device}")
    n = args.size
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        c = a @ b
    torch.cuda.synchronize(dev)
    print(json.dumps({"event": "started", "t": time.clock_gettime(time.CLOCK_MONOTONIC)}), flush=True)
    t0 = time.perf_counter()
    done = 0
    while time.perf_counter() - t0 < args.seconds:
        for _ in range(10):
            c = a @ b
        torch.cuda.synchronize(dev)
        done += 10
    dt = time.perf_counter() - t0
    del c
    print(json.dumps({"event": "done", "tflops": 2 * n ** 3 * done / dt / 1e12, "seconds": dt,
                      "products": done, "device": torch.cuda.get_device_name(dev)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
