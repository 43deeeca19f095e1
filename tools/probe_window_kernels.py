"""GPU time of each kernel of one windowed forward+backward beside the causal one (torch's profiler):
where a small window's time goes that the band does not shrink (the pre-pass over Q, K and V, the
backward's row statistics and dQ conversion).

    python tools/probe_window_kernels.py --batch 2 --seqlen 8192 --windows 1024 4096
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_sdpa_kernels import kernel_times, print_kernel_times  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--gqa", type=int, default=4)
    ap.add_argument("--windows", type=int, nargs="+", default=(1024, 4096))
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    import torch

    import sagebwd_cp

    b, n, h = args.batch, args.seqlen, args.heads
    q, k, v = (torch.randn((b, heads, n, 128), device="cuda", dtype=torch.bfloat16)
               for heads in (h, h // args.gqa, h // args.gqa))
    do = torch.randn_like(q)
    print(torch.cuda.get_device_name(0), f"bf16 {b}x{h}/{h // args.gqa}x{n}x128")
    for window in (None, *args.windows):
        kw = {"causal": True, **({"window_size": (window, 0)} if window else {})}

        def step():
            _, saved = sagebwd_cp.attention_forward(q, k, v, **kw)
            sagebwd_cp.attention_backward(saved, do)

        print_kernel_times("causal" if window is None else f"window {window}", kernel_times(step, args.reps), 90)


if __name__ == "__main__":
    main()
