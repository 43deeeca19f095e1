"""Packed (variable-length) batches for PyTorch: ``flash_attn_varlen_func`` and its operators.

Two functional operators (namespace ``sagebwd_cp``), with fake implementations and autograd, so the
call traces under ``torch.compile(fullgraph=True)`` and replays in CUDA graphs (the offsets are
read on the GPU only; ``max_seqlen_*`` are Python ints that size the grids):

- ``varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *options) ->
  (out, lse2, k_mean)`` (``options`` an AttentionOptions with layout "THD", its fields in order): ``lse2`` the base-2
  LSE (Hq, total_q) and ``k_mean`` μ_K (batch, Hkv, D) float32 (empty (0,) without K-smoothing),
  neither differentiable;
- ``varlen_backward(q, k, v, out, lse2, k_mean, dout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
  max_seqlen_k, *options) -> (dq, dk, dv)``.
"""
# No ``from __future__ import annotations``: torch.library reads the signatures' type hints.
from typing import Optional, Tuple

import torch
from torch import Tensor

from sagebwd_cp import value_head_dim
from sagebwd_cp.api import run_backward, run_forward
from sagebwd_cp.options import FIELDS, AttentionOptions, window_options
from sagebwd_cp.sinks import check_sinks, sinks_grad

from ._checks import check_tensors
from ._ops import NAMESPACE, _as_tensor, _host, _no_k_mean, check_dout, out_like
from .functional import _autocast, _once_differentiable, check_flash_defaults

__all__ = ["flash_attn_varlen_func"]


def _offsets(cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, on_gpu: bool) -> tuple:
    return (cu_q, cu_k, max_q, max_k) if on_gpu else (_host(cu_q), _host(cu_k), max_q, max_k)


def forward_impl(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
                 options: AttentionOptions, return_lse: bool = False, sinks: Tensor | None = None) -> tuple:
    """(out, lse2, k_mean), with ``return_lse`` also the natural-log LSE (Hq, total_q), fourth; with ``sinks`` (Hq,)
    all of them the sink attention's (return_lse)."""
    args = (q, k, v) if q.is_cuda else (_host(q), _host(k), _host(v))
    if sinks is not None and not q.is_cuda:
        sinks = _host(sinks)
    out, lse, (lse2, k_mean) = run_forward(*args, options, training=True, return_lse=return_lse,
                                           varlen=_offsets(cu_q, cu_k, max_q, max_k, q.is_cuda), sinks=sinks)
    result = (_as_tensor(out, None if q.is_cuda else q.dtype), _as_tensor(lse2),
              _as_tensor(k_mean) if k_mean is not None else _no_k_mean(q))
    return result + (_as_tensor(lse),) if return_lse else result


def backward_impl(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse2: Tensor, k_mean: Tensor, dout: Tensor,
                  cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
                  options: AttentionOptions) -> Tuple[Tensor, Tensor, Tensor]:
    check_dout(dout, q, v)
    dout = dout.contiguous()
    mean = k_mean if k_mean.numel() else None
    offsets = _offsets(cu_q, cu_k, max_q, max_k, q.is_cuda)
    if q.is_cuda:
        grads = run_backward(q, k, v, out, lse2, dout, options, k_mean=mean, varlen=offsets)
        return tuple(_as_tensor(g) for g in grads)
    grads = run_backward(_host(q), _host(k), _host(v), _host(out), _host(lse2), _host(dout), options,
                         k_mean=_host(mean) if mean is not None else None, varlen=offsets)
    return tuple(_as_tensor(g, q.dtype) for g in grads)


def _check_packed(**arrays) -> None:
    for name, x in arrays.items():
        if x.dim() != 3:
            raise ValueError(f"{name}: expected a rank-3 tensor (total_tokens, heads, head_dim), got shape "
                             f"{tuple(x.shape)}")


# The operators take the fields of an AttentionOptions in its order (layout "THD"): ``op(..., *options)``.

