"""Time of each launch inside one forward and one backward call (fp16, fine backward), at the
benchmark's shapes: where the pre- and post-kernels (token_sum, quantize, row_stats,
dq_convert) stand against the attention kernels.  The backward runs on the saved state (with the
forward's μ_K) and, for comparison, from plain arrays without it (μ_K summed again).

Every kernel launch of a plan gets a CUDA event before and after it (the plan's own
launch path, wrapped), so each step's time is its own, with the steps queued back to back as in a
real call; the median over --reps calls is printed, and the call's time without the events.

    python tools/probe_steps.py [--seqlens 4096 16384] [--head-dims 64 128] [--causal]
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from bench_attention import timed  # noqa: E402


class _EventedCuda:
    """Stands in for (runtime, driver) in sagebwd_cp.gpu.launch: each launch is bracketed by events,
    recorded as (name, start, end) in ``marks``."""

    def __init__(self, runtime, driver, name_of):
        self._runtime, self._driver, self._name_of = runtime, driver, name_of
        self.marks = []

    def _bracketed(self, name, stream, call):
        import torch

        # The plans of torch arrays launch on torch's current stream.
        assert stream == torch.cuda.current_stream().cuda_stream, "expected torch's current stream"
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        call()
        b.record()
        self.marks.append((name, a, b))

    def modules(self):
        outer = self

        class Runtime:
            def __getattr__(self, attr):
                return getattr(outer._runtime, attr)

        class Driver:
            def __getattr__(self, attr):
                return getattr(outer._driver, attr)

            def launchKernel(self, function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
                outer._bracketed(outer._name_of(function), stream, lambda: outer._driver.launchKernel(
                    function, gx, gy, gz, bx, by, bz, shared, stream, params, extra))

        return Runtime(), Driver()


def step_times(call, reps):
    """{step name (numbered when repeated): median ms} over ``reps`` calls of ``call``, and the
    median ms of a call without events."""
    import torch

    from sagebwd_cp.gpu import launch, plan

    plain = timed(call, reps)  # also builds the plans
    names = {}
    for built in list(plan._plans.values()):
        for step in built.steps:
            names[step.head[0]] = step.entry
    runtime, driver = launch.cuda()
    evented = _EventedCuda(runtime, driver, lambda f: names.get(f, "?"))
    saved = launch._cuda_modules
    launch._cuda_modules = evented.modules()
    try:
        per_step = collections.defaultdict(list)
        for _ in range(reps):
            evented.marks.clear()
            call()
            torch.cuda.synchronize()
            seen = collections.Counter()
            for name, a, b in evented.marks:
                seen[name] += 1
                key = name if seen[name] == 1 else f"{name}#{seen[name]}"
                per_step[key].append(a.elapsed_time(b))
    finally:
        launch._cuda_modules = saved
    return {k: statistics.median(v) for k, v in per_step.items()}, plain


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", type=int, nargs="+", default=(4096, 16384))
    ap.add_argument("--head-dims", type=int, nargs="+", default=(64, 128))
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--gqa", type=int, default=1, help="query heads per key/value head")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    import torch

    import sagebwd_cp

    print(torch.cuda.get_device_name(0), "fp16, fine backward", "causal" if args.causal else "non-causal")
    for d in args.head_dims:
        for n in args.seqlens:
            b, h = max(1, args.tokens // n), args.hidden // d
            q, k, v, do = (torch.randn((b, heads, n, d), device="cuda", dtype=torch.float16)
                           for heads in (h, h // args.gqa, h // args.gqa, h))
            out, saved = sagebwd_cp.attention_forward(q, k, v, causal=args.causal)
            again = lambda: sagebwd_cp.attention_backward_arrays(q, k, v, out, saved.lse2.obj, do,
                                                                 causal=args.causal)
            for which, call in (("inference", lambda: sagebwd_cp.attention(q, k, v, causal=args.causal)),
                                ("forward", lambda: sagebwd_cp.attention_forward(q, k, v, causal=args.causal)),
                                ("backward", lambda: sagebwd_cp.attention_backward(saved, do)),
                                ("backward without the saved μ_K", again)):
                steps, plain = step_times(call, args.reps)
                total = sum(steps.values())
                print(f"d={d} N={n} B={b} H={h}/{h // args.gqa} {which}: call {plain:.3f} ms, steps sum {total:.3f} ms")
                for name, ms in steps.items():
                    print(f"    {name:22s} {ms * 1e3:8.1f} us {100 * ms / total:5.1f}%")


if __name__ == "__main__":
    main()
