"""The numerics of SageBwd, defined once.

Every constant and rounding rule that the CUDA kernels use is defined here and handed to them as
compile-time defines (see ``compiler.numerics_defines``); the NumPy emulator calls the functions
below.  Change a rule here and both sides change together.

Conventions
-----------
* Scales: Q and K are quantized per token (one ψ per row of d values); V per ``BLOCK_KV`` rows and
  dO per ``BLOCK_Q`` rows (per batch, head).  S = Q̂K̂ᵀ dequantizes as (float32(Q̂K̂ᵀ)·s_K[key])·s_Q[query]
  (two float32 products in this order; the kernels may fuse the second into the exponent's FMA).
* The backward's dQ = dS·K and dK = dSᵀ·Q reduce over keys and queries, so they read transposed
  copies of K and Q coded per 64-token block (ψ over the block's tokens and d values, as V and dO),
  whose one scale leaves the reduction: dQ reads dS itself (ψ per query row in "fine", per tile in
  "paper") and adds (Ŷ·K̂ᵀ)·(s_Y·s_Kᵀ[key block]), dK reads dS (ψ per key column, or per tile) and adds
  (Ẑᵀ·Q̂ᵀ)·(s_Z·s_Qᵀ[query block]), each factor one float32 product.  (Per-token scales there would
  vary along the reduction and have to be folded into dS, a product per score twice.)  The
  copies hold the same values as Q̂ and K̂: prescaled Q (less its block means with Q-smoothing) and
  K - μ_K.
* ψ(x) (``quantize_block``): amax = max|x| over the valid entries; scale = amax / 127 and
  inv = 127 / amax (both IEEE float32 divisions); x̂ = rint(x * inv) (the exact product rounded once
  to the nearest integer, ties to even: one FMA in the kernels), clamped to [-127, 127].  A block
  whose amax is below TINY_AMAX = 2^-120 (all zero, or so small that 127/amax would overflow float32)
  counts as zero: scale 0 and x̂ = 0.
  Scales feed other quantizations, where a zero block at scale 1 would coarsen the rest: the
  forward's 128-key tile scales P̂ by s_V/s_max (a zero V block's 1 as s_max).  At scale 0 such a
  block contributes 0, as its codes do.  (The backward's tile quantizers, ``quantize_tile``, keep
  scale 1 for a zero tile: no later quantization reads it.)
* Q is quantized as ``q * qk_prescale`` with qk_prescale = float32(softmax_scale * log2(e)), so the
  integer product Q̂K̂ᵀ·s_Q·s_K is the base-2 logit and the kernels work with exp2.
* K-smoothing subtracts μ_K, the token mean of K per (batch, KV head), computed as the float64
  sum of the 16-bit values (exact for realistic ranges, so independent of summation order)
  divided by the token count in float64 and rounded to float32; then k - μ_K in float32.
* Forward P quantization (per row of a key tile, the "free" scale): with rmax the tile's row max of
  S and m_new the running max, e = exp2(S - rmax), P̂ = rint(255 * e) (unsigned: P ≥ 0, so all
  256 codes of a u8 operand are used; e and 255 as float16 values, below), l = α·l + β·Σe and acc = α·acc + (P̂V̂)·(β/255)·s_V with
  β = exp2(rmax - m_new), α = exp2(m - m_new).  A key tile of 128 keys (the wgmma forward) spans
  two V blocks: it quantizes P̃·s_V[block]/s_max per row instead (legal: the scale is applied
  before the rounding), P̂ = rint(coef·e) with coef = 255 for a block whose s_V equals s_max and
  float32(float32(255·s_V)·(1/s_max)) for the other (1/s_max: IEEE here, the SFU's reciprocal in the
  kernel, within one ulp), s_max the largest s_V among the tile's blocks that
  hold a key < Lk, and acc adds (P̂V̂)·(β/255)·s_max: one row max, scale and O update per 128 keys.
  The rounding runs on float16 pairs (``forward_p_codes``): P̂ = rint(fp16(e)·fp16(coef)), the
  product exact, ties to even (the kernel: cvt.rn.f16x2 of two e, one fma.rn.f16x2 with coef and
  1024, whose low bytes are the codes: 1.25 instructions a score).  l sums e itself in float32.
* Backward P for dV: "fine" quantizes per key, unsigned with 255 levels; "paper" uses 127 levels
  over the 64x64 tile, as published.  The backward's tile quantizers (P̂, Ŷ, Ẑ) take their
  inverse scale from a fast reciprocal (``quantize_tile``); the pre-pass quantizer of Q, K, V, dO
  uses IEEE divisions (``quantize_block``) and matches the emulator bit for bit.
* Non-finite inputs: every maximum that becomes a scale keeps NaN (the kernels' max.NaN, np.max
  here), so a block holding NaN or inf gets a NaN or inf scale and codes 0, and every result
  dequantized with it is non-finite; the forward's O and LSE2 are NaN where l is not finite
  (docs/ALGORITHM.md, non-finite inputs).
* Soft-capping (``softcap`` c; no Q-smoothing): the base-2 score x becomes C·tanh(x·(1/C)) with
  C = c·log2(e) (``soft_cap``) before the row max and the exponent, in the forward and the backward's
  recomputed P; the backward's dS gains the factor 1 - tanh², tanh recovered from P and the LSE
  (``soft_cap_slope``).  With K-smoothing, tanh must see the whole score: each row's share r = c·log2(e)·q·μ_K
  (``softcap_row_bias``) is added back first, x = fmaf(float32(Q̂K̂ᵀ)·s_K, s_Q, r); the stored LSE2 stays in
  the frame of K − μ_K (the row's LSE of the capped scores less r, so the API's add-back below holds), and the
  backward reads LSE2 + r.  dQ = dS·K then takes K̂ᵀ coded from K itself (dS's row sums are not zero under a
  cap, so K − μ_K would lose dS·μ_K); dK and dV are unchanged.
* The base-2 LSE (m + log2 l) is what the backward reads; the natural-log LSE at the API edge is
  LSE2·ln 2 plus c·q·μ_K (the part of each score that K-smoothing removed).
"""
from __future__ import annotations

