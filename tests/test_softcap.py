"""Logit soft-capping on the host: the emulator unquantized is exact attention over c·tanh(s/c) (forward
and backward, causal and windowed, and without a mask, Lq != Lk, GQA); quantized, through the neutral API and torch's
autograd, within the algorithm's error of the FP64 reference, with and without K-smoothing; the combinations
that have no kernels are refused by name; the kernel specs. The kernels' side is tests/test_gpu_softcap.py."""
import numpy as np
import pytest

import sagebwd_cp
from sagebwd_cp.host.emulator import emulate_backward, emulate_forward
from sagebwd_cp.host.reference import attention_reference, attention_reference_backward
from sagebwd_cp.numerics import round_to_dtype, soft_cap, soft_cap_slope, softcap_constants
from sagebwd_cp.options import AttentionOptions


def _inputs(seed, lq, lk, sigma=3.0):
    rng = np.random.default_rng(seed)
    q, k = (round_to_dtype(sigma * rng.standard_normal(s), "float16") for s in ((1, 4, lq, 64), (1, 2, lk, 64)))
    v, do = (round_to_dtype(rng.standard_normal(s), "float16") for s in ((1, 2, lk, 64), (1, 4, lq, 64)))
    return q, k, v, do


def _rel(x, ref):
    return float(np.linalg.norm(np.asarray(x, np.float64) - ref) / np.linalg.norm(ref))


def test_the_cap_and_its_slope():
    c, inv = softcap_constants(20.0)
    x = np.linspace(-200, 200, 101, dtype=np.float32)
    np.testing.assert_allclose(soft_cap(x, c, inv), 20 * np.log2(np.e) * np.tanh(x / (20 * np.log2(np.e))), rtol=1e-5)
    lse2 = np.float32(3.0)
    p = np.exp2(soft_cap(x, c, inv) - lse2)
    np.testing.assert_allclose(soft_cap_slope(p, lse2, inv), 1 - np.tanh(x / c) ** 2, atol=1e-4)
    assert soft_cap_slope(np.float32(0), np.float32(np.inf), inv) == 0  # a padded row: no NaN


@pytest.mark.parametrize("cap", [2.0, 30.0])
@pytest.mark.parametrize("lq,lk,window,causal", [(100, 100, (-1, -1), True), (130, 70, (-1, -1), True),
                                                 (90, 150, (20, 0), True), (1, 1, (-1, -1), True),
                                                 (130, 70, (-1, -1), False), (90, 150, (-1, 30), False)])
def test_unquantized_soft_capped_emulator_is_exact(cap, lq, lk, window, causal):
    q, k, v, do = _inputs(lq + lk, lq, lk)
    o, lse, saved = emulate_forward(q, k, v, causal=causal, window=window, softcap=cap, smooth_k=False,
                                    quantize=False, dtype="float32")
    o_ref, lse_ref = attention_reference(q, k, v, causal=causal, window=window, softcap=cap)
    np.testing.assert_allclose(o, o_ref, atol=2e-5)
    fin = np.isfinite(lse_ref)
    np.testing.assert_allclose(lse[fin], lse_ref[fin], rtol=1e-5, atol=1e-5)
    for g, ref in zip(emulate_backward(saved, do, quantize=False),
                      attention_reference_backward(q, k, v, do, causal=causal, window=window, softcap=cap)):
        np.testing.assert_allclose(g, ref, atol=1e-4 * max(1.0, np.abs(ref).max()))


