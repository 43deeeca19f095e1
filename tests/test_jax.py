"""JAX: arrays through the neutral API and ``sagebwd_cp.jax`` (a ``jax.custom_vjp``), against
``jax.nn.dot_product_attention`` on a GPU and against the emulator on JAX's CPU backend.

Each group skips, with the reason, where JAX, its CPU backend or a GPU is missing."""
import functools
import importlib
import os
import sys

import numpy as np
import pytest

import sagebwd_cp
from sagebwd_cp.host import emulator, reference

from gpu_helpers import cos_sim, rel_l2


def test_import_without_jax_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "jax", None)  # as if JAX were not installed
    monkeypatch.delitem(sys.modules, "sagebwd_cp.jax", raising=False)
    with pytest.raises(ImportError, match=r'sagebwd_cp.jax needs JAX: pip install "sagebwd_cp\[jax\]"'):
        importlib.import_module("sagebwd_cp.jax")


# JAX takes 75% of the GPU at its first use unless told otherwise: the torch and CuPy tests of the same
# session (or parallel workers) would then run out of memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


@functools.lru_cache(maxsize=None)
def _missing(platform: str):
    """None when JAX runs on ``platform`` ("cpu" or "gpu"), else why not."""
    try:
        import jax
    except ImportError as exc:
        return f'JAX is not installed (pip install "sagebwd_cp[jax]"): {exc}'
    try:
        jax.devices(platform)
    except RuntimeError as exc:
        return f"JAX has no {platform} backend: {exc}"
    try:
        import sagebwd_cp.jax  # noqa: F401
    except ImportError as exc:
        return str(exc)
    return None


def _jax_on(platform: str):
    """A fixture giving the jax module where JAX runs on ``platform``, else skipping with the reason."""
    @pytest.fixture
    def fixture():
        reason = _missing(platform)
        if reason:
            pytest.skip(reason)
        import jax

        return jax

    return fixture


jax_cpu, jax_gpu = _jax_on("cpu"), _jax_on("gpu")


def _qkv(jax, shape_q, shape_kv, dtype, seed, device):
    keys = jax.random.split(jax.random.key(seed), 3)
    return tuple(jax.device_put(jax.random.normal(key, s, jax.numpy.float32).astype(dtype), device)
                 for key, s in zip(keys, (shape_q, shape_kv, shape_kv)))


# ------------------------------------------------------------------------------ CPU: the emulator


