"""Argument checking: turn user arrays and an ``AttentionOptions`` (checked when it was made) into
one validated ``AttentionProblem``.

Every error names the argument, what was expected and what came.
"""
from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from .arrays import ArrayDesc, describe, host_numpy
from .numerics import PADDED_HEAD_DIMS, WIDE_HEAD_DIM, padded_head_dim, softcap_constants
from .options import AttentionOptions

KERNEL_DTYPES = ("float16", "bfloat16")
HOST_DTYPES = ("float16", "bfloat16", "float32", "float64")  # bfloat16 from torch, computed as float32
MAX_HEAD_DIM = PADDED_HEAD_DIMS[-1]


@dataclasses.dataclass
class AttentionProblem:
    q: ArrayDesc
    k: ArrayDesc
    v: ArrayDesc
    options: AttentionOptions  # layout "THD" for packed batches
    batch: int
    heads_q: int
    heads_kv: int
    len_q: int
    len_k: int
    head_dim: int
    dtype: str
    softmax_scale: float  # the option, or its default 1/sqrt(head_dim)
    on_gpu: bool
    # Packed batches (layout "THD"): [B + 1] int32 first tokens of each sequence, the last the total
    # (FlashAttention's cu_seqlens); len_q and len_k are then the longest sequence's lengths.
    cu_q: ArrayDesc | None = None
    cu_k: ArrayDesc | None = None

    @property
    def causal(self) -> bool:
        return self.options.causal

    @property
    def window(self) -> tuple:
        """FlashAttention's window_size (left, right), -1 unbounded."""
        return self.options.window_left, self.options.window_right

    @property
    def smooth_k(self) -> bool:
        return self.options.smooth_k

    @property
    def smooth_q(self) -> bool:
        return self.options.smooth_q

    @property
    def layout(self) -> str:
        return self.options.layout

    @property
    def value_dim(self) -> int:
        """V's head dim, and so O's, dO's and dV's: Q·K's or less (multi-head latent attention's 192/128; a wider V
        comes with Q and K widened to it: value_head_dim.py)."""
        return self.v.shape[-1]

    @property
    def padded_head_dim(self) -> int:
        return padded_head_dim(self.head_dim)

    @property
    def varlen(self) -> bool:
        return self.cu_q is not None

    @property
    def total_q(self) -> int:
        """Query tokens of the whole batch."""
        return self.q.shape[0] if self.varlen else self.batch * self.len_q

    @property
    def total_k(self) -> int:
        return self.k.shape[0] if self.varlen else self.batch * self.len_k

    def bhnd_strides(self, desc: ArrayDesc) -> tuple:
        """(batch, head, token) strides in elements for the array's layout (packed: no batch stride)."""
        if self.layout == "THD":
            sn, sh, _ = desc.strides
            return (0, sh, sn)
        sb, s1, s2, _ = desc.strides
        return (sb, s1, s2) if self.layout == "HND" else (sb, s2, s1)

    def shape(self, heads: int, length: int, d: int) -> tuple:
        b = self.batch
        return (b, heads, length, d) if self.layout == "HND" else (b, length, heads, d)

    def query_shape(self, d: int | None = None) -> tuple:
        """The shape of q and dq (of the output and dO with ``d`` V's head dim)."""
        d = self.head_dim if d is None else d
        return (self.total_q, self.heads_q, d) if self.varlen else self.shape(self.heads_q, self.len_q, d)

    def key_shape(self, d: int | None = None) -> tuple:
        """The shape of k and dk (of v and dv with ``d`` V's head dim)."""
        d = self.head_dim if d is None else d
        return (self.total_k, self.heads_kv, d) if self.varlen else self.shape(self.heads_kv, self.len_k, d)

    def output_shape(self) -> tuple:
        """The shape of the output and dO: q's with V's head dim."""
        return self.query_shape(self.value_dim)

    def lse_shape(self) -> tuple:
        """The LSE's shape: (batch, heads_q, len_q), or (heads_q, total_q) for packed batches."""
        return (self.heads_q, self.total_q) if self.varlen else (self.batch, self.heads_q, self.len_q)

    def kernel_band(self) -> dict:
        """The attention kernels' win_hi, win_width fields (kernels/seqinfo.cuh band_hi, band_lo): the band's
        right edge (a packed batch's sequences add their own Lk - Lq) and width."""
        left, right = self.options.band()
        return dict(win_hi=right + (0 if self.varlen else self.len_k - self.len_q), win_width=left + right)

    def kernel_softcap(self) -> dict:
        """The attention kernels' softcap2, inv_softcap2 fields (kernels/softcap.cuh; 0 without soft-capping)."""
        c, inv = softcap_constants(self.options.softcap) if self.options.softcap else (0.0, 0.0)
        return dict(softcap2=float(c), inv_softcap2=float(inv))

    def kernel_lengths(self) -> dict:
        """The kernels' Lq, Lk (token totals for packed batches) and cu_q, cu_k fields."""
        return dict(Lq=self.total_q if self.varlen else self.len_q, Lk=self.total_k if self.varlen else self.len_k,
                    cu_q=self.cu_q, cu_k=self.cu_k)


