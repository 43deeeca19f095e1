"""Would the forward gain from running its quantization pre-pass beside the attention kernel?

The pre-pass (token_sum, then quantize_tensors for K and V) is bound by memory bandwidth, the
attention kernel by instruction issue, so the two could share the GPU. This times, on two
independent input sets of one shape (fp16, 16K tokens per batch, hidden 2048):
  pre       the pre-pass of set A alone
  attend    the attention kernel of set B alone (K, V quantized beforehand)
  serial    pre, then attend, on one stream
  beside    attend on the current stream and pre on a high-priority stream launched after it, joined
            at the end: the pre-pass's CTAs take the slots that attention CTAs free.
If "beside" is close to "attend", a forward that overlaps its pre-pass with the attention of other
heads (docs/history/PERFORMANCE_LOG.md) would save about "serial" - "beside".

    python tools/probe_overlap.py [--seqlens 4096 16384] [--head-dims 64 128] [--reps 20]
"""
from __future__ import annotations

import argparse
import statistics


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", type=int, nargs="+", default=(4096, 16384))
    ap.add_argument("--head-dims", type=int, nargs="+", default=(64, 128))
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    import torch

    from sagebwd_cp.gpu.pieces import attend_launcher
    from sagebwd_cp.gpu.quantize import quantize_inputs
    from sagebwd_cp.gpu.plan import PlanBuilder
    from sagebwd_cp.options import AttentionOptions
    from sagebwd_cp.problem import make_problem

    main_stream = torch.cuda.current_stream()
    side = torch.cuda.Stream(priority=-1)  # the highest priority torch offers
    print(torch.cuda.get_device_name(0), "fp16 forward, non-causal; median ms of", args.reps)
    print(f"{'d':>4} {'N':>6} {'pre':>7} {'attend':>7} {'serial':>7} {'beside':>7}  saved / pre")
    for d in args.head_dims:
        for n in args.seqlens:
            b, h = max(1, 16384 // n), 2048 // d
            mk = lambda: tuple(torch.randn((b, h, n, d), device="cuda", dtype=torch.float16) for _ in range(3))
            (qa, ka, va), (qb, kb, vb) = mk(), mk()
            prob_a = make_problem(qa, ka, va, AttentionOptions())
            builder = PlanBuilder(prob_a.q.device_id, prob_a.q.framework,
                                  [("q", prob_a.q), ("k", prob_a.k), ("v", prob_a.v)])
            quantize_inputs(builder, prob_a, False, quantize_q=False)
            pre_plan = builder.build(cacheable=False)
            ptrs = [x.data_ptr() for x in (qa, ka, va)]
            attend = attend_launcher(make_problem(qb, kb, vb, AttentionOptions()))
            keep = []  # workspaces stay alive until the timing has synchronized

            def pre(stream):
                keep.append(pre_plan.run(ptrs, stream.cuda_stream))

            def beside():
                start = torch.cuda.Event()
                start.record(main_stream)
                attend()
                side.wait_event(start)
                pre(side)
                done = torch.cuda.Event()
                done.record(side)
                main_stream.wait_event(done)

            cases = {"pre": lambda: pre(main_stream), "attend": attend,
                     "serial": lambda: (pre(main_stream), attend()), "beside": beside}
            times = {name: [] for name in cases}
            for rep in range(args.reps + 3):
                for name, fn in cases.items():  # interleaved, so drifts hit every case alike
                    a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record(main_stream)
                    fn()
                    z.record(main_stream)
                    z.synchronize()
                    keep.clear()
                    if rep >= 3:
                        times[name].append(a.elapsed_time(z))
            t = {name: statistics.median(v) for name, v in times.items()}
            print(f"{d:4d} {n:6d} {t['pre']:7.3f} {t['attend']:7.3f} {t['serial']:7.3f} {t['beside']:7.3f}"
                  f"  {(t['serial'] - t['beside']) / t['pre']:5.2f}", flush=True)


if __name__ == "__main__":
    main()
