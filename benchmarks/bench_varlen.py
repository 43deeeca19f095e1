"""Packed (variable-length) batches: speed of ``flash_attn_varlen_func`` next to the padded path and
SDPA's nearest equivalents, measured side by side in one run.

A batch of sequences of mixed lengths (seeded; about ``--tokens`` tokens in all, lengths from
``--min-len`` to ``--max-len``), hidden 2048 (heads = 2048 / head_dim), bf16, causal, forward and
forward+backward. Compared:

- ours, packed: ``sagebwd_cp.torch.flash_attn_varlen_func`` on (total, H, D);
- ours, padded: every sequence padded to the longest, one dense call (the padding computed too);
- SDPA, padded: the same padded batch through ``F.scaled_dot_product_attention`` (cuDNN on Hopper),
  which has no per-sequence lengths without a mask (a mask would take it off its fast kernels);
- SDPA, per sequence: one SDPA call a sequence (exact, no padding, one launch each);
- FlashAttention-2's ``flash_attn_varlen_func`` where the ``flash_attn`` package is installed.

TOPS count only the packed batch's own work (Σ 2·H·L²·d causal forward, 3.5x for fwd+bwd), for every
row, so padding shows up as lost speed.

    python benchmarks/bench_varlen.py [--tokens 16384] [--head-dims 64 128] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from bench_attention import timed


def lengths(tokens: int, lo: int, hi: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    out = []
    while sum(out) < tokens:
        out.append(int(rng.integers(lo, hi + 1)))
    out[-1] -= sum(out) - tokens
    return [n for n in out if n > 0]


def main(argv=None):
    import torch
    import torch.nn.functional as F

    import sagebwd_cp.torch as sage

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--min-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    try:
        from flash_attn import flash_attn_varlen_func as fa2_varlen
    except ImportError:
        fa2_varlen = None

    lens = lengths(args.tokens, args.min_len, args.max_len, args.seed)
    B, L, T = len(lens), max(lens), sum(lens)
    cu = torch.tensor([0] + np.cumsum(lens).tolist(), dtype=torch.int32, device="cuda")
    device = torch.cuda.get_device_name()
    print(f"{device}; {B} sequences, {T} tokens, lengths {min(lens)}..{L}, bf16, causal", flush=True)
    records = []
    for d in args.head_dims:
        H = 2048 // d
        g = torch.Generator(device="cuda").manual_seed(d)
        q, k, v, do = (torch.randn(T, H, d, generator=g, device="cuda").to(torch.bfloat16) for _ in range(4))
        flops = sum(2 * H * n * n * d for n in lens)  # causal forward: 4·H·n²·d / 2

        def padded(x):
            y = x.new_zeros(B, L, H, d)
            for b, n in enumerate(lens):
                y[b, :n] = x[cu[b]:cu[b + 1]]
            return y

        qp, kp, vp, dop = (padded(x) for x in (q, k, v, do))
        qh, kh, vh, doh = (x.transpose(1, 2) for x in (qp, kp, vp, dop))
        pieces = [tuple(x[cu[b]:cu[b + 1]].transpose(0, 1)[None] for x in (q, k, v)) for b in range(B)]

        def train(fn, inputs, grad):
            def step():
                xs = [x.detach().requires_grad_() for x in inputs]
                fn(*xs).backward(grad)
            return step

        cases = {
            "ours packed": (lambda q, k, v: sage.flash_attn_varlen_func(q, k, v, cu, cu, L, L, causal=True), (q, k, v), do),
            "ours padded": (lambda q, k, v: sage.flash_attn_func(q, k, v, causal=True), (qp, kp, vp), dop),
            "SDPA padded": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), (qh, kh, vh), doh),
        }
        if fa2_varlen is not None:
            cases["FA2 packed"] = (lambda q, k, v: fa2_varlen(q, k, v, cu, cu, L, L, causal=True), (q, k, v), do)
        results = {}
        for name, (fn, inputs, grad) in cases.items():
            with torch.no_grad():
                fwd = timed(lambda: fn(*inputs), reps=args.reps)
            both = timed(train(fn, inputs, grad), reps=max(5, args.reps // 2))
            results[name] = (fwd, both)

        def per_sequence():
            for p in pieces:
                F.scaled_dot_product_attention(*p, is_causal=True)

        with torch.no_grad():
            seq_fwd = timed(per_sequence, reps=args.reps)

        def per_sequence_train():
            for p in pieces:
                xs = [x.detach().requires_grad_() for x in p]
                F.scaled_dot_product_attention(*xs, is_causal=True).sum().backward()

        results["SDPA per sequence"] = (seq_fwd, timed(per_sequence_train, reps=max(5, args.reps // 2)))
        print(f"\nhead dim {d}, {H} heads: ms (TOPS of the packed batch's own work)")
        print(f"{'':20s} {'forward':>18s} {'fwd+bwd':>18s}   ours packed's speedup: {'fwd':>5s} {'fwd+bwd':>8s}")
        ref = results["ours packed"]
        for name, (f, b) in results.items():
            print(f"{name:20s} {f:8.3f} ({flops / f / 1e9:6.0f}) {b:8.3f} ({3.5 * flops / b / 1e9:6.0f}) "
                  f"{'':25s}{f / ref[0]:5.2f} {b / ref[1]:8.2f}")
            records.append(dict(device=device, head_dim=d, heads=H, sequences=B, tokens=T, max_len=L, case=name,
                                forward_ms=f, fwd_bwd_ms=b))
        if fa2_varlen is None:
            print("FA2 packed: flash_attn is not installed")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(records, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