@torch.library.custom_op(f"{NAMESPACE}::varlen_forward", mutates_args=())
def varlen_forward_op(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                      max_seqlen_k: int, causal: bool, softmax_scale: Optional[float], smooth_k: bool, smooth_q: bool,
                      layout: str, granularity: str, deterministic: bool, window_left: int,
                      window_right: int, softcap: float) -> Tuple[Tensor, Tensor, Tensor]:
    """Training forward of a packed batch: (out, lse2, k_mean); the last two options are the backward's."""
    check_tensors("q, k, v, cu_seqlens_q, cu_seqlens_k", q, k, v, cu_seqlens_q, cu_seqlens_k)
    options = AttentionOptions(causal, softmax_scale, smooth_k, smooth_q, layout, granularity, deterministic,
                               window_left, window_right, softcap)
    return forward_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options)


@varlen_forward_op.register_fake
def _forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *fields):
    options = AttentionOptions(*fields)
    _check_packed(q=q, k=k, v=v)
    lse2 = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    k_mean = (q.new_empty((cu_seqlens_k.shape[0] - 1, k.shape[1], k.shape[2]), dtype=torch.float32)
              if options.smooth_k else _no_k_mean(q))
    return out_like(q, v), lse2, k_mean


@torch.library.custom_op(f"{NAMESPACE}::varlen_backward", mutates_args=())
def varlen_backward_op(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse2: Tensor, k_mean: Tensor, dout: Tensor,
                       cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                       softmax_scale: Optional[float], smooth_k: bool, smooth_q: bool, layout: str, granularity: str,
                       deterministic: bool, window_left: int, window_right: int,
                       softcap: float) -> Tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of a packed batch from the forward's inputs, output, base-2 LSE and μ_K, and dO."""
    check_tensors("q, k, v, out, lse2, k_mean, dout, cu_seqlens_q, cu_seqlens_k", q, k, v, out, lse2, k_mean, dout,
                  cu_seqlens_q, cu_seqlens_k)
    options = AttentionOptions(causal, softmax_scale, smooth_k, smooth_q, layout, granularity, deterministic,
                               window_left, window_right, softcap)
    return backward_impl(q, k, v, out, lse2, k_mean, dout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         options)


@varlen_backward_op.register_fake
def _backward_fake(q, k, v, out, lse2, k_mean, dout, *_):
    _check_packed(q=q, k=k, v=v, out=out, dout=dout)
    return q.new_empty(q.shape), k.new_empty(k.shape, dtype=q.dtype), v.new_empty(v.shape, dtype=q.dtype)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, *fields = inputs
    out, lse2, k_mean = output
    ctx.save_for_backward(q, k, v, out, lse2, k_mean, cu_q, cu_k)
    ctx.mark_non_differentiable(lse2, k_mean)
    ctx.lengths, ctx.options = (max_q, max_k), AttentionOptions(*fields)


def _backward(ctx, dout, _dlse2, _dk_mean):
    q, k, v, out, lse2, k_mean, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = varlen_backward_op(q, k, v, out, lse2, k_mean, dout, cu_q, cu_k, *ctx.lengths, *ctx.options)
    need = ctx.needs_input_grad
    return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None) + (None,) * (4 + len(FIELDS))


varlen_forward_op.register_autograd(_backward, setup_context=_setup_context)


def _sink_forward(q, k, v, sinks, offsets, options: AttentionOptions) -> tuple:
    """The sink attention of a packed batch (sagebwd_cp/sinks.py, its rows one batch of total_q): (out, lse2,
    k_mean, lse), both LSEs (Hq, total_q) with the sinks."""
    return forward_impl(q, k, v, *offsets, options, return_lse=True, sinks=sinks.detach())


