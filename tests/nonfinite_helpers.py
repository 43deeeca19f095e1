"""Non-finite inputs: where exact attention makes outputs and gradients non-finite.

``exact_nonfinite`` evaluates attention and its gradients in float64 with masked (query, key) pairs left
out of every sum, as FlashAttention-style kernels do (a dense reference that multiplies masked
probabilities by 0 would turn 0·NaN into NaN where nothing depends on the NaN). Its sets are what
SDPA's fused kernels return, and the library's must contain them (docs/ALGORITHM.md, non-finite inputs).
"""
from __future__ import annotations

import numpy as np

# (tensor, value) pairs every test runs: NaN, +inf and -inf in each of q, k, v and dO.
CASES = [(t, v) for t in ("q", "k", "v", "do") for v in ("nan", "inf", "-inf")]


def poison(arrays: dict, tensor: str, value: str, at: tuple) -> None:
    """Write one non-finite value into ``arrays[tensor]`` (NumPy or torch, (B, H, N, D)) at ``at``."""
    arrays[tensor][at] = float(value)


def exact_nonfinite(q, k, v, do, causal: bool, softmax_scale: float | None = None):
    """Boolean (o, dq, dk, dv): which entries exact attention makes non-finite. Arrays (B, H, N, D), HND,
    float; causal bottom-right aligned; GQA by repetition of the KV heads."""
    q, k, v, do = (np.asarray(x, dtype=np.float64) for x in (q, k, v, do))
    b, hq, lq, d = q.shape
    group = hq // k.shape[1]
    k, v = (np.repeat(x, group, axis=1) for x in (k, v))
    lk = k.shape[2]
    c = 1.0 / np.sqrt(d) if softmax_scale is None else softmax_scale
    rows, cols = np.arange(lq)[:, None], np.arange(lk)[None, :]
    mask = np.ones((lq, lk), bool) if not causal else cols <= rows + (lk - lq)
    m3 = mask[None, None, :, :, None]
    with np.errstate(all="ignore"):
        prod = q[:, :, :, None, :] * k[:, :, None, :, :]                 # (B, H, Lq, Lk, D)
        s = np.where(m3, prod, 0.0).sum(-1) * c
        s = np.where(mask, s, -np.inf)
        mx = np.max(s, axis=-1, keepdims=True)
        mx = np.where(np.isfinite(mx), mx, np.where(np.isnan(mx), mx, 0.0))
        e = np.where(mask, np.exp(s - mx), 0.0)
        p = e / e.sum(-1, keepdims=True)
        o = np.where(m3, p[..., None] * v[:, :, None, :, :], 0.0).sum(3)
        dp = np.where(m3, do[:, :, :, None, :] * v[:, :, None, :, :], 0.0).sum(-1)
        delta = (do * o).sum(-1, keepdims=True)
        ds = np.where(mask, p * (dp - delta), 0.0)
        dq = np.where(m3, ds[..., None] * k[:, :, None, :, :], 0.0).sum(3) * c
        dk = np.where(m3, ds[..., None] * q[:, :, :, None, :], 0.0).sum(2) * c
        dv = np.where(m3, p[..., None] * do[:, :, :, None, :], 0.0).sum(2)
        dk, dv = (x.reshape(b, hq // group, group, lk, d).sum(2) for x in (dk, dv))
    return tuple(~np.isfinite(x) for x in (o, dq, dk, dv))


def heads_touched(shape_q, shape_kv, tensor: str, at: tuple):
    """Boolean (o, dq, dk, dv) masks of the (batch, head) slices a non-finite value at ``at`` of ``tensor``
    may reach: its batch entry and, through GQA, its KV head's group of query heads."""
    b, hq = shape_q[:2]
    hkv = shape_kv[1]
    group = hq // hkv
    bi, hi = at[0], at[1]
    hk = hi if tensor in ("k", "v") else hi // group
    masks = []
    for shape, per_q in ((shape_q, True), (shape_q, True), (shape_kv, False), (shape_kv, False)):
        m = np.zeros(shape, bool)
        if per_q:
            m[bi, hk * group:(hk + 1) * group] = True
        else:
            m[bi, hk] = True
        masks.append(m)
    return tuple(masks)
