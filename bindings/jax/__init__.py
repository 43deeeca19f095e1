"""JAX adapter for sagebwd_cp: ``import sagebwd_cp.jax``.

``attention(q, k, v, causal=..., layout=..., softmax_scale=...)`` is a ``jax.custom_vjp`` whose
forward and backward call the neutral API from inside the XLA program through
``jax.experimental.buffer_callback``: XLA hands the callback its device buffers and its stream, the
kernels run on that stream, reading the inputs where XLA keeps them and writing the output O in
place (the saved LSE and μ_K and the gradients are copied device to device from the library's
buffers into XLA's).  Nothing goes through the host, and it works under ``jax.jit``, ``jax.grad``
and eager calls alike.  On the CPU backend the same callback runs the NumPy emulator.
"""
from __future__ import annotations

import functools
import math

try:
    import jax
    import jax.numpy as jnp
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError('sagebwd_cp.jax needs JAX: pip install "sagebwd_cp[jax]" (for GPUs, with the jax CUDA '
                      'plugin, e.g. pip install "jax[cuda13]")') from exc
try:
    from jax.experimental.buffer_callback import buffer_callback
except ImportError as exc:  # pragma: no cover - older jax
    raise ImportError(f"sagebwd_cp.jax needs jax.experimental.buffer_callback, which jax {jax.__version__} lacks; "
                      'upgrade it: pip install -U "sagebwd_cp[jax]"') from exc

import numpy as np

from sagebwd_cp import value_head_dim
from sagebwd_cp.api import run_backward, run_forward
from sagebwd_cp.arrays import KDL_CUDA, ArrayDesc, contiguous_strides, describe, framework_of, what_came
from sagebwd_cp.numerics import k_mean_shape
from sagebwd_cp.options import AttentionOptions, window_options
from sagebwd_cp.problem import make_problem
from sagebwd_cp.sinks import join_sinks, sinks_grad

__all__ = ["attention"]


def attention(q, k, v, *, causal: bool = False, layout: str = "HND", softmax_scale: float | None = None,
              smooth_k: bool = True, smooth_q: bool = False, granularity: str = "fine", deterministic: bool = False,
              window_size=(-1, -1), softcap: float = 0.0, sinks=None):
    """SageBwd attention, differentiable with ``jax.grad`` and traceable by ``jax.jit``.

    q: (B, Hq, Lq, D) for ``layout="HND"`` or (B, Lq, Hq, D) for ``"NHD"`` (the layout of
    ``jax.nn.dot_product_attention``); k, v: Hkv heads and Lk tokens, Hq a multiple of Hkv
    (GQA/MQA); v's head dim may differ from q's and k's (multi-head latent attention:
    sagebwd_cp/value_head_dim.py).  float16 or bfloat16 on a GPU; on the CPU backend the emulator also takes float32.
    Causal masking is bottom-right aligned (query i sees key j iff j <= i + Lk - Lq);
    ``window_size=(left, right)`` is FlashAttention's sliding window (-1 unbounded); ``softcap`` > 0
    logit soft-capping (any mask; no Q-smoothing); rows that see no key give 0.  ``sinks`` (Hq,):
    attention sinks, a logit per query head that joins each row's softmax normalizer (GPT-OSS), with
    their gradient.  ``softmax_scale`` defaults to 1/sqrt(D); the other options are those of
    ``sagebwd_cp.attention_backward``.  q, k and v are JAX arrays (others, NumPy included, are refused
    with a TypeError: convert them with ``jnp.asarray``); shapes, dtypes and options are checked when
    traced.
    """
    _check_arrays(q=q, k=k, v=v, **({} if sinks is None else {"sinks": sinks}))
    if value_head_dim.wider(q, v):  # V's head dim above Q·K's: Q and K widened (value_head_dim.py)
        q, k, softmax_scale = value_head_dim.widen(q, k, v, softmax_scale)
    opts = AttentionOptions(causal=causal, softmax_scale=softmax_scale, smooth_k=smooth_k, smooth_q=smooth_q,
                            layout=layout, granularity=granularity, deterministic=deterministic,
                            **window_options(window_size), softcap=softcap)
    _check(q, k, v, opts)
    if sinks is None:
        out = _attention(q, k, v, opts)
    else:
        heads = _bhnd(q.shape, opts.layout)[1]
        if tuple(sinks.shape) != (heads,) or not jnp.issubdtype(sinks.dtype, jnp.floating):
            raise ValueError(f"sinks: expected one floating logit per query head, shape ({heads},), got shape "
                             f"{tuple(sinks.shape)} of {sinks.dtype}")
        out = _sink_attention(q, k, v, sinks, opts)
    return out


