"""Attention over chunks of the keys, for PyTorch: one chunk's forward with its natural-log LSE, one
chunk's backward against the merged output and LSE, the exact merge, and ``chunked_attention``,
differentiable attention over a list of K/V chunks built from them (the single-process reference of
``ring_attention``).  The math is ``sagebwd_cp.chunked``'s; every chunk is quantized with one μ_K
(``key_mean``), which keeps the summed dQ exact (docs/ALGORITHM.md, chunked attention).

Causal masking is bottom-right aligned over the whole key sequence (the chunks concatenated), as in
``attention``; each chunk runs as at most two calls (``sagebwd_cp.causal_pieces``): the query rows
that see part of it, causal against it, and those that see all of it, not causal.  A sliding window
(or soft-capping, whose kernels take a band) runs each chunk as one call (``sagebwd_cp.band_piece``):
the rows that see some key of it against the keys some row sees, with the window in the call's frame.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from sagebwd_cp import chunked as _neutral
from sagebwd_cp.options import AttentionOptions, check_flag, check_layout, window_options

from . import _ops
from ._checks import check_tensors, tensor_list

__all__ = ["attention_lse", "attention_backward_lse", "merge_attention", "key_mean", "chunked_attention"]


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _seq_dim(layout: str) -> int:
    return 2 if layout == "HND" else 1


def _mean_arg(q: Tensor, k_mean: Optional[Tensor]) -> Tensor:
    return k_mean if k_mean is not None else _ops._no_k_mean(q)


def key_mean(ks: Sequence[Tensor], layout: str = "HND") -> Tensor:
    """μ_K (B, Hkv, D) float32 of the keys of every chunk (see ``sagebwd_cp.key_mean``)."""
    return _neutral.key_mean(tensor_list(ks, "ks"), check_layout(layout), xp=torch)


def merge_attention(outs: Sequence[Tensor], lses: Sequence[Tensor], layout: str = "HND"):
    """(out, lse), both float32: attention over the union of disjoint key sets from each set's
    output and natural-log LSE (see ``sagebwd_cp.merge_attention``)."""
    outs, lses = tensor_list(outs, "outs"), tensor_list(lses, "lses")
    return _neutral.merge_attention(outs, lses, check_layout(layout), xp=torch)


def attention_lse(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, softmax_scale: Optional[float] = None,
                  layout: str = "HND", smooth_k: bool = True, smooth_q: bool = False,
                  k_mean: Optional[Tensor] = None, window_size=(-1, -1), softcap: float = 0.0):
    """(out, lse): attention of q over one chunk of keys and the natural-log LSE (B, Hq, Lq) float32
    of its unsmoothed scores (−inf for a row that sees no key).  ``k_mean``: the μ_K shared by all
    chunks (``key_mean``), None for K's own.  ``window_size`` in this call's own frame
    (``sagebwd_cp.band_piece``).  Not differentiable (inputs are read detached): ``chunked_attention`` is."""
    check_tensors("q, k, v, k_mean", q, k, v, k_mean, optional=("k_mean",))
    options = AttentionOptions(causal=causal, softmax_scale=softmax_scale, smooth_k=smooth_k, smooth_q=smooth_q,
                               layout=check_layout(layout), **window_options(window_size), softcap=softcap)
    return _lse_call(q.detach(), k.detach(), v.detach(), _mean_arg(q, k_mean), options)


def _lse_call(q, k, v, k_mean, options: AttentionOptions):
    if _compiling():
        return _ops.attention_lse_op(q, k, v, k_mean, *options)
    return _ops.lse_impl(q, k, v, k_mean, options)


def _backward_call(q, k, v, out, lse2, dout, k_mean, options: AttentionOptions):
    if _compiling():
        return _ops.attention_backward_op(q, k, v, out, lse2, k_mean, dout, *options)
    return _ops.backward_impl(q, k, v, out, lse2, k_mean, dout, options)


def attention_backward_lse(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, *,
                           causal: bool = False, softmax_scale: Optional[float] = None, layout: str = "HND",
                           smooth_k: bool = True, smooth_q: bool = False, granularity: str = "fine",
                           deterministic: bool = False, k_mean: Optional[Tensor] = None, window_size=(-1, -1),
                           softcap: float = 0.0):
    """(dq, dk, dv) of one chunk of keys against the merged output ``out`` and natural-log ``lse``
    of attention over all chunks: dq is this chunk's share (sum it over the chunks), dk and dv the
    chunk's own.  ``k_mean``: the μ_K the forward used (None: this chunk's own, right for a single
    chunk only); ``window_size`` as in ``attention_lse``.  Each in q's dtype."""
    check_tensors("q, k, v, out, lse, dout, k_mean", q, k, v, out, lse, dout, k_mean, optional=("k_mean",))
    options = AttentionOptions(causal=causal, softmax_scale=softmax_scale, smooth_k=smooth_k, smooth_q=smooth_q,
                               layout=check_layout(layout), granularity=granularity, deterministic=deterministic,
                               **window_options(window_size), softcap=softcap)
    if options.smooth_k and k_mean is None:
        k_mean = key_mean([k], options.layout)
    lse2 = _neutral.lse_to_lse2(lse, q, k_mean if options.smooth_k else None, options.softmax_scale, options.layout,
                                xp=torch).contiguous()
    return _backward_call(q.detach(), k.detach(), v.detach(), out.detach(), lse2, dout, _mean_arg(q, k_mean), options)


