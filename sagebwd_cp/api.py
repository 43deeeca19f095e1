"""The public functions: inference, training forward and backward, on any DLPack array.

CUDA arrays run the INT8 kernels on the caller's current stream; host arrays (NumPy, torch CPU
tensors, or anything NumPy can read through DLPack) run the NumPy emulator of the same quantized
algorithm.  Results come back in the framework and dtype of q: torch in, torch out (bfloat16
included; tensors that require grad are read detached); NumPy in, NumPy out; CuPy in, CuPy out.
The array arguments of one call come from one framework: each public function checks them first
(``arrays.check_arrays``), a non-array or a mix being a TypeError that names the argument.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from . import guard, value_head_dim
from .arrays import (ArrayDesc, check_arrays, contiguous_strides, copy_into, describe, host_numpy, host_result,
                     jax_boundary, signature)
from .numerics import k_mean_shape
from .gpu import backward as gpu_backward, forward as gpu_forward
from .gpu.plan import cached_plan, remember_plan
from .host import emulator, packed
from .options import AttentionOptions, check_flag, window_options
from .sinks import check_sinks, join_sinks, sink_logits, sinks_grad
from .problem import AttentionProblem, check_output, check_wide_options, make_problem, make_varlen_problem


@dataclasses.dataclass
class AttentionSaved:
    """What the backward needs from one training forward, and nothing more: the inputs, the
    16-bit output, the base-2 LSE (B, Hq, Lq) float32 and, with K-smoothing, μ_K (B, Hkv, D) float32
    (quantization is deterministic, so the backward re-derives Q̂, K̂ and their scales from q, k and
    μ_K rather than keeping them alive)."""

    problem: AttentionProblem
    out: ArrayDesc
    lse2: ArrayDesc
    k_mean: ArrayDesc | None = None
    sinks: object = None  # attention sinks (sinks.py): the logits, and the natural-log LSE they joined
    sink_lse: object = None
    head_dims: tuple | None = None  # (Q·K's, V's) where V's is wider: q and k above are widened (value_head_dim.py)


def _host_array(desc: ArrayDesc, layout: str, name: str, head_dim: int | None = None) -> np.ndarray:
    """A host array as float32 (B, H, N, D), or a packed batch's (total, H, D) as it is, with zero columns up to
    ``head_dim`` (the emulator takes V, O and dO at Q·K's head dim: value_head_dim.py)."""
    x = np.asarray(host_numpy(desc, name), dtype=np.float32)
    if head_dim is not None:
        x = value_head_dim.pad_head_dim(x, head_dim)
    return x if layout in ("HND", "THD") else x.transpose(0, 2, 1, 3)


def _to_layout(x: np.ndarray, layout: str, like: ArrayDesc, dtype: str):
    """An emulator result (B, H, N, D) in ``layout``, in ``like``'s framework and ``dtype``."""
    return host_result(x if layout == "HND" else x.transpose(0, 2, 1, 3), like, dtype)


def _emulator_dtype(dtype: str) -> str:
    return dtype if dtype in ("float16", "bfloat16") else "float32"


def _signatures(arrays):
    """(pointers, keys) of the arrays (see arrays.signature), or None if one has no cheap signature."""
    ptrs, keys = [], []
    for x in arrays:
        s = signature(x)
        if s is None:
            return None
        ptrs.append(s[0])
        keys.append(s[1])
    return ptrs, tuple(keys)


def _problem(q, k, v, options: AttentionOptions, varlen) -> AttentionProblem:
    if varlen is None:
        return make_problem(q, k, v, options)
    return make_varlen_problem(q, k, v, *varlen, options)


def _with_offsets(arrays: tuple, varlen) -> tuple:
    """The arrays a plan takes, a packed batch's offsets last (forward.varlen_inputs)."""
    return arrays if varlen is None else arrays + tuple(varlen[:2])


def run_forward(q, k, v, options: AttentionOptions, *, out=None, training: bool = False, return_lse: bool = False,
                want_saved: bool = False, k_mean=None, varlen=None, sinks=None):
    """(out, lse or None, saved) of attention with ``options`` (an AttentionOptions, checked when made).
    ``out``: a buffer to write, or None; ``training``: keep what the backward needs; ``return_lse``:
    also the natural-log LSE; ``want_saved``: that state as an AttentionSaved.  ``saved`` is an AttentionSaved (training and want_saved), the pair
    (base-2 LSE array, μ_K array or None without K-smoothing) (training only), or None.  ``k_mean``:
    a μ_K to quantize K with instead of K's own token mean (chunked attention shares one over the
    chunks; ALGORITHM.md, chunked attention), returned as the saved μ_K.  ``varlen``:
    (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) of a packed batch, or None.  ``sinks``: (Hq,) sink
    logits (sinks.py) joined into the output and both LSEs (with return_lse): on the GPU where the LSE is formed
    (kernels/lse.cu natural_lse), on the host by join_sinks.

    CUDA arrays: a call whose arrays and options match an earlier call's replays that call's launch
    plan (plan.py) without checking or describing anything again; a new combination is checked in
    full (make_problem) and its plan built and cached."""
    if value_head_dim.wider(q, v):
        return _forward_widened(q, k, v, options, out, training, return_lse, want_saved, k_mean, varlen, sinks)
    given = k_mean is not None
    if sinks is not None:
        assert return_lse, "the sinks join where the returned LSE is formed"
        sinks = sink_logits(sinks)
    key_options = ("forward", options, training, return_lse, given, None if varlen is None else tuple(varlen[2:]),
                   sinks is not None)
    arrays = (q, k, v) + ((out,) if out is not None else ()) + ((k_mean,) if given else ()) + (
        (sinks,) if sinks is not None else ())
    sig = _signatures(_with_offsets(arrays, varlen))
    key = None
    if sig is not None:
        key = (key_options, sig[1])
        plan = cached_plan(key)
        if plan is not None:
            return _run_forward(plan, sig[0], q, k, v, out, training, return_lse, want_saved, k_mean, varlen)
    prob = _problem(q, k, v, options, varlen)
    mean_desc = None
    if given:
        if varlen is not None:
            raise ValueError("k_mean: a given μ_K is for dense batches (chunked attention); packed batches "
                             "take each sequence's own")
        mean_desc = describe(k_mean, "k_mean")
        _check_k_mean(mean_desc, prob)
    if not prob.on_gpu:
        result = _host_forward(prob, out, training, return_lse, want_saved, mean_desc)
        return result if sinks is None else _host_sinks(result, sinks, out, prob)
    out_desc = check_output(out, prob) if out is not None else None
    sinks_desc = describe(sinks, "sinks") if sinks is not None else None
    descs = [d for d in (prob.q, prob.k, prob.v, out_desc, mean_desc, sinks_desc, prob.cu_q, prob.cu_k)
             if d is not None]
    plan = None
    if key is None:  # arrays without a cheap signature (JAX, DLPack): key the plan by their descriptors
        key = (key_options, _signatures(descs)[1])
        plan = cached_plan(key)
    if plan is None:
        plan = gpu_forward.forward_plan(prob, out_desc, training, return_lse, mean_desc, sinks_desc)
        remember_plan(key, plan)
    return _run_forward(plan, [d.ptr for d in descs], q, k, v, out, training, return_lse, want_saved,
                        mean_desc.obj if given else None, varlen)


def _host_sinks(result, sinks, out, prob: AttentionProblem):
    """A host forward's (out, lse, saved) with the sinks joined (join_sinks): the output (into ``out`` when given),
    the returned LSE and the saved base-2 LSE (a packed batch's as one batch entry of rows)."""
    o, lse, saved = result
    lse2 = saved.lse2.obj if isinstance(saved, AttentionSaved) else saved[0] if saved is not None else None
    if prob.varlen:
        o_joined, lse, lse2 = join_sinks(o[None], lse[None], None if lse2 is None else lse2[None], sinks, "NHD")
        o_joined, lse, lse2 = o_joined[0], lse[0], None if lse2 is None else lse2[0]
    else:
        o_joined, lse, lse2 = join_sinks(o, lse, lse2, sinks, prob.layout)
    if out is not None:
        out[...] = o_joined
        o_joined = out
    if isinstance(saved, AttentionSaved):
        out_desc = describe(o_joined, "out")
        out_desc.dtype = saved.out.dtype
        saved = dataclasses.replace(saved, out=out_desc, lse2=describe(lse2, "lse2"))
    elif saved is not None:
        saved = (lse2, saved[1])
    return o_joined, lse, saved


def _forward_widened(q, k, v, options, out, training, return_lse, want_saved, k_mean, varlen, sinks=None):
    """run_forward where V's head dim is above Q·K's: Q and K widened to it (the output is V's width already)."""
    dqk, dv = q.shape[-1], v.shape[-1]
    q, k, scale = value_head_dim.widen(q, k, v, options.softmax_scale)
    if k_mean is not None:
        k_mean = value_head_dim.pad_head_dim(k_mean, dv)
    o, lse, saved = run_forward(q, k, v, options._replace(softmax_scale=scale), out=out, training=training,
                                return_lse=return_lse, want_saved=want_saved, k_mean=k_mean, varlen=varlen,
                                sinks=sinks)
    if isinstance(saved, AttentionSaved):
        saved = dataclasses.replace(saved, head_dims=(dqk, dv))
    return o, lse, saved


def _backward_widened(q, k, v, out, lse2, do, options, k_mean, varlen, head_dims=None):
    """run_backward where V's head dim is above Q·K's (``head_dims``: a saved forward's, whose q and k are already
    widened): Q and K widened to it, dQ and dK sliced back."""
    dqk, dv = head_dims or (q.shape[-1], v.shape[-1])
    if head_dims is None:
        q, k, scale = value_head_dim.widen(q, k, v, options.softmax_scale)
        options = options._replace(softmax_scale=scale)
    if k_mean is not None:
        k_mean = value_head_dim.pad_head_dim(k_mean, dv)
    dq, dk, dvv = run_backward(q, k, v, out, lse2, do, options, k_mean=k_mean, varlen=varlen)
    return dq[..., :dqk], dk[..., :dqk], dvv


def _run_forward(plan, ptrs, q, k, v, out, training, return_lse, want_saved, given_mean=None, varlen=None):
    objs, _ = plan.run(ptrs)
    # forward_plan's outputs: out (unless given), lse2 (training), k_mean (training, K-smoothing, unless
    # given), lse
    allocated = iter(objs)
    o = out if out is not None else next(allocated)
    lse2 = next(allocated) if training else None
    k_mean = None
    if training and plan.problem.smooth_k:
        k_mean = given_mean if given_mean is not None else next(allocated)
    lse = next(allocated) if return_lse else None
    if training and want_saved:
        # The plan's problem has the first call's descriptors: describe this call's arrays.
        prob = dataclasses.replace(plan.problem, q=describe(q, "q"), k=describe(k, "k"), v=describe(v, "v"))
        if varlen is not None:
            prob = dataclasses.replace(prob, cu_q=describe(varlen[0], "cu_seqlens_q"),
                                       cu_k=describe(varlen[1], "cu_seqlens_k"))
        out_desc = describe(o, "out")
        out_desc.dtype = prob.dtype  # CuPy holds bfloat16 outputs as uint16
        return o, lse, AttentionSaved(prob, out_desc, describe(lse2, "lse2"),
                                      describe(k_mean, "k_mean") if k_mean is not None else None)
    return o, lse, ((lse2, k_mean) if training else None)


def _host_offsets(prob: AttentionProblem) -> tuple:
    return host_numpy(prob.cu_q, "cu_seqlens_q"), host_numpy(prob.cu_k, "cu_seqlens_k")


def _host_forward(prob: AttentionProblem, out, training, return_lse, want_saved, k_mean: ArrayDesc | None = None):
    layout = prob.layout
    od = check_output(out, prob) if out is not None else None
    dtype = _emulator_dtype(prob.dtype)
    dv = prob.value_dim
    qh, kh = (_host_array(d, layout, n) for d, n in ((prob.q, "q"), (prob.k, "k")))
    vh = _host_array(prob.v, layout, "v", prob.head_dim)
    if prob.varlen:
        o, lse, lse2_host, k_mean_host = packed.emulate_forward(
            qh, kh, vh, _host_offsets(prob), causal=prob.causal, softmax_scale=prob.softmax_scale,
            smooth_k=prob.smooth_k, dtype=dtype, window=prob.window,
            softcap=prob.options.softcap)
        o = host_result(np.ascontiguousarray(o[..., :dv]), prob.q, prob.dtype)
    else:
        o, lse, state = emulator.emulate_forward(qh, kh, vh, causal=prob.causal, softmax_scale=prob.softmax_scale,
                                                 smooth_k=prob.smooth_k, smooth_q=prob.smooth_q, dtype=dtype,
                                                 window=prob.window, softcap=prob.options.softcap,
                                                 k_mean=host_numpy(k_mean, "k_mean") if k_mean is not None else None)
        o = _to_layout(np.ascontiguousarray(o[..., :dv]), layout, prob.q, prob.dtype)
        lse2_host, k_mean_host = state["lse2"][:, :, :prob.len_q], state["inputs"]["k_mean"]
    if od is not None:
        copy_into(od, o)
        o = od.obj
    saved = None
    if training:
        lse2 = host_result(lse2_host, prob.q, "float32")
        k_mean = host_result(k_mean_host, prob.q, "float32") if prob.smooth_k else None
        if want_saved:
            saved = AttentionSaved(prob, describe(o, "out"), describe(lse2, "lse2"),
                                   describe(k_mean, "k_mean") if k_mean is not None else None)
        else:
            saved = (lse2, k_mean)
    return o, (host_result(lse, prob.q, "float32") if return_lse else None), saved


def _guard(q, k, accuracy_guard, options: AttentionOptions) -> None:
    """The accuracy guard (guard.py) where this call's argument or the global setting turns it on."""
    threshold = guard.accuracy_guard_threshold(accuracy_guard)
    if threshold is not None:
        guard.check_scores(q, k, threshold, softmax_scale=options.softmax_scale, smooth_k=options.smooth_k,
                           layout=options.layout)


def _forward_call(q, k, v, out, k_mean, causal, softmax_scale, smooth_k, smooth_q, layout, window_size, softcap,
                  return_lse, accuracy_guard) -> tuple:
    """(options, return_lse) of a forward call (``attention``, ``attention_forward``), its arrays and flag
    checked, and the accuracy guard run where it is on."""
    check_arrays("q, k, v, out, k_mean", q, k, v, out, k_mean, optional=("out", "k_mean"))
    options = AttentionOptions(causal=causal, softmax_scale=softmax_scale, smooth_k=smooth_k, smooth_q=smooth_q,
                               layout=layout, **window_options(window_size), softcap=softcap)
    return_lse = check_flag(return_lse, "return_lse")
    if accuracy_guard is not None or guard._threshold is not None:
        _guard(q, k, accuracy_guard, options)
    return options, return_lse


@jax_boundary
def attention(q, k, v, *, causal=False, softmax_scale=None, smooth_k=True, smooth_q=False, layout="HND",
              out=None, return_lse=False, k_mean=None, accuracy_guard=None, window_size=(-1, -1), softcap=0.0,
              sinks=None):
    """Inference attention (saves nothing for a backward).

    q: (B, Hq, Lq, D) for layout "HND" or (B, Lq, Hq, D) for "NHD"; k, v likewise with Hkv heads
    (Hq a multiple of Hkv: GQA/MQA) and Lk tokens.  fp16 or bf16 on CUDA; on the host (the emulator)
    also fp32 and fp64; results in q's framework and dtype.  Causal masking is
    bottom-right aligned (query i sees key j iff j <= i + Lk - Lq), as in FlashAttention2;
    ``window_size=(left, right)`` is FlashAttention's sliding window (query i sees key j iff
    -left <= j - i - (Lk - Lq) <= right, -1 unbounded; causal sets right to 0), and key tiles outside
    every row's window are skipped.  ``softcap`` c > 0: logit soft-capping, scores c·tanh(s/c) (as
    FlashAttention's and Gemma 2's; with K-smoothing each score's share is added back before tanh).  Rows
    that see no key return 0 (and LSE -inf).  Returns ``out`` or ``(out, lse)`` with lse the
    natural-log logsumexp, shape (B, Hq, Lq), float32, of the scores before K-smoothing (so LSEs of
    calls over different keys merge exactly: ``merge_attention``).  ``k_mean`` (K-smoothing only):
    the μ_K (``k_mean_shape``, float32) to quantize K with instead of K's own token mean; attention
    over chunks of the keys passes all of them one (``key_mean``) so the backward is exact.
    ``accuracy_guard`` (None: the global setting, off unless SAGEBWD_ACCURACY_GUARD or
    ``set_accuracy_guard`` turns it on; True; False; or a threshold): warn once per shape where INT8
    scores get coarse (guard.py).  ``sinks`` (Hq,), a floating array in q's framework: attention sinks,
    a logit per query head that joins each row's softmax normalizer and attends to nothing (sinks.py;
    the LSE then includes them).
    """
    options, return_lse = _forward_call(q, k, v, out, k_mean, causal, softmax_scale, smooth_k, smooth_q, layout,
                                        window_size, softcap, return_lse, accuracy_guard)
    if sinks is not None:
        return _attention_with_sinks(q, k, v, options, out, return_lse, k_mean, sinks)
    o, lse, _ = run_forward(q, k, v, options, out=out, return_lse=return_lse, k_mean=k_mean)
    return (o, lse) if return_lse else o


def _query_heads(q, layout: str) -> int:
    return q.shape[1] if layout == "HND" else q.shape[2]


def _attention_with_sinks(q, k, v, options, out, return_lse, k_mean, sinks):
    check_sinks(sinks, _query_heads(q, options.layout), q)
    o, lse, _ = run_forward(q, k, v, options, out=out, return_lse=True, k_mean=k_mean, sinks=sinks)
    return (o, lse) if return_lse else o


@jax_boundary
def attention_forward(q, k, v, *, causal=False, softmax_scale=None, smooth_k=True, smooth_q=False, layout="HND",
                      out=None, return_lse=False, k_mean=None, accuracy_guard=None, window_size=(-1, -1), softcap=0.0,
              sinks=None):
    """Training forward: returns ``(out, saved)`` (or ``(out, lse, saved)`` with return_lse);
    ``k_mean``, ``accuracy_guard``, ``window_size`` and ``sinks`` as in ``attention`` (with sinks, the
    backward also returns their gradient)."""
    options, return_lse = _forward_call(q, k, v, out, k_mean, causal, softmax_scale, smooth_k, smooth_q, layout,
                                        window_size, softcap, return_lse, accuracy_guard)
    if sinks is not None:
        check_sinks(sinks, _query_heads(q, options.layout), q)
        o, lse, saved = run_forward(q, k, v, options, out=out, training=True, return_lse=True, want_saved=True,
                                    k_mean=k_mean, sinks=sinks)
        saved = dataclasses.replace(saved, sinks=sinks, sink_lse=lse)
        return (o, lse, saved) if return_lse else (o, saved)
    o, lse, saved = run_forward(q, k, v, options, out=out, training=True, return_lse=return_lse, want_saved=True,
                                k_mean=k_mean)
    return (o, lse, saved) if return_lse else (o, saved)


@jax_boundary
def attention_backward(saved: AttentionSaved, do, *, granularity="fine", deterministic=False):
    """dQ, dK, dV (in q's layout and dtype) from the saved forward state and dO; and the sinks'
    gradient (Hq,) if the forward had sinks.

    granularity: "fine" (per-key P scales for dV, per-query / per-key dS scales for dQ / dK) or
    "paper" (one scale per 64x64 tile for P and dS, as published).  deterministic=True orders the
    dQ accumulation so repeated runs are bitwise identical (slower); dK and dV always are."""
    if not isinstance(saved, AttentionSaved):
        raise TypeError(f"saved: expected the AttentionSaved returned by attention_forward, got {type(saved).__name__}")
    p = saved.problem
    check_arrays("the forward's q, do", p.q, do)
    options = p.options._replace(granularity=granularity, deterministic=deterministic)
    varlen = (p.cu_q.obj, p.cu_k.obj, p.len_q, p.len_k) if p.varlen else None
    if saved.head_dims is not None:  # V's head dim is above Q·K's: the saved q and k are widened
        grads = _backward_widened(p.q.obj, p.k.obj, p.v.obj, saved.out.obj, saved.lse2.obj, do, options,
                                  None if saved.k_mean is None else saved.k_mean.obj, varlen, saved.head_dims)
    else:
        grads = run_backward(p.q, p.k, p.v, saved.out, saved.lse2, do, options, prob=p, k_mean=saved.k_mean,
                             varlen=varlen, want_delta=saved.sinks is not None)
    if saved.sinks is None:
        return grads
    delta, out = None, saved.out.obj
    if saved.head_dims is None:
        grads, delta = grads
    return tuple(grads) + (sinks_grad(out, saved.sink_lse, do, saved.sinks, p.layout, delta),)


@jax_boundary
def attention_backward_arrays(q, k, v, out, lse2, do, *, causal=False, softmax_scale=None, smooth_k=True,
                              smooth_q=False, layout="HND", granularity="fine", deterministic=False,
                              k_mean=None, window_size=(-1, -1), softcap=0.0):
    """The backward from plain arrays (what frameworks save): q, k, v and ``out`` of the forward,
    ``lse2`` its base-2 LSE (``lse2_shape``; returned by ``attention_forward`` in ``saved.lse2``),
    and dO.  The options must be those of the forward.  ``k_mean`` (optional, K-smoothing only):
    that forward's μ_K (``k_mean_shape``, float32; ``saved.k_mean``), which spares the backward a
    pass over K; without it μ_K is computed again."""
    check_arrays("q, k, v, out, lse2, do, k_mean", q, k, v, out, lse2, do, k_mean, optional=("k_mean",))
    options = AttentionOptions(causal=causal, softmax_scale=softmax_scale, smooth_k=smooth_k, smooth_q=smooth_q,
                               layout=layout, granularity=granularity, deterministic=deterministic,
                              **window_options(window_size), softcap=softcap)
    return run_backward(q, k, v, out, lse2, do, options, k_mean=k_mean)


_VARLEN_DOC = """Packed (variable-length) batches, FlashAttention's ``flash_attn_varlen_func`` convention:
    q (total_q, Hq, D), k and v (total_k, Hkv, D); sequence b is rows cu_seqlens_q[b]..cu_seqlens_q[b+1]
    of q and cu_seqlens_k[b].. of k, v (int32 offsets of batch + 1 entries, on q's device); max_seqlen_q
    and max_seqlen_k (Python ints) at least the longest sequence's lengths: they size the grids, and on
    a GPU the offsets are not read back (no synchronization; a smaller max would leave tokens out).
    Each sequence is attended alone: its own quantization blocks and μ_K, causal masks bottom-right
    aligned within it.  The LSE is (Hq, total_q).  No Q-smoothing."""


@jax_boundary
def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                     softmax_scale=None, smooth_k=True, out=None, return_lse=False, window_size=(-1, -1),
                     softcap=0.0):
    """Inference attention over a packed batch; returns ``out`` or ``(out, lse)``."""
    check_arrays("q, k, v, cu_seqlens_q, cu_seqlens_k, out", q, k, v, cu_seqlens_q, cu_seqlens_k, out,
                 optional=("out",))
    options = AttentionOptions(causal=causal, softmax_scale=softmax_scale, smooth_k=smooth_k, layout="THD",
                               **window_options(window_size), softcap=softcap)
    return_lse = check_flag(return_lse, "return_lse")
    varlen = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    o, lse, _ = run_forward(q, k, v, options, out=out, return_lse=return_lse, varlen=varlen)
    return (o, lse) if return_lse else o


