"""Attention sinks (sagebwd_cp/sinks.py) on the host: the join is exact (applied to exact attention it
gives the exact sink attention, and its gradient formula the exact dσ); through the neutral API and
torch's autograd on the emulator, within the quantized algorithm's error of the FP64 reference, in
both layouts, with windows and rows that see no key; argument errors. The kernels' side is in
tests/test_gpu_windows.py."""
import numpy as np
import pytest

import sagebwd_cp
from sagebwd_cp.host.reference import attention_reference, attention_reference_backward
from sagebwd_cp.numerics import round_to_dtype
from sagebwd_cp.sinks import join_sinks, sinks_grad


def _inputs(seed, lq=100, lk=100, hq=4, hk=2, d=64):
    rng = np.random.default_rng(seed)
    q, k, v, do = (round_to_dtype(rng.standard_normal(s), "float16") for s in
                   ((2, hq, lq, d), (2, hk, lk, d), (2, hk, lk, d), (2, hq, lq, d)))
    return q, k, v, do, (2 * rng.standard_normal(hq)).astype(np.float32)


def _rel(x, ref):
    return float(np.linalg.norm(np.asarray(x, np.float64) - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("causal,lq,lk", [(True, 100, 100), (True, 130, 70), (False, 64, 200)])
def test_the_join_is_exact(causal, lq, lk):
    """join_sinks on the exact attention (o, λ) is the exact sink attention, rows without keys included
    (o' = 0, λ' = σ); sinks_grad on it is the exact dσ."""
    q, k, v, do, sinks = (x.astype(np.float64) for x in _inputs(1, lq, lk))
    o, lse = attention_reference(q, k, v, causal=causal)
    o_ref, lse_ref = attention_reference(q, k, v, causal=causal, sinks=sinks)
    o2, lse2, _ = join_sinks(o, lse, None, sinks, "HND")
    np.testing.assert_allclose(o2, o_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse2, lse_ref, rtol=1e-6, atol=1e-6)
    ds = sinks_grad(o2, lse2, do, sinks, "HND")
    np.testing.assert_allclose(ds, attention_reference_backward(q, k, v, do, causal=causal, sinks=sinks)[3],
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (20, 20)), (True, (30, -1))])
def test_the_neutral_api_with_sinks(layout, causal, window):
    q, k, v, do, sinks = _inputs(2, lq=130, lk=100)
    t = (lambda x: x) if layout == "HND" else (lambda x: x.transpose(0, 2, 1, 3).copy())
    o, lse = sagebwd_cp.attention(t(q), t(k), t(v), causal=causal, window_size=window, layout=layout, sinks=sinks,
                                  return_lse=True)
    o_ref, lse_ref = attention_reference(q, k, v, causal=causal, window=window, sinks=sinks)
    assert _rel(t(o), o_ref) < 0.03
    np.testing.assert_allclose(lse, lse_ref, atol=0.05)  # finite everywhere: every row has its sink
    out, saved = sagebwd_cp.attention_forward(t(q), t(k), t(v), causal=causal, window_size=window, layout=layout,
                                              sinks=sinks)
    np.testing.assert_array_equal(out, o)
    grads = sagebwd_cp.attention_backward(saved, t(do))
    assert len(grads) == 4 and grads[3].shape == sinks.shape
    refs = attention_reference_backward(q, k, v, do, causal=causal, window=window, sinks=sinks)
    for g, ref in zip(grads[:3], refs[:3]):
        assert _rel(t(g), ref) < 0.06
    assert _rel(grads[3], refs[3]) < 0.06
    # Without the sinks the answer differs: the check can tell.
    assert _rel(t(sagebwd_cp.attention(t(q), t(k), t(v), causal=causal, window_size=window, layout=layout)),
                o_ref) > 0.05


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_sinks_with_a_value_head_dim_of_its_own(layout):
    """Sinks where V's head dim (32) differs from Q·K's (64): the forward's joined output (V's head dim) and LSE, and
    the backward's four gradients (dσ from that output) against the FP64 reference."""
    q, k, v, do, sinks = _inputs(3, lq=90, lk=70)
    v, do = v[..., :32].copy(), do[..., :32].copy()
    t = (lambda x: x) if layout == "HND" else (lambda x: x.transpose(0, 2, 1, 3).copy())
    out, lse, saved = sagebwd_cp.attention_forward(t(q), t(k), t(v), causal=True, layout=layout, sinks=sinks,
                                                   return_lse=True)
    o_ref, lse_ref = attention_reference(q, k, v, causal=True, sinks=sinks)
    assert out.shape[-1] == 32 and _rel(t(out), o_ref) < 0.03
    np.testing.assert_allclose(lse, lse_ref, atol=0.05)
    grads = sagebwd_cp.attention_backward(saved, t(do))
    refs = attention_reference_backward(q, k, v, do, causal=True, sinks=sinks)
    assert [g.shape[-1] for g in grads[:3]] == [64, 64, 32]
    for g, ref in zip(grads[:3], refs[:3]):
        assert _rel(t(g), ref) < 0.06
    assert _rel(grads[3], refs[3]) < 0.06