def test_quantized_soft_capping_through_the_api_and_torch():
    q, k, v, do = _inputs(5, 200, 200)
    kw = dict(causal=True, softcap=5.0, smooth_k=False)
    o = sagebwd_cp.attention(q, k, v, **kw)
    o_ref, _ = attention_reference(q, k, v, causal=True, softcap=5.0)
    assert _rel(o, o_ref) < 0.03
    assert _rel(sagebwd_cp.attention(q, k, v, causal=True, smooth_k=False), o_ref) > 0.05  # the cap matters
    _, saved = sagebwd_cp.attention_forward(q, k, v, **kw)
    refs = attention_reference_backward(q, k, v, do, causal=True, softcap=5.0)
    for g, ref in zip(sagebwd_cp.attention_backward(saved, do), refs):
        assert _rel(g, ref) < 0.08
    torch = pytest.importorskip("torch")
    import sagebwd_cp.torch as st

    qt, kt, vt = (torch.from_numpy(x).transpose(1, 2).requires_grad_() for x in (q, k, v))
    out = st.flash_attn_func(qt, kt, vt, causal=True, softcap=5.0, smooth_k=False)
    out.backward(torch.from_numpy(do).transpose(1, 2))
    assert _rel(out.detach().transpose(1, 2).numpy(), o_ref) < 0.03
    for x, ref in zip((qt, kt, vt), refs):
        assert _rel(x.grad.transpose(1, 2).numpy(), ref) < 0.08


def test_soft_capping_without_a_mask():
    """No causal mask and no window: every key, through the neutral API and flash_attn_func, on the kernels'
    band test with both sides open."""
    q, k, v, do = _inputs(6, 130, 70)
    o_ref, _ = attention_reference(q, k, v, softcap=5.0)
    assert _rel(attention_reference(q, k, v, causal=True, softcap=5.0)[0], o_ref) > 0.05  # the mask matters
    o, saved = sagebwd_cp.attention_forward(q, k, v, softcap=5.0, smooth_k=False)
    assert _rel(o, o_ref) < 0.03
    for g, ref in zip(sagebwd_cp.attention_backward(saved, do), attention_reference_backward(q, k, v, do, softcap=5.0)):
        assert _rel(g, ref) < 0.08
    torch = pytest.importorskip("torch")
    import sagebwd_cp.torch as st

    out = st.flash_attn_func(*(torch.from_numpy(x).transpose(1, 2) for x in (q, k, v)), softcap=5.0)
    assert _rel(out.transpose(1, 2).numpy(), o_ref) < 0.03


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (True, (40, -1)), (False, (-1, -1))])
def test_soft_capping_with_k_smoothing(causal, window):
    """K-smoothing under a cap adds each row's share c·q·μ_K back before tanh: unquantized, the emulator is exact
    attention (the share and LSE2's frame cancel); quantized, with keys far from zero mean (a channel offset of
    4σ), O, dK and dV follow the reference closer than without smoothing (measured 0.6x their error), dQ no worse,
    as the flash_attn_func default and through torch's autograd."""
    q, k, v, do = _inputs(11, 150, 130, sigma=1.0)
    k = round_to_dtype(k + 4.0 * np.random.default_rng(2).standard_normal(64), "float16")
    kw = dict(causal=causal, window=window, softcap=5.0)
    o, lse, saved = emulate_forward(q, k, v, quantize=False, dtype="float32", **kw)
    o_ref, lse_ref = attention_reference(q, k, v, **kw)
    np.testing.assert_allclose(o, o_ref, atol=3e-5)
    fin = np.isfinite(lse_ref)
    np.testing.assert_allclose(lse[fin], lse_ref[fin], rtol=1e-5, atol=1e-4)
    refs = attention_reference_backward(q, k, v, do, **kw)
    for g, ref in zip(emulate_backward(saved, do, quantize=False), refs):
        np.testing.assert_allclose(g, ref, atol=2e-4 * max(1.0, np.abs(ref).max()))

    api = dict(causal=causal, window_size=window, softcap=5.0)
    errors = {}
    for smooth in (False, True):
        out, saved = sagebwd_cp.attention_forward(q, k, v, smooth_k=smooth, **api)
        grads = sagebwd_cp.attention_backward(saved, do)
        errors[smooth] = [_rel(out, o_ref)] + [_rel(g, ref) for g, ref in zip(grads, refs)]
    assert errors[True][0] < 0.02 and errors[True][2] < 0.03 and errors[True][3] < 0.02, errors  # O, dK, dV
    assert errors[True][1] < 1.02 * errors[False][1], errors  # dQ reads K̂ᵀ coded from K itself: no worse
    for e_smooth, e_raw, name in zip(errors[True], errors[False], ("o", "dq", "dk", "dv")):
        if name != "dq":
            assert e_smooth < 0.75 * e_raw, (name, errors)
    torch = pytest.importorskip("torch")
    import sagebwd_cp.torch as st

    qt, kt, vt = (torch.from_numpy(x).transpose(1, 2).requires_grad_() for x in (q, k, v))
    out = st.flash_attn_func(qt, kt, vt, causal=causal, window_size=window, softcap=5.0)  # K-smoothing on
    out.backward(torch.from_numpy(do).transpose(1, 2))
    assert _rel(out.detach().transpose(1, 2).numpy(), o_ref) == pytest.approx(errors[True][0], rel=1e-3)
    assert _rel(kt.grad.transpose(1, 2).numpy(), refs[1]) < 0.75 * errors[False][2]


