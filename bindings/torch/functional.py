"""Differentiable attention for PyTorch, and drop-ins for ``F.scaled_dot_product_attention`` and
``flash_attn_func``.

Eager calls go through a ``torch.autograd.Function`` (``SageAttentionFunction``, or the same with
its options packed into one argument; a few microseconds of Python per call); under ``torch.compile`` the same computation goes through the
``sagebwd_cp::`` custom operators, which the compiler traces without a graph break.  Without
gradients (``torch.no_grad``, ``torch.inference_mode``, or no input requiring grad) the inference
path runs: no LSE is computed and nothing is saved.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from sagebwd_cp import guard, value_head_dim
from sagebwd_cp.options import FIELDS, AttentionOptions, check_flag, window_options
from sagebwd_cp.sinks import check_sinks, sinks_grad

from . import _ops
from ._checks import check_tensors

__all__ = ["attention", "scaled_dot_product_attention", "flash_attn_func", "SageAttentionFunction"]


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _once_differentiable(backward):
    """torch's ``once_differentiable`` without its cost (~4 µs) in the usual backward, which runs with
    grad disabled: there it only calls ``backward``.  With create_graph=True it is torch's."""
    guarded = once_differentiable(backward)

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        return guarded(ctx, *grads) if torch.is_grad_enabled() else backward(ctx, *grads)

    return wrapper


def _save(ctx, q, k, v, out, lse2, k_mean, options: AttentionOptions) -> None:
    ctx.save_for_backward(q, k, v, out, lse2, k_mean)
    ctx.options = options


def _input_grads(ctx, dout) -> tuple:
    """(dq, dk, dv), None for an input that does not require grad."""
    q, k, v, out, lse2, k_mean = ctx.saved_tensors
    # dout is made contiguous there if needed
    if _compiling():
        dq, dk, dv = _ops.attention_backward_op(q, k, v, out, lse2, k_mean, dout, *ctx.options)
    else:
        dq, dk, dv = _ops.backward_impl(q, k, v, out, lse2, k_mean, dout, ctx.options)
    need = ctx.needs_input_grad
    return dq if need[0] else None, dk if need[1] else None, dv if need[2] else None


class SageAttentionFunction(torch.autograd.Function):
    """``apply(q, k, v, causal, softmax_scale, smooth_k, smooth_q, layout, granularity,
    deterministic) -> out``.  Saves q, k, v, the output, the base-2 LSE and μ_K, nothing else;
    returns None for the inputs that do not require grad.  Not twice differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, *fields):
        check_tensors("q, k, v", q, k, v)
        options = AttentionOptions(*fields)  # the fields in AttentionOptions' order
        if _compiling():
            out, lse2, k_mean = _ops.attention_forward_op(q, k, v, *options)
        else:
            out, lse2, k_mean = _ops.forward_impl(q, k, v, options)
        _save(ctx, q, k, v, out, lse2, k_mean, options)
        return out

    @staticmethod
    @_once_differentiable
    def backward(ctx, dout):
        return _input_grads(ctx, dout) + (None,) * len(FIELDS)


class _EagerAttention(torch.autograd.Function):
    """What ``attention`` applies outside ``torch.compile`` (which gets the custom operator instead):
    SageAttentionFunction with its options as one AttentionOptions, since torch's ``apply`` costs
    about 0.2 µs per argument."""

    @staticmethod
    def forward(ctx, q, k, v, options):
        out, lse2, k_mean = _ops.forward_impl(q, k, v, options)
        _save(ctx, q, k, v, out, lse2, k_mean, options)
        return out

    @staticmethod
    @_once_differentiable
    def backward(ctx, dout):
        return _input_grads(ctx, dout) + (None,)


def _sink_forward(q, k, v, sinks, options: AttentionOptions) -> tuple:
    """The sink attention's output and what its backward needs (sagebwd_cp/sinks.py): (out, lse2, k_mean,
    lse), lse2 the base-2 LSE the kernels' backward reads and lse the natural-log one, both with the sinks."""
    out, lse2, k_mean, lse = _ops.forward_impl(q, k, v, options, return_lse=True, sinks=sinks.detach())
    return out, lse2, k_mean, lse


