"""The torch operators: plain implementations over the neutral API, and their ``torch.library``
registrations (namespace ``sagebwd_cp``) with fake implementations and autograd.

Three operators, all functional (no input is mutated, no output aliases an input):

- ``sagebwd_cp::attention(q, k, v, causal, softmax_scale, smooth_k, smooth_q, layout, granularity,
  deterministic) -> out`` (inference: computes no LSE, saves nothing; every operator takes the seven
  fields of an ``AttentionOptions`` in its order, ``op(q, k, v, *options)``);
- ``sagebwd_cp::attention_forward(q, k, v, *options) -> (out, lse2, k_mean)``
  (training forward; ``lse2`` is the base-2 LSE, (B, Hq, Lq) float32, and ``k_mean`` μ_K, (B, Hkv, D)
  float32 with K-smoothing and an empty (0,) tensor without; neither is differentiable; the two
  backward options ride along so the registered autograd formula can pass them on);
- ``sagebwd_cp::attention_backward(q, k, v, out, lse2, k_mean, dout, ...) -> (dq, dk, dv)``;
- ``sagebwd_cp::attention_lse(q, k, v, k_mean, causal, ...) -> (out, lse)`` (a chunk of attention over
  chunked keys: the natural-log LSE in the unsmoothed frame, K quantized with the given μ_K, or its
  own with an empty ``k_mean``; no autograd of its own, ``sagebwd_cp.torch.chunked_attention`` has it).

CUDA tensors go to the INT8 kernels on torch's current stream (outputs come from torch's caching
allocator).  CPU tensors go to the NumPy emulator of the same quantized algorithm; bfloat16 and
float64 CPU tensors are computed as float32 and the results cast back to the input dtype.
Every output is contiguous in the input's layout (what the fake implementations promise).
"""
# No ``from __future__ import annotations``: torch.library reads the signatures' type hints.
from typing import Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from sagebwd_cp.api import run_backward, run_forward
from sagebwd_cp.options import FIELDS, AttentionOptions

from ._checks import check_tensors

NAMESPACE = "sagebwd_cp"


# ------------------------------------------------------------------------------ implementations

def _host(x: Tensor) -> np.ndarray:
    """A NumPy view (or, for bfloat16, a float32 copy) of a CPU tensor, for the emulator."""
    x = x.detach()
    if x.dtype == torch.bfloat16:
        x = x.float()
    return x.numpy()


def _as_tensor(x, dtype: Optional[torch.dtype] = None) -> Tensor:
    """A torch tensor for whatever the neutral API returned (NumPy on the host path; torch on
    CUDA unless a non-torch allocator was installed with ``sagebwd_cp.set_allocator``)."""
    if isinstance(x, np.ndarray):
        t = torch.from_numpy(x)
    elif isinstance(x, Tensor):
        t = x
    else:
        t = torch.from_dlpack(x)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    return t if t.is_contiguous() else t.contiguous()


def inference_impl(q: Tensor, k: Tensor, v: Tensor, options: AttentionOptions) -> Tensor:
    """Attention output only (no LSE, nothing kept for a backward)."""
    if q.is_cuda:
        # The core reads q's device and torch's current stream on it, and switches devices if needed.
        out, _, _ = run_forward(q, k, v, options)
        return _as_tensor(out)
    out, _, _ = run_forward(_host(q), _host(k), _host(v), options)
    return _as_tensor(out, q.dtype)


def lse_impl(q: Tensor, k: Tensor, v: Tensor, k_mean: Tensor, options: AttentionOptions) -> Tuple[Tensor, Tensor]:
    """(out, lse): the output and the natural-log LSE (B, Hq, Lq) float32 of the unsmoothed scores,
    K quantized with ``k_mean`` (empty: K's own token mean)."""
    mean = k_mean if k_mean.numel() else None
    if q.is_cuda:
        out, lse, _ = run_forward(q, k, v, options, return_lse=True, k_mean=mean)
        return _as_tensor(out), _as_tensor(lse)
    out, lse, _ = run_forward(_host(q), _host(k), _host(v), options, return_lse=True,
                              k_mean=_host(mean) if mean is not None else None)
    return _as_tensor(out, q.dtype), _as_tensor(lse)


def _no_k_mean(q: Tensor) -> Tensor:
    """The k_mean of a forward without K-smoothing: an empty float32 tensor on q's device."""
    return q.new_empty((0,), dtype=torch.float32)


