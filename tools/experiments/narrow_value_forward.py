"""The wide wgmma forward holding O for V's head dim (SB_DPV: 128 for MLA's 192/128, 192 for d=192) against the
same kernel holding all 256 padded columns, in one process (GPU).

``check``: forward outputs and LSE bit for bit equal between the two, over ragged, GQA, causal, windowed,
soft-capped and packed cases in both dtypes (outputs poisoned with NaN first).
``time``: ms of the forward and of forward+backward, the two kernels interleaved over rounds, beside cuDNN's SDPA.
``one``: three forwards of one shape by one variant (old, new or cudnn), for ncu to profile the third.

    python tools/experiments/narrow_value_forward.py check
    python tools/experiments/narrow_value_forward.py time [--shapes 2x16x4x4096x192x128 2x16x4x4096x192]
    ncu --kernel-name regex:'^attention_forward$|fprop' --launch-skip 2 --launch-count 1 \
        python tools/experiments/narrow_value_forward.py one --variant new --shapes 2x16x4x4096x192x128
"""
from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
from bench_attention import timed  # noqa: E402
from bench_wide_head_dims import PEERS, shape_inputs  # noqa: E402

# (B, Hq, Hkv, Lq, Lk, Dqk, Dv, options)
CASES = [(1, 2, 2, 1, 1, 192, 128, {}), (2, 4, 2, 300, 257, 192, 128, {"causal": True}),
         (1, 4, 1, 700, 130, 192, 128, {}), (2, 4, 2, 513, 513, 192, 192, {"causal": True}),
         (1, 2, 1, 100, 700, 192, 192, {}), (1, 4, 2, 600, 600, 200, 200, {"causal": True}),
         (1, 4, 2, 777, 777, 192, 128, {"causal": True, "window_size": (200, 0)}),
         (1, 4, 2, 640, 640, 192, 128, {"causal": True, "softcap": 30.0, "smooth_k": False})]


def _narrow(on: bool) -> None:
    from sagebwd_cp.gpu import plan, specs

    specs.NARROW_VALUE_COLS = (128, 192) if on else ()
    plan.clear_plans()


def _digest(t) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(dtype=__import__("torch").uint8).cpu().numpy().tobytes()).hexdigest()[:16]


def _outputs() -> dict:
    import torch

    import sagebwd_cp
    import sagebwd_cp.torch as st

    out = {}
    for b, hq, hk, lq, lk, dqk, dv, opts in CASES:
        for dtype in (torch.float16, torch.bfloat16):
            g = torch.Generator(device="cuda").manual_seed(hash((b, hq, lq, lk, dqk, dv)) % 2**31)
            q, k, v = (torch.randn((b, n, h, e), generator=g, device="cuda").to(dtype)
                       for h, n, e in ((hq, lq, dqk), (hk, lk, dqk), (hk, lk, dv)))
            name = f"{b}x{hq}/{hk}x{lq}/{lk}x{dqk}/{dv}.{opts}.{dtype}"
            # The neutral API (V, O at V's own head dim: value_head_dim.py), into a poisoned output buffer.
            extra = {"out": torch.full(q.shape[:-1] + (dv,), float("nan"), dtype=q.dtype, device=q.device)}
            o, saved = sagebwd_cp.attention_forward(q, k, v, layout="NHD", **opts, **extra)
            lse2 = getattr(saved, "lse2", None)
            if lse2 is not None:
                out[name + ".lse2"] = _digest(torch.as_tensor(lse2.obj))
            out[name + ".o"] = _digest(torch.as_tensor(o))
    # Packed: 192/128 through flash_attn_varlen_func.
    lens = (1, 130, 257, 64)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    for dtype in (torch.float16, torch.bfloat16):
        g = torch.Generator(device="cuda").manual_seed(7)
        q, k, v = (torch.randn((sum(lens), h, e), generator=g, device="cuda").to(dtype)
                   for h, e in ((4, 192), (2, 192), (2, 128)))
        o = st.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
        out[f"varlen.{dtype}.o"] = _digest(o)
    return out


def check() -> int:
    _narrow(False)
    wide = _outputs()
    _narrow(True)
    narrow = _outputs()
    differ = [k for k in wide if wide[k] != narrow[k]]
    for k in differ:
        print("DIFFERS", k)
    print(f"{len(wide) - len(differ)} of {len(wide)} outputs bit for bit equal")
    return 1 if differ else 0


def time_shapes(shapes, rounds: int, reps: int) -> int:
    import torch

    print(f"device: {torch.cuda.get_device_name()}  (bf16, causal; ms fwd / fwd+bwd, median of {rounds} rounds)")
    for text in shapes:
        q, k, v, do = shape_inputs(text)
        res = {"old": ([], []), "new": ([], []), "cudnn": ([], [])}
        for _ in range(rounds):
            for name in res:
                if name != "cudnn":
                    _narrow(name == "new")
                fwd, fwdbwd = PEERS["cudnn" if name == "cudnn" else "ours"](q, k, v, do)
                res[name][0].append(timed(fwd, reps))
                res[name][1].append(timed(fwdbwd, reps))
        med = {k: (statistics.median(f), statistics.median(fb)) for k, (f, fb) in res.items()}
        cells = "  ".join(f"{k} {f:.3f}/{fb:.3f}" for k, (f, fb) in med.items())
        print(f"{text}: {cells}  new/old fwd {med['old'][0] / med['new'][0]:.3f}x fwd+bwd "
              f"{med['old'][1] / med['new'][1]:.3f}x; cuDNN/new fwd {med['cudnn'][0] / med['new'][0]:.3f} "
              f"fwd+bwd {med['cudnn'][1] / med['new'][1]:.3f}")
    return 0


def one(shape: str, variant: str) -> int:
    import torch

    q, k, v, do = shape_inputs(shape)
    if variant != "cudnn":
        _narrow(variant == "new")
    fwd, _ = PEERS["cudnn" if variant == "cudnn" else "ours"](q, k, v, do)
    for _ in range(3):
        fwd()
    torch.cuda.synchronize()
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("check", "time", "one"))
    ap.add_argument("--variant", choices=("old", "new", "cudnn"), default="new", help="one: whose forward")
    ap.add_argument("--shapes", nargs="+", default=["2x16x4x4096x192x128", "1x16x4x8192x192x128", "2x16x4x4096x192",
                                                    "2x16x4x4096x256"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    if args.mode == "one":
        return one(args.shapes[0], args.variant)
    return check() if args.mode == "check" else time_shapes(args.shapes, args.rounds, args.reps)


if __name__ == "__main__":
    sys.exit(main())
