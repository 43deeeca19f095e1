"""Attention speed against SDPA's backends, measured side by side in one run.

fp16, 16K tokens per batch, hidden 2048 (heads = 2048 / head_dim), N = 1K..16K; ``--hidden``, ``--gqa``
(query heads per key/value head) and ``--dtype`` give a model's shapes instead.  TOPS use the
FLOP convention 4·B·H·N²·d for the forward (half when causal), 2.5x that for the backward and
3.5x for forward+backward (docs/ALGORITHM.md).  Also measures the INT8 and fp16 tensor-core
ceilings in the same run (mma.sync, and on Hopper wgmma from shared memory); "%limit" is ours against
the INT8 one the kernels can reach there.  Prints a compact table last; ``--json PATH`` writes records.

    python benchmarks/bench_attention.py [--seqlens 4096 16384] [--head-dims 64 128] [--tiles 8x1 4x2]
        [--hidden 2048] [--gqa 1] [--dtype float16]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import numpy as np


def timed(fn, reps=20, warmup=3):
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def peak_mib(fn) -> float:
    """MiB that one call of ``fn`` allocates at its peak beyond what was allocated before it (after
    one unmeasured call, so compilation, plans and caches stay outside the measurement)."""
    import torch

    fn()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


# Tensor-core ceilings: (kernel, key in the results, operations a product, warps a product, blocks an SM).
MMA_CEILINGS = (("int8_mma_ceiling", "int8_mma_tops", 2 * 16 * 8 * 32, 1, 8),
                ("fp16_mma_ceiling", "fp16_mma_tflops", 2 * 16 * 8 * 16, 1, 8))
WGMMA_CEILINGS = (("int8_wgmma_ceiling", "int8_wgmma_tops", 2 * 64 * 128 * 32, 4, 2),
                  ("fp16_wgmma_ceiling", "fp16_wgmma_tflops", 2 * 64 * 128 * 16, 4, 2))
PRODUCTS_AN_ITERATION = {"mma": 8, "wgmma": 8}  # kernels/ceiling.cu CHAINS and WG_GROUP


def measure_ceilings() -> dict:
    """Tensor-core ceilings measured now, in TOPS / TFLOPS: mma.sync chains (every arch) and, where the
    Hopper kernels run, warpgroup products from shared memory (kernels/ceiling.cu)."""
    import torch

    from sagebwd_cp.gpu import specs
    from sagebwd_cp.gpu.device import device_arch
    from sagebwd_cp.gpu.launch import i32, ptr
    from sagebwd_cp.gpu.plan import launch_now

    dev = torch.cuda.current_device()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    threads, iters = 256, 4096
    kinds = [("mma", specs.ceiling_spec(), MMA_CEILINGS)]
    if specs.use_wgmma(device_arch(dev)):
        kinds.append(("wgmma", specs.ceiling_spec(wgmma=True), WGMMA_CEILINGS))
    res = {}
    for kind, spec, ceilings in kinds:
        for entry, key, ops, warps, per_sm in ceilings:
            blocks = sms * per_sm
            out = torch.empty(blocks * threads, dtype=torch.int32, device="cuda")

            def run():
                launch_now(spec, entry, dev, torch.cuda.current_stream().cuda_stream, (blocks, 1, 1),
                           (threads, 1, 1), [ptr(out.data_ptr()), i32(iters)])
            ms = timed(run, reps=5)
            products = blocks * (threads // 32 // warps) * iters * PRODUCTS_AN_ITERATION[kind]
            res[key] = products * ops / (ms * 1e-3) / 1e12
    return res


def int8_limit(ceilings: dict) -> tuple:
    """(TOPS, name) of the INT8 ceiling the "% of limit" columns use: wgmma's where it was measured."""
    if "int8_wgmma_tops" in ceilings:
        return ceilings["int8_wgmma_tops"], "INT8 wgmma"
    return ceilings["int8_mma_tops"], "INT8 mma.sync"


def describe_ceilings(ceilings: dict) -> str:
    names = {"int8_mma_tops": "INT8 mma.sync {:.0f} TOPS", "fp16_mma_tflops": "fp16 mma.sync {:.0f} TFLOPS",
             "int8_wgmma_tops": "INT8 wgmma {:.0f} TOPS", "fp16_wgmma_tflops": "fp16 wgmma {:.0f} TFLOPS"}
    return ", ".join(names[k].format(v) for k, v in ceilings.items())


