"""The small case set that ``gpu_check.py --sanitize`` runs under compute-sanitizer: every kernel family
and variant on tiny shapes (forward, backward, the quantizer, the row kernels, μ_K's token sums,
Q-smoothing's bias, the returned LSE, the packed copy of misaligned rows; sliding windows, soft caps,
sinks, head dims above 128 and a V head dim of its own, packed batches), on every kernel path (the
default; mma.sync through SAGEBWD_WGMMA=0 on Hopper; 64-key forward tiles; the opt-in
warp-specialized, four-warpgroup and 192-key variants; the pair and two-pass backwards in place of the phase-specialized
one at 192/128), causal and not, GQA, deterministic, ragged N
and Lq != Lk. Prints one line per case.

    python benchmarks/sanitize_cases.py [--quick]
"""
from __future__ import annotations

import argparse
import os
import sys

# (B, Hq, Hkv, Lq, Lk, D, causal, dtype, options): options holds the backward's keywords, and "forward" the
# forward's extra ones; "value_dim" gives V its own head dim, "packed" runs the sequences (Lq, Lk), (Lk, Lq)
# and (1, 1) as one packed batch, "sinks" adds a sink logit per query head, "strided" takes views.
CASES = [
    (1, 2, 2, 77, 77, 64, True, "float16", {}),                                   # ragged N
    (1, 4, 2, 130, 70, 128, False, "bfloat16", {}),                               # GQA, Lq > Lk
    (1, 2, 1, 50, 190, 80, True, "float16", {"granularity": "paper"}),            # MQA, padded head dim
    (2, 2, 2, 129, 129, 64, True, "bfloat16", {"deterministic": True}),           # deterministic (the producer warpgroup)
    (1, 2, 2, 100, 100, 128, True, "float16", {"deterministic": True, "smooth_q": True}),
    (1, 4, 2, 130, 200, 80, True, "bfloat16", {"smooth_q": True, "forward": {"window_size": (64, 0)}}),  # Q-smoothing, window
    (1, 2, 2, 1, 1, 64, False, "float16", {}),                                    # N = 1
    (1, 2, 2, 96, 96, 64, False, "float16", {"strided": True}),                   # strided views, misaligned rows
    (1, 2, 2, 96, 96, 128, True, "bfloat16", {"strided": True, "value_dim": 64}),  # and V, dO of their own head dim
    (1, 4, 2, 200, 200, 128, True, "bfloat16", {"forward": {"window_size": (64, 0)}}),       # causal window
    (1, 2, 2, 150, 170, 64, False, "float16", {"forward": {"window_size": (32, 40)}}),       # two-sided window
    (1, 2, 1, 130, 130, 128, True, "float16", {"forward": {"softcap": 20.0, "smooth_k": False}}),
    (1, 2, 2, 90, 90, 64, False, "bfloat16", {"forward": {"softcap": 20.0, "smooth_k": False}}),  # band-test kernels
    (1, 4, 2, 130, 150, 128, True, "float16", {"forward": {"softcap": 20.0}}),  # soft cap with K-smoothing (row shares)
    (1, 2, 2, 70, 70, 64, True, "bfloat16", {"sinks": True}),
    (1, 4, 2, 100, 100, 256, True, "bfloat16", {}),                               # head dim 256
    (1, 2, 2, 100, 100, 256, True, "bfloat16", {"forward": {"softcap": 20.0, "smooth_k": False}}),
    (1, 2, 2, 130, 130, 256, False, "float16", {"deterministic": True}),
    (1, 2, 2, 100, 120, 256, True, "bfloat16", {"deterministic": True, "forward": {"softcap": 20.0, "window_size": (48, 0)}}),
    (1, 2, 2, 110, 90, 192, True, "bfloat16", {"value_dim": 128}),               # MLA's 192/128
    (1, 4, 2, 100, 120, 192, True, "bfloat16", {"value_dim": 128, "sinks": True}),  # sinks joined on O of V's head dim
    (1, 2, 1, 70, 150, 192, False, "float16", {"value_dim": 128}),                # MLA's, MQA, Lq < Lk
    (1, 4, 2, 90, 130, 192, True, "bfloat16", {"value_dim": 128, "packed": True}),  # MLA's, packed
    (1, 4, 2, 110, 90, 192, True, "float16", {}),                                 # d=192 (the pair kernel's split stage)
    (1, 2, 1, 90, 130, 192, False, "bfloat16", {"packed": True}),                 # d=192, packed
    (1, 4, 2, 90, 130, 128, True, "bfloat16", {"packed": True}),                  # packed batch
    (1, 2, 2, 90, 130, 256, False, "float16", {"packed": True, "forward": {"window_size": (48, 16)}}),
]
SETTINGS = [{}, {"SAGEBWD_WGMMA": "0"}, {"SAGEBWD_FORWARD_KEY_TILE": "64", "SAGEBWD_BACKWARD_PHASES": "0"},
            {"SAGEBWD_FORWARD_WS": "1", "SAGEBWD_BACKWARD_WS": "1", "SAGEBWD_BACKWARD_PAIR": "0"},
            {"SAGEBWD_FORWARD_WS": "1", "SAGEBWD_FORWARD_WS_KEYS": "192", "SAGEBWD_BACKWARD_QUAD": "1"}]
