"""GPU time of each kernel of one windowed forward+backward beside the causal one (torch's profiler):
where a small window's time goes that the band does not shrink (the pre-pass over Q, K and V, the
backward's row statistics and dQ conversion).

    python tools/probe_window_kernels.py --batch 2 --seqlen 8192 --windows 1024 4096
"""
from __future__ import annotations

import argparse
import collections


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
    from torch.profiler import ProfilerActivity, profile

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

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.reps):
                step()
            torch.cuda.synchronize()
        per = collections.defaultdict(float)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per[e.name] += e.device_time_total / args.reps
        total = sum(per.values())
        print(f"{'causal' if window is None else f'window {window}'}: kernels {total:.1f} us a step")
        for name, us in sorted(per.items(), key=lambda kv: -kv[1]):
            print(f"    {us:8.1f} us {100 * us / total:5.1f}%  {name[:90]}")


if __name__ == "__main__":
    main()