class _VarlenSinkAttention(torch.autograd.Function):
    """A packed batch's attention with sinks around the kernels (functional._SinkAttention's, per packed row)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, cu_q, cu_k, max_q, max_k, options):
        out, lse2, k_mean, lse = _sink_forward(q, k, v, sinks, (cu_q, cu_k, max_q, max_k), options)
        ctx.save_for_backward(q, k, v, out, lse2, k_mean, lse, sinks, cu_q, cu_k)
        ctx.lengths, ctx.options = (max_q, max_k), options
        return out

    @staticmethod
    @_once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse2, k_mean, lse, sinks, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv = backward_impl(q, k, v, out, lse2, k_mean, dout, cu_q, cu_k, *ctx.lengths, ctx.options)
        need = ctx.needs_input_grad
        dsinks = sinks_grad(out[None], lse[None], dout[None], sinks, "NHD") if need[3] else None
        return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None, dsinks) + (None,) * 5


@torch.compiler.disable  # (as functional's sinks: a graph break)
def _varlen_attention_with_sinks(q, k, v, sinks, cu_q, cu_k, max_q, max_k, options: AttentionOptions) -> Tensor:
    check_sinks(sinks, q.shape[1], q)
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, sinks)):
        return _VarlenSinkAttention.apply(q, k, v, sinks, cu_q, cu_k, max_q, max_k, options)
    return _sink_forward(q, k, v, sinks, (cu_q, cu_k, max_q, max_k), options)[0]


def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: Optional[float] = None, causal: bool = False, window_size=(-1, -1),
                           softcap: float = 0.0, alibi_slopes=None, deterministic: bool = False,
                           return_attn_probs: bool = False, block_table=None, *, smooth_k: bool = True,
                           granularity: str = "fine", sinks: Optional[Tensor] = None) -> Tensor:
    """Drop-in for FlashAttention's ``flash_attn_varlen_func``: q (total_q, Hq, D), k and v (total_k,
    Hkv, D), Hq a multiple of Hkv; sequence b is rows cu_seqlens_q[b]..cu_seqlens_q[b+1] of q and
    cu_seqlens_k[b].. of k and v (int32, batch + 1 entries, on q's device); ``max_seqlen_*`` (ints) at
    least the longest sequence's lengths (not checked on a GPU: the offsets are not read back).
    Causal masks and sliding windows (``window_size``, as FlashAttention's) are bottom-right aligned
    within each sequence. Returns (total_q, Hq, Dv): v's head dim Dv may differ from D (multi-head latent
    attention: sagebwd_cp/value_head_dim.py).

    ``softcap`` > 0: logit soft-capping (any mask).
    ``dropout_p``, ``alibi_slopes``, ``return_attn_probs`` and ``block_table`` must keep their defaults
    (ValueError otherwise); ``smooth_k`` (default on), ``granularity`` and ``sinks``
    (Hq,), attention sinks with their gradient (a graph break under torch.compile), are this library's
    options (``sagebwd_cp.torch.attention``)."""
    check_tensors("q, k, v, cu_seqlens_q, cu_seqlens_k, sinks", q, k, v, cu_seqlens_q, cu_seqlens_k, sinks,
                  optional=("sinks",))
    check_flash_defaults(dropout_p, alibi_slopes, return_attn_probs)
    if value_head_dim.wider(q, v):  # V's head dim above Q·K's: Q and K widened (value_head_dim.py)
        q, k, softmax_scale = value_head_dim.widen(q, k, v, softmax_scale)
    options = AttentionOptions(causal=causal, softmax_scale=softmax_scale, smooth_k=smooth_k,
                               layout="THD", granularity=granularity, deterministic=deterministic,
                               **window_options(window_size), softcap=softcap)
    if block_table is not None:
        raise ValueError("block_table: paged KV caches are not supported; expected None")
    if q.is_cuda and torch.is_autocast_enabled("cuda"):
        q, k, v = _autocast(q, k, v)
    if sinks is not None:
        out = _varlen_attention_with_sinks(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                           options)
    else:
        out, _, _ = varlen_forward_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *options)
    return out
