"""Argument checking: turn user arrays and options into one validated ``AttentionProblem``.

Every error names the argument, what was expected and what came.
"""
from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from . import specs
from .arrays import ArrayDesc, describe

LAYOUTS = ("HND", "NHD")
GRANULARITIES = ("fine", "paper")
KERNEL_DTYPES = ("float16", "bfloat16")
HOST_DTYPES = ("float16", "bfloat16", "float32", "float64")  # bfloat16 from torch, computed as float32
MAX_HEAD_DIM = specs.PADDED_HEAD_DIMS[-1]


@dataclasses.dataclass
class AttentionProblem:
    q: ArrayDesc
    k: ArrayDesc
    v: ArrayDesc
    layout: str
    batch: int
    heads_q: int
    heads_kv: int
    len_q: int
    len_k: int
    head_dim: int
    dtype: str
    causal: bool
    softmax_scale: float
    smooth_k: bool
    smooth_q: bool
    on_gpu: bool

    @property
    def padded_head_dim(self) -> int:
        return specs.padded_head_dim(self.head_dim)

    def bhnd_strides(self, desc: ArrayDesc) -> tuple:
        """(batch, head, token) strides in elements for the array's layout."""
        sb, s1, s2, _ = desc.strides
        return (sb, s1, s2) if self.layout == "HND" else (sb, s2, s1)

    def shape(self, heads: int, length: int) -> tuple:
        b, d = self.batch, self.head_dim
        return (b, heads, length, d) if self.layout == "HND" else (b, length, heads, d)


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    return layout


def check_flag(value, name: str) -> bool:
    """``value`` as a bool; only True, False and NumPy's bools are taken (a string such as "no" is truthy)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{name}: expected True or False, got {type(value).__name__} {value!r}")


def check_softmax_scale(value) -> float | None:
    """``value`` as a float, or None (the default 1/sqrt(head_dim)); strings and bools are refused."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"softmax_scale: expected a float or None, got {type(value).__name__} {value!r}")
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"softmax_scale: expected a finite positive number, got {value}")
    return value


def check_options(causal, softmax_scale, smooth_k, smooth_q, **flags) -> tuple:
    """(causal, softmax_scale, smooth_k, smooth_q, *flags' values), each checked by name."""
    return (check_flag(causal, "causal"), check_softmax_scale(softmax_scale), check_flag(smooth_k, "smooth_k"),
            check_flag(smooth_q, "smooth_q"), *(check_flag(v, n) for n, v in flags.items()))


def check_granularity(granularity) -> str:
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity: expected one of {GRANULARITIES}, got {granularity!r}")
    return granularity


def _dims(desc: ArrayDesc, name: str, layout: str):
    if desc.ndim != 4:
        raise ValueError(f"{name}: expected a rank-4 array ({'batch, heads, seqlen, head_dim' if layout == 'HND' else 'batch, seqlen, heads, head_dim'}), got shape {desc.shape}")
    b, x, y, d = desc.shape
    return (b, x, y, d) if layout == "HND" else (b, y, x, d)


def make_problem(q, k, v, *, causal=False, softmax_scale=None, smooth_k=True, smooth_q=False,
                 layout="HND") -> AttentionProblem:
    layout = check_layout(layout)
    causal, softmax_scale, smooth_k, smooth_q = check_options(causal, softmax_scale, smooth_k, smooth_q)
    qd, kd, vd = describe(q, "q"), describe(k, "k"), describe(v, "v")
    devices = {(d.device_type, d.device_id) for d in (qd, kd, vd)}
    if len(devices) != 1:
        raise ValueError(f"q, k, v: expected arrays on one device, got q on {qd.device_type}:{qd.device_id}, "
                         f"k on {kd.device_type}:{kd.device_id}, v on {vd.device_type}:{vd.device_id}")
    on_gpu = qd.is_cuda
    allowed = KERNEL_DTYPES if on_gpu else HOST_DTYPES
    for name, d in (("q", qd), ("k", kd), ("v", vd)):
        if d.dtype not in allowed:
            raise TypeError(f"{name}: expected dtype {', '.join(allowed[:-1])} or {allowed[-1]} for a "
                            f"{'CUDA' if on_gpu else 'host'} array, got {d.dtype}")
    if not (qd.dtype == kd.dtype == vd.dtype):
        raise TypeError(f"q, k, v: expected one dtype, got q {qd.dtype}, k {kd.dtype}, v {vd.dtype}")
    bq, hq, lq, dq = _dims(qd, "q", layout)
    bk, hk, lk, dk = _dims(kd, "k", layout)
    bv, hv, lv, dv = _dims(vd, "v", layout)
    if not (bq == bk == bv):
        raise ValueError(f"q, k, v: expected one batch size, got {bq}, {bk}, {bv}")
    if (hk, lk, dk) != (hv, lv, dv):
        raise ValueError(f"k, v: expected the same (heads, seqlen, head_dim), got k {(hk, lk, dk)} and v {(hv, lv, dv)}")
    if dq != dk:
        raise ValueError(f"q, k: expected the same head_dim, got {dq} and {dk}")
    if not (1 <= dq <= MAX_HEAD_DIM) or dq % 8:
        raise ValueError(f"head_dim: expected a multiple of 8 between 8 and {MAX_HEAD_DIM}, got {dq}")
    if hk < 1 or hq % hk:
        raise ValueError(f"heads: expected the query heads ({hq}) to be a multiple of the key/value heads ({hk})")
    if bq < 1 or lq < 1 or lk < 1 or hq < 1:
        raise ValueError(f"q, k: expected batch, heads and seqlen of at least 1, got q {qd.shape}, k {kd.shape}")
    for name, d in (("q", qd), ("k", kd), ("v", vd)):
        if d.strides[3] != 1 and d.shape[3] > 1:
            raise ValueError(f"{name}: expected a contiguous last dimension (stride 1), got strides {d.strides}")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(dq)
    return AttentionProblem(qd, kd, vd, layout, bq, hq, hk, lq, lk, dq, qd.dtype, causal, softmax_scale,
                            smooth_k, smooth_q, on_gpu)


def check_output(out, prob: AttentionProblem, name: str = "out") -> ArrayDesc:
    """A caller-provided output buffer must match q's shape, dtype and device exactly."""
    od = describe(out, name)
    expected = prob.shape(prob.heads_q, prob.len_q)
    if tuple(od.shape) != expected:
        raise ValueError(f"{name}: expected shape {expected}, got {tuple(od.shape)}")
    if od.dtype != prob.dtype:
        raise TypeError(f"{name}: expected dtype {prob.dtype}, got {od.dtype}")
    if (od.device_type, od.device_id) != (prob.q.device_type, prob.q.device_id):
        raise ValueError(f"{name}: expected an array on {prob.q.device_type}:{prob.q.device_id}, got {od.device_type}:{od.device_id}")
    if od.strides[3] != 1:
        raise ValueError(f"{name}: expected a contiguous last dimension, got strides {od.strides}")
    if prob.on_gpu and (od.ptr % 4 or any(s % 2 for s in od.strides[:3])):
        raise ValueError(f"{name}: expected 4-byte aligned rows (even strides), got strides {od.strides}")
    return od