def forward_impl(q: Tensor, k: Tensor, v: Tensor, options: AttentionOptions, return_lse: bool = False,
                 sinks: Optional[Tensor] = None) -> tuple:
    """(out, lse2, k_mean): the output, and what the backward needs besides the inputs: the base-2
    LSE (B, Hq, Lq) float32 and μ_K (B, Hkv, D) float32 (empty without K-smoothing); with ``return_lse``
    also the natural-log LSE (B, Hq, Lq) float32, fourth; with ``sinks`` (Hq,) all of them the sink attention's
    (sagebwd_cp/sinks.py; return_lse)."""
    args = (q, k, v) if q.is_cuda else (_host(q), _host(k), _host(v))
    if sinks is not None and not q.is_cuda:
        sinks = _host(sinks)
    out, lse, (lse2, k_mean) = run_forward(*args, options, training=True, return_lse=return_lse, sinks=sinks)
    result = (_as_tensor(out, None if q.is_cuda else q.dtype), _as_tensor(lse2),
              _as_tensor(k_mean) if k_mean is not None else _no_k_mean(q))
    return result + (_as_tensor(lse),) if return_lse else result


def backward_impl(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse2: Tensor, k_mean: Tensor, dout: Tensor,
                  options: AttentionOptions, want_delta: bool = False) -> tuple:
    """(dq, dk, dv), each in its input's layout and q's dtype.  An empty ``k_mean`` (a forward without
    K-smoothing) is no μ_K.  ``want_delta``: ((dq, dk, dv), δ) with δ = rowsum(dO ∘ O) from the GPU's row
    statistics, or None (api.run_backward)."""
    check_dout(dout, q, v)
    dout = dout.contiguous()  # gradients may arrive expanded (stride 0) or transposed; else dout itself
    mean = k_mean if k_mean.numel() else None
    if q.is_cuda:
        result = run_backward(q, k, v, out, lse2, dout, options, k_mean=mean, want_delta=want_delta)
    else:
        result = run_backward(_host(q), _host(k), _host(v), _host(out), _host(lse2), _host(dout), options,
                              k_mean=_host(mean) if mean is not None else None, want_delta=want_delta)
    grads, delta = result if want_delta else (result, None)
    grads = tuple(_as_tensor(g, None if q.is_cuda else q.dtype) for g in grads)
    return (grads, None if delta is None else _as_tensor(delta)) if want_delta else grads


# ------------------------------------------------------------------------------ shape checks for tracing

def check_ranks(layout: str, **arrays) -> None:
    for name, x in arrays.items():
        if x.dim() != 4:
            dims = "batch, heads, seqlen, head_dim" if layout == "HND" else "batch, seqlen, heads, head_dim"
            raise ValueError(f"{name}: expected a rank-4 tensor ({dims}), got shape {tuple(x.shape)}")


def output_shape(q: Tensor, v: Tensor) -> torch.Size:
    """The output's (and dO's) shape: q's with v's head dim (value_head_dim.py)."""
    return q.shape[:-1] + v.shape[-1:]


def check_dout(dout: Tensor, q: Tensor, v: Tensor) -> None:
    """dO has the output's shape (the core checks the rest, naming it "do")."""
    if dout.shape != output_shape(q, v):
        raise ValueError(f"dout: expected the output's shape {tuple(output_shape(q, v))} (q's with v's head dim), got "
                         f"{tuple(dout.shape)}")


def out_like(q: Tensor, v: Tensor) -> Tensor:
    """An empty output of the output's shape."""
    return q.new_empty(output_shape(q, v))


def lse2_like(q: Tensor, layout: str) -> Tensor:
    """An empty (B, Hq, Lq) float32 tensor on q's device (q in ``layout``)."""
    b, x, y = q.shape[:3]
    return q.new_empty((b, x, y) if layout == "HND" else (b, y, x), dtype=torch.float32)


def k_mean_like(q: Tensor, k: Tensor, layout: str, smooth_k: bool) -> Tensor:
    """An empty μ_K as forward_impl returns it: (B, Hkv, D) float32 with K-smoothing, else (0,)."""
    if not smooth_k:
        return _no_k_mean(q)
    b, x, y, d = k.shape
    return q.new_empty((b, x if layout == "HND" else y, d), dtype=torch.float32)


# ------------------------------------------------------------------------------ registrations
# Each operator takes the fields of an AttentionOptions in its order (FIELDS), called as
# ``op(q, k, v, *options)``; the value is rebuilt (and so checked) once inside.

