"""A long training run: does it stay finite, does memory stay flat, do the caches stay bounded?

Trains the Llama-style decoder of ``bench_model.py`` (its defaults: hidden 1024, 8 layers, GQA 4:1,
byte vocabulary, bfloat16 autocast, AdamW, the standard library's source as the corpus) with sagebwd_cp
attention (or SDPA, ``--impl sdpa``, for comparison) for ``--steps`` steps, and every ``--every``
steps records:

- the window's losses: how many were not finite, their mean, min and max;
- memory: on CUDA the window's peak (``max_memory_allocated``, reset each window), what is allocated
  between steps (weights, gradients set to None, optimizer state: it should not move) and what torch
  has reserved; the process's resident host memory;
- the caches: the kernel cache on disk (files and bytes), and in memory the compiled kernels, the
  loaded functions and the launch plans;
- the window's median step time.

With ``--contexts`` giving several lengths, step i takes the i-th length in turn (one plan a length).
At the end it checks, from the second record on (the first holds the warm-up: first compiles, the
optimizer's state): no loss was non-finite; the allocated and peak CUDA memory grew by at most 1% + 16
MiB; the kernel cache and the in-memory caches did not grow. It prints one line a record, the verdict,
and exits 1 if a check failed.

    python benchmarks/bench_long_run.py [--steps 5000] [--every 250] [--contexts 2048] [--head-dim 128]
        [--impl sagebwd|sdpa] [--json out.json]

Needs PyTorch and transformers; on a machine without a GPU (``--device cpu``) the attention runs on the
emulator, for a check of the script itself (tiny ``--hidden``, ``--layers``, ``--tokens-per-step``).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_model  # noqa: E402
from report_common import json_text  # noqa: E402

MEMORY_SLACK = (0.01, 16 << 20)  # allowed growth of CUDA memory: relative, plus bytes


def corpus(max_bytes: int):
    """The byte corpus (the standard library's source) as a torch int64 tensor."""
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    from train_tiny import read_stdlib_bytes

    return torch.frombuffer(bytearray(read_stdlib_bytes(max_bytes)), dtype=torch.uint8).long()


def batch(data, context: int, tokens_per_step: int, g, device):
    """One (inputs, labels) pair: ``tokens_per_step // context`` random windows of the corpus."""
    import torch

    rows = max(1, tokens_per_step // context)
    starts = torch.randint(0, len(data) - context - 1, (rows,), generator=g)
    block = torch.stack([data[s:s + context + 1] for s in starts.tolist()]).to(device)
    return block[:, :-1], block[:, 1:]


def host_rss_bytes() -> int:
    """The process's resident memory now (Linux), else its peak."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def cache_state() -> dict:
    """The kernel cache on disk and the in-memory caches."""
    from sagebwd_cp.gpu import compiler, kernel_cache, plan

    directory = compiler.cache_dir()
    return {"cache_dir": str(directory), "cache_files": len(kernel_cache.entry_files(directory)),
            "cache_bytes": kernel_cache.cache_bytes(directory), "compiled_kernels": len(compiler._memory_cache),
            "loaded_functions": len(compiler._modules), "plans": len(plan._plans)}


def run(args) -> dict:
    import torch

    cuda = args.device == "cuda"
    device = torch.device(args.device)
    bench_model.HIDDEN, bench_model.LAYERS = args.hidden, args.layers
    attn = "sagebwd" if args.impl == "sagebwd" else "sdpa"
    model = bench_model.build_model(args.head_dim, max(args.contexts), attn, args.seed).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    data = corpus(args.corpus_bytes)
    g = torch.Generator().manual_seed(args.seed)
    records, window, times = [], [], []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for step in range(1, args.steps + 1):
        x, y = batch(data, args.contexts[(step - 1) % len(args.contexts)], args.tokens_per_step, g, device)
        start = time.perf_counter()
        loss = bench_model.train_step(model, opt, x, y, cuda=cuda)
        window.append(loss.detach())  # read at the window's end: no synchronization per step
        if cuda and args.time_steps:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        if step % args.every and step != args.steps:
            continue
        losses = torch.stack(window).float().cpu()
        finite = torch.isfinite(losses)
        good = losses[finite]
        rec = {"step": step, "nonfinite_losses": int((~finite).sum()),
               "loss_mean": float(good.mean()) if len(good) else None,
               "loss_min": float(good.min()) if len(good) else None,
               "loss_max": float(good.max()) if len(good) else None,
               "step_ms_median": 1e3 * statistics.median(times), "host_rss_bytes": host_rss_bytes(), **cache_state()}
        if cuda:
            torch.cuda.synchronize()
            rec.update(peak_bytes=torch.cuda.max_memory_allocated(), allocated_bytes=torch.cuda.memory_allocated(),
                       reserved_bytes=torch.cuda.memory_reserved())
            torch.cuda.reset_peak_memory_stats()
        records.append(rec)
        if not args.quiet:
            print(_line(rec), flush=True)
        window, times = [], []
    return {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
            "impl": args.impl, "head_dim": args.head_dim, "contexts": args.contexts, "hidden": args.hidden,
            "layers": args.layers, "tokens_per_step": args.tokens_per_step, "steps": args.steps,
            "every": args.every, "records": records, "checks": checks(records)}


def _mib(x) -> str:
    return "-" if x is None else f"{x / 2**20:9.1f}"


def _line(rec: dict) -> str:
    loss = "   n/a" if rec["loss_mean"] is None else f"{rec['loss_mean']:6.3f}"
    return (f"step {rec['step']:>7}  loss {loss}  non-finite {rec['nonfinite_losses']:>3}  "
            f"{rec['step_ms_median']:8.1f} ms  peak {_mib(rec.get('peak_bytes'))} MiB  "
            f"allocated {_mib(rec.get('allocated_bytes'))} MiB  host {_mib(rec['host_rss_bytes'])} MiB  "
            f"cache {rec['cache_files']} files {_mib(rec['cache_bytes'])} MiB  plans {rec['plans']}  "
            f"kernels {rec['compiled_kernels']}")


def checks(records: list) -> dict:
    """{check: (passed, detail)}, from the second record on (the first holds the warm-up)."""
    out = {"finite": (all(r["nonfinite_losses"] == 0 for r in records),
                      f"{sum(r['nonfinite_losses'] for r in records)} non-finite losses")}
    steady = records[1:] or records
    base = steady[0]
    for key in ("allocated_bytes", "peak_bytes"):
        if key in base:
            limit = base[key] * (1 + MEMORY_SLACK[0]) + MEMORY_SLACK[1]
            worst = max(r[key] for r in steady)
            out[f"flat_{key[:-6]}_memory"] = (worst <= limit, f"{_mib(base[key]).strip()} MiB at step "
                                              f"{base['step']}, at most {_mib(worst).strip()} MiB after")
    for key in ("cache_files", "cache_bytes", "compiled_kernels", "loaded_functions", "plans"):
        values = [r[key] for r in steady]
        out[f"bounded_{key}"] = (max(values) <= base[key], f"{base[key]} at step {base['step']}, at most "
                                                           f"{max(values)} after")
    out["host_rss_growth_mib"] = (True, f"{(steady[-1]['host_rss_bytes'] - base['host_rss_bytes']) / 2**20:.1f} "
                                        f"MiB (reported, not checked)")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--every", type=int, default=250, help="steps per record")
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--impl", choices=["sagebwd", "sdpa"], default="sagebwd")
    ap.add_argument("--hidden", type=int, default=bench_model.HIDDEN)
    ap.add_argument("--layers", type=int, default=bench_model.LAYERS)
    ap.add_argument("--tokens-per-step", type=int, default=bench_model.TOKENS_PER_STEP)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corpus-bytes", type=int, default=64 << 20)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--time-steps", action="store_true", help="synchronize after each step (exact step times)")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.steps < 1 or args.every < 1:
        ap.error(f"--steps and --every: expected at least 1, got {args.steps} and {args.every}")
    if args.hidden % args.head_dim or (args.hidden // args.head_dim) % bench_model.GQA:
        ap.error(f"--hidden {args.hidden}: expected a multiple of {bench_model.GQA} heads of --head-dim {args.head_dim}")

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_long_run.py: no CUDA GPU (use --device cpu for the emulator)", file=sys.stderr)
        return 2
    result = run(args)
    if args.json:
        with open(args.json, "w") as f:
            f.write(json_text(result) + "\n")
    print(f"\n{result['device']}: {args.impl}, hidden {args.hidden}, {args.layers} layers, head dim {args.head_dim}, "
          f"contexts {args.contexts}, {args.tokens_per_step} tokens a step, {args.steps} steps")
    failed = [name for name, (ok, _) in result["checks"].items() if not ok]
    for name, (ok, detail) in result["checks"].items():
        print(f"  {'ok  ' if ok else 'FAIL'} {name}: {detail}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