@jax_boundary
def attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                             softmax_scale=None, smooth_k=True, out=None, return_lse=False, window_size=(-1, -1),
                     softcap=0.0):
    """Training forward over a packed batch: ``(out, saved)`` (or ``(out, lse, saved)``); the backward
    is ``attention_backward(saved, do)``."""
    check_arrays("q, k, v, cu_seqlens_q, cu_seqlens_k, out", q, k, v, cu_seqlens_q, cu_seqlens_k, out,
                 optional=("out",))
    options = AttentionOptions(causal=causal, softmax_scale=softmax_scale, smooth_k=smooth_k, layout="THD",
                               **window_options(window_size), softcap=softcap)
    return_lse = check_flag(return_lse, "return_lse")
    varlen = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    o, lse, saved = run_forward(q, k, v, options, out=out, training=True, return_lse=return_lse, want_saved=True,
                                varlen=varlen)
    return (o, lse, saved) if return_lse else (o, saved)


@jax_boundary
def attention_varlen_backward_arrays(q, k, v, out, lse2, do, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     *, causal=False, softmax_scale=None, smooth_k=True,
                                     granularity="fine", deterministic=False, k_mean=None, window_size=(-1, -1),
                                     softcap=0.0):
    """``attention_backward_arrays`` for a packed batch: ``lse2`` (Hq, total_q), ``k_mean`` (batch, Hkv, D)."""
    check_arrays("q, k, v, out, lse2, do, cu_seqlens_q, cu_seqlens_k, k_mean", q, k, v, out, lse2, do, cu_seqlens_q,
                 cu_seqlens_k, k_mean, optional=("k_mean",))
    options = AttentionOptions(causal=causal, softmax_scale=softmax_scale, smooth_k=smooth_k, layout="THD",
                               granularity=granularity, deterministic=deterministic, **window_options(window_size),
                               softcap=softcap)
    varlen = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return run_backward(q, k, v, out, lse2, do, options, k_mean=k_mean, varlen=varlen)


