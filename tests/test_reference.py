"""The float64 reference: gradients against finite differences, masking, softmax invariance, GQA."""
import math

import numpy as np
import pytest

from sagebwd_cp.host.reference import attention_reference, attention_reference_backward


def _inputs(seed, b=1, hq=2, hkv=1, lq=5, lk=7, d=4):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, hq, lq, d))
    k = rng.standard_normal((b, hkv, lk, d))
    v = rng.standard_normal((b, hkv, lk, d))
    do = rng.standard_normal((b, hq, lq, d))
    return q, k, v, do


def _naive(q, k, v, causal, scale):
    """Loop-per-row attention, written independently of the vectorised code."""
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    group = hq // hkv
    o = np.zeros_like(q)
    lse = np.full((b, hq, lq), -np.inf)
    for bi in range(b):
        for h in range(hq):
            for i in range(lq):
                keys = [j for j in range(lk) if not causal or j <= i + lk - lq]
                if not keys:
                    continue
                s = np.array([scale * q[bi, h, i] @ k[bi, h // group, j] for j in keys])
                mx = s.max()
                w = np.exp(s - mx)
                lse[bi, h, i] = mx + math.log(w.sum())
                o[bi, h, i] = (w / w.sum()) @ v[bi, h // group, keys]
    return o, lse


def _numeric_grads(q, k, v, do, causal, eps=1e-6):
    def loss(q_, k_, v_):
        return float(np.sum(attention_reference(q_, k_, v_, causal=causal)[0] * do))

    grads = []
    for which in range(3):
        args = [q.copy(), k.copy(), v.copy()]
        x = args[which]
        g = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            orig = x[idx]
            x[idx] = orig + eps
            up = loss(*args)
            x[idx] = orig - eps
            down = loss(*args)
            x[idx] = orig
            g[idx] = (up - down) / (2 * eps)
        grads.append(g)
    return grads


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq,lk", [(5, 7), (7, 5), (6, 6)])
def test_forward_matches_naive(causal, lq, lk):
    q, k, v, _ = _inputs(1, b=2, hq=4, hkv=2, lq=lq, lk=lk, d=3)
    o, lse = attention_reference(q, k, v, causal=causal)
    o_n, lse_n = _naive(q, k, v, causal, 1 / math.sqrt(3))
    np.testing.assert_allclose(o, o_n, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(lse_n))
    fin = np.isfinite(lse_n)
    np.testing.assert_allclose(lse[fin], lse_n[fin], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq,lk", [(5, 7), (7, 5)])
def test_gradients_match_finite_differences(causal, lq, lk):
    q, k, v, do = _inputs(2, lq=lq, lk=lk)
    dq, dk, dv = attention_reference_backward(q, k, v, do, causal=causal)
    nq, nk, nv = _numeric_grads(q, k, v, do, causal)
    for got, want in ((dq, nq), (dk, nk), (dv, nv)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8)


def test_fully_masked_rows():
    # Lq > Lk with causal masking: the first Lq - Lk queries see no key.
    q, k, v, do = _inputs(3, lq=7, lk=4)
    o, lse = attention_reference(q, k, v, causal=True)
    dq, dk, dv = attention_reference_backward(q, k, v, do, causal=True)
    for x in (o, dq, dk, dv):
        assert np.all(np.isfinite(x))
    assert np.all(o[:, :, :3] == 0)
    assert np.all(lse[:, :, :3] == -np.inf)
    assert np.all(np.isfinite(lse[:, :, 3:]))
    assert np.all(dq[:, :, :3] == 0)
    # The masked rows' do must not reach dk or dv.
    do2 = do.copy()
    do2[:, :, :3] = 1e3
    _, dk2, dv2 = attention_reference_backward(q, k, v, do2, causal=True)
    np.testing.assert_array_equal(dk, dk2)
    np.testing.assert_array_equal(dv, dv2)


@pytest.mark.parametrize("causal", [False, True])
def test_key_shift_invariance(causal):
    # k + μ adds c·q_i·μ to every score of row i: softmax ignores it (why K-smoothing is exact).
    q, k, v, do = _inputs(4, lq=6, lk=9)
    mu = np.array([3.0, -2.0, 0.5, 7.0])
    o, lse = attention_reference(q, k, v, causal=causal)
    o2, lse2 = attention_reference(q, k + mu, v, causal=causal)
    np.testing.assert_allclose(o2, o, rtol=1e-10, atol=1e-12)
    shift = (q @ mu) / math.sqrt(q.shape[-1])
    np.testing.assert_allclose(lse2, lse + shift, rtol=1e-12, atol=1e-12)
    g = attention_reference_backward(q, k, v, do, causal=causal)
    g2 = attention_reference_backward(q, k + mu, v, do, causal=causal)
    for a, b in zip(g, g2):
        np.testing.assert_allclose(b, a, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("causal", [False, True])
def test_gqa_equals_expanded_heads(causal):
    q, k, v, do = _inputs(5, b=2, hq=6, hkv=2, lq=5, lk=8, d=4)
    ke, ve = np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1)
    o, lse = attention_reference(q, k, v, causal=causal)
    o_e, lse_e = attention_reference(q, ke, ve, causal=causal)
    np.testing.assert_array_equal(o, o_e)
    np.testing.assert_array_equal(lse, lse_e)
    dq, dk, dv = attention_reference_backward(q, k, v, do, causal=causal)
    dq_e, dk_e, dv_e = attention_reference_backward(q, ke, ve, do, causal=causal)
    np.testing.assert_allclose(dq, dq_e, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(dk, dk_e.reshape(2, 2, 3, 8, 4).sum(2), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dv, dv_e.reshape(2, 2, 3, 8, 4).sum(2), rtol=1e-12, atol=1e-14)


def test_softmax_scale_and_dtype():
    q, k, v, do = _inputs(6)
    o, lse = attention_reference(q.astype(np.float32), k, v, softmax_scale=0.3)
    assert o.dtype == np.float64 and lse.dtype == np.float64
    o2, lse2 = attention_reference(q * 0.3 / 0.5, k, v, softmax_scale=0.5)
    np.testing.assert_allclose(o, o2, rtol=1e-6)
    with pytest.raises(ValueError):
        attention_reference(q, k[:, :, :, :3], v)
    with pytest.raises(ValueError):
        attention_reference(q[:, :1].repeat(3, axis=1), np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1))