def test_what_has_no_soft_capped_kernels_is_refused():
    q = np.zeros((1, 2, 8, 16), np.float32)
    with pytest.raises(ValueError, match="softcap: soft-capping takes no Q-smoothing"):
        sagebwd_cp.attention(q, q, q, causal=True, softcap=10.0, smooth_q=True)
    with pytest.raises(ValueError, match="granularity 'fine'"):
        sagebwd_cp.attention_backward_arrays(q, q, q, q, q[..., 0], q, causal=True, smooth_k=False, softcap=10.0,
                                             granularity="paper")
    with pytest.raises(ValueError, match="softcap: expected a finite number >= 0"):
        sagebwd_cp.attention(q, q, q, causal=True, smooth_k=False, softcap=float("inf"))


def test_the_kernels_of_soft_capping():
    from sagebwd_cp.gpu import specs

    opts = AttentionOptions(causal=True, smooth_k=False, softcap=50.0)
    fwd = specs.forward_spec(128, "bfloat16", opts, specs.ForwardTiles(4, 1, True, 128))
    assert ".softcap" in fwd.key and dict(fwd.defines)["SB_SOFTCAP"] == 1
    window = specs.backward_spec(64, "float16", opts._replace(window_left=9), specs.BackwardTiles(2))
    assert ".causal.window.softcap.fine" in window.key
    # Without a causal mask the band test's kernels, open on both sides (problem.kernel_band): no kernels of their own.
    unmasked = opts._replace(causal=False)
    assert specs.backward_spec(64, "float16", unmasked, specs.BackwardTiles(2)).key == window.key
    assert specs.forward_spec(128, "bfloat16", unmasked, specs.ForwardTiles(4, 1, True, 128)).key == \
        specs.forward_spec(128, "bfloat16", opts._replace(window_left=9), specs.ForwardTiles(4, 1, True, 128)).key
    keys = {s.key for s in specs.all_specs("sm_90")}
    assert "backward.hd128.bfloat16.causal.softcap.fine.s2.wgmma" in keys
    assert not any(".softcap" in k and ".paper" in k for k in keys)


def test_a_given_mean_at_any_float_alignment_passes_the_checks():
    """The row kernels read μ_K 16 bytes at a time where it is 16-byte aligned and a float at a time where it is not
    (kernels/row_dot.cuh), so a CUDA k_mean at a 4-byte offset is accepted, capped or not (tests/test_gpu_softcap.py
    checks the results equal the aligned copy's)."""
    from types import SimpleNamespace

    from sagebwd_cp.api import _check_k_mean
    from sagebwd_cp.arrays import ArrayDesc

    def prob(softcap):
        return SimpleNamespace(on_gpu=True, smooth_k=True, options=AttentionOptions(softcap=softcap), batch=1,
                               heads_kv=2, head_dim=64, q=SimpleNamespace(device_type="cuda", device_id=0))

    def mean(ptr):
        return ArrayDesc(ptr, (1, 2, 64), (128, 64, 1), "float32", "cuda", 0, None, "torch")

    for cap in (5.0, 0.0):
        _check_k_mean(mean(0x1004), prob(cap))
    with pytest.raises(ValueError, match="k_mean: μ_K belongs to K-smoothing"):
        _check_k_mean(mean(0x1004), SimpleNamespace(**{**vars(prob(5.0)), "smooth_k": False}))