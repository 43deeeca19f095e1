"""Sliding windows on the host: the mask's definition (FlashAttention's ``window_size``, bottom-right
aligned), the emulator against the exact reference unquantized (exact up to float32) and quantized
(within the algorithm's error), packed batches, options and argument errors, and the adapters that
run on the CPU. The kernels' side is tests/test_gpu_windows.py."""
import itertools
import math

import numpy as np
import pytest

import sagebwd_cp
from sagebwd_cp.host import packed
from sagebwd_cp.host.emulator import emulate_backward, emulate_forward
from sagebwd_cp.host.reference import attention_reference, attention_reference_backward, causal_mask
from sagebwd_cp.numerics import round_to_dtype
from sagebwd_cp.options import UNBOUNDED, AttentionOptions

WINDOWS = [(0, 0), (5, -1), (-1, 7), (20, 3), (63, 64), (200, 200)]


def _inputs(seed, b, hq, hkv, lq, lk, d):
    rng = np.random.default_rng(seed)
    xs = (rng.standard_normal(s) for s in ((b, hq, lq, d), (b, hkv, lk, d), (b, hkv, lk, d), (b, hq, lq, d)))
    return tuple(round_to_dtype(x, "float16") for x in xs)


def _close(got, want, name, tol=1e-5):
    err = np.linalg.norm(np.asarray(got, np.float64) - want)
    assert err <= tol * (np.linalg.norm(want) + math.sqrt(want.size)), (name, err)


def test_the_mask_is_flash_attentions():
    """Query i sees key j iff i + Lk - Lq - left <= j <= i + Lk - Lq + right; causal sets right to 0."""
    lq, lk = 5, 8
    for (left, right), causal in itertools.product(WINDOWS + [(-1, -1)], (False, True)):
        m = causal_mask(lq, lk, causal, (left, right))
        for i, j in itertools.product(range(lq), range(lk)):
            r = 0 if causal else right
            want = (left < 0 or j >= i + lk - lq - left) and (r < 0 or j <= i + lk - lq + r)
            assert m[i, j] == want, (left, right, causal, i, j)
    opts = AttentionOptions(causal=True, window_left=4, window_right=9)
    assert opts.band() == (4, 0) and opts.windowed and opts.banded
    assert AttentionOptions(window_right=2).band() == (UNBOUNDED, 2)
    assert not AttentionOptions(causal=True, window_right=5).windowed  # causal bounds the right side already


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq,lk", [(1, 1), (100, 100), (70, 190), (190, 70), (130, 129)])
def test_unquantized_windowed_emulator_is_exact(window, causal, lq, lk):
    """quantize=False turns the tiled algorithm into exact attention: with windows too, including the
    key tiles it skips and the rows that see no key (o = 0, LSE -inf, no gradient)."""
    _check_unquantized_is_exact(*_inputs(lq * 7 + lk, 1, 4, 2, lq, lk, 16), causal, window)


def _check_unquantized_is_exact(q, k, v, do, causal, window, smooth_q=False):
    o_ref, lse_ref = attention_reference(q, k, v, causal=causal, window=window)
    o, lse, saved = emulate_forward(q, k, v, causal=causal, window=window, smooth_q=smooth_q, quantize=False,
                                    dtype="float32")
    _close(o, o_ref, "o")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    fin = np.isfinite(lse_ref)
    np.testing.assert_allclose(lse[fin], lse_ref[fin], rtol=1e-5, atol=1e-5)
    assert not o[np.broadcast_to(~fin[..., None], o.shape)].any()
    for g, g_ref, name in zip(emulate_backward(saved, do, quantize=False),
                              attention_reference_backward(q, k, v, do, causal=causal, window=window), "qkv"):
        _close(g, g_ref, "d" + name)


@pytest.mark.parametrize("window,causal", [((5, -1), True), ((20, 3), False), ((63, 64), False), ((0, -1), True)])
@pytest.mark.parametrize("lq,lk", [(1, 1), (130, 129), (70, 190), (190, 70)])
def test_unquantized_windowed_emulator_with_q_smoothing_is_exact(window, causal, lq, lk):
    """Q-smoothing's bias (each query block's mean times the keys) adds each score's own shift back, so a window,
    which keeps some keys of a row, changes nothing: quantize=False stays exact attention."""
    q, k, v, do = _inputs(lq * 3 + lk, 1, 4, 2, lq, lk, 16)
    _check_unquantized_is_exact(q + 2.0, k, v, do, causal, window, smooth_q=True)  # (a mean for it to take out)


@pytest.mark.parametrize("window,causal", [((64, -1), True), ((30, 30), False), ((200, -1), True)])
@pytest.mark.parametrize("smooth_q", [False, True])
def test_quantized_windowed_attention_is_within_the_algorithms_error(window, causal, smooth_q):
    q, k, v, do = _inputs(3, 1, 4, 1, 300, 300, 64)
    q = q + (1.5 if smooth_q else 0.0)  # (Q-smoothing's case: queries with a common offset)
    o, _ = sagebwd_cp.attention(q, k, v, causal=causal, window_size=window, smooth_q=smooth_q, return_lse=True)
    o_ref, _ = attention_reference(q, k, v, causal=causal, window=window)
    assert np.linalg.norm(o - o_ref) / np.linalg.norm(o_ref) < 0.03
    _, saved = sagebwd_cp.attention_forward(q, k, v, causal=causal, window_size=window, smooth_q=smooth_q)
    grads = sagebwd_cp.attention_backward(saved, do)
    for g, ref in zip(grads, attention_reference_backward(q, k, v, do, causal=causal, window=window)):
        assert np.linalg.norm(g - ref) / np.linalg.norm(ref) < 0.06
    # The window matters: the same call without it is far from the windowed reference.
    full = sagebwd_cp.attention(q, k, v, causal=causal)
    assert np.linalg.norm(full - o_ref) / np.linalg.norm(o_ref) > 0.1


