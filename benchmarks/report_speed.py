"""Speed sweep in the style of SB26 Figures 2-3: forward, backward and forward+backward TOPS of our
kernels against SDPA's FlashAttention2, cuDNN and memory-efficient backends and the sageattention
1.0.6 Triton forward (inference only, where installed), with the INT8 and 16-bit mma.sync
ceilings measured in the same run.

16K tokens per batch, hidden 2048 (heads = 2048 / head_dim); FLOPs as in report_common.py.  Backward
alone: ours is one attention_backward call on a saved state (its quantization and pre/postprocess
included); the peers' is torch.autograd.grad on a retained SDPA graph.  Two input sets alternate
so that no call finds its inputs in L2.  A peer that rejects a shape is skipped with the reason.
Writes <results-dir>/<device>/speed.json; progress goes to stderr, the tables to stdout last.

    python benchmarks/report_speed.py [--quick] [--seqlens 4096 16384] [--head-dims 128]
        [--dtypes float16] [--passes fwd bwd fwdbwd] [--impls sagebwd sdpa-flash] [--causal no]
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import report_common  # noqa: E402
from bench_attention import describe_ceilings, measure_ceilings, timed  # noqa: E402

SEQLENS = (1024, 2048, 4096, 8192, 16384, 32768)
HEAD_DIMS = (64, 128)
DTYPES = ("float16", "bfloat16")
PASSES = ("fwd", "bwd", "fwdbwd")
GRANULARITIES = ("fine", "paper")
SDPA_BACKENDS = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION",
                 "sdpa-efficient": "EFFICIENT_ATTENTION"}
IMPLS = ("sagebwd", "sageattn") + tuple(SDPA_BACKENDS)
KERNEL_ONLY = "sagebwd[kernel]"  # our forward without its quantization pre-pass (timed with "sagebwd")


def ours_name(pass_: str, granularity: str | None) -> str:
    """Our forward has one mode; the backward (and so forward+backward) one per granularity."""
    return "sagebwd" if pass_ == "fwd" else f"sagebwd[{granularity}]"


def make_record(impl, pass_, dtype, head_dim, causal, seqlen, batch, heads, ms) -> dict:
    tflops = report_common.flops(pass_, batch, heads, seqlen, head_dim, causal) / (ms * 1e-3) / 1e12
    return {"impl": impl, "pass": pass_, "dtype": dtype, "head_dim": head_dim, "causal": causal, "seqlen": seqlen,
            "batch": batch, "heads": heads, "ms": ms, "tflops": tflops}


def reps_for(seqlen: int, quick: bool, reps: int | None) -> tuple:
    """(warmup, reps): every call at one seqlen does the same work per token, so longer sequences
    take proportionally longer; fewer repetitions keep N = 32K inside the time budget."""
    if reps is not None:
        return min(3, reps), reps
    if quick:
        return 2, 3
    return (2, 5) if seqlen >= 32768 else (3, 10)


def alternate(fn):
    """A zero-argument callable running fn(0), fn(1), fn(0), ... (two input sets, rotated)."""
    state = [1]

    def call():
        state[0] ^= 1
        return fn(state[0])

    return call


class Config:
    """Two input sets (q, k, v, dO) of one (dtype, head_dim, seqlen) on the GPU, HND layout."""

    def __init__(self, dtype, head_dim, seqlen):
        import torch

        self.dtype, self.head_dim, self.seqlen = dtype, head_dim, seqlen
        self.batch, self.heads = report_common.sweep_shape(seqlen, head_dim)
        shape = (self.batch, self.heads, seqlen, head_dim)
        tdt = getattr(torch, dtype)
        self.sets = [tuple(torch.randn(shape, device="cuda", dtype=tdt) for _ in range(4)) for _ in range(2)]


def _ours(pass_, cfg, causal, granularity):
    import sagebwd_cp

    sets = cfg.sets
    if pass_ == "fwd":
        return alternate(lambda i: sagebwd_cp.attention(*sets[i][:3], causal=causal))
    if pass_ == "bwd":
        saved = [sagebwd_cp.attention_forward(*s[:3], causal=causal)[1] for s in sets]
        return alternate(lambda i: sagebwd_cp.attention_backward(saved[i], sets[i][3], granularity=granularity))

    def fwdbwd(i):
        _, sv = sagebwd_cp.attention_forward(*sets[i][:3], causal=causal)
        return sagebwd_cp.attention_backward(sv, sets[i][3], granularity=granularity)

    return alternate(fwdbwd)


def _ours_kernel_only(cfg, causal):
    """Our forward kernel alone, on K and V quantized beforehand (the pre-pass excluded; the kernel
    quantizes Q itself)."""
    from sagebwd_cp.gpu.pieces import attend_launcher
    from sagebwd_cp.options import AttentionOptions
    from sagebwd_cp.problem import make_problem

    runs = [attend_launcher(make_problem(q, k, v, AttentionOptions(causal=causal))) for q, k, v, _ in cfg.sets]
    return alternate(lambda i: runs[i]())


def _sdpa(pass_, cfg, causal):
    import torch
    import torch.nn.functional as F

    if pass_ == "fwd":
        return alternate(lambda i: F.scaled_dot_product_attention(*cfg.sets[i][:3], is_causal=causal))
    # Leaves sharing the inputs' storage; grads are returned, not accumulated into .grad.
    leaves = [tuple(x.detach().requires_grad_(True) for x in s[:3]) for s in cfg.sets]
    dos = [s[3] for s in cfg.sets]
    if pass_ == "bwd":
        outs = [F.scaled_dot_product_attention(*lv, is_causal=causal) for lv in leaves]
        return alternate(lambda i: torch.autograd.grad(outs[i], leaves[i], dos[i], retain_graph=True))

    def fwdbwd(i):
        o = F.scaled_dot_product_attention(*leaves[i], is_causal=causal)
        return torch.autograd.grad(o, leaves[i], dos[i])

    return alternate(fwdbwd)


def _sageattn(cfg, causal):
    from sageattention import sageattn

    # sageattn subtracts K's mean from k in place: give it copies so the other inputs stay intact.
    sets = [(q, k.clone(), v) for q, k, v, _ in cfg.sets]
    return alternate(lambda i: sageattn(*sets[i], tensor_layout="HND", is_causal=causal))


def _sageattn_missing():
    try:
        importlib.import_module("sageattention")
    except Exception as exc:  # noqa: BLE001 - absent, or triton missing: skip it with the reason
        return f"sageattention not importable ({type(exc).__name__}: {exc})"
    return None


def failure_reason(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200] if lines else ''}"


def _release(torch) -> None:
    """Give memory back after a failure (an out-of-memory one leaves blocks cached)."""
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception as exc:  # noqa: BLE001 - a sticky CUDA error: report it, later calls will fail too
        report_common.log(f"  CUDA error after a failure: {failure_reason(exc)}")


def run_config(cfg, causal, passes, impls, granularities, warmup, reps, records, skipped):
    """Time every (pass, impl) of one shape; failures are recorded in ``skipped``."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    key = dict(dtype=cfg.dtype, head_dim=cfg.head_dim, causal=causal, seqlen=cfg.seqlen)
    sa_missing = _sageattn_missing() if "sageattn" in impls else None
    for pass_ in passes:
        jobs = []
        if "sagebwd" in impls:
            for gran in ((None,) if pass_ == "fwd" else granularities):
                jobs.append((ours_name(pass_, gran), lambda p=pass_, g=gran: _ours(p, cfg, causal, g), None))
            if pass_ == "fwd":
                jobs.append((KERNEL_ONLY, lambda: _ours_kernel_only(cfg, causal), None))
        if "sageattn" in impls and pass_ == "fwd":
            jobs.append(("sageattn", lambda: _sageattn(cfg, causal), sa_missing))
        for name in SDPA_BACKENDS:
            if name in impls:
                jobs.append((name, lambda p=pass_: _sdpa(p, cfg, causal), None))
        for name, build, missing in jobs:
            if missing:
                skipped.append(dict(impl=name, **{"pass": pass_}, **key, reason=missing))
                continue
            fn = None
            try:
                if name in SDPA_BACKENDS:
                    # The backend is picked when the graph is built, so build and time inside the context.
                    with sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[name])):
                        fn = build()
                        ms = timed(fn, reps=reps, warmup=warmup)
                else:
                    fn = build()
                    ms = timed(fn, reps=reps, warmup=warmup)
            except Exception as exc:  # noqa: BLE001 - e.g. a backend without a kernel for this shape
                reason = failure_reason(exc)
                skipped.append(dict(impl=name, **{"pass": pass_}, **key, reason=reason))
                report_common.log(f"  {name:<16} {pass_:<6} skipped: {reason}")
                fn = None
                _release(torch)
                continue
            rec = make_record(name, pass_, cfg.dtype, cfg.head_dim, causal, cfg.seqlen, cfg.batch, cfg.heads, ms)
            records.append(rec)
            report_common.log(f"  {name:<16} {pass_:<6} {ms:9.3f} ms {rec['tflops']:7.1f} TOPS")
            fn = None  # frees retained graphs and saved states before the next job allocates its own


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", type=int, nargs="+", default=list(SEQLENS))
    ap.add_argument("--head-dims", type=int, nargs="+", default=list(HEAD_DIMS))
    ap.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    ap.add_argument("--passes", nargs="+", choices=PASSES, default=list(PASSES))
    ap.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    ap.add_argument("--granularities", nargs="+", choices=GRANULARITIES, default=list(GRANULARITIES))
    ap.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    ap.add_argument("--reps", type=int, default=None, help="timed calls per measurement (default 10; 5 at N=32K)")
    ap.add_argument("--quick", action="store_true", help="N = 4K and 16K, fp16, 3 timed calls: a smoke run")
    ap.add_argument("--results-dir", default=report_common.DEFAULT_RESULTS)
    ap.add_argument("--out", default=None, help="JSON path (default <results-dir>/<device>/speed.json)")
    args = ap.parse_args(argv)
    if args.quick:
        args.seqlens = [n for n in args.seqlens if n in (4096, 16384)] or [4096]
        args.dtypes = args.dtypes[:1]

    import torch

    device = report_common.cuda_device_name()
    start = time.time()
    ceilings = measure_ceilings()
    report_common.log(f"{device}: ceilings {describe_ceilings(ceilings)}")
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    from tqdm import tqdm

    # A bar with the time left (on a terminal; the log lines stay): the full sweep takes tens of minutes.
    bar = tqdm(total=len(args.dtypes) * len(args.head_dims) * len(args.seqlens) * len(causals), unit="config",
               desc="speed sweep", file=sys.stderr, disable=None)
    records, skipped, timing = [], [], {}
    for dtype in args.dtypes:
        for d in args.head_dims:
            for n in args.seqlens:
                warmup, reps = reps_for(n, args.quick, args.reps)
                timing[n] = {"warmup": warmup, "reps": reps}
                cfg = Config(dtype, d, n)
                for causal in causals:
                    report_common.log(f"[{time.time() - start:6.0f} s] {dtype} d={d} N={n} "
                                      f"{'causal' if causal else 'non-causal'} B={cfg.batch} H={cfg.heads}")
                    run_config(cfg, causal, args.passes, args.impls, args.granularities, warmup, reps, records, skipped)
                    bar.update()
                del cfg
                torch.cuda.empty_cache()
    bar.close()
    elapsed = time.time() - start
    meta = report_common.metadata(
        device, ceilings=ceilings,
        sweep={"tokens_per_batch": report_common.TOKENS_PER_BATCH, "hidden": report_common.HIDDEN,
               "layout": "HND", "timing": "median of CUDA-event times after warm-up",
               "reps": timing, "granularities": args.granularities},
        seconds=round(elapsed, 1))
    data = {"kind": "speed", "metadata": meta, "records": records, "skipped": skipped}
    out = args.out or os.path.join(report_common.device_dir(args.results_dir, device), "speed.json")
    report_common.write_json(out, data)
    report_common.log(f"speed sweep: {len(records)} measurements, {len(skipped)} skipped, {elapsed:.0f} s")

    import render_report

    print(render_report.speed_markdown(data))
    print(render_report.headline(data, None, None, os.path.dirname(os.path.abspath(out))))  # the compact summary
    return 0


if __name__ == "__main__":
    sys.exit(main())
