"""Non-finite inputs and the accuracy guard, measured as a new user meets them (issue: "no silent wrong
answers"). Table 1: one NaN, +inf or -inf in q, k, v or dO (fp16, 1x2x256x64, causal; at token 100,
column 5 of head 1): how many outputs and gradients are non-finite, ours and SDPA's, and whether ours
cover SDPA's. Table 2: bf16 q and k at 1x and 8x the unit scale: the per-head score step, whether the
guard warns, and Rel-L2 against FP32 attention.

    python tools/probe_nonfinite.py
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

import sagebwd_cp
import sagebwd_cp.torch as st


def _run(fn, x):
    q, k, v = (x[n].detach().clone().requires_grad_(True) for n in "qkv")
    out = fn(q, k, v)
    out.backward(x["do"])
    return [t.detach() for t in (out, q.grad, k.grad, v.grad)]


def nonfinite_table(b=1, h=2, n=256, d=64, causal=True):
    print(f"| input | value | ours: O, dQ, dK, dV non-finite | SDPA: O, dQ, dK, dV | ours cover SDPA |")
    print("|---|---|---|---|---|")
    g = torch.Generator(device="cuda").manual_seed(0)
    for tensor in ("q", "k", "v", "do"):
        for value in ("nan", "inf", "-inf"):
            x = {t: torch.randn((b, h, n, d), generator=g, device="cuda").half() for t in ("q", "k", "v", "do")}
            x[tensor][0, 1, 100, 5] = float(value)
            ours = _run(lambda q, k, v: st.attention(q, k, v, causal=causal), x)
            sdpa = _run(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal), x)
            o_bad = [~torch.isfinite(t) for t in ours]
            s_bad = [~torch.isfinite(t) for t in sdpa]
            covers = all(bool((s & ~o).sum() == 0) for o, s in zip(o_bad, s_bad))
            print(f"| {tensor} | {value} | {', '.join(str(int(t.sum())) for t in o_bad)} | "
                  f"{', '.join(str(int(t.sum())) for t in s_bad)} | {'yes' if covers else 'NO'} |")


def guard_table(b=1, h=2, n=1024, d=64):
    print("\n| q, k scale | score step (max over heads) | guard warns | Rel-L2 O | dQ | dK | dV |")
    print("|---|---|---|---|---|---|---|")
    for sigma in (1.0, 8.0):
        g = torch.Generator(device="cuda").manual_seed(1)
        x = {t: torch.randn((b, h, n, d), generator=g, device="cuda") for t in ("q", "k", "v", "do")}
        x["q"], x["k"] = x["q"] * sigma, x["k"] * sigma
        x16 = {t: v.bfloat16() for t, v in x.items()}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ours = _run(lambda q, k, v: st.attention(q, k, v, accuracy_guard=True), x16)
        warned = any(issubclass(w.category, sagebwd_cp.AccuracyWarning) for w in caught)
        ref = _run(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), {t: v.float() for t, v in x16.items()})
        errs = [float((a.float() - r).norm() / r.norm()) for a, r in zip(ours, ref)]
        step = float(sagebwd_cp.score_step(x16["q"], x16["k"]).max())
        print(f"| {sigma:g}x | {step:.3f} | {'yes' if warned else 'no'} | " + " | ".join(f"{e:.4f}" for e in errs) + " |")


if __name__ == "__main__":
    print(torch.cuda.get_device_name())
    nonfinite_table()
    guard_table()
