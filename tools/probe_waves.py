"""Time per head of the forward kernel (attend-only) and of the whole backward as the head count
varies at a fixed N: a sawtooth in ms/head shows the cost of the grid's last partial wave. With
--fixed-ctas, the forward kernel at N = 1K..16K with N·H fixed (the same 4096 work tiles), so that
time = A + B·(key tiles per work tile) separates a fixed cost per work tile (docs/history/PERFORMANCE_LOG.md).

    python tools/probe_waves.py [--seqlen 4096] [--heads 56 72] [--head-dims 64 128] [--backward]
    python tools/probe_waves.py --fixed-ctas
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from bench_attention import timed  # noqa: E402


def inputs(h, n, d):
    import torch

    return tuple(torch.randn((1, h, n, d), device="cuda", dtype=torch.float16) for _ in range(3))


def attend_ms(q, k, v, reps) -> float:
    """The forward kernel alone, on K and V quantized beforehand (it quantizes Q itself)."""
    from sagebwd_cp.gpu.pieces import attend_launcher
    from sagebwd_cp.options import AttentionOptions
    from sagebwd_cp.problem import make_problem

    return timed(attend_launcher(make_problem(q, k, v, AttentionOptions())), reps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--heads", type=int, nargs=2, default=(56, 72))
    ap.add_argument("--head-dims", type=int, nargs="+", default=(64, 128))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--fixed-ctas", action="store_true",
                    help="instead: forward attend-only at N = 1K..16K with N·H fixed (H = 2^18 / N), ms per key tile")
    args = ap.parse_args()
    import torch

    import sagebwd_cp

    if args.fixed_ctas:
        for d in args.head_dims:
            print(f"d={d}, N x H = 2^18: N, H, forward attend-only ms, us per CTA-key-tile (CTAs = N/64 x H)")
            for n in (1024, 2048, 4096, 8192, 16384):
                h = 2**18 // n
                ms = attend_ms(*inputs(h, n, d), args.reps)
                print(f"  {n:6d} {h:4d} {ms:8.3f} {ms * 1e3 / (h * n / 64 * n / 128):8.4f}", flush=True)
        return
    n = args.seqlen
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)}, {sms} SMs, N={n}, B=1")
    for d in args.head_dims:
        print(f"d={d}: heads, forward attend-only ms/head" + (", backward ms/head" if args.backward else ""))
        for h in range(args.heads[0], args.heads[1] + 1):
            q, k, v = inputs(h, n, d)
            line = f"  {h:4d} {attend_ms(q, k, v, args.reps) / h * 1e3:8.2f} us"
            if args.backward:
                o, saved = sagebwd_cp.attention_forward(q, k, v)
                do = torch.randn_like(o)
                line += f" {timed(lambda: sagebwd_cp.attention_backward(saved, do), args.reps) / h * 1e3:8.2f} us"
            print(line, flush=True)


if __name__ == "__main__":
    main()