class _SinkAttention(torch.autograd.Function):
    """Attention with sinks around the kernels' forward and backward: saves q, k, v, the sink attention's
    output, its LSEs, μ_K and the sinks, and gives the sinks' gradient too."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, options):
        out, lse2, k_mean, lse = _sink_forward(q, k, v, sinks, options)
        ctx.save_for_backward(q, k, v, out, lse2, k_mean, lse, sinks)
        ctx.options = options
        return out

    @staticmethod
    @_once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse2, k_mean, lse, sinks = ctx.saved_tensors
        need = ctx.needs_input_grad
        grads = _ops.backward_impl(q, k, v, out, lse2, k_mean, dout, ctx.options, want_delta=need[3])
        (dq, dk, dv), delta = grads if need[3] else (grads, None)
        dsinks = sinks_grad(out, lse, dout, sinks, ctx.options.layout, delta) if need[3] else None
        return dq if need[0] else None, dk if need[1] else None, dv if need[2] else None, dsinks, None


@torch.compiler.disable  # (its CuPy and NumPy arithmetic is not traced: a graph break)
def _attention_with_sinks(q, k, v, sinks, options: AttentionOptions) -> Tensor:
    check_tensors("q, sinks", q, sinks)
    check_sinks(sinks, q.shape[1] if options.layout == "HND" else q.shape[2], q)
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, sinks)):
        return _SinkAttention.apply(q, k, v, sinks, options)
    return _sink_forward(q, k, v, sinks, options)[0]


def _autocast(q: Tensor, k: Tensor, v: Tensor):
    """Under CUDA autocast, float32 inputs are cast to the autocast dtype (the kernels take fp16 or
    bf16 only), as autocast does for torch's own attention."""
    dt = torch.get_autocast_dtype("cuda")
    return tuple(x.to(dt) if x.dtype == torch.float32 else x for x in (q, k, v))


def _last_dim_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, softmax_scale: float | None = None,
              layout: str = "HND", smooth_k: bool = True, smooth_q: bool = False, granularity: str = "fine",
              deterministic: bool = False, accuracy_guard: bool | float | None = None,
              window_size=(-1, -1), softcap: float = 0.0, sinks: Tensor | None = None) -> Tensor:
    """SageBwd attention with autograd.

    q: (B, Hq, Lq, D) for ``layout="HND"`` or (B, Lq, Hq, D) for ``"NHD"``; k, v: Hkv heads and Lk
    tokens, Hq a multiple of Hkv (GQA/MQA); v's head dim may differ from D (multi-head latent attention,
    192/128: sagebwd_cp/value_head_dim.py), and sets the output's.  Causal masking is bottom-right aligned (query i sees
    key j iff j <= i + Lk - Lq); ``window_size=(left, right)`` is FlashAttention's sliding window
    (query i sees key j iff -left <= j - i - (Lk - Lq) <= right, -1 unbounded; causal sets right to 0);
    ``softcap`` c > 0: logit soft-capping, scores c·tanh(s/c) (any mask; no Q-smoothing);
    rows that see no key give 0.  ``sinks`` (Hq,): attention sinks, a logit per query head that joins
    each row's softmax normalizer and attends to nothing (GPT-OSS), with their gradient; outside
    ``torch.compile``'s graphs.  ``softmax_scale`` defaults to
    1/sqrt(D).  ``smooth_k``/``smooth_q``: K/Q smoothing before quantization; ``granularity``
    ("fine" or "paper") and ``deterministic`` select the backward's quantization scales and dQ
    accumulation order.  CUDA tensors: fp16/bf16 (float32 is cast under autocast).  CPU tensors
    run the emulator: float16/float32/float64, and bfloat16 computed as float32.  ``accuracy_guard``
    (None: the global setting, SAGEBWD_ACCURACY_GUARD or ``sagebwd_cp.set_accuracy_guard``; True; False;
    or a threshold): warn once per shape where INT8 scores get coarse (sagebwd_cp/guard.py); not under
    ``torch.compile``.
    """
    check_tensors("q, k, v", q, k, v)
    if value_head_dim.wider(q, v):  # V's head dim above Q·K's: Q and K widened (value_head_dim.py)
        q, k, softmax_scale = value_head_dim.widen(q, k, v, softmax_scale)
    # (The default window and cap leave AttentionOptions' fast path: no window_options call per step.)
    masking = {} if window_size == (-1, -1) else window_options(window_size)
    if softcap:
        masking["softcap"] = softcap
    options = AttentionOptions(causal=causal, softmax_scale=softmax_scale, smooth_k=smooth_k, smooth_q=smooth_q,
                               layout=layout, granularity=granularity, deterministic=deterministic,
                               **masking)
    return _attention(q, k, v, options, accuracy_guard, sinks)


def _attention(q: Tensor, k: Tensor, v: Tensor, options: AttentionOptions, accuracy_guard, sinks) -> Tensor:
    """``attention`` of arrays at one head dim, with its options made."""
    if q.is_cuda and torch.is_autocast_enabled("cuda"):
        q, k, v = _autocast(q, k, v)
    # is_contiguous is the cheapest test of the usual case; it implies stride(-1) == 1 or a
    # dimension of size <= 1, where .contiguous() would return the tensor itself anyway.
    if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
        q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    compiling = _compiling()
    if (accuracy_guard is not None or guard._threshold is not None) and not compiling:
        threshold = guard.accuracy_guard_threshold(accuracy_guard)
        if threshold is not None:
            guard.check_scores(q, k, threshold, softmax_scale=options.softmax_scale, smooth_k=options.smooth_k,
                               layout=options.layout)
    if sinks is not None:
        return _attention_with_sinks(q, k, v, sinks, options)
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        if compiling:
            return _ops.attention_op(q, k, v, *options)
        return _ops.inference_impl(q, k, v, options)
    if compiling:
        return _ops.attention_forward_op(q, k, v, *options)[0]
    return _EagerAttention.apply(q, k, v, options)


# ------------------------------------------------------------------------------ drop-ins

