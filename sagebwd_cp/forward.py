"""The forward on the GPU: quantize Q, K, V into the layouts the products read, then attend."""
from __future__ import annotations

import dataclasses

from . import numerics, specs
from .arrays import ArrayDesc, current_stream, empty
from .launch import f32, i32, i64, launch, memset_async, ptr, shared_memory_limit
from .problem import AttentionProblem

QUANT_THREADS = 256
TOKENS_PER_SUM = 256  # kernels/quantize.cu MEAN_TOKENS


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


@dataclasses.dataclass
class Quantized:
    """Q̂, K̂, V̂ in every layout the kernels read, with their scales (see numerics.py)."""

    q8: ArrayDesc  # [B][Hq][Nq_pad][Dp]
    q8t: ArrayDesc | None  # [B][Hq][Dp][Nq_pad], query order permuted for register-fed products (backward)
    q_scale: ArrayDesc  # [B][Hq][Nq_pad/64]
    q_mean: ArrayDesc | None  # [B][Hq][Nq_pad/64][Dp] (Q-smoothing)
    k8: ArrayDesc  # [B][Hkv][Nk_pad][Dp]
    k8t: ArrayDesc | None  # [B][Hkv][Dp][Nk_pad] (backward)
    k_scale: ArrayDesc
    k_mean: ArrayDesc | None  # [B][Hkv][Dp] (K-smoothing)
    vt8: ArrayDesc | None  # [B][Hkv][Dp][Nk_pad], key order permuted (numerics.KEY_PERMUTATION_16) (forward)
    v_scale: ArrayDesc | None
    bias: ArrayDesc | None  # [B][Hq][Nq_pad/64][Nk_pad] (Q-smoothing add-back)
    nq_pad: int
    nk_pad: int


