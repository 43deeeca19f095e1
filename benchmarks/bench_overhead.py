"""Per-call host overhead of the PyTorch adapter at a small shape, where kernels take microseconds.

For each way of calling the attention it prints, in µs per call:
  issue   CPU time until the call returns (Python, argument checks, allocations, launches);
  wall    many calls back to back, one synchronize at the end;
  kernels GPU time (sum of the kernel and memset durations that torch.profiler records; no CUDA
          graphs involved), with the number of GPU operations per call;
  over    wall - kernels: what a call costs beyond its kernels.

    python benchmarks/bench_overhead.py                      # B=1, H=1, N=64, D=64, float16
    python benchmarks/bench_overhead.py --seqlen 128 --head-dim 128 --dtype bfloat16
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import sagebwd_cp
import sagebwd_cp.torch as st
from report_memory import kernel_times  # benchmarks/ is on sys.path when this script runs


def host_us(fn, calls: int, burst: int = 50):
    """(issue µs, wall µs) per call.  Issue: CPU time to return from a call, from bursts short
    enough that the launch queue never fills (best burst).  Wall: ``calls`` calls back to back,
    one synchronize at the end."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    issue = float("inf")
    for _ in range(max(1, calls // burst)):
        start = time.perf_counter()
        for _ in range(burst):
            fn()
        issue = min(issue, (time.perf_counter() - start) / burst)
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return 1e6 * issue, 1e6 * (time.perf_counter() - start) / calls


def kernel_us(fn, calls: int):
    """(GPU µs per call, GPU operations per call): the kernels and memsets torch.profiler records."""
    times, count = kernel_times(fn, calls)
    return 1e3 * sum(times.values()), count


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=1)
    p.add_argument("--seqlen", type=int, default=64)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--no-backward", action="store_true", help="forward calls only")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_overhead.py needs a CUDA device")
    dtype = getattr(torch, args.dtype)
    shape = (args.batch, args.heads, args.seqlen, args.head_dim)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(shape, generator=g, device="cuda", dtype=dtype) for _ in range(3))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    do = torch.randn(shape, generator=g, device="cuda", dtype=dtype)

    def grad_step():
        st.attention(qg, kg, vg, causal=True).backward(do)
        for x in (qg, kg, vg):
            x.grad = None

    cases = [
        ("torch SDPA forward (reference)", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
        ("sagebwd_cp.attention (neutral API)", lambda: sagebwd_cp.attention(q, k, v, causal=True)),
        ("adapter inference forward", lambda: st.attention(q, k, v, causal=True)),
        ("adapter training forward (autograd.Function)", lambda: st.attention(qg, kg, vg, causal=True)),
        ("custom op attention_forward (dispatcher)",
         lambda: torch.ops.sagebwd_cp.attention_forward(qg, kg, vg, *sagebwd_cp.AttentionOptions(causal=True))),
    ]
    if not args.no_backward:
        cases.append(("adapter forward + backward", grad_step))
    print(f"shape (B, H, N, D) = {shape}, {args.dtype}, causal; {torch.cuda.get_device_name()}; "
          f"torch {torch.__version__}, sagebwd_cp {sagebwd_cp.__version__}")
    print(f"{'call (µs per call)':48s} {'issue':>8s} {'wall':>8s} {'kernels':>8s} {'count':>6s} {'over':>8s}")
    for name, fn in cases:
        try:
            issue, wall = host_us(fn, args.calls)
            gpu, count = kernel_us(fn, min(args.calls, 200))
        except NotImplementedError as exc:
            print(f"{name:48s} skipped: {exc}")
            continue
        print(f"{name:48s} {issue:8.1f} {wall:8.1f} {gpu:8.1f} {count:6.1f} {wall - gpu:8.1f}")


if __name__ == "__main__":
    main()
