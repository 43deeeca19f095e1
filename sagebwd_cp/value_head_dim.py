"""A value head dim that differs from the query/key one (multi-head latent attention: 192 for Q·K, 128 for V).

The kernels take V, and so O, dO and dV, at V's own head dim Dv up to Q·K's D: their 16-bit loads of V and dO
zero-fill the columns from Dv to the padded head dim, the quantizer codes V and dO as if padded with zeros (a
scale is a maximum that zeros do not raise), the products of those zero columns are skipped, and O and dV are
stored for Dv columns. The emulator is handed V, O and dO padded with zero columns and its O and dV sliced back
(``pad_head_dim``), which is the same arithmetic.
A V wider than Q·K instead widens Q and K with zero columns (a zero column adds nothing to a score) and slices
dQ and dK back: ``widen``, in the array library's own pad and slice, so that autograd and ``jax.grad`` see
through them. The softmax scale's default stays 1/sqrt(query/key head dim).
"""
from __future__ import annotations

import math

from .arrays import array_namespace
from .problem import MAX_HEAD_DIM


def wider(q, v) -> bool:
    """Whether v's head dim is above q's, for arrays with shapes (a plain DLPack producer has none and goes on to
    the problem's checks, which refuse it)."""
    qs, vs = getattr(q, "shape", None), getattr(v, "shape", None)
    return bool(qs) and bool(vs) and vs[-1] > qs[-1]


def check(dqk: int, dv: int) -> None:
    if not (1 <= dv <= MAX_HEAD_DIM) or dv % 8:
        raise ValueError(f"v: expected a head_dim that is a multiple of 8 between 8 and {MAX_HEAD_DIM}, got {dv} "
                         f"(q and k: {dqk})")


def pad_head_dim(x, d: int):
    """``x`` with zero columns appended to its last axis, up to ``d``."""
    n = x.shape[-1]
    if n == d:
        return x
    xp = array_namespace(x, "x")
    if xp.__name__ == "torch":
        import torch.nn.functional as F

        return F.pad(x, (0, d - n))
    return xp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, d - n)])


def widen(q, k, v, softmax_scale):
    """(q, k, softmax_scale): q and k widened to V's wider head dim, and the scale resolved from Q·K's head dim (as
    the problem resolves it when the dims agree)."""
    dqk, dv = q.shape[-1], v.shape[-1]
    check(dqk, dv)
    scale = 1.0 / math.sqrt(dqk) if softmax_scale is None else softmax_scale
    return pad_head_dim(q, dv), pad_head_dim(k, dv), scale
