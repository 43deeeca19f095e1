"""The small case set that ``gpu_check.py --sanitize`` runs under compute-sanitizer: every kernel family
and variant on tiny shapes (forward, backward, the quantizer, the row kernels, μ_K's token sums,
Q-smoothing's bias, the returned LSE, the packed copy of misaligned rows), on both kernel paths
(the default, and mma.sync through SAGEBWD_WGMMA=0 on Hopper; 64-key forward tiles too), causal and not,
GQA, deterministic, ragged N and Lq != Lk. Prints one line per case.

    python benchmarks/sanitize_cases.py [--quick]
"""
from __future__ import annotations

import argparse
import os
import sys

# (B, Hq, Hkv, Lq, Lk, D, causal, dtype, options)
CASES = [
    (1, 2, 2, 77, 77, 64, True, "float16", {}),                                   # ragged N
    (1, 4, 2, 130, 70, 128, False, "bfloat16", {}),                               # GQA, Lq > Lk
    (1, 2, 1, 50, 190, 80, True, "float16", {"granularity": "paper"}),            # MQA, padded head dim
    (2, 2, 2, 129, 129, 64, True, "bfloat16", {"deterministic": True}),           # deterministic (the producer warpgroup)
    (1, 2, 2, 100, 100, 128, True, "float16", {"deterministic": True, "smooth_q": True}),
    (1, 2, 2, 1, 1, 64, False, "float16", {}),                                    # N = 1
    (1, 2, 2, 96, 96, 64, False, "float16", {"strided": True}),                   # strided views, misaligned rows
]
SETTINGS = [{}, {"SAGEBWD_WGMMA": "0"}, {"SAGEBWD_FORWARD_KEY_TILE": "64"}]


def run_case(case) -> None:
    import torch

    import sagebwd_cp

    b, hq, hkv, lq, lk, d, causal, dtype, opts = case
    opts = dict(opts)
    strided = opts.pop("strided", False)
    smooth_q = opts.pop("smooth_q", False)
    g = torch.Generator(device="cuda").manual_seed(lq * 131 + d)
    dt = getattr(torch, dtype)
    rand = lambda *shape: torch.randn(shape, generator=g, device="cuda").to(dt)  # noqa: E731
    if strided:  # q, k: views of a fused (B, N, 2, H, D); v and dO start 8 bytes into rows of D + 4 values,
        # so their rows are not 16-byte aligned (the backward packs them first: pack_rows)
        fused = rand(b, lq, 2, hq, d)
        q, k = fused[:, :, 0], fused[:, :, 1]
        v, do = rand(b, lq, hq, d + 4)[..., 4:], rand(b, lq, hq, d + 4)[..., 4:]
        layout = "NHD"
    else:
        q, k, v, do = rand(b, hq, lq, d), rand(b, hkv, lk, d), rand(b, hkv, lk, d), rand(b, hq, lq, d)
        layout = "HND"
    _, _, saved = sagebwd_cp.attention_forward(q, k, v, causal=causal, smooth_q=smooth_q, layout=layout,
                                               return_lse=True)
    sagebwd_cp.attention(q, k, v, causal=causal, smooth_q=smooth_q, layout=layout)  # the inference forward
    sagebwd_cp.attention_backward(saved, do, **opts)
    torch.cuda.synchronize()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the first three cases only")
    args = ap.parse_args(argv)
    from sagebwd_cp.gpu import plan

    for setting in SETTINGS:
        os.environ.pop("SAGEBWD_WGMMA", None)
        os.environ.pop("SAGEBWD_FORWARD_KEY_TILE", None)
        os.environ.update(setting)
        plan.clear_plans()
        for case in CASES[:3] if args.quick else CASES:
            run_case(case)
            print(f"{setting or 'default'} {case[:8]} {case[8]} ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
