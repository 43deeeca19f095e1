"""The wide wgmma backward whose passes split the Q·K and V head dims up to 192 (SB_DQK 192, SB_DPV 128 or 192: 96
columns of dK and dQ a pass, dV's half of V's) against the same kernel splitting the 256 padded columns, in one
process (GPU).

``check``: dK and dV bit for bit equal between the two, dQ to its accumulation order (rel-L2 < 1e-4), over ragged,
GQA, causal and packed cases at 192/128, 192 and 136/64, both dtypes (gradients poisoned with NaN first).
``time``: ms of forward+backward, the variants interleaved over rounds, beside cuDNN's SDPA. Variants: ``old`` (256
columns), ``new`` (narrow, the tiles the library picks), ``s1``/``s2`` (narrow with one split stage / two stages),
``s2q2`` (two stages and two dQ tiles), ``pair`` and ``twopass`` (kernels/backward_pair.cu, a CTA of 64 keys, each
score formed once, the library's default; or the two-pass kernel; ``s1``, ``s2`` and ``s2q2`` vary the two-pass
kernel), ``phases`` (kernels/backward_phases.cu, the pair kernel's warpgroups specialized by phase, where V's head dim
is at most 128; the pair kernel elsewhere).
``one``: three forward+backward calls of one shape by one variant, for ncu to profile the third backward.

    python tools/experiments/narrow_backward.py check
    python tools/experiments/narrow_backward.py time --variants old new s2 [--shapes 2x16x4x4096x192x128]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
from bench_attention import timed  # noqa: E402
from bench_wide_head_dims import PEERS, shape_inputs  # noqa: E402

# (B, Hq, Hkv, Lq, Lk, Dqk, Dv, options)
CASES = [(1, 2, 2, 1, 1, 192, 128, {}), (2, 4, 2, 300, 257, 192, 128, {"causal": True}),
         (1, 4, 1, 700, 130, 192, 128, {}), (2, 4, 2, 513, 513, 192, 192, {"causal": True}),
         (1, 2, 1, 100, 700, 192, 192, {}), (1, 4, 2, 600, 600, 136, 64, {"causal": True}),
         (1, 4, 4, 1000, 1000, 160, 160, {})]

_library_tiles = None


def _variant(name: str) -> None:
    """Make the library pick variant ``name``'s backward (its plans rebuilt)."""
    from sagebwd_cp.gpu import plan, specs

    global _library_tiles
    if _library_tiles is None:
        _library_tiles = specs.narrow_backward_tiles
    lib = _library_tiles

    def tiles(t, dp, head_dim, value_dim, options):
        if name == "old":
            return t
        t = lib(t, dp, head_dim, value_dim, options, pair=None if name == "new" else name in ("pair", "phases"),
                phases=None if name == "new" else name == "phases")
        if not t.qk_cols or name in ("new", "pair", "phases", "twopass"):
            return t
        return dataclasses.replace(t, stages=1 if name == "s1" else 2, dq_tiles=2 if name == "s2q2" else 1)

    specs.narrow_backward_tiles = tiles
    plan.clear_plans()


def _poison_the_allocator() -> None:
    """NaN in the memory the next outputs are allocated from (torch's caching allocator reuses the block)."""
    import torch

    torch.full((1 << 26,), float("nan"), device="cuda")


