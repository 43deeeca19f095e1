"""The warp-specialized sm_90 forward (kernels/forward_ws.cu) against the one-warpgroup kernel and
cuDNN, in one process: kernel variants are chosen by their environment variables and the plan
cache is cleared between them, so every variant and the peer run side by side.

    python tools/probe_forward_ws.py check             # outputs bit for bit those of the old kernel
    python tools/probe_forward_ws.py time [--shapes 8x16x2048x128 ...] [--variants ws=0 ws=1 ...]
    ncu --kernel-name attention_forward --launch-skip 1 --launch-count 1 \
        python tools/probe_forward_ws.py one --shapes 1x32x16384x64 --causal yes --variants ws=1

A variant is comma-separated NAME=VALUE settings: ws (SAGEBWD_FORWARD_WS), c (CONSUMERS), s
(STAGES), pp (PINGPONG), ps (PERSISTENT), kt (KEY_TILE), wk (WS_KEYS: the warp-specialized
forward's 128- or 192-key tiles). ``time`` prints ms per forward (training forward: O and LSE; K and V's
quantization included) and the ratio to SDPA on cuDNN, interleaving the variants over rounds.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

from digest_outputs import CASES as DIGEST_CASES, _digest  # tools/, beside this file

ENV = {"ws": "SAGEBWD_FORWARD_WS", "c": "SAGEBWD_FORWARD_CONSUMERS", "s": "SAGEBWD_FORWARD_STAGES",
       "pp": "SAGEBWD_FORWARD_PINGPONG", "ps": "SAGEBWD_FORWARD_PERSISTENT", "kt": "SAGEBWD_FORWARD_KEY_TILE",
       "wk": "SAGEBWD_FORWARD_WS_KEYS"}
# (B, Hq, Hkv, Lq, Lk, D, causal): the digest tool's cases, and N = 1 causal, a tile and one row, a
# padded head dim of 96 with Lq != Lk.
CASES = DIGEST_CASES + [(1, 2, 2, 1, 1, 128, True), (1, 2, 2, 129, 129, 128, True), (3, 2, 2, 200, 456, 96, True)]


def _apply(variant: str) -> None:
    from sagebwd_cp.gpu import plan

    for name in ENV.values():
        os.environ.pop(name, None)
    for item in filter(None, variant.split(",")):
        k, v = item.split("=")
        os.environ[ENV[k]] = v
    plan.clear_plans()


def _outputs() -> dict:
    import torch

    import sagebwd_cp

    out = {}
    for b, hq, hk, lq, lk, d, causal in CASES:
        for dtype in (torch.float16, torch.bfloat16):
            g = torch.Generator(device="cuda").manual_seed(hash((b, hq, hk, lq, lk, d)) % 2**31)
            q, k, v = (torch.randn((b, n, h, d), generator=g, device="cuda").to(dtype)
                       for h, n in ((hq, lq), (hk, lk), (hk, lk)))
            name = f"{b}x{hq}/{hk}x{lq}/{lk}x{d}.{'causal' if causal else 'full'}.{dtype}"
            o = torch.full_like(q, float("nan"))
            o, saved = sagebwd_cp.attention_forward(q, k, v, causal=causal, layout="NHD", out=o)
            out[name + ".o"] = _digest(torch.as_tensor(o))
            out[name + ".lse2"] = _digest(torch.as_tensor(saved.lse2.obj))
    import sagebwd_cp.torch as st

    for hq, lens, d, causal in ((4, (1, 130, 257, 64), 128, True), (2, (300, 513), 64, False)):
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
        total = int(cu[-1])
        g = torch.Generator(device="cuda").manual_seed(7)
        q, k, v = (torch.randn((total, hq, d), generator=g, device="cuda").half() for _ in range(3))
        o = st.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=causal)
        out[f"varlen{lens}.{d}.{causal}.o"] = _digest(o)
    torch.cuda.synchronize()
    return out


def check(variants) -> int:
    base = variants[0]
    _apply(base)
    ref = _outputs()
    bad = 0
    for var in variants[1:]:
        _apply(var)
        got = _outputs()
        differ = sorted(k for k in ref if ref[k] != got.get(k))
        bad += len(differ)
        print(f"{var or 'default'} against {base or 'default'}: {len(ref)} outputs, {len(differ)} differ")
        for k in differ[:20]:
            print("   ", k)
    return 1 if bad else 0


def _time(fn, reps: int) -> float:
    import torch

    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / reps


def time_variants(shapes, variants, rounds: int, reps: int, causal_modes, dtype_name: str, gqa: int) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import sagebwd_cp

    dtype = getattr(torch, dtype_name)
    rows = []
    for shape in shapes:
        b, h, n, d = (int(x) for x in shape.split("x"))
        hk = h // gqa
        for causal in causal_modes:
            # Several input sets, larger than L2 together, rotated between calls.
            sets = [tuple(torch.randn((b, hh, n, d), device="cuda", dtype=dtype) for hh in (h, hk, hk)) for _ in range(3)]
            idx = [0]

            def ours():
                q, k, v = sets[idx[0] % 3]
                idx[0] += 1
                sagebwd_cp.attention_forward(q, k, v, causal=causal, layout="HND")

            def cudnn():
                q, k, v = sets[idx[0] % 3]
                idx[0] += 1
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa > 1)

            times = {v: [] for v in variants}
            times["cudnn"] = []
            for _ in range(rounds):
                for var in variants:
                    _apply(var)
                    times[var].append(_time(ours, reps))
                times["cudnn"].append(_time(cudnn, reps))
            med = {k: statistics.median(v) for k, v in times.items()}
            rows.append((shape, causal, med))
            print(f"{shape} {'causal' if causal else 'full':6} cudnn {med['cudnn']:.3f} ms | " +
                  " | ".join(f"{v or 'default'} {med[v]:.3f} ms x{med['cudnn'] / med[v]:.2f}" for v in variants), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("check", "time", "one"))
    ap.add_argument("--variants", nargs="+", default=None)
    ap.add_argument("--shapes", nargs="+", default=["8x16x2048x128", "2x16x8192x128", "8x32x2048x64", "1x32x16384x64"])
    ap.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--gqa", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    if args.mode == "check":
        return check(args.variants or ["ws=0", "ws=1", "ws=1,c=1", "ws=1,c=3", "ws=1,c=3,pp=0", "ws=1,pp=0",
                                        "ws=1,ps=0", "ws=1,s=2", "ws=1,s=4"])
    modes = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    if args.mode == "one":  # two forwards of the first shape and variant (for a profiler: skip the first)
        import torch

        import sagebwd_cp

        _apply((args.variants or ["ws=1"])[0])
        b, h, n, d = (int(x) for x in args.shapes[0].split("x"))
        q, k, v = (torch.randn((b, hh, n, d), device="cuda", dtype=getattr(torch, args.dtype)) for hh in (h, h // args.gqa, h // args.gqa))
        for _ in range(2):
            sagebwd_cp.attention_forward(q, k, v, causal=modes[0], layout="HND")
        torch.cuda.synchronize()
        return 0
    time_variants(args.shapes, args.variants or ["ws=0", "ws=1"], args.rounds, args.reps, modes, args.dtype, args.gqa)
    return 0


if __name__ == "__main__":
    sys.exit(main())
