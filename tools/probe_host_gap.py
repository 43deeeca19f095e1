"""How much host time a timed call exposes, for us and for the SDPA backends (fp16, forward).

`timed` (bench_attention.py, used by the report) synchronizes after every call, so each call starts
on an idle GPU and its time includes the host work before its first launch. Timed back to back
(events around each call, one synchronize at the end, the host running ahead as in training) the
same call shows its GPU time. The difference is the host time the first method exposes.

    python tools/probe_host_gap.py [--seqlens 1024 4096 16384] [--head-dims 64 128]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from bench_attention import timed  # noqa: E402


def back_to_back(fn, reps=20, warmup=3) -> float:
    """Median ms per call with the calls queued back to back (events around each call)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in events:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in events)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", type=int, nargs="+", default=(1024, 4096, 16384))
    ap.add_argument("--head-dims", type=int, nargs="+", default=(64, 128))
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import sagebwd_cp

    print(torch.cuda.get_device_name(0), "fp16 forward, non-causal; ms per call: synchronized each call / back to back")
    for d in args.head_dims:
        for n in args.seqlens:
            b, h = max(1, 16384 // n), 2048 // d
            q, k, v = (torch.randn((b, h, n, d), device="cuda", dtype=torch.float16) for _ in range(3))
            row = [f"d={d:3d} N={n:5d}"]
            cases = [("ours", None, lambda: sagebwd_cp.attention(q, k, v)),
                     ("FA2", SDPBackend.FLASH_ATTENTION, lambda: F.scaled_dot_product_attention(q, k, v)),
                     ("cuDNN", SDPBackend.CUDNN_ATTENTION, lambda: F.scaled_dot_product_attention(q, k, v))]
            for name, backend, fn in cases:
                if backend is None:
                    sync, queued = timed(fn, args.reps), back_to_back(fn, args.reps)
                else:
                    with sdpa_kernel(backend):
                        sync, queued = timed(fn, args.reps), back_to_back(fn, args.reps)
                row.append(f"{name} {sync:.3f} / {queued:.3f} ({1e3 * (sync - queued):+.0f} us)")
            print("  ".join(row), flush=True)


if __name__ == "__main__":
    main()