for _f in (attention_varlen, attention_varlen_forward, attention_varlen_backward_arrays):
    _f.__doc__ += "\n\n    " + _VARLEN_DOC


def lse2_shape(batch: int, heads_q: int, len_q: int) -> tuple:
    """Shape of the saved base-2 LSE (float32)."""
    return (batch, heads_q, len_q)


def _check_float32_array(x: ArrayDesc, name: str, expected: tuple, prob: AttentionProblem) -> None:
    """A contiguous float32 array of shape ``expected`` on q's device (the saved LSE and μ_K)."""
    if tuple(x.shape) != expected:
        raise ValueError(f"{name}: expected shape {expected}, got {tuple(x.shape)}")
    if x.dtype != "float32":
        raise TypeError(f"{name}: expected dtype float32, got {x.dtype}")
    if (x.device_type, x.device_id) != (prob.q.device_type, prob.q.device_id):
        raise ValueError(f"{name}: expected an array on {prob.q.device_type}:{prob.q.device_id}, got "
                         f"{x.device_type}:{x.device_id}")
    # Strides of size-1 dimensions are never used (NumPy keeps a slice's there, e.g. a (B, H, 1) LSE).
    if any(s != c and n > 1 for s, c, n in zip(x.strides, contiguous_strides(expected), expected)):
        raise ValueError(f"{name}: expected a contiguous array, got strides {x.strides}")