import math

import numpy as np

PADDED_HEAD_DIMS = (64, 128, 256)  # the kernels' head dims; a head dim runs padded to the next of them
# Head dims above this run kernels that split the head dim in two (the mma.sync forward's O, the backward's dK, dV
# and dQ a half a pass or a CTA; docs/KERNELS.md), built without Q-smoothing, the deterministic dQ order and the
# paper granularity (problem.wide_refusal).
WIDE_HEAD_DIM = 128


def padded_head_dim(head_dim: int) -> int:
    for dp in PADDED_HEAD_DIMS:
        if head_dim <= dp:
            return dp
    raise ValueError(f"head_dim: expected at most {PADDED_HEAD_DIMS[-1]}, got {head_dim}")


BLOCK_Q = 64  # rows per quantization block of Q and dO; the backward's query tile
BLOCK_KV = 64  # rows per quantization block of K and V; the forward's and backward's key tile
INT8_MAX = 127
P_LEVELS = 255  # P ≥ 0: P̂ is unsigned 8-bit (mma .u8.s8) in the forward and the fine backward
TINY_AMAX = np.float32(2.0 ** -120)  # blocks with a smaller amax quantize to zero
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# The forward keeps P̂ in registers as the A operand of mma m16n8k32; the S accumulator's
# (row g, columns 2t, 2t+1 of each n8 tile) order differs from the A fragment's (row g, columns
# 4t..4t+3), so V̂ᵀ stores its keys in the order the A fragment sees them (a contraction does
# not care about order).  Within every group of 16 keys, stored position p holds key
# KEY_PERMUTATION_16[p].
KEY_PERMUTATION_16 = tuple((p // 4) * 2 + (p % 4 & 1) + 8 * ((p % 4) >> 1) for p in range(16))


def qk_prescale(softmax_scale: float) -> np.float32:
    """The factor folded into Q before quantization: c·log2(e), rounded once to float32."""
    return np.float32(softmax_scale * LOG2E)


def default_softmax_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def _psi(x: np.ndarray, axis, levels: int, fast_reciprocal: bool, zero_scale: float):
    """(float32 integer codes in [-levels, levels], float32 scale) with one scale per reduction of
    max|x| over ``axis``; blocks under TINY_AMAX count as zero (scale ``zero_scale``, codes 0).
    A block holding NaN or inf has amax NaN or inf (np.max propagates NaN, as the kernels' max.NaN),
    hence a NaN or inf scale; its NaN products code 0, as the kernels' pre-pass codes them."""
    x = np.asarray(x, dtype=np.float32)
    amax = np.max(np.abs(x), axis=axis, keepdims=axis is not None).astype(np.float32)
    zero = amax < TINY_AMAX
    safe = np.where(zero, np.float32(1), amax).astype(np.float32)
    n = np.float32(levels)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        if fast_reciprocal:
            scale, inv = safe * (np.float32(1) / n), n * (np.float32(1) / safe)
        else:
            scale, inv = safe / n, n / safe
        scale = np.where(zero, np.float32(zero_scale), scale).astype(np.float32)
        inv = np.where(zero, np.float32(0), inv).astype(np.float32)
        # The product of two float32 values is exact in float64, so rint rounds it once, as the kernels' FMA does.
        codes = np.clip(np.rint(x.astype(np.float64) * inv.astype(np.float64)), -levels, levels).astype(np.float32)
    return np.where(np.isnan(codes), np.float32(0), codes), scale


def quantize_block(x: np.ndarray, axis=None):
    """ψ: symmetric INT8 quantization of float32 ``x`` with one scale per reduction over ``axis``.

    ``axis=None`` gives one scale for the whole array; otherwise the max is taken over ``axis``
    (kept as a size-1 dimension in the returned scale).  scale = amax/127 and inv = 127/amax (IEEE
    divisions); a block under TINY_AMAX gets scale 0.  Returns (int8 values, float32 scale).
    """
    q, scale = _psi(x, axis, INT8_MAX, fast_reciprocal=False, zero_scale=0.0)
    return q.astype(np.int8), scale


def quantize_tile(x: np.ndarray, axis, levels: int = INT8_MAX):
    """ψ as the backward kernel applies it to its tiles (P̂, Ŷ, Ẑ), one scale per reduction over
    ``axis``: amax = max|x|; scale = amax·(1/levels) and inv = levels·(1/amax), float32 products;
    x̂ = rint(x·inv).  The kernel's 1/amax is the SFU's reciprocal (rcp.approx, within one ulp of
    the IEEE value used here), a dozen instructions cheaper than a division.  levels = INT8_MAX for
    signed values; P_LEVELS for P ≥ 0 (unsigned codes 0..255).  Blocks under TINY_AMAX count as
    zero (scale 1: no later quantization reads it).  Returns (float32 integer values, float32 scale)."""
    q, scale = _psi(x, axis, levels, fast_reciprocal=True, zero_scale=1.0)
    return q.astype(np.float32), scale


def forward_p_codes(e: np.ndarray, coef) -> np.ndarray:
    """The forward's P̂ (float32 codes 0..255) from e = exp2(S - rmax) in [0, 1] and P̂'s coefficient
    (≤ 255, per key): rint(fp16(e)·fp16(coef)) with ties to even.  The product of two float16 values
    is exact in float64, and the kernel's fma.rn.f16x2(e, coef, 1024) rounds it once to an integer
    (float16 spacing is 1 in [1024, 2048), and 1024 is even)."""
    e16 = np.asarray(e, dtype=np.float32).astype(np.float16).astype(np.float64)
    c16 = np.asarray(coef, dtype=np.float32).astype(np.float16).astype(np.float64)
    with np.errstate(invalid="ignore"):
        codes = np.clip(np.rint(e16 * c16), 0, P_LEVELS)
    # A NaN e or coefficient (a non-finite input) codes 0 here (the kernel: some byte); its row's l or its
    # tile's V scale is NaN then, and that carries the NaN (numerics: non-finite inputs).
    return np.where(np.isnan(codes), 0, codes).astype(np.float32)


def softcap_constants(softcap: float) -> tuple:
    """Logit soft-capping on base-2 scores: (C, 1/C) as float32, C = float32(softcap·log2(e)) and 1/C
    rounded once from float64 (the kernels' softcap2 and inv_softcap2)."""
    c = np.float32(softcap * LOG2E)
    return c, np.float32(1.0 / float(c))


def soft_cap(x, c, inv_c) -> np.ndarray:
    """C·tanh(x·(1/C)) on float32 base-2 scores x, as the kernels compute it after the scales (their tanh is
    the SFU's tanh.approx, relative error below 2^-10.9, where this one is NumPy's)."""
    x = np.asarray(x, dtype=np.float32)
    return (c * np.tanh((x * inv_c).astype(np.float32))).astype(np.float32)


def soft_cap_slope(p, lse2, inv_c) -> np.ndarray:
    """The soft-cap's derivative 1 - tanh² at a score whose probability is p under base-2 LSE lse2, tanh
    recovered as (log2 p + lse2)/C and clamped to [-1, 1] (the kernels' backward holds p, not tanh;
    kernels/softcap.cuh); 0 where p is 0 (log2 p = -inf, and a NaN from an infinite LSE clamps too).  The kernels form 1 - th² in one FMA: float64
    here, rounded once."""
    p = np.asarray(p, dtype=np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        # fmax/fmin take the number over a NaN, as the kernels' fmaxf/fminf (p = 0 on a padded row: -inf + inf)
        th = np.fmin(np.fmax(((np.log2(p) + lse2).astype(np.float32) * inv_c).astype(np.float32), -1), 1)
        return (1.0 - th.astype(np.float64) ** 2).astype(np.float32)


def fma32(a, b, c) -> np.ndarray:
    """float32 fmaf(a, b, c), rounded once (through float64, where a·b of two float32 values is exact)."""
    f64 = np.float64
    return (np.asarray(a, f64) * np.asarray(b, f64) + np.asarray(c, f64)).astype(np.float32)


def row_dot_mean(q32: np.ndarray, k_mean: np.ndarray) -> np.ndarray:
    """q·μ_K per query row, the part of each of its scores that K-smoothing removes, in the kernels' order
    (kernels/row_dot.cuh): the padded head dim's D_pad/8 lanes each an fmaf chain over its 8 columns, then an xor
    butterfly.  q32 (B, H, L, D) float32 of the 16-bit q, k_mean (B, H, D) μ_K per query head; returns (B, H, L)
    float32."""
    d = q32.shape[-1]
    dp = padded_head_dim(d)
    pad = [(0, 0)] * (q32.ndim - 1) + [(0, dp - d)]
    q = np.pad(q32.astype(np.float32), pad).reshape(q32.shape[:-1] + (dp // 8, 8))
    mu = np.pad(np.asarray(k_mean, np.float32), [(0, 0), (0, 0), (0, dp - d)]).reshape(k_mean.shape[:2] + (1, dp // 8, 8))
    lanes = np.zeros(q.shape[:-1], dtype=np.float32)
    for e in range(8):
        lanes = fma32(q[..., e], mu[..., e], lanes)
    lane = np.arange(dp // 8)
    o = dp // 16
    while o:
        lanes = (lanes + lanes[..., lane ^ o]).astype(np.float32)
        o //= 2
    return lanes[..., 0]


def softcap_row_bias(q32: np.ndarray, k_mean: np.ndarray, prescale) -> np.ndarray:
    """Soft-capped attention with K-smoothing: each query row's share c·log2(e)·q·μ_K of its base-2 scores,
    which K̂ = K − μ_K leaves out and tanh does not ignore (kernels/lse.cu row_shares, backward_rows.cu row_stats):
    float32(prescale · row_dot_mean)."""
    return (np.float32(prescale) * row_dot_mean(q32, k_mean)).astype(np.float32)


def natural_lse(lse2: np.ndarray, q_dot_mean, softmax_scale) -> np.ndarray:
    """The natural-log LSE returned to users (kernels/lse.cu natural_lse): fmaf(LSE2, ln 2, c·q·μ_K), K-smoothing's
    share added back (softmax ignores it, a returned LSE must not); -inf where LSE2 is +inf (no key seen)."""
    lse = fma32(lse2, np.float32(LN2), (np.float32(softmax_scale) * np.asarray(q_dot_mean, np.float32)).astype(np.float32))
    return np.where(np.asarray(lse2) == np.inf, np.float32(-np.inf), lse).astype(np.float32)


# The accuracy guard (guard.py) warns where score_step passes this, in base-2 logit units: at head dim 64
# about 3x the unit scale of q and k (std 1), where dQ's and dK's error passes ~3x its unit-scale value
# (docs/ALGORITHM.md, error against SB26).
SCORE_STEP_LIMIT = 0.25


def score_step(q_amax, k_amax):
    """The accuracy guard's statistic, per (batch, query head): 127·s_Q·s_K (float32 products), where
    s_Q = q_amax/127 is the largest per-token scale of Q̂ (q_amax = max|c·log2(e)·q| over the head) and
    s_K = k_amax/127 the largest of K̂ (k_amax = max|k - μ_K| over the KV head).  It is the most a base-2
    logit moves when one code of q̂ moves by one step against the largest k̂ entry (or the reverse):
    a bound on the quantization step of the scores, which grows as the square of q's and k's scale.
    Works elementwise on float32 NumPy, CuPy or torch arrays."""
    return (q_amax / INT8_MAX) * (k_amax / INT8_MAX) * INT8_MAX


def token_mean(x16: np.ndarray, axis: int) -> np.ndarray:
    """μ over tokens as the kernels compute it: float64 sum / count, rounded to float32."""
    x = np.asarray(x16).astype(np.float64)
    n = x.shape[axis]
    return (np.sum(x, axis=axis) / np.float64(max(n, 1))).astype(np.float32)


def k_mean_shape(batch: int, heads_kv: int, head_dim: int) -> tuple:
    """Shape of μ_K (float32; ``token_mean`` of K), which a training forward with K-smoothing returns
    so that the backward quantizes K with the same μ_K without summing K again."""
    return (batch, heads_kv, head_dim)


def round_to_bfloat16(x: np.ndarray) -> np.ndarray:
    """Round float32 values to the nearest bfloat16 (ties to even), returned as float32."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    out = rounded.astype(np.uint32).view(np.float32)
    return np.where(nan, np.float32(np.nan), out).astype(np.float32)


def round_to_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """Round to the 16-bit storage dtype ('float16' or 'bfloat16'); float32 values come back."""
    if dtype == "float16":
        return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        return round_to_bfloat16(x)
    if dtype in ("float32", "float64"):
        return np.asarray(x, dtype=np.float32)
    raise ValueError(f"dtype: expected 'float16' or 'bfloat16', got {dtype!r}")


def compile_defines() -> dict:
    """The constants above as preprocessor defines for every kernel."""
    return {
        "SB_BLOCK_Q": BLOCK_Q,
        "SB_BLOCK_KV": BLOCK_KV,
        "SB_INT8_MAX": INT8_MAX,
        "SB_P_LEVELS": P_LEVELS,
        "SB_TINY_AMAX": f"{float(TINY_AMAX).hex()}",  # a hexadecimal float literal: exact
    }