def chunk_pieces(len_q: int, chunk_lens: Sequence[int], options: AttentionOptions) -> list:
    """``(chunk, row0, row1, key0, key1, options)`` for every call of attention over chunks of these
    lengths: rows of q, keys of the chunk, and the call's options (``options`` with the piece's causal
    flag or window)."""
    total, start, pieces = sum(chunk_lens), 0, []
    for c, n in enumerate(chunk_lens):
        pieces += band_pieces(c, 0, len_q, start, start + n, total - len_q, options)
        start += n
    return pieces


def band_pieces(chunk: int, q_start: int, q_stop: int, k_start: int, k_stop: int, offset: int,
                options: AttentionOptions) -> list:
    """The pieces (as ``chunk_pieces``) that attend queries q_start..q_stop-1 to keys k_start..k_stop-1
    of the whole sequence (``offset``: its Lk - Lq), as rows of the local q counted from q_start and keys
    of ``chunk`` counted from k_start: one call without a mask; ``causal_pieces``' one or two (q_start
    0); with a window or a soft cap (whose kernels take a band), ``band_piece``'s one."""
    if not (options.windowed or options.softcap):
        if not options.causal:
            return [(chunk, 0, q_stop - q_start, 0, k_stop - k_start, options)]
        assert q_start == 0, "causal pieces start at the first query"
        plain = options._replace(causal=False)
        return [(chunk, r0, r1, 0, k_stop - k_start, options if causal else plain)
                for r0, r1, causal in _neutral.causal_pieces(q_stop, q_stop + offset, k_start, k_stop, True)]
    piece = _neutral.band_piece(q_start, q_stop, k_start, k_stop, offset, *options.band())
    if piece is None:
        return []
    r0, r1, k0, k1, (left, right) = piece
    return [(chunk, r0, r1, k0, k1, options._replace(causal=False, window_left=left, window_right=right))]


def forward_chunks(q: Tensor, kvs: Sequence[tuple], pieces, k_mean: Tensor, layout: str, out=None, lse=None):
    """Merge the calls ``pieces`` ((chunk, row0, row1, key0, key1, options): rows of q against keys of
    ``kvs[chunk]`` = (k, v)) into the float32 accumulators ``out`` (q's shape, in ``layout``) and ``lse``
    (B, Hq, Lq), new when None (out 0, lse −∞).  Returns (out, lse)."""
    if out is None:
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = _ops.lse2_like(q, layout).fill_(float("-inf"))
    for c, r0, r1, k0, k1, options in pieces:
        seq = _seq_dim(options.layout)
        k, v = (x.narrow(seq, k0, k1 - k0) for x in kvs[c])
        o, l = _lse_call(q.narrow(seq, r0, r1 - r0), k, v, k_mean, options)
        acc_o, acc_l = out.narrow(seq, r0, r1 - r0), lse[:, :, r0:r1]
        merged_o, merged_l = _neutral.merge_attention([acc_o, o], [acc_l, l], options.layout, xp=torch)
        acc_o.copy_(merged_o)
        acc_l.copy_(merged_l)
    return out, lse


