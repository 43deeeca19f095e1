"""The accuracy guard: its statistic is the kernels' per-token scales' bound, it warns once per shape where
q and k are large and stays silent at unit scale, and it costs nothing when off."""
import warnings

import numpy as np
import pytest

import sagebwd_cp
from sagebwd_cp import guard
from sagebwd_cp.host import emulator
from sagebwd_cp.numerics import SCORE_STEP_LIMIT


def _qkv(sigma, n=128, d=64, seed=0, heads=(2, 1)):
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((1, heads[0], n, d)) * sigma).astype(np.float16)
    k = (rng.standard_normal((1, heads[1], n, d)) * sigma + 0.5).astype(np.float16)
    v = rng.standard_normal((1, heads[1], n, d)).astype(np.float16)
    return q, k, v


@pytest.fixture(autouse=True)
def _fresh_guard(monkeypatch):
    monkeypatch.setattr(guard, "_threshold", None)
    monkeypatch.setattr(guard, "_warned", set())


@pytest.mark.parametrize("smooth_k", [True, False])
def test_score_step_is_the_product_of_the_largest_per_token_scales(smooth_k):
    q, k, v = _qkv(3.0)
    step = sagebwd_cp.score_step(q, k, smooth_k=smooth_k)
    qi = emulator.quantize_inputs(q, k, v, smooth_k=smooth_k)
    s_q = qi["q_scale"].max(axis=2)                       # (B, Hq)
    s_k = np.repeat(qi["k_scale"].max(axis=2), 2, axis=1)  # (B, Hkv) -> query heads
    assert step.shape == (1, 2) and step.dtype == np.float32
    assert np.array_equal(step, (s_q * s_k * np.float32(127)).astype(np.float32))


def test_score_step_reads_the_layout():
    q, k, _ = _qkv(2.0)
    hnd = sagebwd_cp.score_step(q, k)
    nhd = sagebwd_cp.score_step(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), layout="NHD")
    assert np.array_equal(hnd, nhd)


def test_score_step_of_torch_tensors_matches_numpy():
    torch = pytest.importorskip("torch")
    q, k, _ = _qkv(2.0)
    ours = sagebwd_cp.score_step(torch.from_numpy(q), torch.from_numpy(k))
    assert isinstance(ours, torch.Tensor)
    np.testing.assert_allclose(ours.numpy(), sagebwd_cp.score_step(q, k), rtol=1e-6)


def test_the_guard_warns_at_eight_times_the_unit_scale_and_not_at_unit_scale():
    q1, k1, v1 = _qkv(1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sagebwd_cp.attention(q1, k1, v1, accuracy_guard=True)
    assert sagebwd_cp.score_step(q1, k1).max() < SCORE_STEP_LIMIT / 4
    q8, k8, v8 = _qkv(8.0, n=96)
    with pytest.warns(sagebwd_cp.AccuracyWarning, match=r"QK-norm.*scaled_dot_product_attention"):
        sagebwd_cp.attention(q8, k8, v8, accuracy_guard=True)
    with warnings.catch_warnings():  # once per shape
        warnings.simplefilter("error")
        sagebwd_cp.attention_forward(q8, k8, v8, accuracy_guard=True)


def test_the_guard_is_off_by_default_and_follows_the_global_setting():
    q8, k8, v8 = _qkv(8.0, n=64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sagebwd_cp.attention(q8, k8, v8)
        sagebwd_cp.set_accuracy_guard(100.0)  # a threshold above the step: silent
        sagebwd_cp.attention(q8, k8, v8)
    sagebwd_cp.set_accuracy_guard(True)
    with pytest.warns(sagebwd_cp.AccuracyWarning):
        sagebwd_cp.attention(q8, k8, v8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sagebwd_cp.attention(q8[:, :, :32], k8[:, :, :32], v8[:, :, :32], accuracy_guard=False)


def test_the_guard_costs_nothing_when_off(monkeypatch):
    q, k, v = _qkv(8.0, n=64)
    monkeypatch.setattr(guard, "score_step", lambda *a, **kw: pytest.fail("the guard ran while off"))
    sagebwd_cp.attention(q, k, v)
    sagebwd_cp.attention_forward(q, k, v)


@pytest.mark.parametrize("value,threshold", [(None, None), ("0", None), ("", None), ("1", SCORE_STEP_LIMIT),
                                             ("0.5", 0.5), ("on", SCORE_STEP_LIMIT)])
def test_the_environment_variable(value, threshold):
    assert guard._parse(value, guard.ENV) == threshold


@pytest.mark.parametrize("bad", ["lots", -1.0, float("nan"), [1]])
def test_a_bad_setting_is_an_error_naming_it(bad):
    q, k, v = _qkv(1.0, n=16)
    with pytest.raises(ValueError, match="accuracy_guard"):
        sagebwd_cp.attention(q, k, v, accuracy_guard=bad)


def test_the_torch_adapter_warns_through_its_argument():
    torch = pytest.importorskip("torch")
    import sagebwd_cp.torch as st

    q, k, v = (torch.from_numpy(x) for x in _qkv(8.0, n=64))
    with pytest.warns(sagebwd_cp.AccuracyWarning):
        st.attention(q, k, v, causal=True, accuracy_guard=True)
    assert st.score_step(q, k).shape == (1, 2)


@pytest.mark.gpu
@pytest.mark.torch
def test_the_guard_on_the_gpu():
    """bf16 q and k at 8x the unit scale (score std ~64) warn, at unit scale they do not; the statistic of
    CUDA tensors is computed on the GPU and equals the host's."""
    torch = pytest.importorskip("torch")
    import sagebwd_cp.torch as st

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn((1, 2, 512, 64), generator=g, device="cuda") for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        st.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), accuracy_guard=True)
    q8, k8 = (8 * q).bfloat16(), (8 * k).bfloat16()
    with pytest.warns(sagebwd_cp.AccuracyWarning):
        st.attention(q8, k8, v.bfloat16(), accuracy_guard=True)
    step = st.score_step(q8, k8)
    assert step.is_cuda
    host = sagebwd_cp.score_step(q8.float().cpu().numpy(), k8.float().cpu().numpy())
    np.testing.assert_allclose(step.cpu().numpy(), host, rtol=1e-6)