def _check_arrays(**arrays) -> None:
    """Each array argument is a JAX array (traced ones included): TypeError naming the argument and
    saying what came (a NumPy array, a torch tensor, a list...)."""
    for name, x in arrays.items():
        if not isinstance(x, jax.Array):
            hint = "; convert it with jnp.asarray" if framework_of(x) else ""
            raise TypeError(f"{name}: expected a jax.Array, got {what_came(x)}{hint}")


def _platform(x) -> str:
    try:
        return next(iter(x.devices())).platform  # a concrete array
    except Exception:  # noqa: BLE001 - a tracer has no devices: the default backend compiles it
        return jax.default_backend()


def _check(q, k, v, opts: AttentionOptions) -> None:
    """The library's own checks (make_problem), on stand-ins with the arrays' shapes and dtypes."""
    device = "cpu" if _platform(q) == "cpu" else "cuda"

    def stand_in(x):
        shape = tuple(int(s) for s in x.shape)
        return ArrayDesc(0, shape, contiguous_strides(shape), str(x.dtype), device, 0, None, "jax")

    make_problem(stand_in(q), stand_in(k), stand_in(v), opts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attention(q, k, v, opts):
    return _forward(q, k, v, opts, False)[0]


def _attention_fwd(q, k, v, opts):
    out, *state = _forward(q, k, v, opts, True)  # state: lse2 (and μ_K with K-smoothing)
    return out, (q, k, v, out, *state)


def _attention_bwd(opts, residuals, dout):
    return tuple(_backward(opts, *residuals, dout))


_attention.defvjp(_attention_fwd, _attention_bwd)


# Attention sinks around the kernels (sagebwd_cp/sinks.py, its arithmetic in jax.numpy): the forward's
# output and LSEs joined with the sinks, the kernels' backward run with them, and the sinks' gradient.
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _sink_attention(q, k, v, sinks, opts):
    return _sink_forward(q, k, v, sinks, opts)[0]


def _sink_forward(q, k, v, sinks, opts):
    out, lse2, *rest = _forward(q, k, v, opts, True, return_lse=True)  # rest: (μ_K,) and the natural LSE
    *mean, lse = rest
    out, lse, lse2 = join_sinks(out, lse, lse2, sinks, opts.layout)
    return out, lse, lse2, mean


def _sink_attention_fwd(q, k, v, sinks, opts):
    out, lse, lse2, mean = _sink_forward(q, k, v, sinks, opts)
    return out, (q, k, v, sinks, out, lse, lse2, *mean)


def _sink_attention_bwd(opts, residuals, dout):
    q, k, v, sinks, out, lse, lse2, *mean = residuals
    return tuple(_backward(opts, q, k, v, out, lse2, *mean, dout)) + (sinks_grad(out, lse, dout, sinks, opts.layout),)


_sink_attention.defvjp(_sink_attention_fwd, _sink_attention_bwd)


# ------------------------------------------------------------------------------ the callbacks

def _bhnd(shape, layout: str) -> tuple:
    b, x, y, d = shape
    return (b, x, y, d) if layout == "HND" else (b, y, x, d)


def _forward(q, k, v, opts: AttentionOptions, training: bool, return_lse: bool = False):
    """(out,), with ``training`` also the base-2 LSE and μ_K (with K-smoothing), with ``return_lse`` last
    the natural-log LSE (B, Hq, Lq)."""
    b, hq, lq, d = _bhnd(q.shape, opts.layout)
    hkv = _bhnd(k.shape, opts.layout)[1]
    results = [jax.ShapeDtypeStruct(q.shape[:-1] + v.shape[-1:], q.dtype)]  # O: V's head dim
    if training:
        results.append(jax.ShapeDtypeStruct((b, hq, lq), jnp.float32))  # base-2 LSE
        if opts.smooth_k:
            results.append(jax.ShapeDtypeStruct(k_mean_shape(b, hkv, d), jnp.float32))
    if return_lse:
        results.append(jax.ShapeDtypeStruct((b, hq, lq), jnp.float32))
    return buffer_callback(_bound(_forward_callback, opts, (training, return_lse)), tuple(results))(q, k, v)


def _backward(opts: AttentionOptions, q, k, v, out, lse2, *rest):
    results = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    return buffer_callback(_bound(_backward_callback, opts, None), results)(q, k, v, out, lse2, *rest)


@functools.lru_cache(maxsize=None)
def _bound(fn, opts: AttentionOptions, training):
    # The callable is a parameter of the primitive: the same one for the same options lets eager
    # calls (compiled once per parameters) and jit caches hit.
    return functools.partial(fn, opts=opts, training=training)


_streams: dict = {}  # (XLA stream handle, device) -> its CuPy wrapper, made once


class _OnStream:
    """Makes XLA's stream CuPy's current one on the buffers' device: the library launches on, and
    allocates its outputs and workspaces for, CuPy's current stream."""

    def __init__(self, ctx, device_id: int):
        import cupy

        self.device = cupy.cuda.Device(device_id)
        key = (ctx.stream, device_id)
        self.stream = _streams.get(key)
        if self.stream is None:
            self.stream = _streams[key] = cupy.cuda.ExternalStream(*key)

    def __enter__(self):
        self.device.__enter__()
        self.stream.__enter__()
        return self.stream.ptr

    def __exit__(self, *exc):
        self.stream.__exit__(*exc)
        self.device.__exit__(*exc)


_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}


