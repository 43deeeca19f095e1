"""GPU time of each kernel SDPA launches for one forward and one backward (the peer's side of
``probe_steps.py``): which backend torch picked, by kernel name, and where its time goes. With ``--ours``
the same for sagebwd_cp's forward and backward at each shape, by the same profiler (kernel durations, so
short kernels are not inflated by the host's launch time as CUDA events around them are).

    python tools/probe_sdpa_kernels.py --seqlens 2048 8192 --head-dims 64 128 --hidden 1024 --gqa 4 --causal --ours
"""
from __future__ import annotations

import argparse
import collections


def kernel_times(step, reps: int, warmup: int = 3) -> dict:
    """{kernel name: GPU µs a call} of ``step`` (``warmup`` calls, then ``reps`` under torch's profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    per = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name] += e.device_time_total / reps
    return dict(per)


def print_kernel_times(title: str, per: dict, width: int = 110) -> None:
    total = sum(per.values())
    print(f"{title}: kernels {total:.1f} us a step")
    for name, us in sorted(per.items(), key=lambda kv: -kv[1]):
        print(f"    {us:8.1f} us {100 * us / total:5.1f}%  {name[:width]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlens", type=int, nargs="+", default=(2048, 8192))
    ap.add_argument("--head-dims", type=int, nargs="+", default=(64, 128))
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--gqa", type=int, default=4, help="query heads per key/value head")
    ap.add_argument("--dtype", choices=("float16", "bfloat16"), default="bfloat16")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--ours", action="store_true", help="also sagebwd_cp's kernels at each shape")
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F

    import sagebwd_cp
    dtype = getattr(torch, args.dtype)
    print(torch.cuda.get_device_name(0), args.dtype, "causal" if args.causal else "non-causal")
    for d in args.head_dims:
        for n in args.seqlens:
            b, h = max(1, args.tokens // n), args.hidden // d
            q, k, v = (torch.randn((b, heads, n, d), device="cuda", dtype=dtype, requires_grad=True)
                       for heads in (h, h // args.gqa, h // args.gqa))
            do = torch.randn((b, h, n, d), device="cuda", dtype=dtype)

            def step():
                out = F.scaled_dot_product_attention(q, k, v, is_causal=args.causal, enable_gqa=args.gqa > 1)
                torch.autograd.grad(out, (q, k, v), do)

            print_kernel_times(f"d={d} N={n} B={b} H={h}/{h // args.gqa}", kernel_times(step, args.reps))
            if args.ours:
                def ours():
                    _, saved = sagebwd_cp.attention_forward(q.detach(), k.detach(), v.detach(), causal=args.causal)
                    sagebwd_cp.attention_backward(saved, do)

                print_kernel_times("    sagebwd_cp", kernel_times(ours, args.reps))


if __name__ == "__main__":
    main()