@torch.library.custom_op(f"{NAMESPACE}::attention", mutates_args=())
def attention_op(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: Optional[float], smooth_k: bool,
                 smooth_q: bool, layout: str, granularity: str, deterministic: bool,
                 window_left: int, window_right: int, softcap: float) -> Tensor:
    """Inference attention (see ``inference_impl``)."""
    check_tensors("q, k, v", q, k, v)
    options = AttentionOptions(causal, softmax_scale, smooth_k, smooth_q, layout, granularity, deterministic,
                               window_left, window_right, softcap)
    return inference_impl(q, k, v, options)


@attention_op.register_fake
def _attention_fake(q, k, v, *fields):
    check_ranks(AttentionOptions(*fields).layout, q=q, k=k, v=v)
    return out_like(q, v)


@torch.library.custom_op(f"{NAMESPACE}::attention_lse", mutates_args=())
def attention_lse_op(q: Tensor, k: Tensor, v: Tensor, k_mean: Tensor, causal: bool, softmax_scale: Optional[float],
                     smooth_k: bool, smooth_q: bool, layout: str, granularity: str,
                     deterministic: bool,
                     window_left: int, window_right: int, softcap: float) -> Tuple[Tensor, Tensor]:
    """(out, natural-log LSE) of one chunk of keys (see ``lse_impl``)."""
    check_tensors("q, k, v, k_mean", q, k, v, k_mean)
    options = AttentionOptions(causal, softmax_scale, smooth_k, smooth_q, layout, granularity, deterministic,
                               window_left, window_right, softcap)
    return lse_impl(q, k, v, k_mean, options)


@attention_lse_op.register_fake
def _attention_lse_fake(q, k, v, k_mean, *fields):
    layout = AttentionOptions(*fields).layout
    check_ranks(layout, q=q, k=k, v=v)
    return out_like(q, v), lse2_like(q, layout)


@torch.library.custom_op(f"{NAMESPACE}::attention_forward", mutates_args=())
def attention_forward_op(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: Optional[float],
                         smooth_k: bool, smooth_q: bool, layout: str, granularity: str,
                         deterministic: bool,
                         window_left: int, window_right: int, softcap: float) -> Tuple[Tensor, Tensor, Tensor]:
    """Training forward: (out, lse2, k_mean).  ``granularity`` and ``deterministic`` are for the
    backward."""
    check_tensors("q, k, v", q, k, v)
    options = AttentionOptions(causal, softmax_scale, smooth_k, smooth_q, layout, granularity, deterministic,
                               window_left, window_right, softcap)
    return forward_impl(q, k, v, options)


@attention_forward_op.register_fake
def _attention_forward_fake(q, k, v, *fields):
    options = AttentionOptions(*fields)
    check_ranks(options.layout, q=q, k=k, v=v)
    return out_like(q, v), lse2_like(q, options.layout), k_mean_like(q, k, options.layout, options.smooth_k)


@torch.library.custom_op(f"{NAMESPACE}::attention_backward", mutates_args=())
def attention_backward_op(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse2: Tensor, k_mean: Tensor, dout: Tensor,
                          causal: bool, softmax_scale: Optional[float], smooth_k: bool, smooth_q: bool, layout: str,
                          granularity: str, deterministic: bool,
                          window_left: int, window_right: int, softcap: float) -> Tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) from the forward's inputs, output, base-2 LSE and μ_K, and dO."""
    check_tensors("q, k, v, out, lse2, k_mean, dout", q, k, v, out, lse2, k_mean, dout)
    options = AttentionOptions(causal, softmax_scale, smooth_k, smooth_q, layout, granularity, deterministic,
                               window_left, window_right, softcap)
    return backward_impl(q, k, v, out, lse2, k_mean, dout, options)


@attention_backward_op.register_fake
def _attention_backward_fake(q, k, v, out, lse2, k_mean, dout, *fields):
    check_ranks(AttentionOptions(*fields).layout, q=q, k=k, v=v, out=out, dout=dout)
    return q.new_empty(q.shape), k.new_empty(k.shape, dtype=q.dtype), v.new_empty(v.shape, dtype=q.dtype)


def _setup_context(ctx, inputs, output):
    q, k, v, *fields = inputs
    out, lse2, k_mean = output
    ctx.save_for_backward(q, k, v, out, lse2, k_mean)
    ctx.mark_non_differentiable(lse2, k_mean)
    ctx.options = AttentionOptions(*fields)


def _backward(ctx, dout, _dlse2, _dk_mean):
    q, k, v, out, lse2, k_mean = ctx.saved_tensors
    dq, dk, dv = attention_backward_op(q, k, v, out, lse2, k_mean, dout, *ctx.options)  # dout made contiguous there
    need = ctx.needs_input_grad
    return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None) + (None,) * len(FIELDS)


attention_forward_op.register_autograd(_backward, setup_context=_setup_context)