def _flatten_batch(x: Tensor, name: str):
    """(N..., H, L, E) -> (prod N, H, L, E); (L, E) and (N, L, E) get unit batch/head dims."""
    if x.dim() < 2:
        raise ValueError(f"{name}: expected at least 2 dimensions (..., seqlen, head_dim), got shape {tuple(x.shape)}")
    if x.dim() == 2:
        return x[None, None]
    if x.dim() == 3:
        return x[:, None]
    return x.reshape((-1,) + tuple(x.shape[-3:])) if x.dim() > 4 else x


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                                 dropout_p: float = 0.0, is_causal: bool = False, *, scale: float | None = None,
                                 enable_gqa: bool = False, smooth_k: bool = True, smooth_q: bool = False,
                                 granularity: str = "fine", deterministic: bool = False) -> Tensor:
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention`` (layout (..., H, L, E)).

    Same semantics as torch's: ``is_causal`` is top-left aligned (query i sees key j iff j <= i),
    also when L != S; ``enable_gqa=True`` is needed for fewer key/value heads than query heads.
    ``attn_mask`` and ``dropout_p`` are not supported (ValueError).  The last four keywords are
    this library's options (see ``attention``).
    """
    check_tensors("query, key, value", query, key, value)
    if attn_mask is not None:
        raise ValueError("attn_mask: arbitrary attention masks are not supported; pass attn_mask=None "
                         "(use is_causal=True for causal masking)")
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p: attention dropout is not supported; expected 0.0, got {dropout_p}")
    if query.dim() != key.dim() or query.dim() != value.dim():
        raise ValueError(f"query, key, value: expected the same number of dimensions, got shapes "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    if query.shape[:-3] != key.shape[:-3] or query.shape[:-3] != value.shape[:-3]:
        raise ValueError(f"query, key, value: expected the same batch dimensions, got shapes "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    if query.dim() >= 3:
        hq, hk = query.shape[-3], key.shape[-3]
        if hq != hk and not enable_gqa:
            raise ValueError(f"enable_gqa: query has {hq} heads and key/value {hk}; pass enable_gqa=True for "
                             "grouped-query attention (as torch requires)")
    is_causal = is_causal if is_causal.__class__ is bool else check_flag(is_causal, "is_causal")
    q, k, v = (_flatten_batch(x, n) for x, n in ((query, "query"), (key, "key"), (value, "value")))
    opts = dict(softmax_scale=scale, layout="HND", smooth_k=smooth_k, smooth_q=smooth_q, granularity=granularity,
                deterministic=deterministic)
    lq, lk = q.shape[2], k.shape[2]
    if not is_causal or lq == lk:
        out = attention(q, k, v, causal=is_causal, **opts)
    elif lq < lk:
        # Top-left: query i sees keys 0..i, so keys from lq on are never seen; on the first lq keys
        # top-left and bottom-right alignment coincide.
        out = attention(q, k[:, :, :lq], v[:, :, :lq], causal=True, **opts)
    else:
        # Top-left with more queries than keys: the first lk queries see a causal square, the
        # others see every key.
        head = attention(q[:, :, :lk], k, v, causal=True, **opts)
        tail = attention(q[:, :, lk:], k, v, causal=False, **opts)
        out = torch.cat([head, tail], dim=2)
    return out.reshape(query.shape[:-1] + value.shape[-1:])


def check_flash_defaults(dropout_p, alibi_slopes, return_attn_probs) -> None:
    """FlashAttention's options this library does not implement must keep their defaults."""
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p: attention dropout is not supported; expected 0.0, got {dropout_p}")
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes: ALiBi is not supported; expected None")
    if return_attn_probs:
        raise ValueError("return_attn_probs: returning the attention probabilities is not supported; expected False")


def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None,
                    causal: bool = False, window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                    deterministic: bool = False, return_attn_probs: bool = False, *, smooth_k: bool = True,
                    smooth_q: bool = False, granularity: str = "fine", sinks: Tensor | None = None) -> Tensor:
    """Drop-in for FlashAttention's ``flash_attn_func``: q (B, Lq, Hq, D), k and v (B, Lk, Hkv, D),
    Hq a multiple of Hkv, causal bottom-right aligned; returns (B, Lq, Hq, D).

    ``window_size=(left, right)``: a sliding window, as FlashAttention's; ``softcap`` > 0: logit
    soft-capping (any mask).  ``dropout_p``,
    ``alibi_slopes`` and ``return_attn_probs`` must keep their defaults (ValueError otherwise).
    ``deterministic`` orders the dQ accumulation; ``smooth_k`` (default on),
    ``smooth_q``, ``granularity`` and ``sinks`` are this library's options (see ``attention``).
    """
    check_tensors("q, k, v", q, k, v)
    check_flash_defaults(dropout_p, alibi_slopes, return_attn_probs)
    return attention(q, k, v, causal=causal, softmax_scale=softmax_scale, layout="NHD",
                     smooth_k=smooth_k, smooth_q=smooth_q, granularity=granularity,
                     deterministic=deterministic, window_size=window_size, softcap=softcap, sinks=sinks)

