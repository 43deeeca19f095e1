"""Packed batches on the host: the emulator, sequence by sequence.

A packed batch's kernels treat every sequence as a batch of one (its own quantization blocks, its own
μ_K, bottom-right causal alignment within it: kernels/seqinfo.cuh), so the emulator of a packed batch
is the dense emulator on each sequence, the results laid side by side: q, out, dq (total_q, Hq, D),
k, v, dk, dv (total_k, Hkv, D), LSE (Hq, total_q), μ_K (batch, Hkv, D).
"""
from __future__ import annotations

import numpy as np

from . import emulator


def offsets(cu) -> list:
    """[(q0, q1, k0, k1), ...] per sequence from host offset arrays (cu_q, cu_k)."""
    cq, ck = (np.asarray(c, dtype=np.int64) for c in cu)
    return [(int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])) for b in range(len(cq) - 1)]


def _one(x: np.ndarray) -> np.ndarray:
    """(tokens, H, D) -> (1, H, tokens, D), the emulator's layout."""
    return x.transpose(1, 0, 2)[None]


def _back(x: np.ndarray) -> np.ndarray:
    """(1, H, tokens, D) -> (tokens, H, D)."""
    return x[0].transpose(1, 0, 2)


def emulate_forward(q, k, v, cu, *, causal, softmax_scale, smooth_k, dtype, window=(-1, -1), softcap=0.0):
    """(out, lse, lse2, k_mean or None) float32, each sequence emulated alone; a sequence without keys
    gives output 0, LSE -inf (lse2 +inf), μ_K 0."""
    hq, d = q.shape[1], q.shape[2]
    hk = k.shape[1]
    spans = offsets(cu)
    out = np.zeros(q.shape, np.float32)
    lse = np.full((hq, q.shape[0]), -np.inf, np.float32)
    lse2 = np.full((hq, q.shape[0]), np.inf, np.float32)
    k_mean = np.zeros((len(spans), hk, d), np.float32) if smooth_k else None
    for b, (q0, q1, k0, k1) in enumerate(spans):
        if q1 == q0 or k1 == k0:
            continue
        o, l, state = emulator.emulate_forward(_one(q[q0:q1]), _one(k[k0:k1]), _one(v[k0:k1]), causal=causal,
                                               softmax_scale=softmax_scale, smooth_k=smooth_k, dtype=dtype,
                                               window=window, softcap=softcap)
        out[q0:q1] = _back(o)
        lse[:, q0:q1] = l[0]
        lse2[:, q0:q1] = state["lse2"][0, :, :q1 - q0]
        if smooth_k:
            k_mean[b] = state["inputs"]["k_mean"][0]
    return out, lse, lse2, k_mean


def emulate_backward(q, k, v, out, lse2, do, cu, *, causal, softmax_scale, smooth_k, dtype, granularity,
                     k_mean=None, window=(-1, -1), softcap=0.0):
    """(dq, dk, dv) float32, each sequence's backward emulated alone from its saved output and LSE."""
    dq, dk, dv = np.zeros(q.shape, np.float32), np.zeros(k.shape, np.float32), np.zeros(v.shape, np.float32)
    for b, (q0, q1, k0, k1) in enumerate(offsets(cu)):
        if q1 == q0 or k1 == k0:
            continue
        state = emulator.backward_state(_one(q[q0:q1]), _one(k[k0:k1]), _one(v[k0:k1]), _one(out[q0:q1]),
                                        lse2[None, :, q0:q1], causal=causal, softmax_scale=softmax_scale,
                                        smooth_k=smooth_k, dtype=dtype, window=window, softcap=softcap,
                                        k_mean=None if k_mean is None else k_mean[b:b + 1])
        g = emulator.emulate_backward(state, _one(do[q0:q1]), granularity=granularity)
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = (_back(x) for x in g)
    return dq, dk, dv