# The shapes measured: hidden size (query heads = hidden / head dim), query heads per key/value head, dtype.
SHAPE = {"hidden": 2048, "gqa": 1, "dtype": "float16"}


def make_inputs(d, n, count):
    """(batch, query heads, key/value heads) and ``count`` sets of (q, k, v) of SHAPE's kind."""
    import torch

    b, h = max(1, 16384 // n), SHAPE["hidden"] // d
    hk, dtype = h // SHAPE["gqa"], getattr(torch, SHAPE["dtype"])
    sets = [tuple(torch.randn((b, heads, n, d), device="cuda", dtype=dtype) for heads in (h, hk, hk))
            for _ in range(count)]
    return b, h, hk, sets


def sdpa(q, k, v, causal):
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])


def bench_forward(d, n, causal, tiles_list, reps):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import sagebwd_cp
    from sagebwd_cp.gpu import specs
    from sagebwd_cp.gpu.pieces import attend_launcher
    from sagebwd_cp.options import AttentionOptions
    from sagebwd_cp.problem import make_problem

    b, h, _, sets = make_inputs(d, n, 2)
    flops = 4 * b * h * n * n * d / (2 if causal else 1)
    rows = []
    it = [0]

    def pick():
        it[0] ^= 1
        return sets[it[0]]

    def tops(ms):
        return flops / (ms * 1e-3) / 1e12

    for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("sdpa-efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                ms = timed(lambda: sdpa(*pick(), causal), reps)
            rows.append((name, ms, tops(ms)))
        except RuntimeError as exc:
            print(f"  {name} unavailable: {str(exc)[:80]}", file=sys.stderr)

    saved_tiles = dict(specs.FORWARD_TILES)
    for tiles in tiles_list:
        if tiles is not None:
            specs.FORWARD_TILES[specs.padded_head_dim(d)] = tiles
        label = "sagebwd" if tiles is None else f"sagebwd[{tiles.warps}x{tiles.m_tiles}]"
        ms = timed(lambda: sagebwd_cp.attention(*pick(), causal=causal), reps)
        rows.append((label, ms, tops(ms)))
        ms_attend = timed(attend_launcher(make_problem(*sets[0], AttentionOptions(causal=causal))), reps)
        rows.append((label + " attend-only", ms_attend, tops(ms_attend)))
        specs.FORWARD_TILES.update(saved_tiles)
    return b, h, rows


PEERS = (("sdpa-flash", "FLASH_ATTENTION"), ("sdpa-cudnn", "CUDNN_ATTENTION"), ("sdpa-efficient", "EFFICIENT_ATTENTION"))


def bench_training(d, n, causal, reps, granularities):
    """Backward alone and forward+backward (quantization and pre/postprocessing included), and the
    peak memory of one forward+backward, for us and SDPA's backends."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import sagebwd_cp
    from sagebwd_cp import numerics

    b, h, _, ((q, k, v),) = make_inputs(d, n, 1)
    do = torch.randn_like(q)
    fwd_flops = 4 * b * h * n * n * d / (2 if causal else 1)
    rows = []

    def record(name, pas, ms, peak=None):
        rows.append((name, pas, ms, fwd_flops * (2.5 if pas == "bwd" else 3.5) / (ms * 1e-3) / 1e12, peak))

    for name, backend in PEERS:
        try:
            with sdpa_kernel(getattr(SDPBackend, backend)):
                qr, kr, vr = (x.clone().requires_grad_(True) for x in (q, k, v))
                out = sdpa(qr, kr, vr, causal)
                ms_b = timed(lambda: torch.autograd.grad(out, (qr, kr, vr), do, retain_graph=True), reps)
                del out

                def fwdbwd():
                    o = sdpa(qr, kr, vr, causal)
                    torch.autograd.grad(o, (qr, kr, vr), do)

                ms_fb = timed(fwdbwd, reps)
                peak = peak_mib(fwdbwd)
            record(name, "bwd", ms_b)
            record(name, "fwdbwd", ms_fb, peak)
        except RuntimeError as exc:
            print(f"  {name} unavailable: {str(exc)[:80]}", file=sys.stderr)

    for gran in granularities:
        # (head dims above 128 have no deterministic kernels: refused by name)
        for det in (False, True) if gran == granularities[0] and d <= numerics.WIDE_HEAD_DIM else (False,):
            label = f"sagebwd[{gran}{',det' if det else ''}]"
            out, saved = sagebwd_cp.attention_forward(q, k, v, causal=causal)
            ms_b = timed(lambda: sagebwd_cp.attention_backward(saved, do, granularity=gran, deterministic=det), reps)
            del out, saved

            def fwdbwd():
                o, sv = sagebwd_cp.attention_forward(q, k, v, causal=causal)
                sagebwd_cp.attention_backward(sv, do, granularity=gran, deterministic=det)

            ms_fb = timed(fwdbwd, reps)
            record(label, "bwd", ms_b)
            record(label, "fwdbwd", ms_fb, peak_mib(fwdbwd))
    return b, h, rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--tiles", nargs="*", default=[], help="extra forward tile configs WARPSxMTILES to compare")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--passes", nargs="+", choices=["fwd", "bwd"], default=["fwd", "bwd"],
                    help="fwd: inference forward; bwd: backward and forward+backward")
    ap.add_argument("--granularities", nargs="+", default=["fine", "paper"])
    ap.add_argument("--hidden", type=int, default=SHAPE["hidden"], help="query heads = hidden / head dim")
    ap.add_argument("--gqa", type=int, default=SHAPE["gqa"], help="query heads per key/value head")
    ap.add_argument("--dtype", choices=["float16", "bfloat16"], default=SHAPE["dtype"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    SHAPE.update(hidden=args.hidden, gqa=args.gqa, dtype=args.dtype)
    bad = [d for d in args.head_dims if args.hidden % d or (args.hidden // d) % args.gqa]
    if bad:
        ap.error(f"--hidden {args.hidden} / --gqa {args.gqa}: expected head dims that divide the hidden size into a "
                 f"multiple of {args.gqa} heads, got {bad}")

    import torch

    from sagebwd_cp.gpu import specs

    extra = [specs.ForwardTiles(*map(int, t.split("x"))) for t in args.tiles]
    ceilings = measure_ceilings()
    i8, limit_name = int8_limit(ceilings)
    dev = torch.cuda.get_device_name()
    records, lines = [], []
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    for d in args.head_dims:
        for causal in causals:
            for n in args.seqlens:
                rows = []
                if "fwd" in args.passes:
                    b, h, fwd_rows = bench_forward(d, n, causal, [None] + extra, args.reps)
                    rows += [(name, "fwd", ms, t, None) for name, ms, t in fwd_rows]
                if "bwd" in args.passes:
                    b, h, train_rows = bench_training(d, n, causal, args.reps, args.granularities)
                    rows += train_rows
                ref = {(name, pas): t for name, pas, _, t, _ in rows}
                for name, pas, ms, t, peak in rows:
                    rec = dict(impl=name, **{"pass": pas}, dtype=args.dtype, head_dim=d, causal=causal, seqlen=n,
                               batch=b, heads=h, kv_heads=h // args.gqa, ms=ms, tflops=t)
                    if peak is not None:
                        rec["peak_mib"] = peak
                    records.append(rec)
                    ratio = lambda peer: f"{t / ref[peer, pas]:5.2f}" if (peer, pas) in ref else "  -  "
                    mem = f" {peak:8.0f}MiB" if peak is not None else ""
                    lines.append(f"{d:>3} {'c' if causal else 'n'} {n:>6} {pas:<6} {name:<28} {ms:8.3f} {t:7.1f} "
                                 f"{ratio('sdpa-flash')} {ratio('sdpa-cudnn')} {100 * t / i8:5.1f}%{mem}")
    if args.json:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from report_common import write_json

        write_json(args.json, {"device": dev, **ceilings, "records": records})
    print(f"\n{dev}: ceilings {describe_ceilings(ceilings)} (measured now); %limit: of {limit_name}; {args.dtype}, "
          f"hidden {args.hidden}, {args.gqa} query heads a key/value head")
    print("  d c      N pass   impl                               ms    TOPS  xFA2 xcuDNN %limit  peak(fwd+bwd)")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