def quantize_inputs_gpu(prob: AttentionProblem, backward: bool, stream: int) -> Quantized:
    """The forward reads Q̂, K̂ row-major and V̂ᵀ; the backward re-derives the same Q̂, K̂ (the
    quantization is deterministic) and also needs their transposes, but not V̂."""
    B, Hq, Hk, Lq, Lk, D = prob.batch, prob.heads_q, prob.heads_kv, prob.len_q, prob.len_k, prob.head_dim
    dp = prob.padded_head_dim
    nq, nk = _round_up(Lq, specs.TOKEN_PAD), _round_up(Lk, specs.TOKEN_PAD)
    dev, like = prob.q.device_id, prob.q
    spec = specs.quantize_spec(prob.dtype)
    block = (QUANT_THREADS, 1, 1)

    def quantize(src, heads, n, npad, prescale, mean_sum, mean_out, block_mean, rows, t, permute, scale):
        sb, sh, sn = prob.bhnd_strides(src)
        launch(spec, "quantize_blocks", dev, stream, (npad // numerics.BLOCK_Q, heads, B), block,
               [ptr(src), i64(sb), i64(sh), i64(sn), i32(heads), i32(n), i32(D), i32(dp), i32(npad), f32(prescale),
                ptr(mean_sum), ptr(mean_out), ptr(block_mean), ptr(rows), ptr(t), i32(permute), ptr(scale)])

    k_mean = k_sum = None
    if prob.smooth_k:
        k_mean = empty((B, Hk, dp), "float32", like)
        k_sum = empty((B, Hk, dp), "float64", like)
        memset_async(k_sum, B * Hk * dp * 8, dev, stream)
        sb, sh, sn = prob.bhnd_strides(prob.k)
        launch(spec, "token_sum", dev, stream, ((Lk + TOKENS_PER_SUM - 1) // TOKENS_PER_SUM, Hk, B), block,
               [ptr(prob.k), i64(sb), i64(sh), i64(sn), i32(Hk), i32(Lk), i32(D), i32(dp), ptr(k_sum)])

    q8 = empty((B, Hq, nq, dp), "int8", like)
    q8t = empty((B, Hq, dp, nq), "int8", like) if backward else None
    q_scale = empty((B, Hq, nq // numerics.BLOCK_Q), "float32", like)
    q_mean = empty((B, Hq, nq // numerics.BLOCK_Q, dp), "float32", like) if prob.smooth_q else None
    quantize(prob.q, Hq, Lq, nq, numerics.qk_prescale(prob.softmax_scale), None, None, q_mean, q8, q8t, 1, q_scale)

    k8 = empty((B, Hk, nk, dp), "int8", like)
    k8t = empty((B, Hk, dp, nk), "int8", like) if backward else None
    k_scale = empty((B, Hk, nk // numerics.BLOCK_KV), "float32", like)
    quantize(prob.k, Hk, Lk, nk, 1.0, k_sum, k_mean, None, k8, k8t, 0, k_scale)

    vt8 = v_scale = None
    if not backward:
        vt8 = empty((B, Hk, dp, nk), "int8", like)
        v_scale = empty((B, Hk, nk // numerics.BLOCK_KV), "float32", like)
        quantize(prob.v, Hk, Lk, nk, 1.0, None, None, None, None, vt8, 1, v_scale)

    bias = None
    if prob.smooth_q:
        bias = empty((B, Hq, nq // numerics.BLOCK_Q, nk), "float32", like)
        sb, sh, sn = prob.bhnd_strides(prob.k)
        launch(specs.bias_spec(), "smooth_q_bias", dev, stream, ((nk + 127) // 128, nq // numerics.BLOCK_Q, B * Hq),
               (128, 1, 1), [ptr(prob.k), i64(sb), i64(sh), i64(sn), i32(Hq), i32(Hk), i32(Lk), i32(D), i32(dp),
                             i32(nq), i32(nk), ptr(q_mean), ptr(k_mean), ptr(bias), i32(prob.dtype == "bfloat16")])
    return Quantized(q8, q8t, q_scale, q_mean, k8, k8t, k_scale, k_mean, vt8, v_scale, bias, nq, nk)


def attend_gpu(prob: AttentionProblem, qz: Quantized, out: ArrayDesc, lse2: ArrayDesc | None, stream: int) -> None:
    dp, dev = prob.padded_head_dim, prob.q.device_id
    tiles = specs.forward_tiles(dp, shared_memory_limit(dev))
    spec = specs.forward_spec(dp, prob.dtype, prob.causal, prob.smooth_q, tiles)
    ob, oh, on = prob.bhnd_strides(out)
    grid = ((prob.len_q + tiles.cta_q - 1) // tiles.cta_q, prob.heads_q, prob.batch)
    launch(spec, "attention_forward", dev, stream, grid, (tiles.threads, 1, 1),
           [ptr(qz.q8), ptr(qz.q_scale), ptr(qz.k8), ptr(qz.k_scale), ptr(qz.vt8), ptr(qz.v_scale), ptr(qz.bias),
            ptr(out), i64(ob), i64(oh), i64(on), ptr(lse2), i32(prob.heads_q), i32(prob.heads_kv), i32(prob.len_q),
            i32(prob.len_k), i32(prob.head_dim), i32(qz.nq_pad), i32(qz.nk_pad)],
           shared=tiles.shared_bytes(dp))


def natural_lse_gpu(prob: AttentionProblem, qz: Quantized, lse2: ArrayDesc, stream: int) -> ArrayDesc:
    """[B][Hq][Lq] float32 natural-log LSE, K-smoothing's shift added back."""
    lse = empty((prob.batch, prob.heads_q, prob.len_q), "float32", prob.q)
    sb, sh, sn = prob.bhnd_strides(prob.q)
    launch(specs.lse_spec(prob.dtype), "natural_lse", prob.q.device_id, stream,
           ((prob.len_q + 127) // 128, prob.heads_q, prob.batch), (128, 1, 1),
           [ptr(prob.q), i64(sb), i64(sh), i64(sn), i32(prob.heads_q), i32(prob.heads_kv), i32(prob.len_q),
            i32(prob.head_dim), i32(prob.padded_head_dim), f32(prob.softmax_scale), ptr(qz.k_mean),
            ptr(lse2), ptr(lse)])
    return lse


def forward_gpu(prob: AttentionProblem, out: ArrayDesc | None, training: bool, return_lse: bool):
    """Run the forward; returns (out desc, base-2 LSE desc [B][Hq][Lq] or None, natural LSE desc or None)."""
    stream = current_stream(prob.q)
    qz = quantize_inputs_gpu(prob, False, stream)
    if out is None:
        out = empty(prob.shape(prob.heads_q, prob.len_q), prob.dtype, prob.q)
    lse2 = empty((prob.batch, prob.heads_q, prob.len_q), "float32", prob.q) if (training or return_lse) else None
    attend_gpu(prob, qz, out, lse2, stream)
    lse = natural_lse_gpu(prob, qz, lse2, stream) if return_lse else None
    return out, (lse2 if training else None), lse


def quantize_grad_output_gpu(prob: AttentionProblem, do: ArrayDesc, stream: int):
    """dÔ for dV = P̂ᵀdÔ: ψ per 64 rows of dO, stored transposed ([B][Hq][Dp][Nq_pad]) in the
    fragment token order of register-fed products; returns (dÔᵀ, scales [B][Hq][Nq_pad/64])."""
    B, Hq, Lq, D, dp = prob.batch, prob.heads_q, prob.len_q, prob.head_dim, prob.padded_head_dim
    nq = _round_up(Lq, specs.TOKEN_PAD)
    dot8 = empty((B, Hq, dp, nq), "int8", prob.q)
    scale = empty((B, Hq, nq // numerics.BLOCK_Q), "float32", prob.q)
    sb, sh, sn = prob.bhnd_strides(do)
    launch(specs.quantize_spec(prob.dtype), "quantize_blocks", prob.q.device_id, stream,
           (nq // numerics.BLOCK_Q, Hq, B), (QUANT_THREADS, 1, 1),
           [ptr(do), i64(sb), i64(sh), i64(sn), i32(Hq), i32(Lq), i32(D), i32(dp), i32(nq), f32(1.0), ptr(None),
            ptr(None), ptr(None), ptr(None), ptr(dot8), i32(1), ptr(scale)])
    return dot8, scale
