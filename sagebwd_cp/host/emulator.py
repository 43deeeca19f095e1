"""NumPy emulation of SageBwd's quantized forward and backward, tile by tile as the kernels do.

Every constant and rounding rule comes from ``numerics``.  Arrays are HND: q is (B, Hq, Lq, D),
k and v are (B, Hkv, Lk, D), Hq a multiple of Hkv.  Inputs hold values representable in the
16-bit ``dtype`` and are computed with as float32.  Integer tile products are computed exactly
(float64 matmul of int8 values) and dequantized once per tile with float32 scales.

``quantize=False`` turns ψ into the identity (float32 values, scale 1) so the same tiled code
computes exact attention up to float32 rounding; with ``dtype="float32"`` the stored output is not
rounded either, which is what comparisons against the float64 reference want.
"""
from __future__ import annotations

import functools

import numpy as np

from ..numerics import (
    BLOCK_KV,
    BLOCK_Q,
    INT8_MAX,
    P_LEVELS,
    LN2,
    default_softmax_scale,
    fma32,
    forward_p_codes,
    qk_prescale,
    quantize_block,
    soft_cap,
    soft_cap_slope,
    softcap_constants,
    natural_lse,
    row_dot_mean,
    softcap_row_bias,
    quantize_tile,
    round_to_dtype,
    token_mean,
)
from ..options import GRANULARITIES, AttentionOptions, check_granularity

__all__ = ["quantize_inputs", "emulate_forward", "backward_state", "emulate_backward", "GRANULARITIES"]

_DTYPES = ("float16", "bfloat16", "float32")  # float32: no output rounding (testing)

_F32 = np.float32


def _nonfinite_quiet(fn):
    """NaN and inf inputs flow through the arithmetic as they flow through the kernels' (numerics:
    non-finite inputs): the entry points compute them without NumPy's warnings."""
    @functools.wraps(fn)
    def quiet(*args, **kwargs):
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            return fn(*args, **kwargs)
    return quiet


# ----------------------------------------------------------------------------- small helpers

def _num_blocks(n: int, block: int) -> int:
    return -(-n // block)


def _as_f32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def _pad_rows(x: np.ndarray, block: int) -> np.ndarray:
    """Zero-pad axis 2 to a multiple of ``block``."""
    n = x.shape[2]
    pad = _num_blocks(n, block) * block - n
    if pad == 0:
        return x
    return np.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0)))


def _rows_per_block(x: np.ndarray, block: int) -> np.ndarray:
    """Per-block values (..., nblocks, ...) repeated to one per row along axis 2."""
    return np.repeat(x, block, axis=2)


def _expand_heads(x: np.ndarray, group: int) -> np.ndarray:
    """KV-head arrays lined up with query heads (query head h reads KV head h // group)."""
    return np.repeat(x, group, axis=1) if group > 1 else x