def _check_k_mean(k_mean: ArrayDesc, prob: AttentionProblem) -> None:
    if not prob.smooth_k:
        raise ValueError("k_mean: μ_K belongs to K-smoothing, but smooth_k is False; pass k_mean=None")
    _check_float32_array(k_mean, "k_mean", k_mean_shape(prob.batch, prob.heads_kv, prob.head_dim), prob)


def _check_lse2(lse2: ArrayDesc, prob: AttentionProblem) -> None:
    _check_float32_array(lse2, "lse2", prob.lse_shape(), prob)


def run_backward(q, k, v, out, lse2, do, options: AttentionOptions, *, prob: AttentionProblem | None = None,
                 k_mean=None, varlen=None, want_delta: bool = False):
    """(dq, dk, dv) of attention with ``options`` (an AttentionOptions, checked when made).  ``prob`` (with ``out``, ``lse2`` and ``k_mean`` descriptors) comes from a saved
    forward state; without it the arrays are checked here.  ``k_mean``: the forward's μ_K, or None to
    compute it again.  CUDA arrays replay a cached plan as in ``run_forward``.  ``want_delta``: returns
    ((dq, dk, dv), δ) instead, δ = rowsum(dO ∘ O) (B, Hq, Lq) float32 as the GPU's row statistics hold it (a view
    of them), or None where there are none to share (host arrays, packed batches, a V head dim above Q·K's)."""
    if prob is None and value_head_dim.wider(q, v):
        grads = _backward_widened(q, k, v, out, lse2, do, options, k_mean, varlen)
        return (grads, None) if want_delta else grads
    given = k_mean is not None
    keep_stats = want_delta and varlen is None
    key_options = ("backward", options, given, None if varlen is None else tuple(varlen[2:]), keep_stats)
    sig = _signatures(_with_offsets((q, k, v, out, lse2, do, k_mean) if given else (q, k, v, out, lse2, do), varlen))
    key = None
    if sig is not None:
        key = (key_options, sig[1])
        plan = cached_plan(key)
        if plan is not None:
            return _backward_results(plan.run(sig[0])[0], keep_stats, want_delta, plan.problem)
    if prob is None:
        prob = _problem(q, k, v, options, varlen)
        out, lse2 = check_output(out, prob), describe(lse2, "lse2")
        k_mean = describe(k_mean, "k_mean") if given else None
    check_wide_options(prob.head_dim, options)  # a saved forward's problem, with the backward's own options
    dd = check_output(do, prob, "do")
    _check_lse2(lse2, prob)
    if given:
        _check_k_mean(k_mean, prob)
    if prob.on_gpu:
        descs = (prob.q, prob.k, prob.v, out, lse2, dd) + ((k_mean,) if given else ()) + (
            (prob.cu_q, prob.cu_k) if prob.varlen else ())
        plan = None
        if key is None:  # arrays without a cheap signature: key the plan by their descriptors
            key = (key_options, _signatures(descs)[1])
            plan = cached_plan(key)
        if plan is None:
            plan = gpu_backward.backward_plan(prob, out, lse2, dd, options, k_mean, keep_stats=keep_stats)
            remember_plan(key, plan)
        return _backward_results(plan.run([d.ptr for d in descs])[0], keep_stats, want_delta, prob)
    grads = _host_backward(prob, out, lse2, dd, options, k_mean if given else None)
    return (grads, None) if want_delta else grads


