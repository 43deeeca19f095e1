"""The backward on the GPU: re-derive Q̂, K̂ (deterministic, so identical to the forward's), quantize
dO, gather (LSE2, δ) per query row, run the key-block-owned kernel, convert dQ."""
from __future__ import annotations

from . import numerics, specs
from .arrays import ArrayDesc, current_stream, empty
from .forward import quantize_grad_output_gpu, quantize_inputs_gpu
from .launch import f32, i32, i64, launch, memset_async, ptr, shared_memory_limit
from .problem import AttentionProblem


def _cp_async_ready(desc: ArrayDesc, prob: AttentionProblem) -> bool:
    """cp.async reads 16-byte chunks: the base and every (batch, head, token) stride must keep
    rows 16-byte aligned."""
    return desc.ptr % 16 == 0 and all(s % 8 == 0 for s in prob.bhnd_strides(desc))


def _aligned_rows(desc: ArrayDesc, prob: AttentionProblem, heads: int, length: int, stream: int):
    """(array, (batch, head, token) strides): the array itself, or a packed [B][H][L][D] copy."""
    if _cp_async_ready(desc, prob):
        return desc, prob.bhnd_strides(desc)
    d = prob.head_dim
    packed = empty((prob.batch, heads, length, d), prob.dtype, desc)
    sb, sh, sn = prob.bhnd_strides(desc)
    launch(specs.backward_rows_spec(prob.dtype), "pack_rows", prob.q.device_id, stream,
           ((length * d + 255) // 256, heads, prob.batch), (256, 1, 1),
           [ptr(desc), i64(sb), i64(sh), i64(sn), i32(heads), i32(length), i32(d), ptr(packed)])
    return packed, (heads * length * d, length * d, d)


def backward_gpu(prob: AttentionProblem, out: ArrayDesc, lse2: ArrayDesc, do: ArrayDesc, granularity: str,
                 deterministic: bool):
    """dQ, dK, dV descriptors (new arrays in q's layout and dtype)."""
    stream = current_stream(prob.q)
    dev = prob.q.device_id
    B, Hq, Hk, Lq, Lk, D = prob.batch, prob.heads_q, prob.heads_kv, prob.len_q, prob.len_k, prob.head_dim
    dp = prob.padded_head_dim
    rows = specs.backward_rows_spec(prob.dtype)

    qz = quantize_inputs_gpu(prob, True, stream)
    nq, nk = qz.nq_pad, qz.nk_pad
    dot8, do_scale = quantize_grad_output_gpu(prob, do, stream)

    stats = empty((B, Hq, nq, 2), "float32", prob.q)  # (LSE2, δ) per query row
    db, dh, dn = prob.bhnd_strides(do)
    ob, oh, on = prob.bhnd_strides(out)
    launch(rows, "row_stats", dev, stream, (nq // 8, Hq, B), (256, 1, 1),
           [ptr(do), i64(db), i64(dh), i64(dn), ptr(out), i64(ob), i64(oh), i64(on), ptr(lse2), i32(Hq), i32(Lq),
            i32(D), i32(nq), ptr(stats)])

    dq_acc = empty((B, Hq, nq, dp), "float32", prob.q)
    memset_async(dq_acc, B * Hq * nq * dp * 4, dev, stream)
    lock = None
    if deterministic:
        lock = empty((B, Hq, nq // numerics.BLOCK_Q), "int32", prob.q)
        memset_async(lock, B * Hq * (nq // numerics.BLOCK_Q) * 4, dev, stream)

    v_rows, (vb, vh, vn) = _aligned_rows(prob.v, prob, Hk, Lk, stream)
    do_rows, (db, dh, dn) = _aligned_rows(do, prob, Hq, Lq, stream)

    dq = empty(prob.shape(Hq, Lq), prob.dtype, prob.q)
    dk = empty(prob.shape(Hk, Lk), prob.dtype, prob.q)
    dv = empty(prob.shape(Hk, Lk), prob.dtype, prob.q)
    kb, kh, kn = prob.bhnd_strides(dk)
    wb, wh, wn = prob.bhnd_strides(dv)

    tiles = specs.backward_tiles(dp, shared_memory_limit(dev))
    spec = specs.backward_spec(dp, prob.dtype, prob.causal, prob.smooth_q, granularity == "fine", deterministic,
                               tiles)
    launch(spec, "attention_backward", dev, stream, ((Lk + numerics.BLOCK_KV - 1) // numerics.BLOCK_KV, Hk, B),
           (tiles.threads, 1, 1),
           [ptr(qz.q8), ptr(qz.q8t), ptr(qz.q_scale), ptr(qz.q_mean), ptr(qz.k8), ptr(qz.k8t), ptr(qz.k_scale),
            ptr(qz.bias), ptr(v_rows), ptr(do_rows), ptr(dot8), ptr(do_scale), ptr(stats), ptr(dq_acc),
            ptr(lock), ptr(dk), ptr(dv), i64(vb), i64(vh), i64(vn), i64(db), i64(dh), i64(dn), i64(kb), i64(kh),
            i64(kn), i64(wb), i64(wh), i64(wn), i32(Hq), i32(Hk), i32(Lq), i32(Lk), i32(D), i32(nq), i32(nk)],
           shared=tiles.shared_bytes(dp))

    qb, qh, qn = prob.bhnd_strides(dq)
    launch(rows, "dq_convert", dev, stream, ((Lq * (D // 2) + 255) // 256, Hq, B), (256, 1, 1),
           [ptr(dq_acc), i32(Hq), i32(Lq), i32(D), i32(dp), i32(nq), f32(prob.softmax_scale), ptr(dq), i64(qb),
            i64(qh), i64(qn)])
    return dq, dk, dv


