"""Where a model step's time goes besides the GPU's kernels: bench_model.py's decoder trained a few
steps with SDPA and with sagebwd_cp, then a few steps under the profiler with CPU activity. Prints
per step the wall time, the CUDA kernels' busy time, the CUDA API calls that can stall the host or
the GPU (synchronizations, allocations, copies, launches) with counts and host time, the CPU
operators with the most self time, and the GPU's idle gaps: their total, and their time by the CPU
operator that was launching the work that ended each gap (a gap whose next launch came late is time
the GPU waited on the host).

    python tools/probe_model_host.py [--context 2048] [--head-dim 128] [--steps 3]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_model  # noqa: E402

API = ("Synchronize", "Malloc", "Free", "Memcpy", "Memset", "LaunchKernel", "EventQuery", "EventRecord",
       "StreamWaitEvent", "FuncSetAttribute", "FuncGetAttribute", "ModuleGetFunction", "GetDevice")


def probe(attn: str, context: int, head_dim: int, steps: int, top: int) -> None:
    import torch

    device = torch.device("cuda")
    model = bench_model.build_model(head_dim, context, attn, 0).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)

    def step(x, y):
        return bench_model.train_step(model, opt, x, y).item()

    data = list(bench_model.batches(context, 5 + steps, 0, device))
    for x, y in data[:5]:
        step(x, y)
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for x, y in data[5:]:
            step(x, y)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps * 1e3
    events = prof.key_averages()
    kernel = sum(e.device_time_total for e in events if e.device_time_total > 0 and e.device_type.name == "CUDA")
    cpu = sorted((e for e in events if e.self_cpu_time_total > 0), key=lambda e: e.self_cpu_time_total, reverse=True)
    print(f"\n## {attn}: context {context}, head dim {head_dim}: {wall:.1f} ms a step (wall, profiled), "
          f"kernels {kernel / 1e3 / steps:.1f} ms a step")
    print("CUDA API (per step): calls, host ms")
    for e in cpu:
        if any(a in e.key for a in API):
            print(f"  {e.key[:60]:<60} {e.count / steps:8.1f} {e.self_cpu_time_total / 1e3 / steps:8.2f}")
    print(f"CPU operators by self time (per step, ms), top {top}")
    for e in [e for e in cpu if not any(a in e.key for a in API)][:top]:
        print(f"  {e.key[:60]:<60} {e.count / steps:8.1f} {e.self_cpu_time_total / 1e3 / steps:8.2f}")
    gaps(prof, steps, top)
    del model, opt
    torch.cuda.empty_cache()


def gaps(prof, steps: int, top: int, least_us: float = 5.0) -> None:
    """The GPU's idle gaps (at least ``least_us``) between its kernels, memsets and copies, by the
    outermost CPU operator around the launch of the work after each gap, and how late that launch
    came (launch time minus the gap's start: positive where the GPU waited on the host)."""
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ops = sorted((e for e in events if e.get("cat") == "cpu_op" and not e["name"].startswith("ProfilerStep")),
                 key=lambda e: e["ts"])

    def outer(t: float, tid) -> str:
        best = None
        for e in ops:
            if e["ts"] > t:
                break
            if e["tid"] == tid and e["ts"] + e["dur"] >= t and (best is None or e["dur"] > best["dur"]):
                best = e
        return best["name"] if best else "(no operator)"

    total, late, by_op = 0.0, 0.0, {}
    for prev, nxt in zip(gpu, gpu[1:]):
        gap = nxt["ts"] - (prev["ts"] + prev["dur"])
        if gap < least_us:
            continue
        total += gap
        launch = launches.get(nxt.get("args", {}).get("correlation"))
        name = outer(launch["ts"], launch["tid"]) if launch else "(launch not found)"
        waited = launch is not None and launch["ts"] + launch["dur"] > prev["ts"] + prev["dur"]
        late += gap if waited else 0.0
        n, t, w = by_op.get(name, (0, 0.0, 0.0))
        by_op[name] = (n + 1, t + gap, w + (gap if waited else 0.0))
    print(f"GPU idle gaps of {least_us:.0f} us or more: {total / 1e3 / steps:.2f} ms a step, of which "
          f"{late / 1e3 / steps:.2f} ms after a launch that came late")
    print("  by the CPU operator launching the next work: gaps a step, ms a step, of which late")
    for name, (n, t, w) in sorted(by_op.items(), key=lambda kv: kv[1][1], reverse=True)[:top]:
        print(f"  {name[:60]:<60} {n / steps:8.1f} {t / 1e3 / steps:8.2f} {w / 1e3 / steps:8.2f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--head-dim", type=int, default=128, choices=[64, 128])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    for attn in ("sdpa", "sagebwd"):
        probe(attn, args.context, args.head_dim, args.steps, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
