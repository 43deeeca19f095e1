"""A value head dim that differs from the query/key one (multi-head latent attention, 192/128) on the CPU:
every entry point (neutral inference, training and backward-from-arrays, dense and packed; torch's
functional, flash_attn and SDPA drop-ins with autograd; JAX with jax.grad) against exact attention, and
bit for bit against the same call with the narrower side zero-padded by hand (what value_head_dim.py
defines it to be). The GPU takes V at its own head dim, against the same padded call
(tests/test_gpu_wide_head_dims.py)."""
import math

import numpy as np
import pytest

import sagebwd_cp
from sagebwd_cp.host import reference

# (Q·K head dim, V head dim): V narrower, as MLA's 192/128, and wider.
DIMS = [(48, 32), (32, 48)]


def _inputs(dqk, dv, seed=0, lq=70, lk=90, hq=4, hk=2, dtype=np.float16):
    rng = np.random.default_rng(seed)
    shapes = ((1, hq, lq, dqk), (1, hk, lk, dqk), (1, hk, lk, dv), (1, hq, lq, dv))
    return tuple(rng.standard_normal(s).astype(dtype) for s in shapes)


def _pad(x, d):
    return np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, d - x.shape[-1])])


def _rel(x, ref):
    return float(np.linalg.norm(np.asarray(x, np.float64) - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("dqk,dv", DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_neutral_forward_and_backward(dqk, dv, causal):
    q, k, v, do = _inputs(dqk, dv, seed=dqk + causal)
    d, scale = max(dqk, dv), 1.0 / math.sqrt(dqk)
    o_ref, _ = reference.attention_reference(q, k, v, causal=causal)
    g_ref = reference.attention_reference_backward(q, k, v, do, causal=causal)

    out = sagebwd_cp.attention(q, k, v, causal=causal)
    assert out.shape == q.shape[:3] + (dv,)
    assert _rel(out, o_ref) < 0.03
    by_hand = sagebwd_cp.attention(_pad(q, d), _pad(k, d), _pad(v, d), causal=causal, softmax_scale=scale)
    np.testing.assert_array_equal(out, by_hand[..., :dv])

    o, saved = sagebwd_cp.attention_forward(q, k, v, causal=causal)
    np.testing.assert_array_equal(o, out)
    grads = sagebwd_cp.attention_backward(saved, do)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    for g, r in zip(grads, g_ref):
        assert _rel(g, r) < 0.06
    _, saved_hand = sagebwd_cp.attention_forward(_pad(q, d), _pad(k, d), _pad(v, d), causal=causal,
                                                 softmax_scale=scale)
    for g, h, x in zip(grads, sagebwd_cp.attention_backward(saved_hand, _pad(do, d)), (q, k, v)):
        np.testing.assert_array_equal(g, h[..., :x.shape[-1]])

    o, lse, saved = sagebwd_cp.attention_forward(q, k, v, causal=causal, return_lse=True)
    from_arrays = sagebwd_cp.attention_backward_arrays(q, k, v, o, saved.lse2.obj, do, causal=causal)
    for g, h in zip(from_arrays, grads):
        np.testing.assert_array_equal(g, h)

    buffer = np.full(out.shape, np.nan, out.dtype)  # poisoned: every element must be written
    assert sagebwd_cp.attention(q, k, v, causal=causal, out=buffer) is buffer
    np.testing.assert_array_equal(buffer, out)


@pytest.mark.parametrize("dqk,dv", DIMS)
def test_neutral_packed_batches(dqk, dv):
    """Two sequences packed: each as its own dense call."""
    rng = np.random.default_rng(5)
    lens = (37, 61)
    q, k = (rng.standard_normal((sum(lens), h, dqk)).astype(np.float16) for h in (4, 2))
    v = rng.standard_normal((sum(lens), 2, dv)).astype(np.float16)
    do = rng.standard_normal((sum(lens), 4, dv)).astype(np.float16)
    cu = np.array([0, lens[0], sum(lens)], np.int32)
    out, saved = sagebwd_cp.attention_varlen_forward(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    grads = sagebwd_cp.attention_backward(saved, do)
    assert out.shape == (sum(lens), 4, dv) and [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    for s in range(2):
        rows = slice(cu[s], cu[s + 1])
        dense = lambda x: x[rows].transpose(1, 0, 2)[None]  # noqa: E731
        o1, saved1 = sagebwd_cp.attention_forward(dense(q), dense(k), dense(v), causal=True)
        np.testing.assert_array_equal(dense(out), o1)
        for g, g1 in zip(grads, sagebwd_cp.attention_backward(saved1, dense(do))):
            np.testing.assert_array_equal(dense(g), g1)


def test_a_value_head_dim_out_of_range_is_refused_by_name():
    q, k, _, _ = _inputs(64, 64)
    with pytest.raises(ValueError, match=r"v: expected a head_dim that is a multiple of 8 between 8 and q's and k's "
                                         r"\(64\), got 20"):
        sagebwd_cp.attention(q, k, np.zeros(k.shape[:3] + (20,), np.float16))
    with pytest.raises(ValueError, match=r"v: expected a head_dim that is a multiple of 8 between 8 and 256, got 264"):
        sagebwd_cp.attention(q, k, np.zeros(k.shape[:3] + (264,), np.float16))


def test_the_problem_takes_a_narrower_v_and_refuses_a_wider_one():
    """The problem (below the array functions, which widen Q and K for a wider V) takes V's head dim up to Q·K's
    as value_dim, and names V for a wider one."""
    from sagebwd_cp.arrays import describe
    from sagebwd_cp.options import AttentionOptions
    from sagebwd_cp.problem import make_problem

    q, k, v, _ = _inputs(192, 128)
    prob = make_problem(q, k, v, AttentionOptions())
    assert (prob.head_dim, prob.value_dim) == (192, 128) and prob.output_shape() == q.shape[:3] + (128,)
    with pytest.raises(ValueError, match=r"v: expected a head_dim .* between 8 and q's and k's \(128\), got 192 "
                                         r"\(a wider V"):
        wide_q, wide_k, wide_v, _ = _inputs(128, 192)
        make_problem(describe(wide_q, "q"), describe(wide_k, "k"), describe(wide_v, "v"), AttentionOptions())


@pytest.mark.parametrize("dqk,dv", DIMS)
def test_torch_entry_points_with_autograd(dqk, dv):
    torch = pytest.importorskip("torch")
    import sagebwd_cp.torch as sage

    q, k, v, do = (torch.from_numpy(x.astype(np.float32)) for x in _inputs(dqk, dv, seed=3))
    g_ref = reference.attention_reference_backward(q.numpy(), k.numpy(), v.numpy(), do.numpy(), causal=True)
    o_ref, _ = reference.attention_reference(q.numpy(), k.numpy(), v.numpy(), causal=True)
    results = {}
    for name in ("attention", "flash_attn_func", "sdpa"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        if name == "attention":
            out = sage.attention(*leaves, causal=True)
        elif name == "flash_attn_func":  # (B, N, H, D); bottom-right causal
            out = sage.flash_attn_func(*(x.transpose(1, 2) for x in leaves), causal=True).transpose(1, 2)
        else:  # SDPA's top-left causal differs from bottom-right when Lq != Lk: the keys cut to Lq
            lq = q.shape[2]
            out = sage.scaled_dot_product_attention(leaves[0], leaves[1][:, :, :lq], leaves[2][:, :, :lq],
                                                    is_causal=True, enable_gqa=True)
            want = torch.nn.functional.scaled_dot_product_attention(
                q.double(), k[:, :, :lq].double(), v[:, :, :lq].double(), is_causal=True, enable_gqa=True)
            assert out.shape == want.shape and _rel(out.detach(), want.numpy()) < 0.03
            continue
        out.backward(do)
        assert out.shape == q.shape[:3] + (dv,)
        assert _rel(out.detach(), o_ref) < 0.03
        for x, r in zip(leaves, g_ref):
            assert x.grad.shape == x.shape and _rel(x.grad, r) < 0.06
        results[name] = (out.detach(),) + tuple(x.grad for x in leaves)
    for a, b in zip(results["attention"], results["flash_attn_func"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_torch_packed_batches():
    torch = pytest.importorskip("torch")
    import sagebwd_cp.torch as sage

    rng = np.random.default_rng(7)
    lens = (29, 50)
    q, k = (torch.from_numpy(rng.standard_normal((sum(lens), h, 48)).astype(np.float32)) for h in (4, 2))
    v = torch.from_numpy(rng.standard_normal((sum(lens), 2, 32)).astype(np.float32))
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = sage.flash_attn_varlen_func(*leaves, cu, cu, max(lens), max(lens), causal=True)
    assert out.shape == (sum(lens), 4, 32)
    out.square().sum().backward()
    for s in range(2):
        rows = slice(int(cu[s]), int(cu[s + 1]))
        dense = [x[rows].detach().clone().requires_grad_() for x in (q, k, v)]
        o1 = sage.flash_attn_func(*(x[None] for x in dense), causal=True)[0]
        o1.square().sum().backward()
        torch.testing.assert_close(out[rows].detach(), o1.detach(), rtol=0, atol=0)
        for x, x1 in zip(leaves, dense):
            torch.testing.assert_close(x.grad[rows], x1.grad, rtol=0, atol=0)


def test_jax_with_grad():
    """On JAX's default backend: float32 on the CPU (the emulator), bfloat16 where it is a GPU (the kernels
    take 16-bit arrays; traced arrays run where the default backend puts them)."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    import sagebwd_cp.jax as sjax

    dtype = np.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    q, k, v, do = (jnp.asarray(x.astype(np.float32)).astype(dtype) for x in _inputs(48, 32, seed=9))
    exact = [np.asarray(x, np.float32) for x in (q, k, v, do)]  # the values the library sees
    o_ref, _ = reference.attention_reference(*exact[:3], causal=True)
    g_ref = reference.attention_reference_backward(*exact, causal=True)
    out = sjax.attention(q, k, v, causal=True)
    assert out.shape == q.shape[:3] + (32,) and _rel(out, o_ref) < 0.03
    grads = jax.grad(lambda q, k, v: jnp.sum(sjax.attention(q, k, v, causal=True) * do), argnums=(0, 1, 2))(q, k, v)
    for g, x, r in zip(grads, (q, k, v), g_ref):
        assert g.shape == x.shape and _rel(g, r) < 0.06