def _grads() -> dict:
    import torch

    import sagebwd_cp.torch as st
    from sagebwd_cp.api import run_backward, run_forward
    from sagebwd_cp.options import AttentionOptions

    out = {}
    for b, hq, hk, lq, lk, dqk, dv, opts in CASES:
        for dtype in (torch.float16, torch.bfloat16):
            g = torch.Generator(device="cuda").manual_seed(hash((b, hq, lq, lk, dqk, dv)) % 2**31)
            q, k, v, do = (torch.randn((b, n, h, e), generator=g, device="cuda").to(dtype)
                           for h, n, e in ((hq, lq, dqk), (hk, lk, dqk), (hk, lk, dv), (hq, lq, dv)))
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            _poison_the_allocator()
            st.flash_attn_func(*leaves, **opts).backward(do)
            out[f"{b}x{hq}/{hk}x{lq}/{lk}x{dqk}/{dv}.{opts}.{dtype}"] = [x.grad.float() for x in leaves]
            if dv < dqk:  # the neutral API on HND copies (V and dO at their own head dim)
                qh, kh, vh, doh = (x.transpose(1, 2).contiguous() for x in (q, k, v, do))
                options = AttentionOptions(**opts)
                _poison_the_allocator()
                o, _, (lse2, k_mean) = run_forward(qh, kh, vh, options, training=True)
                grads = run_backward(qh, kh, vh, o, lse2, doh, options, k_mean=k_mean)
                out[f"{b}x{hq}/{hk}x{lq}/{lk}x{dqk}/{dv}.{opts}.{dtype}.hnd"] = [torch.as_tensor(x).float() for x in grads]
    lens = (1, 130, 257, 64)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    for dtype in (torch.float16, torch.bfloat16):
        g = torch.Generator(device="cuda").manual_seed(7)
        q, k, v, do = (torch.randn((sum(lens), h, e), generator=g, device="cuda").to(dtype)
                       for h, e in ((4, 192), (2, 192), (2, 128), (4, 128)))
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        st.flash_attn_varlen_func(*leaves, cu, cu, max(lens), max(lens), causal=True).backward(do)
        out[f"varlen.{dtype}"] = [x.grad.float() for x in leaves]
    return out


def check(variant: str, base: str = "old") -> int:
    _variant(base)
    old = _grads()
    _variant(variant)
    new = _grads()
    bad = 0
    rel = lambda x, y: float((x - y).norm() / x.norm().clamp_min(1e-30))  # noqa: E731
    for key, (a, b) in ((k, (old[k], new[k])) for k in old):
        dq_err = rel(a[0], b[0])
        same_kv = all(bool(x.isfinite().all()) and bool((x == y).all()) for x, y in zip(a[1:], b[1:]))
        kv_err = max(rel(x, y) for x, y in zip(a[1:], b[1:]))
        # pair: the causal sweep's fold order differs (64-key CTAs start their rotation elsewhere)
        kv_ok = same_kv or (variant == "pair" and kv_err < 1e-5 and all(bool(y.isfinite().all()) for y in b[1:]))
        ok = kv_ok and dq_err < 1e-4 and bool(b[0].isfinite().all())
        bad += not ok
        print(f"{'ok' if ok else 'DIFFERS'} {key}: dK, dV equal {same_kv} (rel-L2 {kv_err:.1e}), dQ rel-L2 {dq_err:.2e}")
    print(f"{len(old) - bad} of {len(old)} cases agree")
    return 1 if bad else 0


def time_shapes(shapes, variants, rounds: int, reps: int) -> int:
    import torch

    print(f"device: {torch.cuda.get_device_name()}  (bf16, causal; ms fwd+bwd, median of {rounds} rounds)")
    for text in shapes:
        q, k, v, do = shape_inputs(text)
        res = {name: [] for name in (*variants, "cudnn")}
        for _ in range(rounds):
            for name in res:
                if name != "cudnn":
                    _variant(name)
                _, fwdbwd = PEERS["cudnn" if name == "cudnn" else "ours"](q, k, v, do)
                res[name].append(timed(fwdbwd, reps))
        med = {k: statistics.median(x) for k, x in res.items()}
        base = med[variants[0]]
        cells = "  ".join(f"{k} {t:.3f} ({base / t:.3f}x)" for k, t in med.items())
        print(f"{text}: {cells}")
    return 0


def one(shape: str, variant: str) -> int:
    import torch

    q, k, v, do = shape_inputs(shape)
    if variant != "cudnn":
        _variant(variant)
    _, fwdbwd = PEERS["cudnn" if variant == "cudnn" else "ours"](q, k, v, do)
    for _ in range(3):
        fwdbwd()
    torch.cuda.synchronize()
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("check", "time", "one"))
    ap.add_argument("--variant", default="new", help="check, one: the variant against --base / profiled")
    ap.add_argument("--base", default="old", help="check: the variant it is compared with")
    ap.add_argument("--variants", nargs="+", default=["old", "new"])
    ap.add_argument("--shapes", nargs="+", default=["2x16x4x4096x192x128", "1x16x4x8192x192x128", "2x16x4x4096x192"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    if args.mode == "one":
        return one(args.shapes[0], args.variant)
    if args.mode == "check":
        return check(args.variant, args.base)
    return time_shapes(args.shapes, args.variants, args.rounds, args.reps)


if __name__ == "__main__":
    sys.exit(main())