def test_torch_autograd_gives_the_sinks_gradient():
    torch = pytest.importorskip("torch")
    import sagebwd_cp.torch as st

    q, k, v, do, sinks = (torch.from_numpy(x.astype(np.float64)) for x in _inputs(3))
    q, k, v, sinks = (x.requires_grad_() for x in (q, k, v, sinks))
    out = st.attention(q, k, v, causal=True, sinks=sinks)
    out.backward(do)
    arrays = [x.detach().numpy() for x in (q, k, v)]
    o_ref, _ = attention_reference(*arrays, causal=True, sinks=sinks.detach().numpy())
    refs = attention_reference_backward(*arrays, do.numpy(), causal=True, sinks=sinks.detach().numpy())
    assert _rel(out.detach().numpy(), o_ref) < 0.03
    for x, ref in zip((q, k, v, sinks), refs):
        assert _rel(x.grad.numpy(), ref) < 0.06
    with torch.no_grad():
        assert torch.equal(st.attention(q, k, v, causal=True, sinks=sinks), out)


def test_sink_arguments_are_checked():
    q, k, v, _, sinks = _inputs(4, lq=8, lk=8)
    with pytest.raises(ValueError, match=r"sinks: expected one logit per query head, shape \(4,\)"):
        sagebwd_cp.attention(q, k, v, sinks=sinks[:2])
    with pytest.raises(TypeError, match="sinks: expected a floating dtype"):
        sagebwd_cp.attention(q, k, v, sinks=np.arange(4))
    with pytest.raises(TypeError, match="sinks"):
        sagebwd_cp.attention(q, k, v, sinks=[0.0] * 4)


def _packed_against_dense(device):
    """flash_attn_varlen_func with sinks against one dense call per sequence: outputs, input gradients
    and the sinks' gradient summed over the sequences (a window too, and Lq != Lk)."""
    torch = pytest.importorskip("torch")
    import sagebwd_cp.torch as st

    g = torch.Generator().manual_seed(5)
    lens_q, lens_k, hq, hk, d = [1, 70, 33], [9, 70, 100], 4, 2, 64
    dtype = torch.float16 if device == "cuda" else torch.float64
    make = lambda n, h: torch.randn((n, h, d), generator=g).to(device=device, dtype=dtype)  # noqa: E731
    q, k, v, do = make(sum(lens_q), hq), make(sum(lens_k), hk), make(sum(lens_k), hk), make(sum(lens_q), hq)
    sinks = (2 * torch.randn(hq, generator=g)).to(device).requires_grad_()
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    cu = lambda lens: torch.tensor([0] + list(np.cumsum(lens)), dtype=torch.int32, device=device)  # noqa: E731
    opts = dict(causal=True, window_size=(30, 0))
    out = st.flash_attn_varlen_func(q, k, v, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k), sinks=sinks, **opts)
    packed = torch.autograd.grad(out, (q, k, v, sinks), do)
    outs, grads = [], [torch.zeros_like(x) for x in (q, k, v, sinks)]
    for i in range(3):
        rq, rk = slice(sum(lens_q[:i]), sum(lens_q[:i + 1])), slice(sum(lens_k[:i]), sum(lens_k[:i + 1]))
        o = st.flash_attn_func(q[None, rq], k[None, rk], v[None, rk], sinks=sinks, **opts)
        gi = torch.autograd.grad(o, (q, k, v, sinks), do[None, rq])
        outs.append(o[0])
        for acc, x in zip(grads, gi):
            acc += x
    # each sequence is quantized alone in both: the same arithmetic up to float32 summation order
    torch.testing.assert_close(out, torch.cat(outs), rtol=0, atol=2e-3 if device == "cuda" else 1e-6)
    for a, b in zip(packed, grads):
        assert _rel(a.detach().float().cpu().numpy(), b.detach().float().cpu().numpy()) < (1e-2 if device == "cuda" else 1e-6)
    assert _rel(st.flash_attn_varlen_func(q, k, v, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k), **opts)
                .detach().float().cpu().numpy(), out.detach().float().cpu().numpy()) > 0.05  # the sinks matter


def test_packed_batches_with_sinks_are_their_dense_calls():
    _packed_against_dense("cpu")


@pytest.mark.gpu
def test_gpu_packed_batches_with_sinks_are_their_dense_calls():
    _packed_against_dense("cuda")
