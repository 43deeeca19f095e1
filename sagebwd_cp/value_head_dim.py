"""A value head dim that differs from the query/key one (multi-head latent attention: 192 for Q·K, 128 for V).

The kernels take one head dim for Q, K and V. A call whose V head dim differs pads the narrower side with zero
columns up to the wider one and slices the output back; a narrower V's head dim goes to the kernels as the option
value_head_dim, so that they skip the products of its zero columns (V's in the forward, dO's in the backward).
Zero columns change nothing that is kept: a zero column of Q and K adds nothing to a score, a quantization scale
is a maximum that zeros do not raise, and O's columns below V's head dim are the same sums; the padded output
columns are zero and dropped, and so are their gradients (the pad and the slice are the array library's own, so
autograd and ``jax.grad`` see through them).
The softmax scale's default stays 1/sqrt(query/key head dim).
"""
from __future__ import annotations

import math

from .arrays import array_namespace
from .problem import MAX_HEAD_DIM


def differs(q, v) -> bool:
    """Whether v's head dim differs from q's, for arrays with shapes (a plain DLPack producer has none and
    goes on to the problem's checks, which want them equal)."""
    qs, vs = getattr(q, "shape", None), getattr(v, "shape", None)
    return bool(qs) and bool(vs) and qs[-1] != vs[-1]


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


def option(dqk: int, dv: int) -> int:
    """The option value_head_dim of arrays widened from Q·K's head dim ``dqk`` and V's ``dv``: V's where it is the
    narrower (its padded columns are zeros), else 0."""
    return dv if dv < dqk else 0


def widened_options(options, softmax_scale, dqk: int, dv: int):
    """``options`` for the widened arrays: the resolved scale, and ``option``'s value_head_dim."""
    return options._replace(softmax_scale=softmax_scale, value_head_dim=option(dqk, dv))


def widen(q, k, v, softmax_scale):
    """(q, k, v, softmax_scale) at one head dim, the larger of Q·K's and V's, and the scale resolved from
    Q·K's head dim (as the problem resolves it when the dims agree)."""
    dqk, dv = q.shape[-1], v.shape[-1]
    check(dqk, dv)
    d = max(dqk, dv)
    scale = 1.0 / math.sqrt(dqk) if softmax_scale is None else softmax_scale
    return pad_head_dim(q, d), pad_head_dim(k, d), pad_head_dim(v, d), scale
