"""The accuracy guard: a bound on the INT8 quantization step of the attention scores per (batch, head),
and an opt-in warning where it is large.

INT8 scores lose accuracy as q and k grow: the step of Q̂ and K̂ grows with their largest entries, and the
step of the scores with the product (numerics.score_step).  At 8x the unit scale (score std ~64) O's
error is ~0.08 and dQ's and dK's ~0.35 (Rel-L2, docs/ALGORITHM.md), with no error raised.  The guard
reads q and k (two reductions over each, plus one host sync, only while it is on) and warns once per
shape when the step of some head passes the threshold.  ``score_step`` returns the statistic for
logging.  Off by default: no cost then but one flag test per call.
"""
from __future__ import annotations

import os
import warnings

import numpy as np

from .arrays import check_arrays, check_rank, layout_dims
from .numerics import SCORE_STEP_LIMIT, default_softmax_scale, qk_prescale, score_step as _step

__all__ = ["AccuracyWarning", "score_step", "set_accuracy_guard", "accuracy_guard_threshold", "check_scores"]

ENV = "SAGEBWD_ACCURACY_GUARD"


class AccuracyWarning(UserWarning):
    """INT8 scores of this call are coarse: expect errors well above the unit-scale ones."""


def _parse(value, name: str):
    """The threshold a setting stands for (None: off). True or "1": the default; a positive number: itself."""
    if value is None or value is False:
        return None
    if value is True:
        return SCORE_STEP_LIMIT
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("", "0", "off", "false", "no"):
            return None
        if text in ("1", "on", "true", "yes"):
            return SCORE_STEP_LIMIT
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{name}: expected 0, 1 or a positive threshold, got {value!r}") from None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 and np.isfinite(value):
        return float(value)
    raise ValueError(f"{name}: expected None, a bool or a positive threshold, got {value!r}")


_threshold = _parse(os.environ.get(ENV), ENV)
_warned: set = set()


def set_accuracy_guard(enabled) -> None:
    """Turn the guard on for every call (True: threshold ``numerics.SCORE_STEP_LIMIT``; a positive
    number: that threshold) or off (False, None).  The environment variable SAGEBWD_ACCURACY_GUARD
    (0, 1 or a threshold) sets the same at import."""
    global _threshold
    _threshold = _parse(enabled, "enabled")


def accuracy_guard_threshold(argument=None):
    """The threshold a call runs the guard with: its own ``accuracy_guard`` argument if given, else
    the global setting; None when off."""
    return _threshold if argument is None else _parse(argument, "accuracy_guard")


def _heads_axes(layout: str):
    if layout not in ("HND", "NHD"):
        raise ValueError(f"layout: expected 'HND' or 'NHD', got {layout!r}")
    return (2, 3) if layout == "HND" else (1, 3)  # token and head-dim axes


def score_step(q, k, *, softmax_scale=None, smooth_k=True, layout="HND"):
    """The bound on the score quantization step (base-2 logits) per (batch, query head): a (B, Hq)
    float32 array in q's framework (torch, CuPy, JAX or NumPy), computed from q and k as the kernels'
    per-token scales are (max|c·log2(e)·q| per query head, max|k - μ_K| per KV head with K-smoothing).
    For logging it in a training loop; the guard warns where it passes its threshold."""
    check_arrays("q, k", q, k)
    axes = _heads_axes(layout)
    check_rank(q, "q", layout_dims(layout))
    check_rank(k, "k", layout_dims(layout))
    d = q.shape[-1]
    prescale = float(qk_prescale(default_softmax_scale(d) if softmax_scale is None else softmax_scale))
    group = q.shape[3 - axes[0]] // k.shape[3 - axes[0]]
    if type(q).__module__.split(".")[0] == "torch":
        import torch

        with torch.no_grad():
            q_amax = q.detach().float().abs().amax(dim=axes) * prescale
            k32 = k.detach().float()
            if smooth_k:  # μ_K as numerics.token_mean: a float64 mean rounded to float32
                k32 = k32 - k.detach().double().mean(dim=axes[0], keepdim=True).float()
            k_amax = k32.abs().amax(dim=axes)
            return _step(q_amax, k_amax.repeat_interleave(group, dim=1))
    if type(q).__module__.split(".")[0] == "cupy":
        import cupy as xp
    else:  # NumPy, JAX (the array API namespace of the array)
        xp = q.__array_namespace__() if hasattr(q, "__array_namespace__") else np
    q_amax = xp.max(xp.abs(xp.asarray(q, dtype=xp.float32)), axis=axes) * xp.asarray(prescale, dtype=xp.float32)
    k32 = xp.asarray(k, dtype=xp.float32)
    if smooth_k:
        mean = xp.mean(xp.asarray(k, dtype=xp.float64 if xp is np else xp.float32), axis=axes[0], keepdims=True)
        k32 = k32 - xp.asarray(mean, dtype=xp.float32)
    k_amax = xp.max(xp.abs(k32), axis=axes)
    return _step(q_amax, xp.repeat(k_amax, group, axis=1))


def check_scores(q, k, threshold, *, softmax_scale=None, smooth_k=True, layout="HND") -> None:
    """Warn (AccuracyWarning, once per shape, dtype and layout) if the score step of some head passes
    ``threshold``, saying which head and what to do."""
    step = score_step(q, k, softmax_scale=softmax_scale, smooth_k=smooth_k, layout=layout)
    host = np.asarray(step.cpu() if hasattr(step, "cpu") else (step.get() if hasattr(step, "get") else step),
                      dtype=np.float32)
    worst = float(np.nanmax(host)) if host.size and not np.isnan(host).all() else float("nan")
    if not (worst > threshold):  # NaN (a non-finite input) is reported by the results themselves
        return
    key = (tuple(q.shape), tuple(k.shape), str(q.dtype), layout)
    if key in _warned:
        return
    _warned.add(key)
    b, h = np.unravel_index(int(np.nanargmax(host)), host.shape)
    warnings.warn(
        f"sagebwd_cp: the INT8 quantization step of the attention scores reaches {worst:.3g} (base-2 logits) "
        f"in batch {b}, head {h}, above the accuracy guard's {threshold:g}; q and k are large (the step grows "
        f"as the square of their scale), so expect outputs and gradients several times less accurate than at "
        f"unit scale. Normalize q and k per head (QK-norm), keep granularity='fine' for the backward, or run "
        f"this layer with torch's scaled_dot_product_attention. (Reported once per shape; "
        f"sagebwd_cp.score_step(q, k) gives the per-head value.)", AccuracyWarning, stacklevel=3)