def _sum_groups(x: np.ndarray, group: int) -> np.ndarray:
    if group == 1:
        return x
    b, hq = x.shape[:2]
    return x.reshape((b, hq // group, group) + x.shape[2:]).sum(axis=2, dtype=np.float32)


def _int_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b for integer-valued operands, exact, returned as float32.

    float64 holds every partial sum exactly (|sum| <= 127*127*n << 2**53); the result is an
    integer below 2**24 for the tile sizes used (n <= 1040), so float32 holds it too.  With
    quantize=False the operands are float32 values and this is a float64-accumulated product."""
    return np.matmul(a.astype(np.float64), b.astype(np.float64)).astype(np.float32)


def _quantize_rows(x: np.ndarray, block: int, quantize: bool):
    """ψ per ``block`` rows along axis 2 of a zero-padded float32 (B, H, N_pad, D) array.

    Padded rows are zero, so they never raise a block's max.  Returns (values, scale (B, H, nb))."""
    b, h, n_pad, d = x.shape
    nb = n_pad // block
    if not quantize:
        return x.copy(), np.ones((b, h, nb), dtype=np.float32)
    vals, scale = quantize_block(x.reshape(b, h, nb, block, d), axis=(-2, -1))
    return vals.reshape(b, h, n_pad, d), scale.reshape(b, h, nb)


def _quantize_tokens(x: np.ndarray, quantize: bool):
    """ψ per token (row) of a zero-padded float32 (B, H, N_pad, D) array: zero rows (padded ones
    too) get scale 0.  Returns (values, scale (B, H, N_pad))."""
    if not quantize:
        return x.copy(), np.ones(x.shape[:3], dtype=np.float32)
    vals, scale = quantize_block(x, axis=-1)
    return vals, scale[..., 0]


def _psi(x: np.ndarray, axis, quantize: bool, levels: int = INT8_MAX):
    """The backward's ψ of one tile (or a batch of tiles) with the scale reduced over ``axis``."""
    if not quantize:
        shape = list(x.shape)
        for ax in (axis if isinstance(axis, tuple) else (axis,)):
            shape[ax] = 1
        return x, np.ones(shape, dtype=np.float32)
    return quantize_tile(x, axis, levels)


def _check_inputs(q, k, v):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError("q, k, v must be 4-D arrays in (batch, heads, seqlen, head_dim) layout")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"shape mismatch: q {q.shape}, k {k.shape}, v {v.shape}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k.shape[1]})")
    if q.shape[2] == 0 or k.shape[2] == 0:
        raise ValueError("empty sequences are not supported")
    return q.shape[1] // k.shape[1]


# ----------------------------------------------------------------------------- tiles

def _band(causal: bool, window: tuple) -> tuple | None:
    """(left, right) of the mask (options.AttentionOptions.band), or None where no key is masked by position."""
    opts = AttentionOptions(causal=causal, window_left=window[0], window_right=window[1])
    return opts.band() if opts.banded else None


def _tile_mask(r0: int, r1: int, c0: int, c1: int, lq: int, lk: int, band) -> np.ndarray:
    """(r1 - r0, c1 - c0) bool: True where query row r may see key c (both in range and, with a band
    (left, right), -left <= c - r - (lk - lq) <= right: bottom-right aligned)."""
    rows = np.arange(r0, r1)[:, None]
    cols = np.arange(c0, c1)[None, :]
    mask = (rows < lq) & (cols < lk)
    if band is not None:
        offset = cols - rows - (lk - lq)
        mask &= (offset >= -band[0]) & (offset <= band[1])
    return mask


def _tile_visible(r0: int, r1: int, c0: int, c1: int, lq: int, lk: int, band) -> bool:
    """Whether any row of [r0, r1) sees any key of [c0, c1)."""
    last_row, last_key = min(r1, lq) - 1, min(c1, lk) - 1
    if last_row < r0 or last_key < c0:
        return False
    if band is None:
        return True
    shift = lk - lq
    return c0 - last_row - shift <= band[1] and last_key - r0 - shift >= -band[0]


def _smooth_q_bias(q_mean: np.ndarray, k_smoothed_j: np.ndarray) -> np.ndarray:
    """Per-query-block bias μ_Q·K_smᵀ of one key tile, float32: (B, H, nQ, D) x (B, H, C, D) ->
    (B, H, nQ, C).  Forward and backward both call this on whole key tiles so S is recomputed
    bit for bit."""
    return np.matmul(q_mean, np.swapaxes(k_smoothed_j, -1, -2))


def _tile_logits(q_hat, s_q, k_hat, s_k, bias=None, row_bias=None) -> np.ndarray:
    """Base-2 logits of a tile: (float32(Q̂ K̂ᵀ) * s_K[key]) * s_Q[query] (+ bias), float32 products in
    this order (numerics.py); with ``row_bias`` (..., R) (soft-capping's K-smoothing share) the second
    product and the row's share in one fmaf.

    q_hat (..., R, D); s_q (..., R); k_hat (..., C, D); s_k (..., C); bias broadcastable to
    (..., R, C) or None."""
    prod = _int_matmul(q_hat, np.swapaxes(k_hat, -1, -2))
    u = (prod * _as_f32(s_k)[..., None, :]).astype(np.float32)
    if row_bias is not None:
        return fma32(u, _as_f32(s_q)[..., :, None], row_bias[..., :, None])
    s = (u * _as_f32(s_q)[..., :, None]).astype(np.float32)
    if bias is not None:
        s = (s + bias).astype(np.float32)
    return s


# ----------------------------------------------------------------------------- quantization

@_nonfinite_quiet
def quantize_inputs(q, k, v, *, softmax_scale=None, smooth_k=True, smooth_q=False, quantize=True, k_mean=None,
                    softcap=0.0):
    """Quantize q, k, v as the forward's pre-pass does (with ``k_mean``, a saved forward's μ_K
    (B,Hkv,D), instead of the token mean of k: the backward's pre-pass given it).

    Returns a dict of per-(batch, head) arrays, rows padded to a multiple of 64 with zeros:
    q_int8 (B,Hq,Lq_pad,D), q_scale (B,Hq,Lq_pad) per token, q_mean (B,Hq,nQ,D); k_int8, k_scale
    (B,Hkv,Lk_pad) per token, k_mean (B,Hkv,D), k_smoothed (float32 K - μ_K, padded rows 0); v_int8,
    v_scale (B,Hkv,nK) per block; the backward's transposed copies of the same values coded per
    64-token block: qt_int8, qt_scale (B,Hq,nQ) and kt_int8, kt_scale (B,Hkv,nK) (untransposed).  With
    quantize=False the "int8" arrays hold the float32 values and every scale is 1.
    """
    q32, k32, v32 = _as_f32(q), _as_f32(k), _as_f32(v)
    _check_inputs(q32, k32, v32)
    d = q32.shape[-1]
    if softmax_scale is None:
        softmax_scale = default_softmax_scale(d)
    lq, lk = q32.shape[2], k32.shape[2]

    # Q: fold c·log2(e) in, optionally subtract the per-block mean of the valid rows.
    x = _pad_rows((q32 * qk_prescale(softmax_scale)).astype(np.float32), BLOCK_Q)
    b, hq, lq_pad, _ = x.shape
    n_qb = lq_pad // BLOCK_Q
    valid_q = (np.arange(lq_pad) < lq)[None, None, :, None]
    if smooth_q:
        sums = x.astype(np.float64).reshape(b, hq, n_qb, BLOCK_Q, d).sum(axis=3)
        counts = np.minimum(lq - np.arange(n_qb) * BLOCK_Q, BLOCK_Q).astype(np.float64)
        q_mean = (sums / counts[None, None, :, None]).astype(np.float32)
        x = np.where(valid_q, x - _rows_per_block(q_mean, BLOCK_Q), _F32(0)).astype(np.float32)
    else:
        q_mean = np.zeros((b, hq, n_qb, d), dtype=np.float32)
    q_int8, q_scale = _quantize_tokens(x, quantize)
    qt_int8, qt_scale = _quantize_rows(x, BLOCK_Q, quantize)

    # K: subtract the token mean (K-smoothing), then ψ per key.
    if smooth_k:
        k_mean = token_mean(k32, axis=2) if k_mean is None else np.asarray(k_mean, dtype=np.float32)
        k_sm = (k32 - k_mean[:, :, None, :]).astype(np.float32)
    else:
        k_mean = np.zeros((k32.shape[0], k32.shape[1], d), dtype=np.float32)
        k_sm = k32.copy()
    k_sm = _pad_rows(k_sm, BLOCK_KV)
    k_int8, k_scale = _quantize_tokens(k_sm, quantize)
    capped_smooth = bool(softcap) and smooth_k
    kt_int8, kt_scale = _quantize_rows(_pad_rows(k32, BLOCK_KV) if capped_smooth else k_sm, BLOCK_KV, quantize)
    row_bias = None
    if capped_smooth:
        group = q32.shape[1] // k32.shape[1]
        row_bias = _pad_rows(softcap_row_bias(q32, _expand_heads(k_mean, group), qk_prescale(softmax_scale))[..., None],
                           BLOCK_Q)[..., 0]
    v_int8, v_scale = _quantize_rows(_pad_rows(v32, BLOCK_KV), BLOCK_KV, quantize)

    return {
        "q_int8": q_int8, "q_scale": q_scale, "q_mean": q_mean,
        "k_int8": k_int8, "k_scale": k_scale, "k_mean": k_mean, "k_smoothed": k_sm,
        "qt_int8": qt_int8, "qt_scale": qt_scale, "kt_int8": kt_int8, "kt_scale": kt_scale,
        "v_int8": v_int8, "v_scale": v_scale, "row_bias": row_bias,
        "softmax_scale": float(softmax_scale), "smooth_k": bool(smooth_k),
        "smooth_q": bool(smooth_q), "quantize": bool(quantize), "lq": lq, "lk": lk,
    }


# ----------------------------------------------------------------------------- forward

def _pv_coefficients(s_v_tile: np.ndarray, blocks_valid: np.ndarray):
    """P̂'s coefficient per V block of a key tile and the tile's V scale (numerics.py, forward P
    quantization): s_max = the largest s_V among the tile's blocks that hold a key < Lk (the first
    always does); 255 for a block with s_V = s_max, float32(float32(255·s_V) · float32(1/s_max))
    otherwise.
    s_v_tile (..., nb) float32; blocks_valid (nb,) bool.  Returns (coef (..., nb), s_max (...))."""
    # np.max propagates NaN, as the kernel's max.NaN: a non-finite block's scale wins.
    s_max = np.max(np.where(blocks_valid, s_v_tile, s_v_tile[..., :1]), axis=-1).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # s_max = 0: every block zero, coef 255 below
        inv = (_F32(1) / s_max).astype(np.float32)  # the kernel's SFU reciprocal is within one ulp of this
        ratio = ((_F32(P_LEVELS) * s_v_tile).astype(np.float32) * inv[..., None]).astype(np.float32)
    coef = np.where(s_v_tile == s_max[..., None], _F32(P_LEVELS), ratio).astype(np.float32)
    return coef, s_max


@_nonfinite_quiet
def emulate_forward(q, k, v, *, causal=False, softmax_scale=None, smooth_k=True, smooth_q=False,
                    quantize=True, dtype="float16", key_tile=BLOCK_KV, k_mean=None, window=(-1, -1), softcap=0.0):
    """SageBwd forward.  Returns (o, lse, saved): o (B,Hq,Lq,D) float32 holding the stored
    ``dtype`` values, lse (B,Hq,Lq) float32 natural-log logsumexp (-inf for rows that see no
    key), saved the dict ``emulate_backward`` needs.  ``key_tile`` (64, 128, or 192 for the
    warp-specialized forward's wide tiles) is the kernel's keys per tile (``specs.ForwardTiles.key_tile``,
    ``WsForwardTiles.key_tile``): the span of P̂'s row scale.  ``k_mean``: μ_K
    (B,Hkv,D) to smooth K with instead of K's token mean.  ``window``: FlashAttention's ``window_size``
    (left, right), -1 unbounded (causal sets right to 0).  ``softcap``: logit soft-capping's c (0: none;
    numerics.soft_cap)."""
    band = _band(causal, window)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: expected one of {_DTYPES}, got {dtype!r}")
    if key_tile not in (BLOCK_KV, 2 * BLOCK_KV, 3 * BLOCK_KV):
        raise ValueError(f"key_tile: expected {BLOCK_KV}, {2 * BLOCK_KV} or {3 * BLOCK_KV}, got {key_tile!r}")
    q32, k32, v32 = _as_f32(q), _as_f32(k), _as_f32(v)
    group = _check_inputs(q32, k32, v32)
    if softmax_scale is None:
        softmax_scale = default_softmax_scale(q32.shape[-1])
    qi = quantize_inputs(q32, k32, v32, softmax_scale=softmax_scale, smooth_k=smooth_k,
                         smooth_q=smooth_q, quantize=quantize, k_mean=k_mean, softcap=softcap)
    lq, lk = qi["lq"], qi["lk"]
    b, hq, lq_pad, d = qi["q_int8"].shape
    row_bias = qi["row_bias"]
    n_kb = qi["v_scale"].shape[-1]

    q_hat, s_q = qi["q_int8"], qi["q_scale"]
    k_hat = _expand_heads(qi["k_int8"], group)
    s_k = _expand_heads(qi["k_scale"], group)
    qt_hat, s_qt = qi["qt_int8"], qi["qt_scale"]  # dK's Q operand and dQ's K operand: per block
    kt_hat, s_kt = _expand_heads(qi["kt_int8"], group), _expand_heads(qi["kt_scale"], group)
    v_hat = _expand_heads(qi["v_int8"], group)
    s_v = _expand_heads(qi["v_scale"], group)
    k_sm = _expand_heads(qi["k_smoothed"], group) if smooth_q else None

    m = np.full((b, hq, lq_pad), -np.inf, dtype=np.float32)
    l = np.zeros((b, hq, lq_pad), dtype=np.float32)
    acc = np.zeros((b, hq, lq_pad, d), dtype=np.float32)
    zero = _F32(0)

    for c0 in range(0, n_kb * BLOCK_KV, key_tile):
        c1 = min(c0 + key_tile, n_kb * BLOCK_KV)
        blocks = np.arange(c0 // BLOCK_KV, c1 // BLOCK_KV)
        if not _tile_visible(0, lq_pad, c0, c1, lq, lk, band):
            continue
        bias = None
        if smooth_q:  # per 64-key block, as the backward recomputes it
            bias = np.concatenate([_rows_per_block(_smooth_q_bias(qi["q_mean"], k_sm[:, :, c:c + BLOCK_KV]), BLOCK_Q)
                                   for c in range(c0, c1, BLOCK_KV)], axis=-1)
        s = _tile_logits(q_hat, s_q, k_hat[:, :, c0:c1], s_k[:, :, c0:c1], bias, row_bias)
        if softcap:
            s = soft_cap(s, *softcap_constants(softcap))
        mask = _tile_mask(0, lq_pad, c0, c1, lq, lk, band)
        s = np.where(mask, s, _F32(-np.inf))

        rmax = np.max(s, axis=-1)
        m_new = np.maximum(m, rmax)
        # Rows with nothing visible so far use 0 in place of -inf: exponents become -inf -> 0.
        rmax_safe = np.where(np.isfinite(rmax), rmax, zero)
        m_new_safe = np.where(np.isfinite(m_new), m_new, zero)
        e = np.exp2(s - rmax_safe[..., None]).astype(np.float32)
        coef, s_max = _pv_coefficients(s_v[:, :, blocks], blocks * BLOCK_KV < lk)
        coef = np.repeat(coef, BLOCK_KV, axis=-1)[:, :, None, :]
        if quantize:
            p_hat = forward_p_codes(e, coef)
        else:
            p_hat = (coef * e).astype(np.float32)
        beta = np.exp2(rmax - m_new_safe).astype(np.float32)
        alpha = np.exp2(m - m_new_safe).astype(np.float32)

        l = (alpha * l + beta * np.sum(e, axis=-1, dtype=np.float32)).astype(np.float32)
        pv = _int_matmul(p_hat, v_hat[:, :, c0:c1])
        # A non-finite V block (s_max NaN or inf) reaches every row of a 64-query block that sees a key of the
        # tile, also a row that sees none (0·NaN), as in the kernels, whose query tiles hold 64 rows or more.
        rows_see = np.repeat([_tile_visible(r, r + BLOCK_Q, c0, c1, lq, lk, band) for r in range(0, lq_pad, BLOCK_Q)],
                             BLOCK_Q)
        factor = np.where(rows_see, (beta / _F32(P_LEVELS)) * s_max[..., None], zero).astype(np.float32)
        acc = (alpha[..., None] * acc + pv * factor[..., None]).astype(np.float32)
        m = m_new

    # Rows that saw no key (l = 0) give 0 and LSE +inf; a non-finite l (a NaN or inf input reached the
    # row) gives NaN for both, as in the kernel.
    live = l != 0
    bad = ~np.isfinite(l)
    safe_l = np.where(live & ~bad, l, _F32(1))
    o = np.where(live[..., None], acc / safe_l[..., None], zero)
    o = np.where(bad[..., None], _F32(np.nan), o)
    o16 = round_to_dtype(o.astype(np.float32), dtype)[:, :, :lq]
    if row_bias is not None:  # stored in the frame of K − μ_K (numerics.py, soft-capping): less the row's share
        m = (m - row_bias).astype(np.float32)
    lse2 = np.where(live, m + np.log2(safe_l), _F32(np.inf))
    lse2 = np.where(bad, _F32(np.nan), lse2).astype(np.float32)

    # Natural-log LSE at the API edge: add back c·q·μ_K, which K-smoothing removed from each score.
    lse_nat = natural_lse(lse2[:, :, :lq], row_dot_mean(q32, _expand_heads(qi["k_mean"], group)), softmax_scale)
    lse_nat = np.where(live[:, :, :lq], lse_nat, _F32(-np.inf)).astype(np.float32)

    saved = {
        "inputs": qi,
        "lse2": lse2,  # (B, Hq, Lq_pad); +inf where l == 0 (also on padded rows)
        "o": o16,
        "v": v32,
        "causal": bool(causal),
        "window": tuple(window),
        "softcap": float(softcap),
        "softmax_scale": float(softmax_scale),
        "smooth_q": bool(smooth_q),
        "quantize": bool(quantize),
        "dtype": dtype,
        "group": group,
        "lq": lq,
        "lk": lk,
    }
    return o16, lse_nat, saved


# ----------------------------------------------------------------------------- backward

@_nonfinite_quiet
def backward_state(q, k, v, o, lse2, *, causal=False, softmax_scale=None, smooth_k=True, smooth_q=False,
                   quantize=True, dtype="float16", k_mean=None, window=(-1, -1), softcap=0.0):
    """The dict ``emulate_backward`` reads, rebuilt from the inputs, the stored output and the
    base-2 LSE (B, Hq, Lq) of a forward (and its μ_K, if given): the quantization is deterministic,
    so Q̂, K̂ and their scales come out exactly as the forward had them."""
    q32, k32, v32 = _as_f32(q), _as_f32(k), _as_f32(v)
    group = _check_inputs(q32, k32, v32)
    if softmax_scale is None:
        softmax_scale = default_softmax_scale(q32.shape[-1])
    qi = quantize_inputs(q32, k32, v32, softmax_scale=softmax_scale, smooth_k=smooth_k, smooth_q=smooth_q,
                         quantize=quantize, k_mean=k_mean, softcap=softcap)
    lq, lk = qi["lq"], qi["lk"]
    lse2 = _as_f32(lse2)
    if lse2.shape != q32.shape[:3]:
        raise ValueError(f"lse2: expected shape {q32.shape[:3]}, got {lse2.shape}")
    pad = qi["q_int8"].shape[2] - lq
    lse2 = np.pad(lse2, ((0, 0), (0, 0), (0, pad)), constant_values=np.inf).astype(np.float32)
    return {"inputs": qi, "lse2": lse2, "o": _as_f32(o), "v": v32, "causal": bool(causal), "window": tuple(window),
            "softcap": float(softcap),
            "softmax_scale": float(softmax_scale), "smooth_q": bool(smooth_q), "quantize": bool(quantize),
            "dtype": dtype, "group": group, "lq": lq, "lk": lk}


@_nonfinite_quiet
def emulate_backward(saved, do, *, granularity="fine", quantize=True):
    """SageBwd backward (KV-block-owned loop).  Returns float32 (dq, dk, dv) of the true shapes.

    granularity="paper": one ψ scale per 64x64 tile for P and for each of dQ's and dK's dS operands.
    "fine": per-key scales for P (dV) and for dK's dS operand, per-query scales for dQ's."""
    check_granularity(granularity)
    qi = saved["inputs"]
    band, group = _band(saved["causal"], saved.get("window", (-1, -1))), saved["group"]
    cap = softcap_constants(saved["softcap"]) if saved.get("softcap") else None
    lq, lk = saved["lq"], saved["lk"]
    smooth_q = saved["smooth_q"]
    fine = granularity == "fine"
    b, hq, lq_pad, d = qi["q_int8"].shape
    n_qb, n_kb = lq_pad // BLOCK_Q, qi["v_scale"].shape[-1]
    lk_pad = n_kb * BLOCK_KV

    do32 = _as_f32(do)
    if do32.shape != (b, hq, lq, d):
        raise ValueError(f"do has shape {do32.shape}, expected {(b, hq, lq, d)}")

    # Per-row pre-pass: δ from the stored output, dO quantized per query block.
    delta = np.sum(do32 * saved["o"], axis=-1, dtype=np.float32)
    delta = np.pad(delta, ((0, 0), (0, 0), (0, lq_pad - lq)))
    do_pad = _pad_rows(do32, BLOCK_Q)
    do_hat, s_do = _quantize_rows(do_pad, BLOCK_Q, quantize)
    lse2, row_bias = saved["lse2"], qi["row_bias"]
    if row_bias is not None:  # the capped scores' own LSE (numerics.py, soft-capping)
        lse2 = (lse2 + row_bias).astype(np.float32)

    q_hat, s_q, q_mean = qi["q_int8"], qi["q_scale"], qi["q_mean"]
    k_hat = _expand_heads(qi["k_int8"], group)
    s_k = _expand_heads(qi["k_scale"], group)
    qt_hat, s_qt = qi["qt_int8"], qi["qt_scale"]  # dK's Q operand and dQ's K operand: per block
    kt_hat, s_kt = _expand_heads(qi["kt_int8"], group), _expand_heads(qi["kt_scale"], group)
    v16 = _expand_heads(_pad_rows(saved["v"], BLOCK_KV), group)
    k_sm = _expand_heads(qi["k_smoothed"], group) if smooth_q else None

    dq_acc = np.zeros((b, hq, lq_pad, d), dtype=np.float32)
    dk_acc = np.zeros((b, hq, lk_pad, d), dtype=np.float32)
    dv_acc = np.zeros((b, hq, lk_pad, d), dtype=np.float32)

    for j in range(n_kb):
        c0, c1 = j * BLOCK_KV, (j + 1) * BLOCK_KV
        k_j, v_j = k_hat[:, :, c0:c1], v16[:, :, c0:c1]
        bias_j = _smooth_q_bias(q_mean, k_sm[:, :, c0:c1]) if smooth_q else None
        dk_j = np.zeros((b, hq, BLOCK_KV, d), dtype=np.float32)
        dv_j = np.zeros((b, hq, BLOCK_KV, d), dtype=np.float32)
        for i in range(n_qb):
            r0, r1 = i * BLOCK_Q, (i + 1) * BLOCK_Q
            if not _tile_visible(r0, r1, c0, c1, lq, lk, band):
                continue
            mask = _tile_mask(r0, r1, c0, c1, lq, lk, band)
            bias = bias_j[:, :, i, None, :] if smooth_q else None
            s_q_i, s_k_j = s_q[:, :, r0:r1], s_k[:, :, c0:c1]
            s = _tile_logits(q_hat[:, :, r0:r1], s_q_i, k_j, s_k_j, bias,
                             None if row_bias is None else row_bias[:, :, r0:r1])
            if cap:
                s = soft_cap(s, *cap)
            p = np.where(mask, np.exp2(s - lse2[:, :, r0:r1, None]), _F32(0)).astype(np.float32)

            # #4: dV_j += P̂ᵀ dÔ_i
            # per key with 255 unsigned levels (fine), or 127 levels over the tile (paper)
            p_hat, s_p = _psi(p, -2, quantize, P_LEVELS) if fine else _psi(p, (-2, -1), quantize)
            s_p_rows = np.swapaxes(s_p, -1, -2)  # per key -> per row of dV (or the tile scalar)
            pv = _int_matmul(np.swapaxes(p_hat, -1, -2), do_hat[:, :, r0:r1])
            dv_j = (dv_j + pv * (s_p_rows * s_do[:, :, i, None, None]).astype(np.float32)).astype(np.float32)

            # #5: dP in 16-bit inputs, float32 accumulation; dS = P ∘ (dP - δ)
            dp = np.matmul(do_pad[:, :, r0:r1], np.swapaxes(v_j, -1, -2)).astype(np.float32)
            # Masked entries have P = 0 and dS = 0·(dP - δ), not a select, as in the kernels: a NaN or
            # inf dP or δ (a non-finite dO, v or o) gives NaN there too.
            ds = (p * (dp - delta[:, :, r0:r1, None])).astype(np.float32)
            if cap:  # times the cap's slope, recovered from P and the LSE as the kernels do
                ds = (ds * soft_cap_slope(p, lse2[:, :, r0:r1, None], cap[1])).astype(np.float32)

            # #6 / #7: dQ_i += dŜ K̂_j, dK_j += dŜᵀ Q̂_i with K̂ and Q̂ coded per 64-token block
            # (numerics.py): the block's scale leaves the reduction, so dS is quantized as it is (ψ
            # per query for dQ and per key for dK, or per tile) and the block scale joins ψ's.
            y_hat, s_y = _psi(ds, -1 if fine else (-2, -1), quantize)
            z_hat, s_z = _psi(ds, -2 if fine else (-2, -1), quantize)
            f_y = (s_y * s_kt[:, :, j, None, None]).astype(np.float32)
            f_z = (np.swapaxes(s_z, -1, -2) * s_qt[:, :, i, None, None]).astype(np.float32)
            dq_tile = (_int_matmul(y_hat, kt_hat[:, :, c0:c1]) * f_y).astype(np.float32)
            dq_acc[:, :, r0:r1] = (dq_acc[:, :, r0:r1] + dq_tile).astype(np.float32)
            dk_tile = (_int_matmul(np.swapaxes(z_hat, -1, -2), qt_hat[:, :, r0:r1]) * f_z).astype(np.float32)
            dk_j = (dk_j + dk_tile).astype(np.float32)
            if smooth_q:
                # exact term of Q-smoothing: colsum(dS)ᵀ ⊗ μ_Q,i from the FP32 dS
                colsum = np.sum(ds, axis=-2, dtype=np.float32)
                dk_j = (dk_j + colsum[..., None] * q_mean[:, :, i, None, :]).astype(np.float32)
        dk_acc[:, :, c0:c1] = dk_j
        dv_acc[:, :, c0:c1] = dv_j

    dq = (dq_acc[:, :, :lq] * _F32(saved["softmax_scale"])).astype(np.float32)
    # Q̂ holds c·log2(e)·Q, so dSᵀQ̂ carries a factor log2(e) too much.
    dk = (dk_acc[:, :, :lk] * _F32(LN2)).astype(np.float32)
    dv = dv_acc[:, :, :lk]
    return dq, _sum_groups(dk, group), _sum_groups(dv, group)

