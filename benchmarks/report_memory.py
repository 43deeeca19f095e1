"""Peak GPU memory of one forward+backward (ours against SDPA's FlashAttention2, cuDNN and
memory-efficient backends), and where our GPU time goes: the share of the quantization kernels and
of the other pre/postprocess kernels against the main attention kernels (torch.profiler).

Shapes as in the speed sweep (16K tokens per batch, hidden 2048).  Peak = max_memory_allocated()
after reset_peak_memory_stats() minus what was allocated before the call (the inputs); with torch
inputs every workspace of ours comes from torch's caching allocator (sagebwd_cp/arrays.py), which
the CuPy pool size recorded beside it confirms.  Writes <results-dir>/<device>/memory.json.

    python benchmarks/report_memory.py [--quick] [--seqlens 16384] [--head-dims 64 128]
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import report_common  # noqa: E402
from bench_attention import peak_mib, timed  # noqa: E402
from report_speed import failure_reason  # noqa: E402

IMPLS = ("sagebwd[fine]", "sagebwd[paper]", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient")
SDPA_BACKENDS = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION",
                 "sdpa-efficient": "EFFICIENT_ATTENTION"}
QUANTIZATION = {"quantize_tensors", "quantize_blocks", "token_sum", "smooth_q_bias"}
ATTENTION = {"attention_forward", "attention_backward"}
NOT_ATTENTION = {"int8_mma_ceiling", "fp16_mma_ceiling"}  # benchmark kernels, never in a call
_ENTRY = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(')


def library_kernels() -> set:
    """The names of our kernels, read from kernels/*.cu so the list cannot go stale."""
    names = set()
    for path in glob.glob(os.path.join(report_common.ROOT, "kernels", "*.cu")):
        with open(path) as f:
            names.update(_ENTRY.findall(f.read()))
    return names - NOT_ATTENTION


def category(name: str, library: set) -> str:
    base = name.split("(")[0].strip()
    if base in QUANTIZATION:
        return "quantization"
    if base in ATTENTION:
        return "attention"
    if base in library:
        return "prepost"
    if "memset" in name.lower():
        return "memset"
    return "other"


def _inputs(dtype, d, n):
    import torch

    b, h = report_common.sweep_shape(n, d)
    tdt = getattr(torch, dtype)
    return b, h, tuple(torch.randn((b, h, n, d), device="cuda", dtype=tdt) for _ in range(4))


def fwdbwd_call(impl, q, k, v, do, causal):
    """One forward+backward of ``impl`` as a zero-argument callable returning nothing."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import sagebwd_cp

    if impl.startswith("sagebwd"):
        gran = impl[impl.index("[") + 1:-1]

        def ours():
            _, saved = sagebwd_cp.attention_forward(q, k, v, causal=causal)
            sagebwd_cp.attention_backward(saved, do, granularity=gran)

        return ours
    leaves = tuple(x.detach().requires_grad_(True) for x in (q, k, v))
    backend = getattr(SDPBackend, SDPA_BACKENDS[impl])

    def peer():
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(*leaves, is_causal=causal)
            torch.autograd.grad(o, leaves, do)

    return peer


def cupy_pool_mib():
    try:
        import cupy

        return cupy.get_default_memory_pool().total_bytes() / 2**20
    except Exception:  # noqa: BLE001
        return None


def measure_peaks(dtype, head_dims, seqlens, causal, impls, skipped) -> list:
    import torch

    records = []
    for d in head_dims:
        for n in seqlens:
            b, h, (q, k, v, do) = _inputs(dtype, d, n)
            inputs = sum(x.numel() * x.element_size() for x in (q, k, v, do)) / 2**20
            for impl in impls:
                key = dict(impl=impl, dtype=dtype, head_dim=d, causal=causal, seqlen=n, batch=b, heads=h)
                try:
                    peak = peak_mib(fwdbwd_call(impl, q, k, v, do, causal))
                except Exception as exc:  # noqa: BLE001 - a backend without a kernel for this shape
                    skipped.append(dict(key, reason=failure_reason(exc)))
                    report_common.log(f"  {impl:<16} d={d} N={n}: skipped ({failure_reason(exc)})")
                    torch.cuda.empty_cache()
                    continue
                records.append(dict(key, peak_mib=peak, inputs_mib=inputs, cupy_pool_mib=cupy_pool_mib()))
                report_common.log(f"  {impl:<16} d={d} N={n}: peak {peak:8.1f} MiB (inputs {inputs:.0f} MiB)")
            q = k = v = do = None  # free this shape's inputs before the next one is allocated
            torch.cuda.empty_cache()
    return records


def kernel_times(fn, iters: int):
    """({kernel or memset name: ms per call}, GPU operations per call) from torch.profiler."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    if not events:
        raise RuntimeError("torch.profiler recorded no GPU activity (is CUPTI available?)")
    times = {}
    for e in events:
        times[e.name] = times.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e3 / iters
    return times, len(events) / iters


def _profile_shape(dtype, d, n, causals, granularities, iters, library, records, skipped) -> None:
    """Profile our calls at one (head dim, seqlen); the inputs die with this frame."""
    import sagebwd_cp

    b, h, (q, k, v, do) = _inputs(dtype, d, n)
    for causal in causals:
        calls = [("sagebwd", "fwd", lambda c=causal: sagebwd_cp.attention(q, k, v, causal=c))]
        for gran in granularities:
            saved = sagebwd_cp.attention_forward(q, k, v, causal=causal)[1]
            calls.append((f"sagebwd[{gran}]", "bwd",
                          lambda s=saved, g=gran: sagebwd_cp.attention_backward(s, do, granularity=g)))
            calls.append((f"sagebwd[{gran}]", "fwdbwd", fwdbwd_call(f"sagebwd[{gran}]", q, k, v, do, causal)))
        for impl, pass_, fn in calls:
            key = dict(impl=impl, dtype=dtype, head_dim=d, causal=causal, seqlen=n, batch=b, heads=h,
                       **{"pass": pass_})
            try:
                kernels, launches = kernel_times(fn, iters)
                wall = timed(fn, reps=5, warmup=1)
            except Exception as exc:  # noqa: BLE001
                skipped.append(dict(key, reason=failure_reason(exc)))
                report_common.log(f"  profile {impl} {pass_} d={d} N={n}: skipped ({failure_reason(exc)})")
                continue
            cats = {}
            for name, ms in kernels.items():
                c = category(name, library)
                cats[c] = cats.get(c, 0.0) + ms
            total = sum(kernels.values())
            records.append(dict(key, wall_ms=wall, kernel_ms=total, categories=cats, kernels=kernels,
                                launches=launches))
            report_common.log(f"  profile {impl:<15} {pass_:<6} d={d} N={n} {'c' if causal else 'nc'}: wall "
                              f"{wall:7.2f} ms, kernels {total:7.2f} ms, " + ", ".join(
                                  f"{c} {100 * ms / total:.1f}%" for c, ms in sorted(cats.items())))


def profile_calls(dtype, head_dims, seqlens, causals, granularities, iters, skipped) -> list:
    import torch

    library = library_kernels()
    records = []
    for d in head_dims:
        for n in seqlens:
            _profile_shape(dtype, d, n, causals, granularities, iters, library, records, skipped)
            torch.cuda.empty_cache()
    return records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[16384], help="peak-memory lengths")
    ap.add_argument("--profile-seqlens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    ap.add_argument("--causal", choices=("both", "yes", "no"), default="both",
                    help="for the profile; peak memory is measured non-causal")
    ap.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    ap.add_argument("--granularities", nargs="+", choices=("fine", "paper"), default=["fine", "paper"])
    ap.add_argument("--iters", type=int, default=3, help="profiled calls per measurement")
    ap.add_argument("--quick", action="store_true", help="profile N = 4K only, non-causal")
    ap.add_argument("--results-dir", default=report_common.DEFAULT_RESULTS)
    ap.add_argument("--out", default=None, help="JSON path (default <results-dir>/<device>/memory.json)")
    args = ap.parse_args(argv)
    if args.quick:
        args.profile_seqlens, args.causal = args.profile_seqlens[:1], "no"

    device = report_common.cuda_device_name()
    start = time.time()
    skipped = []
    peak = measure_peaks(args.dtype, args.head_dims, args.seqlens, False, args.impls, skipped)
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    prof = profile_calls(args.dtype, args.head_dims, args.profile_seqlens, causals, args.granularities,
                         args.iters, skipped)
    meta = report_common.metadata(
        device, seconds=round(time.time() - start, 1),
        kernel_categories={"quantization": sorted(QUANTIZATION), "attention": sorted(ATTENTION),
                           "prepost": sorted(library_kernels() - QUANTIZATION - ATTENTION)})
    data = {"kind": "memory", "metadata": meta, "peak": peak, "profile": prof, "skipped": skipped}
    out = args.out or os.path.join(report_common.device_dir(args.results_dir, device), "memory.json")
    report_common.write_json(out, data)

    import render_report

    print(render_report.memory_markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