def test_cpu_backend_runs_the_emulator(jax_cpu):
    """JAX CPU arrays: the neutral API returns JAX arrays equal to the emulator's, and the adapter
    under jax.jit and jax.grad gives the same bits as the neutral forward and backward."""
    jax, jnp = jax_cpu, jax_cpu.numpy
    import sagebwd_cp.jax as sj

    cpu = jax.devices("cpu")[0]
    q, k, v = _qkv(jax, (1, 4, 70, 64), (1, 2, 90, 64), jnp.float16, 0, cpu)
    do = _qkv(jax, (1, 4, 70, 64), (1, 1, 1, 64), jnp.float16, 1, cpu)[0]
    host = [np.asarray(x) for x in (q, k, v, do)]

    out = sagebwd_cp.attention(q, k, v, causal=True)
    assert isinstance(out, jax.Array) and out.dtype == jnp.float16 and out.devices() == {cpu}
    np.testing.assert_array_equal(np.asarray(out), emulator.emulate_forward(*host[:3], causal=True)[0]
                                  .astype(np.float16))
    o, saved = sagebwd_cp.attention_forward(q, k, v, causal=True)
    assert isinstance(saved.lse2.obj, jax.Array) and isinstance(saved.k_mean.obj, jax.Array)
    grads = sagebwd_cp.attention_backward(saved, do)
    assert all(isinstance(g, jax.Array) for g in grads)
    again = sagebwd_cp.attention_backward_arrays(q, k, v, o, saved.lse2.obj, do, causal=True, k_mean=saved.k_mean.obj)
    for g, a in zip(grads, again):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(g))

    def loss(q, k, v):
        return jnp.sum(sj.attention(q, k, v, causal=True).astype(jnp.float32) * do.astype(jnp.float32))

    out_jit = jax.jit(lambda q, k, v: sj.attention(q, k, v, causal=True))(q, k, v)
    grads_jit = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    np.testing.assert_array_equal(np.asarray(out_jit), np.asarray(o))
    ref = reference.attention_reference_backward(*(x.astype(np.float64) for x in host), causal=True)
    for name, g, gj, r in zip(("dq", "dk", "dv"), grads, grads_jit, ref):
        assert gj.dtype == jnp.float16 and gj.shape == g.shape
        np.testing.assert_array_equal(np.asarray(gj), np.asarray(g), err_msg=name)
        assert rel_l2(np.asarray(g, np.float64), r) < 0.03, name


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_the_adapter_takes_a_sliding_window(platform, request):
    """``window_size`` under jax.jit and jax.grad: the same bits as the neutral API's call with the window,
    within the algorithm's error of the FP64 reference, and not what the call without it gives."""
    jax = request.getfixturevalue(f"jax_{platform}")
    jnp = jax.numpy
    import sagebwd_cp.jax as sj

    device = jax.devices(platform)[0]
    q, k, v = _qkv(jax, (1, 4, 300, 64), (1, 2, 300, 64), jnp.float16, 7, device)
    do = _qkv(jax, (1, 4, 300, 64), (1, 1, 1, 64), jnp.float16, 8, device)[0]
    window = (50, 0)

    @jax.jit
    def forward_backward(q, k, v):
        out, vjp = jax.vjp(lambda q, k, v: sj.attention(q, k, v, causal=True, window_size=window), q, k, v)
        return (out,) + vjp(do)

    result = forward_backward(q, k, v)
    o, saved = sagebwd_cp.attention_forward(q, k, v, causal=True, window_size=window)
    for x, y in zip(result, (o,) + tuple(sagebwd_cp.attention_backward(saved, do))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    host = [np.asarray(x, np.float64) for x in (q, k, v, do)]
    o_ref, _ = reference.attention_reference(*host[:3], causal=True, window=window)
    refs = reference.attention_reference_backward(*host, causal=True, window=window)
    for x, r in zip(result, (o_ref,) + tuple(refs)):
        assert rel_l2(np.asarray(x, np.float64), r) < 0.06
    assert rel_l2(np.asarray(sj.attention(q, k, v, causal=True), np.float64), o_ref) > 0.1


def test_errors_name_the_argument(jax_cpu):
    jax, jnp = jax_cpu, jax_cpu.numpy
    import sagebwd_cp.jax as sj

    q = jnp.zeros((1, 2, 16, 64), jnp.float16, device=jax.devices("cpu")[0])
    with pytest.raises(TypeError, match=r"q: got a traced JAX array .* use sagebwd_cp.jax.attention"):
        jax.jit(lambda x: sagebwd_cp.attention(x, x, x))(q)
    with pytest.raises(ValueError, match=r"out: JAX arrays are immutable"):
        sagebwd_cp.attention(q, q, q, out=q)
    with pytest.raises(ValueError, match=r"head_dim: expected a multiple of 8 between 8 and 256, got 60"):
        jax.jit(lambda x: sj.attention(x, x, x))(q[..., :60])
    with pytest.raises(ValueError, match=r"heads: expected the query heads \(2\) to be a multiple"):
        sj.attention(q, q[:, :1].repeat(3, axis=1), q[:, :1].repeat(3, axis=1))
    with pytest.raises(ValueError, match=r"layout: expected one of \('HND', 'NHD'\), got 'BHSD'"):
        sj.attention(q, q, q, layout="BHSD")
    with pytest.raises(ValueError, match=r"granularity: expected one of \('fine', 'paper'\), got 'coarse'"):
        sj.attention(q, q, q, granularity="coarse")


def test_adapter_and_neutral_api_take_jax_arrays_only_among_jax_arrays(jax_cpu):
    """sagebwd_cp.jax takes JAX arrays only; the neutral API refuses a mix of JAX and NumPy arrays."""
    jax, jnp = jax_cpu, jax_cpu.numpy
    import sagebwd_cp.jax as sj

    q = jnp.zeros((1, 2, 16, 64), jnp.float16, device=jax.devices("cpu")[0])
    host = np.zeros((1, 2, 16, 64), np.float16)
    for bad, came in ((host, r"a NumPy float16 array of shape \(1, 2, 16, 64\); convert it with jnp.asarray"),
                      ([[1.0]], r"list \[\[1\.0\]\]"), (None, "None"), (2.0, "float 2.0"), ("k", "str 'k'")):
        for name, args in (("q", (bad, q, q)), ("k", (q, bad, q)), ("v", (q, q, bad))):
            with pytest.raises(TypeError, match=rf"^{name}: expected a jax\.Array, got {came}"):
                sj.attention(*args)
    with pytest.raises(TypeError, match=r"^k: expected a JAX array like q, got a NumPy float16 array"):
        sagebwd_cp.attention(q, host, q)


# ------------------------------------------------------------------------------ GPU


def _reference(jax, q, k, v, do, causal, layout):
    """jax.nn.dot_product_attention in float32 (NHD is its layout): (out, dq, dk, dv)."""
    jnp = jax.numpy
    to = (lambda x: x) if layout == "NHD" else (lambda x: jnp.swapaxes(x, 1, 2))

    def f(q, k, v):
        return to(jax.nn.dot_product_attention(to(q), to(k), to(v), is_causal=causal, implementation="xla"))

    with jax.default_matmul_precision("highest"):
        out, vjp = jax.vjp(f, *(x.astype(jnp.float32) for x in (q, k, v)))
        return (out,) + vjp(do.astype(jnp.float32))


def _assert_close(x, ref, name, cos_min=0.99, rel_max=0.05):
    """The bounds tests/test_gpu_torch.py holds the PyTorch adapter to against SDPA."""
    a, r = np.asarray(x, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(a).all(), f"{name}: non-finite values"
    assert cos_sim(a, r) > cos_min, f"{name}: cos sim {cos_sim(a, r)}"
    assert rel_l2(a, r) < rel_max, f"{name}: rel-L2 {rel_l2(a, r)}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_neutral_api_takes_and_returns_jax_gpu_arrays(jax_gpu, dtype):
    """The shape that once failed inside JAX with CUDA_ERROR_INVALID_HANDLE; outputs are JAX arrays
    over the memory the kernels wrote (no copy), and the adapter under jax.jit gives the same bits."""
    jax, jnp = jax_gpu, jax_gpu.numpy
    import sagebwd_cp.jax as sj

    gpu = jax.devices("gpu")[0]
    q, k, v = _qkv(jax, (2, 4, 1000, 128), (2, 4, 1000, 128), dtype, 1, gpu)
    do = _qkv(jax, (2, 4, 1000, 128), (1, 1, 1, 128), dtype, 2, gpu)[0]
    ref = _reference(jax, q, k, v, do, True, "HND")

    out = sagebwd_cp.attention(q, k, v, causal=True)
    assert isinstance(out, jax.Array) and out.dtype == dtype and out.shape == q.shape and out.devices() == {gpu}
    _assert_close(out, ref[0], "out")
    o, saved = sagebwd_cp.attention_forward(q, k, v, causal=True)
    assert saved.out.obj is o and saved.out.ptr == o.unsafe_buffer_pointer()  # JAX reads the kernels' memory
    assert isinstance(saved.lse2.obj, jax.Array) and saved.lse2.obj.dtype == jnp.float32
    grads = sagebwd_cp.attention_backward(saved, do, deterministic=True)
    for name, x, r in zip(("dq", "dk", "dv"), grads, ref[1:]):
        assert isinstance(x, jax.Array) and x.dtype == dtype
        _assert_close(x, r, name)
    again = sagebwd_cp.attention_backward_arrays(q, k, v, o, saved.lse2.obj, do, causal=True, deterministic=True,
                                                 k_mean=saved.k_mean.obj)

    def loss(q, k, v):
        return jnp.sum(sj.attention(q, k, v, causal=True, deterministic=True).astype(jnp.float32)
                       * do.astype(jnp.float32))

    out_jit = jax.jit(lambda q, k, v: sj.attention(q, k, v, causal=True))(q, k, v)
    grads_jit = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    np.testing.assert_array_equal(np.asarray(out_jit), np.asarray(out))
    for name, g, a, gj in zip(("dq", "dk", "dv"), grads, again, grads_jit):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(g), err_msg=name)
        np.testing.assert_array_equal(np.asarray(gj), np.asarray(g), err_msg=name)


@pytest.mark.gpu
def test_stream_handshake_with_late_inputs_and_early_consumers(jax_gpu):
    """Inputs still being computed by JAX when the call is made, kernels on a non-blocking CuPy
    stream, and a JAX consumer queued at once on the outputs: equal to the same call made after
    everything has finished."""
    jax, jnp = jax_gpu, jax_gpu.numpy
    import cupy

    gpu = jax.devices("gpu")[0]
    w = jax.device_put(jnp.eye(4096, dtype=jnp.float32) * 1.0001, gpu)
    seed = _qkv(jax, (1, 8, 2048, 128), (1, 8, 2048, 128), jnp.float32, 3, gpu)

    @jax.jit
    def slow_inputs(w, *xs):  # many chained products: the inputs land late
        m = w
        for _ in range(40):
            m = jnp.tanh(m @ w) * 1.0001
        return tuple((x + jnp.sum(m) * 1e-9).astype(jnp.bfloat16) for x in xs)

    def run():
        q, k, v = slow_inputs(w, *seed)
        with cupy.cuda.Stream(non_blocking=True):
            out, saved = sagebwd_cp.attention_forward(q, k, v, causal=True)
            dq, dk, dv = sagebwd_cp.attention_backward(saved, out, deterministic=True)
        return [jnp.sum(x.astype(jnp.float32), axis=(2, 3)) for x in (out, dq, dk, dv)]  # queued at once

    early = [np.asarray(x) for x in run()]
    jax.block_until_ready(seed)
    q, k, v = jax.block_until_ready(slow_inputs(w, *seed))
    out, saved = sagebwd_cp.attention_forward(q, k, v, causal=True)
    late = [out, *sagebwd_cp.attention_backward(saved, out, deterministic=True)]
    cupy.cuda.Device(0).synchronize()
    for name, e, x in zip(("out", "dq", "dk", "dv"), early, late):
        np.testing.assert_array_equal(e, np.asarray(jnp.sum(x.astype(jnp.float32), axis=(2, 3))), err_msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("hq,hk", [(4, 4), (8, 2)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,layout", [(17, "NHD"), (1000, "HND"), (1000, "NHD")])
def test_adapter_matches_dot_product_attention(jax_gpu, n, layout, causal, hq, hk, dtype):
    jax, jnp = jax_gpu, jax_gpu.numpy
    import sagebwd_cp.jax as sj

    b, d = 2, 64
    shape = (lambda h: (b, h, n, d)) if layout == "HND" else (lambda h: (b, n, h, d))
    gpu = jax.devices("gpu")[0]
    q, k, v = _qkv(jax, shape(hq), shape(hk), dtype, 4, gpu)
    do = _qkv(jax, shape(hq), shape(1), dtype, 5, gpu)[0]

    @jax.jit
    def forward_backward(q, k, v):
        out, vjp = jax.vjp(lambda q, k, v: sj.attention(q, k, v, causal=causal, layout=layout), q, k, v)
        return (out,) + vjp(do)

    result = forward_backward(q, k, v)
    for name, x, like, r in zip(("out", "dq", "dk", "dv"), result, (q, q, k, v),
                                _reference(jax, q, k, v, do, causal, layout)):
        assert x.dtype == dtype and x.shape == like.shape
        _assert_close(x, r, name)


def _transformer(jax, attention):
    """A 2-block byte-level causal transformer with GQA (4 query heads, 2 key/value heads), its
    attention computed in bfloat16 by ``attention(q, k, v)`` on (B, N, H, D) arrays."""
    jnp = jax.numpy
    d_model, heads, kv_heads, head_dim, vocab = 256, 4, 2, 64, 256

    def init(key):
        keys = iter(jax.random.split(key, 16))
        dense = lambda i, o: jax.random.normal(next(keys), (i, o), jnp.float32) / np.sqrt(i)
        blocks = [{"qkv": dense(d_model, (heads + 2 * kv_heads) * head_dim), "proj": dense(heads * head_dim, d_model),
                   "up": dense(d_model, 4 * d_model), "down": dense(4 * d_model, d_model)} for _ in range(2)]
        return {"embed": jax.random.normal(next(keys), (vocab, d_model), jnp.float32) * 0.5, "blocks": blocks}

    def norm(x):
        return (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)

    def loss(params, tokens):
        x = params["embed"][tokens[:, :-1]]
        b, n = x.shape[:2]
        for p in params["blocks"]:
            qkv = (norm(x) @ p["qkv"]).reshape(b, n, heads + 2 * kv_heads, head_dim)
            q, k, v = jnp.split(qkv.astype(jnp.bfloat16), [heads, heads + kv_heads], axis=2)
            x = x + attention(q, k, v).astype(jnp.float32).reshape(b, n, -1) @ p["proj"]
            x = x + jax.nn.gelu(norm(x) @ p["up"]) @ p["down"]
        logits = norm(x) @ params["embed"].T
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))

    return init, loss


@pytest.mark.gpu
def test_jitted_training_step_matches_dot_product_attention(jax_gpu):
    """A jax.jit-ed SGD step of a small GQA transformer: its gradients match the same model's with
    jax.nn.dot_product_attention, and a few steps lower the loss."""
    jax, jnp = jax_gpu, jax_gpu.numpy
    import sagebwd_cp.jax as sj

    init, loss_sage = _transformer(jax, lambda q, k, v: sj.attention(q, k, v, causal=True, layout="NHD"))
    _, loss_ref = _transformer(jax, lambda q, k, v: jax.nn.dot_product_attention(
        q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), is_causal=True))
    gpu = jax.devices("gpu")[0]
    params = jax.device_put(init(jax.random.key(0)), gpu)
    text = np.frombuffer((sagebwd_cp.__doc__ * 40).encode()[: 4 * 513], np.uint8).reshape(4, 513)
    tokens = jax.device_put(jnp.asarray(text, jnp.int32), gpu)

    @jax.jit
    def step(params, tokens):
        loss, grads = jax.value_and_grad(loss_sage)(params, tokens)
        return loss, grads, jax.tree.map(lambda p, g: p - 0.05 * g, params, grads)

    loss, grads, _ = step(params, tokens)
    with jax.default_matmul_precision("highest"):
        loss_r, grads_r = jax.jit(jax.value_and_grad(loss_ref))(params, tokens)
    assert abs(float(loss) - float(loss_r)) < 0.01 * float(loss_r)
    leaves, leaves_r = jax.tree.leaves(grads), jax.tree.leaves(grads_r)
    assert len(leaves) == 9
    for i, (g, r) in enumerate(zip(leaves, leaves_r)):
        _assert_close(g, r, f"grad {i}")
    losses = []
    for _ in range(5):
        loss, _, params = step(params, tokens)
        losses.append(float(loss))
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_the_adapter_takes_attention_sinks(platform, request):
    """``sinks`` under jax.jit and jax.grad: output and gradients (the sinks' included) within the
    algorithm's error of the FP64 reference with sinks, and not what the call without them gives."""
    jax = request.getfixturevalue(f"jax_{platform}")
    jnp = jax.numpy
    import sagebwd_cp.jax as sj

    device = jax.devices(platform)[0]
    q, k, v = _qkv(jax, (1, 200, 4, 64), (1, 200, 2, 64), jnp.bfloat16 if platform == "gpu" else jnp.float16, 9,
                   device)
    do = _qkv(jax, (1, 200, 4, 64), (1, 1, 1, 64), q.dtype, 10, device)[0]
    sinks = jax.device_put(2 * jax.random.normal(jax.random.key(11), (4,), jnp.float32), device)
    opts = dict(causal=True, layout="NHD", window_size=(60, 0))

    @jax.jit
    def forward_backward(q, k, v, sinks):
        out, vjp = jax.vjp(lambda q, k, v, s: sj.attention(q, k, v, sinks=s, **opts), q, k, v, sinks)
        return (out,) + vjp(do)

    result = forward_backward(q, k, v, sinks)
    assert result[4].dtype == jnp.float32 and result[4].shape == (4,)
    to = lambda x: np.swapaxes(np.asarray(x, np.float64), 1, 2)  # noqa: E731 (NHD to HND)
    host = [to(x) for x in (q, k, v, do)]
    s64 = np.asarray(sinks, np.float64)
    o_ref, _ = reference.attention_reference(*host[:3], causal=True, window=(60, 0), sinks=s64)
    refs = reference.attention_reference_backward(*host, causal=True, window=(60, 0), sinks=s64)
    for x, r in zip(result[:4], (o_ref,) + tuple(refs[:3])):
        assert rel_l2(to(x), r) < 0.06
    assert rel_l2(np.asarray(result[4], np.float64), refs[3]) < 0.06
    assert rel_l2(to(sj.attention(q, k, v, **opts)), o_ref) > 0.05
    with pytest.raises(ValueError, match=r"sinks: expected one floating logit per query head, shape \(4,\)"):
        sj.attention(q, k, v, sinks=sinks[:2], **opts)
