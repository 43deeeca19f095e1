"""Why a model step's time varies from step to step: ``bench_model.py``'s decoder trained with one
attention, each step timed on the GPU (events, as bench_model times it) and on the host (the time to
queue the step's work, before the synchronization), with the garbage collector's pauses during the
step and the caching allocator's device allocations, frees and retries counted; then the same with
the collector disabled.  A step whose host time reaches its GPU time kept the GPU waiting on the host.

    python tools/probe_step_jitter.py --attn sagebwd --context 2048 --head-dim 128 --steps 150
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_model  # noqa: E402


def run(attn: str, context: int, head_dim: int, steps: int, warmup: int, collect: bool) -> None:
    import torch

    device = torch.device("cuda")
    model = bench_model.build_model(head_dim, context, bench_model.IMPLS[attn], 0).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    pauses = []

    def on_gc(phase, info, _start=[0.0]):
        if phase == "start":
            _start[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - _start[0]))

    gc.callbacks.append(on_gc)
    if not collect:
        gc.disable()
    rows = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    try:
        with bench_model._backends(attn):
            for step, (x, y) in enumerate(bench_model.batches(context, warmup + steps, 0, device)):
                del pauses[:]
                before = torch.cuda.memory_stats()
                t0 = time.perf_counter()
                start.record()
                loss = bench_model.train_step(model, opt, x, y)
                end.record()
                queued = time.perf_counter() - t0
                torch.cuda.synchronize()
                loss.item()
                after = torch.cuda.memory_stats()
                if step >= warmup:
                    rows.append((start.elapsed_time(end), 1e3 * queued, len(pauses), 1e3 * sum(p for _, p in pauses),
                                 max((g for g, _ in pauses), default=-1),
                                 after["num_device_alloc"] - before["num_device_alloc"],
                                 after["num_device_free"] - before["num_device_free"],
                                 after["num_alloc_retries"] - before["num_alloc_retries"]))
    finally:
        gc.callbacks.remove(on_gc)
        gc.enable()
    gpu = [r[0] for r in rows]
    print(f"{attn} context {context} d={head_dim} collector {'on' if collect else 'off'}: {len(rows)} steps, "
          f"GPU step ms median {statistics.median(gpu):.1f} min {min(gpu):.1f} max {max(gpu):.1f}; "
          f"host queue ms median {statistics.median(r[1] for r in rows):.1f}")
    slow = sorted(rows, key=lambda r: -r[0])[:6]
    fast = sorted(rows, key=lambda r: r[0])[:3]
    print("   GPU ms  queue ms  gc runs  gc ms  gen  cudaMalloc  cudaFree  retries")
    for r in slow + fast:
        print(f"   {r[0]:6.1f}  {r[1]:8.1f}  {r[2]:7d}  {r[3]:5.1f}  {r[4]:3d}  {r[5]:10d}  {r[6]:8d}  {r[7]:7d}")
    del model, opt
    torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--attn", choices=sorted(bench_model.IMPLS), default="sagebwd")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--head-dim", type=int, default=128, choices=[64, 128])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args(argv)
    for collect in (True, False):
        run(args.attn, args.context, args.head_dim, args.steps, args.warmup, collect)
    return 0


if __name__ == "__main__":
    sys.exit(main())