VARIABLES = sorted({name for setting in SETTINGS for name in setting})


def run_packed(case, rand, device: str):
    """The case's (Lq, Lk), (Lk, Lq) and (1, 1) sequences as one packed (THD) batch, forward and backward;
    returns the gradients."""
    import torch

    import sagebwd_cp

    _, hq, hkv, lq, lk, d, causal, _, opts = case
    dv = opts.get("value_dim", d)
    lens_q, lens_k = [lq, lk, 1], [lk, lq, 1]
    def cu(lens):
        return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=device)

    q, do = rand(sum(lens_q), hq, d), rand(sum(lens_q), hq, dv)
    k, v = rand(sum(lens_k), hkv, d), rand(sum(lens_k), hkv, dv)
    fwd = dict(opts.get("forward", {}))
    args = (cu(lens_q), cu(lens_k), max(lens_q), max(lens_k))
    _, saved = sagebwd_cp.attention_varlen_forward(q, k, v, *args, causal=causal, **fwd)
    sagebwd_cp.attention_varlen(q, k, v, *args, causal=causal, **fwd)
    return sagebwd_cp.attention_backward(saved, do, deterministic=opts.get("deterministic", False))


def run_case(case, device: str = "cuda"):
    """Forward (training and inference) and backward of one case; returns the gradients.  On "cpu" the
    emulator runs it (tests/test_sanitize_cases.py keeps the set runnable there)."""
    import torch

    import sagebwd_cp

    b, hq, hkv, lq, lk, d, causal, dtype, opts = case
    g = torch.Generator(device=device).manual_seed(lq * 131 + d)
    dt = getattr(torch, dtype)
    rand = lambda *shape: torch.randn(shape, generator=g, device=device).to(dt)  # noqa: E731
    if opts.get("packed"):
        grads = run_packed(case, rand, device)
        if device == "cuda":
            torch.cuda.synchronize()
        return grads
    opts = dict(opts)
    strided = opts.pop("strided", False)
    smooth_q = opts.pop("smooth_q", False)
    fwd = opts.pop("forward", {})
    dv = opts.pop("value_dim", d)
    if opts.pop("sinks", False):
        fwd = {**fwd, "sinks": torch.randn(hq, generator=g, device=device)}
    if strided:  # q, k: views of a fused (B, N, 2, H, D); v and dO start 8 bytes into rows of Dv + 4 values,
        # so their rows are not 16-byte aligned (the backward packs them first: pack_rows)
        fused = rand(b, lq, 2, hq, d)
        q, k = fused[:, :, 0], fused[:, :, 1]
        v, do = rand(b, lq, hq, dv + 4)[..., 4:], rand(b, lq, hq, dv + 4)[..., 4:]
        layout = "NHD"
    else:
        q, k, v, do = rand(b, hq, lq, d), rand(b, hkv, lk, d), rand(b, hkv, lk, dv), rand(b, hq, lq, dv)
        layout = "HND"
    _, _, saved = sagebwd_cp.attention_forward(q, k, v, causal=causal, smooth_q=smooth_q, layout=layout,
                                               return_lse=True, **fwd)
    sagebwd_cp.attention(q, k, v, causal=causal, smooth_q=smooth_q, layout=layout, **fwd)  # the inference forward
    grads = sagebwd_cp.attention_backward(saved, do, **opts)
    if device == "cuda":
        torch.cuda.synchronize()
    return grads


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the first three cases only")
    args = ap.parse_args(argv)
    from sagebwd_cp.gpu import plan

    for setting in SETTINGS:
        for name in VARIABLES:
            os.environ.pop(name, None)
        os.environ.update(setting)
        plan.clear_plans()
        for case in CASES[:3] if args.quick else CASES:
            try:
                run_case(case)
            except ValueError as exc:  # a combination this path refuses by name (e.g. deterministic d=256 on mma.sync)
                print(f"{setting or 'default'} {case[:8]} {case[8]} refused: {exc}", flush=True)
                continue
            print(f"{setting or 'default'} {case[:8]} {case[8]} ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