def _copy_into(buffer, array, stream: int) -> None:
    """Device-to-device copy of a contiguous array of the library into an XLA buffer, on XLA's stream."""
    import cupy

    dst, src = describe(buffer, "result"), describe(array, "result")
    nbytes = math.prod(dst.shape) * _ITEMSIZE[dst.dtype]
    cupy.cuda.runtime.memcpyAsync(dst.ptr, src.ptr, nbytes, cupy.cuda.runtime.memcpyDeviceToDevice, stream)


def _describe(buffers, names):
    return [describe(x, n) if x is not None else None for x, n in zip(buffers, names)]


def _forward_callback(ctx, results, q, k, v, *, opts: AttentionOptions, training: tuple):
    training, return_lse = training

    def extras(lse, state):  # what results[1:] hold: the saved state (None: no μ_K), then the LSE
        return [a for a in (tuple(state) if training else ()) if a is not None] + ([lse] if return_lse else [])

    dev_type, dev = q.__dlpack_device__()
    if dev_type != KDL_CUDA:  # the emulator, on host buffers
        o, lse, state = run_forward(*_describe((q, k, v), "qkv"), opts, training=training, return_lse=return_lse)
        for buffer, array in zip(results, [o] + extras(lse, state)):
            np.asarray(buffer)[...] = array
        return
    with _OnStream(ctx, dev) as stream:  # described inside: the DLPack handshake reads the stream
        out = describe(results[0], "out")  # the kernels write O in place
        _, lse, state = run_forward(*_describe((q, k, v), "qkv"), opts, out=out, training=training,
                                    return_lse=return_lse)
        for buffer, array in zip(results[1:], extras(lse, state)):
            _copy_into(buffer, array, stream)


def _backward_callback(ctx, results, q, k, v, out, lse2, *rest, opts: AttentionOptions, training=None):
    *k_mean, do = rest
    buffers, names = (q, k, v, out, lse2, do, k_mean[0] if k_mean else None), ("q", "k", "v", "out", "lse2", "do",
                                                                               "k_mean")
    dev_type, dev = q.__dlpack_device__()
    if dev_type != KDL_CUDA:
        *arrays, km = _describe(buffers, names)
        for buffer, g in zip(results, run_backward(*arrays, opts, k_mean=km)):
            np.asarray(buffer)[...] = g
        return
    with _OnStream(ctx, dev) as stream:
        *arrays, km = _describe(buffers, names)
        for buffer, g in zip(results, run_backward(*arrays, opts, k_mean=km)):
            _copy_into(buffer, g, stream)