def _backward_results(results, keep_stats: bool, want_delta: bool, prob: AttentionProblem):
    """A backward plan's (dq, dk, dv), or with ``want_delta`` ((dq, dk, dv), δ): with ``keep_stats`` the plan's first
    output is its row statistics [B][Hq][Nq_pad][4], δ their third column (backward_rows.cu row_stats)."""
    if not keep_stats:
        return (tuple(results), None) if want_delta else tuple(results)
    stats, *grads = results
    return tuple(grads), stats[:, :, :prob.len_q, 2]


def _host_backward(prob: AttentionProblem, out, lse2, dd, options: AttentionOptions, k_mean):
    """(dq, dk, dv) on the emulator, for host arrays."""
    given = k_mean is not None
    d, layout = prob.head_dim, prob.layout
    qh, kh = (_host_array(x, layout, n) for x, n in ((prob.q, "q"), (prob.k, "k")))
    vh, oh, doh = (_host_array(x, layout, n, d) for x, n in ((prob.v, "v"), (out, "out"), (dd, "do")))
    if prob.varlen:
        grads = packed.emulate_backward(qh, kh, vh, oh, host_numpy(lse2, "lse2"), doh, _host_offsets(prob),
                                        causal=prob.causal, softmax_scale=prob.softmax_scale, smooth_k=prob.smooth_k,
                                        dtype=_emulator_dtype(prob.dtype), granularity=options.granularity,
                                        window=prob.window, softcap=prob.options.softcap,
                                        k_mean=host_numpy(k_mean, "k_mean") if given else None)
    else:
        state = emulator.backward_state(qh, kh, vh, oh, host_numpy(lse2, "lse2"), causal=prob.causal,
                                        softmax_scale=prob.softmax_scale, smooth_k=prob.smooth_k, smooth_q=prob.smooth_q,
                                        dtype=_emulator_dtype(prob.dtype), window=prob.window,
                                        softcap=prob.options.softcap, k_mean=host_numpy(k_mean, "k_mean") if given else None)
        grads = emulator.emulate_backward(state, doh, granularity=options.granularity)
    dq, dk, dv = grads
    dv = np.ascontiguousarray(dv[..., :prob.value_dim])
    if prob.varlen:
        return tuple(host_result(g, prob.q, prob.dtype) for g in (dq, dk, dv))
    return tuple(_to_layout(g, layout, prob.q, prob.dtype) for g in (dq, dk, dv))