def backward_chunks(q: Tensor, kvs: Sequence[tuple], pieces, out: Tensor, lse2: Tensor, dout: Tensor, k_mean: Tensor,
                    dq: Tensor, dkvs: Sequence[tuple]) -> None:
    """Add each call's gradients to the float32 accumulators ``dq`` (q's shape) and ``dkvs[chunk]``
    = (dk, dv); ``lse2``: the merged LSE in the kernels' frame (``lse_to_lse2``); ``pieces`` as
    ``forward_chunks`` takes them."""
    for c, r0, r1, k0, k1, options in pieces:
        seq = _seq_dim(options.layout)
        rows = lambda x: x.narrow(seq, r0, r1 - r0)  # noqa: E731
        keys = lambda x: x.narrow(seq, k0, k1 - k0)  # noqa: E731
        k, v = (keys(x) for x in kvs[c])
        gq, gk, gv = _backward_call(rows(q), k, v, rows(out), lse2[:, :, r0:r1].contiguous(), rows(dout), k_mean,
                                    options)
        rows(dq).add_(gq)
        keys(dkvs[c][0]).add_(gk)
        keys(dkvs[c][1]).add_(gv)


class _ChunkedAttention(torch.autograd.Function):
    """apply(q, options, n_chunks, *ks, *vs) -> (out, lse); options an AttentionOptions."""

    @staticmethod
    def forward(ctx, q, options, n, *kv):
        layout = options.layout
        ks, vs = kv[:n], kv[n:]
        k_mean = key_mean(ks, layout) if options.smooth_k else _ops._no_k_mean(q)
        pieces = chunk_pieces(q.shape[_seq_dim(layout)], [k.shape[_seq_dim(layout)] for k in ks], options)
        out, lse = forward_chunks(q, list(zip(ks, vs)), pieces, k_mean, layout)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, out, lse, k_mean, *kv)
        ctx.n, ctx.pieces, ctx.options = n, pieces, options
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, out, lse, k_mean, *kv = ctx.saved_tensors
        n, options = ctx.n, ctx.options
        ks, vs = kv[:n], kv[n:]
        lse2 = _neutral.lse_to_lse2(lse, q, k_mean if options.smooth_k else None, options.softmax_scale,
                                    options.layout, xp=torch)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkvs = [(torch.zeros(k.shape, dtype=torch.float32, device=k.device),
                 torch.zeros(v.shape, dtype=torch.float32, device=v.device)) for k, v in zip(ks, vs)]
        backward_chunks(q, list(zip(ks, vs)), ctx.pieces, out, lse2, dout.contiguous(), k_mean, dq, dkvs)
        grads = [dq.to(q.dtype)] + [g.to(q.dtype) for g, _ in dkvs] + [g.to(q.dtype) for _, g in dkvs]
        return (grads[0], None, None, *grads[1:])


def chunked_attention(q: Tensor, ks: Sequence[Tensor], vs: Sequence[Tensor], *, causal: bool = False,
                      softmax_scale: Optional[float] = None, layout: str = "HND", smooth_k: bool = True,
                      smooth_q: bool = False, granularity: str = "fine", deterministic: bool = False,
                      return_lse: bool = False, window_size=(-1, -1), softcap: float = 0.0):
    """Attention of q over the keys and values given as chunks (``ks[i]``, ``vs[i]``: consecutive
    pieces of the sequence, concatenated along the token axis), one call per chunk, merged by LSE;
    differentiable.  The same result as ``attention(q, cat(ks), cat(vs), ...)`` up to float32
    merging and 16-bit rounding of each chunk's partial results.  ``return_lse=True`` also returns
    the natural-log LSE (B, Hq, Lq) float32 (not differentiable).  Options as in ``attention``,
    ``window_size`` and ``softcap`` included (over the whole sequence).  Each chunk's output and
    gradients are accumulated in float32."""
    check_tensors("q", q)
    ks, vs = tensor_list(ks, "ks"), tensor_list(vs, "vs")
    _ops.check_ranks(check_layout(layout), q=q, **{f"ks[{i}]": k for i, k in enumerate(ks)},
                     **{f"vs[{i}]": v for i, v in enumerate(vs)})
    if not ks or len(ks) != len(vs):
        raise ValueError(f"ks, vs: expected the same positive number of key and value chunks, got {len(ks)} and "
                         f"{len(vs)}")
    options = AttentionOptions(causal=causal, softmax_scale=softmax_scale, smooth_k=smooth_k, smooth_q=smooth_q,
                               layout=check_layout(layout), granularity=granularity, deterministic=deterministic,
                               **window_options(window_size), softcap=softcap)
    return_lse = check_flag(return_lse, "return_lse")
    out, lse = _ChunkedAttention.apply(q, options, len(ks), *ks, *vs)
    return (out, lse) if return_lse else out
