"""Attention speed against SDPA's backends, measured side by side in one run.

fp16, 16K tokens per batch, hidden 2048 (heads = 2048 / head_dim), N = 1K..16K.  TOPS use the
FLOP convention 4·B·H·N²·d for the forward (half when causal).  Also measures the INT8 and fp16
mma.sync ceilings in the same run.  Prints a compact table last; ``--json PATH`` writes records.

    python benchmarks/bench_attention.py [--seqlens 4096 16384] [--head-dims 64 128] [--tiles 8x1 4x2]
"""
from __future__ import annotations

import argparse
import json
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


def measure_ceilings():
    import cupy
    import torch

    from sagebwd_cp import specs
    from sagebwd_cp.launch import i32, launch, ptr

    dev = torch.cuda.current_device()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    blocks, threads, iters = sms * 8, 256, 4096
    out = torch.empty(blocks * threads, dtype=torch.int32, device="cuda")
    res = {}
    for entry, flops_per_mma in (("int8_mma_ceiling", 2 * 16 * 8 * 32), ("fp16_mma_ceiling", 2 * 16 * 8 * 16)):
        def run():
            launch(specs.ceiling_spec(), entry, dev, torch.cuda.current_stream().cuda_stream, (blocks, 1, 1),
                   (threads, 1, 1), [ptr(out.data_ptr()), i32(iters)])
        ms = timed(run, reps=5)
        mmas = blocks * (threads // 32) * iters * 8
        res[entry] = mmas * flops_per_mma / (ms * 1e-3) / 1e12
    return res["int8_mma_ceiling"], res["fp16_mma_ceiling"]


def bench_forward(d, n, causal, tiles_list, reps):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import sagebwd_cp
    from sagebwd_cp import specs
    from sagebwd_cp.arrays import current_stream, empty
    from sagebwd_cp.forward import attend_gpu, quantize_inputs_gpu
    from sagebwd_cp.problem import make_problem

    b, h = max(1, 16384 // n), 2048 // d
    flops = 4 * b * h * n * n * d / (2 if causal else 1)
    sets = [tuple(torch.randn((b, h, n, d), device="cuda", dtype=torch.float16) for _ in range(3)) for _ in range(2)]
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
                ms = timed(lambda: F.scaled_dot_product_attention(*pick(), is_causal=causal), reps)
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
        q, k, v = sets[0]
        prob = make_problem(q, k, v, causal=causal)
        stream = current_stream(prob.q)
        qz = quantize_inputs_gpu(prob, False, stream)
        out = empty(prob.shape(h, n), "float16", prob.q)
        ms_attend = timed(lambda: attend_gpu(prob, qz, out, None, stream), reps)
        rows.append((label + " attend-only", ms_attend, tops(ms_attend)))
        specs.FORWARD_TILES.update(saved_tiles)
    return b, h, rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--tiles", nargs="*", default=[], help="extra forward tile configs WARPSxMTILES to compare")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import torch

    from sagebwd_cp import specs

    extra = [specs.ForwardTiles(*map(int, t.split("x"))) for t in args.tiles]
    i8, f16 = measure_ceilings()
    dev = torch.cuda.get_device_name()
    records, lines = [], []
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    for d in args.head_dims:
        for causal in causals:
            for n in args.seqlens:
                b, h, rows = bench_forward(d, n, causal, [None] + extra, args.reps)
                ref = {name: t for name, _, t in rows}
                for name, ms, t in rows:
                    records.append(dict(impl=name, **{"pass": "fwd"}, dtype="float16", head_dim=d, causal=causal,
                                        seqlen=n, batch=b, heads=h, ms=ms, tflops=t))
                    ratio = lambda peer: f"{t / ref[peer]:5.2f}" if peer in ref else "  -  "
                    lines.append(f"{d:>3} {'c' if causal else 'n'} {n:>6} {name:<28} {ms:8.3f} {t:7.1f} "
                                 f"{ratio('sdpa-flash')} {ratio('sdpa-cudnn')} {100 * t / i8:5.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": dev, "int8_mma_tops": i8, "fp16_mma_tflops": f16, "records": records}, f, indent=1)
    print(f"\n{dev}: INT8 mma.sync ceiling {i8:.0f} TOPS, fp16 mma.sync {f16:.0f} TFLOPS (measured now)")
    print("  d c      N impl                               ms    TOPS  xFA2 xcuDNN  %int8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