def test_a_packed_batch_windows_each_sequence_alone():
    rng = np.random.default_rng(4)
    lens_q, lens_k = [1, 90, 130], [1, 150, 64]
    cq, ck = (np.array([0] + np.cumsum(x).tolist(), np.int32) for x in (lens_q, lens_k))
    q, k, v = (round_to_dtype(rng.standard_normal((n, h, 32)), "float16")
               for n, h in ((sum(lens_q), 4), (sum(lens_k), 2), (sum(lens_k), 2)))
    out, lse = sagebwd_cp.attention_varlen(q, k, v, cq, ck, 130, 150, causal=True, window_size=(20, -1),
                                           return_lse=True)
    for b in range(3):
        sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        o1, l1 = sagebwd_cp.attention(q[sq][None], k[sk][None], v[sk][None], causal=True, window_size=(20, -1),
                                      layout="NHD", return_lse=True)
        np.testing.assert_array_equal(out[sq], o1[0])
        np.testing.assert_array_equal(lse[:, sq], l1[0])
    state = packed.emulate_forward(q, k, v, (cq, ck), causal=True, softmax_scale=None, smooth_k=True, dtype="float32",
                                   window=(20, -1))
    np.testing.assert_array_equal(state[0], out)


def test_window_arguments_are_checked():
    q = np.zeros((1, 2, 8, 16), np.float32)
    with pytest.raises(ValueError, match=r"window_size\[0\]: expected -1"):
        sagebwd_cp.attention(q, q, q, window_size=(-2, 0))
    with pytest.raises(TypeError, match=r"window_size\[1\]: expected an int"):
        sagebwd_cp.attention(q, q, q, window_size=(3, 1.5))
    with pytest.raises(TypeError, match="window_size: expected a pair"):
        sagebwd_cp.attention(q, q, q, window_size=7)
    # Q-smoothing under a window runs (its kernels: test_the_kernels_of_a_window; V is zero here, so is O).
    assert not sagebwd_cp.attention(q, q, q, smooth_q=True, window_size=(4, 4)).any()
    # Wider than any sequence: the same as unbounded, stored as UNBOUNDED.
    assert AttentionOptions(window_left=10**12).window_left == UNBOUNDED


def test_the_kernels_of_a_window():
    """A window selects the SB_WINDOW kernels (the causal kernels stay as they are), never the
    warp-specialized forward, and hands the kernels its band."""
    from sagebwd_cp.gpu import specs

    opts = AttentionOptions(causal=True, window_left=100)
    fwd = specs.forward_spec(128, "float16", opts, specs.ForwardTiles(4, 1, True, 128))
    bwd = specs.backward_spec(128, "float16", opts, specs.BackwardTiles(2, True, 2))
    assert ".causal.window." in fwd.key and dict(fwd.defines)["SB_WINDOW"] == 1
    assert dict(bwd.defines)["SB_WINDOW"] == 1 and dict(bwd.defines)["SB_CAUSAL"] == 1
    plain = specs.forward_spec(128, "float16", AttentionOptions(causal=True), specs.ForwardTiles(4, 1, True, 128))
    assert "SB_WINDOW" not in dict(plain.defines) and ".window" not in plain.key
    right_only = specs.forward_spec(64, "float16", AttentionOptions(window_right=8), specs.ForwardTiles(4, 1))
    assert dict(right_only.defines)["SB_CAUSAL"] == 1 and dict(right_only.defines)["SB_WINDOW"] == 1
    with pytest.raises(AssertionError):
        specs.forward_ws_spec(128, "float16", opts, specs.WsForwardTiles())
    # Q-smoothing under a window: the windowed kernels with the bias (SB_BIAS), both passes.
    smoothed = opts._replace(smooth_q=True)
    for spec in (specs.forward_spec(128, "float16", smoothed, specs.ForwardTiles(4, 1, True, 64)),
                 specs.backward_spec(64, "bfloat16", smoothed, specs.BackwardTiles(2, True, 2))):
        assert ".causal.window.qbias." in spec.key, spec.key
        assert dict(spec.defines)["SB_WINDOW"] == 1 and dict(spec.defines)["SB_BIAS"] == 1


def test_torch_on_the_cpu_takes_flash_attentions_keyword():
    torch = pytest.importorskip("torch")
    import sagebwd_cp.torch as st

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 150, 4, 32, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    out = st.flash_attn_func(q, k, v, causal=True, window_size=(40, 0))
    ref, _ = attention_reference(*(x.detach().transpose(1, 2).numpy() for x in (q, k, v)), causal=True, window=(40, 0))
    got = out.detach().transpose(1, 2).numpy()
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.03
    out.square().sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))
    module = st.SageAttention(causal=True, window_size=(40, 0), layout="NHD")
    assert torch.equal(module(q, k, v), out) and "window_size=(40, 0)" in repr(module)