def _dims(desc: ArrayDesc, name: str, layout: str):
    if desc.ndim != 4:
        raise ValueError(f"{name}: expected a rank-4 array ({'batch, heads, seqlen, head_dim' if layout == 'HND' else 'batch, seqlen, heads, head_dim'}), got shape {desc.shape}")
    b, x, y, d = desc.shape
    return (b, x, y, d) if layout == "HND" else (b, y, x, d)


def make_problem(q, k, v, options: AttentionOptions) -> AttentionProblem:
    """A dense batch: q (B, Hq, Lq, D) for layout "HND" or (B, Lq, Hq, D) for "NHD"; k, v likewise."""
    layout = options.layout
    if layout == "THD":
        raise ValueError("layout: 'THD' is the layout of packed batches; call the varlen functions "
                         "(attention_varlen, flash_attn_varlen_func) with cu_seqlens")
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
    if (hk, lk) != (hv, lv):
        raise ValueError(f"k, v: expected the same (heads, seqlen), got k {(hk, lk)} and v {(hv, lv)}")
    if dq != dk:
        raise ValueError(f"q, k: expected the same head_dim, got {dq} and {dk}")
    if not (1 <= dq <= MAX_HEAD_DIM) or dq % 8:
        raise ValueError(f"head_dim: expected a multiple of 8 between 8 and {MAX_HEAD_DIM}, got {dq}")
    if not (1 <= dv <= dq) or dv % 8:
        raise ValueError(f"v: expected a head_dim that is a multiple of 8 between 8 and q's and k's ({dq}), got {dv}"
                         + (" (a wider V takes arrays with shapes, whose Q and K are widened)" if dv > dq else ""))
    check_wide_options(dq, options)
    if hk < 1 or hq % hk:
        raise ValueError(f"heads: expected the query heads ({hq}) to be a multiple of the key/value heads ({hk})")
    if bq < 1 or lq < 1 or lk < 1 or hq < 1:
        raise ValueError(f"q, k: expected batch, heads and seqlen of at least 1, got q {qd.shape}, k {kd.shape}")
    for name, d in (("q", qd), ("k", kd), ("v", vd)):
        if d.strides[3] != 1 and d.shape[3] > 1:
            raise ValueError(f"{name}: expected a contiguous last dimension (stride 1), got strides {d.strides}")
    softmax_scale = options.softmax_scale
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(dq)
    return AttentionProblem(qd, kd, vd, options, bq, hq, hk, lq, lk, dq, qd.dtype, softmax_scale, on_gpu)


def wide_refusal(head_dim: int, options: AttentionOptions) -> str | None:
    """What of ``options`` the kernels above WIDE_HEAD_DIM (the head dim split in two halves) are not built for, or
    None: Q-smoothing and the paper granularity (the deterministic dQ order runs on sm_90 alone:
    specs.backward_kernel)."""
    if head_dim <= WIDE_HEAD_DIM:
        return None
    for refused, what in ((options.smooth_q, "smooth_q=True"),
                          (options.granularity != "fine", f"granularity={options.granularity!r}")):
        if refused:
            return what
    return None


def check_wide_options(head_dim: int, options: AttentionOptions) -> None:
    """A ValueError naming what wide_refusal finds."""
    what = wide_refusal(head_dim, options)
    if what is not None:
        raise ValueError(f"head_dim: head dims above {WIDE_HEAD_DIM} (got {head_dim}) take no {what}: its kernels "
                         f"are built up to head dim {WIDE_HEAD_DIM}")


def check_output(out, prob: AttentionProblem, name: str = "out") -> ArrayDesc:
    """A caller-provided output buffer (or dO) must match the output's shape (q's with V's head dim), q's dtype and
    device exactly."""
    od = describe(out, name)
    expected = prob.output_shape()
    if tuple(od.shape) != expected:
        raise ValueError(f"{name}: expected shape {expected}, got {tuple(od.shape)}")
    if od.dtype != prob.dtype:
        raise TypeError(f"{name}: expected dtype {prob.dtype}, got {od.dtype}")
    if (od.device_type, od.device_id) != (prob.q.device_type, prob.q.device_id):
        raise ValueError(f"{name}: expected an array on {prob.q.device_type}:{prob.q.device_id}, got {od.device_type}:{od.device_id}")
    if od.strides[-1] != 1:
        raise ValueError(f"{name}: expected a contiguous last dimension, got strides {od.strides}")
    if prob.on_gpu and (od.ptr % 4 or any(s % 2 for s in od.strides[:-1])):
        raise ValueError(f"{name}: expected 4-byte aligned rows (even strides), got strides {od.strides}")
    return od


