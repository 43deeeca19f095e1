"""Exact attention in float64: the ground truth the emulator and the kernels are measured against.

Layout is HND: q is (B, Hq, Lq, D), k and v are (B, Hkv, Lk, D), with Hq a multiple of Hkv
(grouped-query attention: query head h reads KV head h // (Hq // Hkv)).  Causal masking is
bottom-right aligned as in FlashAttention2: query i sees key j iff j <= i + (Lk - Lq); a sliding
window (left, right) as FlashAttention's ``window_size``: iff -left <= j - i - (Lk - Lq) <= right
(-1 unbounded; causal sets right to 0).  ``softcap`` c > 0 turns the scaled scores s into
c·tanh(s/c); ``sinks`` (Hq,) are per-head logits that join each row's normalizer and attend to
nothing.  A query row that sees no key (and has no sink) has o = 0, lse = -inf and contributes
nothing to any gradient.
"""
from __future__ import annotations

import math

import numpy as np

__all__ = ["attention_reference", "attention_reference_backward", "causal_mask"]


def causal_mask(lq: int, lk: int, causal: bool, window=(-1, -1)) -> np.ndarray:
    """Boolean (lq, lk) array, True where query i may see key j."""
    rows = np.arange(lq)[:, None]
    offset = np.arange(lk)[None, :] - rows - (lk - lq)
    mask = np.ones((lq, lk), dtype=bool)
    left, right = window
    if causal:
        right = 0
    if left >= 0:
        mask &= offset >= -left
    if right >= 0:
        mask &= offset <= right
    return mask


def _check_shapes(q, k, v):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError("q, k, v must be 4-D arrays in (batch, heads, seqlen, head_dim) layout")
    b, hq, _, d = q.shape
    if k.shape[:3] != v.shape[:3] or k.shape[0] != b or k.shape[3] != d:  # v's head dim is its own
        raise ValueError(f"shape mismatch: q {q.shape}, k {k.shape}, v {v.shape}")
    hkv = k.shape[1]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    return hq // hkv


def _expand_kv(x: np.ndarray, group: int) -> np.ndarray:
    """KV heads repeated so that query head h lines up with KV head h // group."""
    return np.repeat(x, group, axis=1) if group > 1 else x


def _reduce_kv(x: np.ndarray, group: int) -> np.ndarray:
    """Sum a per-query-head gradient over the query heads that share each KV head."""
    if group == 1:
        return x
    b, hq, n, d = x.shape
    return x.reshape(b, hq // group, group, n, d).sum(axis=2)


def _probabilities(q, k, causal, softmax_scale, window=(-1, -1), softcap=0.0, sinks=None):
    """Normalised probabilities, lse, the derivative of the soft-cap at each score and the sinks'
    probabilities (B, Hq, Lq) (all float64); masked entries have p = 0."""
    lq, lk = q.shape[2], k.shape[2]
    s = softmax_scale * np.matmul(q, np.swapaxes(k, -1, -2))
    cap_grad = np.ones_like(s)
    if softcap:
        t = np.tanh(s / softcap)
        s, cap_grad = softcap * t, 1.0 - t * t
    mask = causal_mask(lq, lk, causal, window)
    s = np.where(mask, s, -np.inf)
    if sinks is not None:  # a column of sink logits, dropped again below
        sink = np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None, None], s.shape[:3] + (1,))
        s = np.concatenate([s, sink], axis=-1)
    m = np.max(s, axis=-1, keepdims=True) if s.shape[-1] > 0 else np.full(s.shape[:-1] + (1,), -np.inf)
    m_safe = np.where(np.isfinite(m), m, 0.0)  # fully masked rows: avoid -inf - -inf
    e = np.exp(s - m_safe)
    denom = np.sum(e, axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = np.where(denom > 0, m_safe + np.log(np.where(denom > 0, denom, 1.0)), -np.inf)
    p = np.where(denom > 0, e / np.where(denom > 0, denom, 1.0), 0.0)
    p_sink = p[..., lk] if sinks is not None else None
    return p[..., :lk], lse[..., 0], cap_grad, p_sink


def attention_reference(q, k, v, *, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0, sinks=None):
    """Exact softmax attention in float64.  Returns (o, lse), lse the natural-log logsumexp
    of the scaled (soft-capped) scores per (B, Hq, Lq), the sinks included."""
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    group = _check_shapes(q, k, v)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    ke, ve = _expand_kv(k, group), _expand_kv(v, group)
    p, lse, _, _ = _probabilities(q, ke, causal, softmax_scale, window, softcap, sinks)
    return np.matmul(p, ve), lse


def attention_reference_backward(q, k, v, do, *, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0,
                                 sinks=None):
    """Exact gradients (dq, dk, dv) in float64 of sum(o * do) with o = attention_reference(...), and
    with ``sinks`` a fourth, d sinks (Hq,)."""
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    do = np.asarray(do, dtype=np.float64)
    group = _check_shapes(q, k, v)
    if do.shape != q.shape[:3] + (v.shape[3],):
        raise ValueError(f"do has shape {do.shape}, expected {q.shape[:3] + (v.shape[3],)}")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    ke, ve = _expand_kv(k, group), _expand_kv(v, group)
    p, _, cap_grad, p_sink = _probabilities(q, ke, causal, softmax_scale, window, softcap, sinks)
    o = np.matmul(p, ve)
    dv = np.matmul(np.swapaxes(p, -1, -2), do)
    dp = np.matmul(do, np.swapaxes(ve, -1, -2))
    delta = np.sum(do * o, axis=-1, keepdims=True)
    ds = p * (dp - delta) * cap_grad  # p = 0 on masked entries, so they carry no gradient
    dq = softmax_scale * np.matmul(ds, ke)
    dk = softmax_scale * np.matmul(np.swapaxes(ds, -1, -2), q)
    grads = (dq, _reduce_kv(dk, group), _reduce_kv(dv, group))
    if sinks is None:
        return grads
    return grads + (-np.sum(p_sink * delta[..., 0], axis=(0, 2)),)