def _check_max_seqlen(value, name: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected a Python int (the longest sequence's length), got "
                        f"{type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name}: expected at least 1, got {value}")
    return int(value)


def _check_cu_seqlens(cu, name: str, like: ArrayDesc) -> ArrayDesc:
    d = describe(cu, name)
    if d.ndim != 1 or d.dtype != "int32":
        raise TypeError(f"{name}: expected a rank-1 int32 array of batch + 1 offsets, got a rank-{d.ndim} {d.dtype} array")
    if d.shape[0] < 2:
        raise ValueError(f"{name}: expected at least 2 entries (one sequence), got {d.shape[0]}: an empty batch")
    if d.shape[0] > 1 and d.strides[0] != 1:
        raise ValueError(f"{name}: expected a contiguous array, got stride {d.strides[0]}")
    if (d.device_type, d.device_id) != (like.device_type, like.device_id):
        raise ValueError(f"{name}: expected an array on {like.device_type}:{like.device_id} (q's device), "
                         f"got {d.device_type}:{d.device_id}")
    return d


def _check_host_offsets(d: ArrayDesc, name: str, total: int, max_seqlen: int, max_name: str) -> None:
    """Host offsets are read and checked; on a GPU they are not (no synchronization in the hot path)."""
    cu = np.asarray(host_numpy(d, name), dtype=np.int64)
    lengths = np.diff(cu)
    if cu[0] != 0 or (lengths < 0).any():
        raise ValueError(f"{name}: expected non-decreasing offsets from 0, got {cu.tolist()[:16]}")
    if cu[-1] != total:
        raise ValueError(f"{name}: expected the last offset to be the token count {total}, got {int(cu[-1])}")
    if lengths.max() > max_seqlen:
        raise ValueError(f"{max_name}: expected at least the longest sequence ({int(lengths.max())} tokens), "
                         f"got {max_seqlen}")


def make_varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        options: AttentionOptions) -> AttentionProblem:
    """A packed batch (FlashAttention's varlen convention): q (total_q, heads_q, head_dim), k and v
    (total_k, heads_kv, head_dim; v's may be less); sequence b is tokens cu_seqlens_q[b]..cu_seqlens_q[b+1] of q and
    cu_seqlens_k[b].. of k and v; max_seqlen_* at least the longest (it sizes the grids; on a GPU it is
    not checked, as the offsets are not read back)."""
    if options.layout != "THD":
        raise ValueError(f"layout: packed batches take layout 'THD', got {options.layout!r}")
    if options.smooth_q:
        raise ValueError("smooth_q: packed batches (cu_seqlens) take smooth_q=False")
    qd, kd, vd = describe(q, "q"), describe(k, "k"), describe(v, "v")
    for name, d in (("q", qd), ("k", kd), ("v", vd)):
        if d.ndim != 3:
            raise ValueError(f"{name}: expected a rank-3 array (total_tokens, heads, head_dim) for packed "
                             f"sequences, got shape {d.shape}")
    # The dense checks on (1, tokens, heads, dim) views of the same arrays: devices, dtypes, heads, head dim.
    views = [dataclasses.replace(d, shape=(1,) + tuple(d.shape), strides=(0,) + tuple(d.strides)) for d in (qd, kd, vd)]
    dense = make_problem(*views, options._replace(layout="NHD"))
    cq, ck = _check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", qd), _check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", qd)
    if cq.shape != ck.shape:
        raise ValueError(f"cu_seqlens_q, cu_seqlens_k: expected one batch size, got {cq.shape[0] - 1} and {ck.shape[0] - 1} "
                         "sequences")
    max_q, max_k = _check_max_seqlen(max_seqlen_q, "max_seqlen_q"), _check_max_seqlen(max_seqlen_k, "max_seqlen_k")
    if not dense.on_gpu:
        _check_host_offsets(cq, "cu_seqlens_q", qd.shape[0], max_q, "max_seqlen_q")
        _check_host_offsets(ck, "cu_seqlens_k", kd.shape[0], max_k, "max_seqlen_k")
    return dataclasses.replace(dense, q=qd, k=kd, v=vd, options=options, batch=cq.shape[0] - 1, len_q=max_q,
                               len_k=max_k, cu_q=cq, cu_k=ck)
