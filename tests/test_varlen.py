"""Packed (variable-length) batches on the CPU: the emulator path of attention_varlen* and
flash_attn_varlen_func against per-sequence calls (bit for bit: each sequence is attended alone),
and the argument checks."""
import numpy as np
import pytest

import sagebwd_cp


def _packed(lens_q, lens_k, hq=4, hk=2, d=64, dtype=np.float16, seed=0):
    rng = np.random.default_rng(seed)
    cu = lambda lens: np.array([0] + np.cumsum(lens).tolist(), np.int32)
    rand = lambda n, h: rng.standard_normal((n, h, d)).astype(dtype)
    return rand(sum(lens_q), hq), rand(sum(lens_k), hk), rand(sum(lens_k), hk), cu(lens_q), cu(lens_k)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens", [([1], [1]), ([5, 70, 1, 130], [9, 70, 3, 129]), ([3] * 12, [7] * 12)],
                         ids=["one-token", "ragged-lq-ne-lk", "many-short"])
def test_packed_batch_equals_per_sequence_calls(causal, lens):
    lens_q, lens_k = lens
    q, k, v, cq, ck = _packed(lens_q, lens_k, seed=len(lens_q))
    out, lse, saved = sagebwd_cp.attention_varlen_forward(q, k, v, cq, ck, max(lens_q), max(lens_k), causal=causal,
                                                         return_lse=True)
    assert out.shape == q.shape and lse.shape == (4, sum(lens_q))
    do = np.random.default_rng(1).standard_normal(q.shape).astype(np.float16)
    dq, dk, dv = sagebwd_cp.attention_backward(saved, do, granularity="paper")
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape
    np.testing.assert_array_equal(sagebwd_cp.attention_varlen(q, k, v, cq, ck, max(lens_q), max(lens_k),
                                                              causal=causal), out)
    for b in range(len(lens_q)):
        sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        o1, l1, s1 = sagebwd_cp.attention_forward(q[None, sq], k[None, sk], v[None, sk], causal=causal, layout="NHD",
                                                  return_lse=True)
        g1 = sagebwd_cp.attention_backward(s1, do[None, sq], granularity="paper")
        np.testing.assert_array_equal(out[sq], o1[0])
        np.testing.assert_array_equal(lse[:, sq], l1[0])
        for got, want in zip((dq[sq], dk[sk], dv[sk]), g1):
            np.testing.assert_array_equal(got, want[0])


@pytest.mark.parametrize("causal", [False, True])
def test_soft_capped_packed_batch_with_k_smoothing_equals_per_sequence_calls(causal):
    """Soft-capping with K-smoothing (each sequence's own μ_K, its rows' shares added back before tanh) in a packed
    batch: bit for bit each sequence's own call, forward, LSE and gradients."""
    lens_q, lens_k = [5, 70, 1, 130], [9, 70, 3, 129]
    q, k, v, cq, ck = _packed(lens_q, lens_k, seed=7)
    k = (k + np.random.default_rng(3).standard_normal(64).astype(np.float16) * 3).astype(np.float16)  # offset keys
    kw = dict(causal=causal, softcap=5.0)
    out, lse, saved = sagebwd_cp.attention_varlen_forward(q, k, v, cq, ck, max(lens_q), max(lens_k), return_lse=True,
                                                         **kw)
    do = np.random.default_rng(1).standard_normal(q.shape).astype(np.float16)
    dq, dk, dv = sagebwd_cp.attention_backward(saved, do)
    for b in range(len(lens_q)):
        sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        o1, l1, s1 = sagebwd_cp.attention_forward(q[None, sq], k[None, sk], v[None, sk], layout="NHD", return_lse=True,
                                                  **kw)
        g1 = sagebwd_cp.attention_backward(s1, do[None, sq])
        np.testing.assert_array_equal(out[sq], o1[0])
        np.testing.assert_array_equal(lse[:, sq], l1[0])
        for got, want in zip((dq[sq], dk[sk], dv[sk]), g1):
            np.testing.assert_array_equal(got, want[0])


def test_backward_from_arrays_matches_the_saved_state():
    q, k, v, cq, ck = _packed([40, 3], [10, 90], hq=2, hk=1)
    out, saved = sagebwd_cp.attention_varlen_forward(q, k, v, cq, ck, 40, 90, causal=True)
    do = np.ones_like(q)
    want = sagebwd_cp.attention_backward(saved, do)
    got = sagebwd_cp.attention_varlen_backward_arrays(q, k, v, out, saved.lse2.obj, do, cq, ck, 40, 90, causal=True,
                                                      k_mean=saved.k_mean.obj)
    again = sagebwd_cp.attention_varlen_backward_arrays(q, k, v, out, saved.lse2.obj, do, cq, ck, 40, 90, causal=True)
    for a, b, c in zip(got, want, again):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(c, b)  # μ_K computed again is the saved one


def test_a_sequence_without_keys_gives_zeros():
    q, k, v, cq, ck = _packed([4, 6], [0, 5], hq=2, hk=2)
    out, lse = sagebwd_cp.attention_varlen(q, k, v, cq, ck, 6, 5, return_lse=True)
    assert not out[:4].any() and np.isneginf(lse[:, :4]).all() and np.isfinite(lse[:, 4:]).all()


@pytest.mark.parametrize("change,match", [
    (dict(cu_seqlens_q=np.array([0], np.int32)), "cu_seqlens_q: expected at least 2 entries"),
    (dict(cu_seqlens_q=np.array([0, 10], np.int64)), "cu_seqlens_q: expected a rank-1 int32"),
    (dict(cu_seqlens_k=np.array([0, 4, 10], np.int32)), "expected one batch size"),
    (dict(cu_seqlens_q=np.array([0, 9], np.int32)), "cu_seqlens_q: expected the last offset to be the token count 10"),
    (dict(max_seqlen_q=5), "max_seqlen_q: expected at least the longest sequence \\(10 tokens\\)"),
    (dict(max_seqlen_k=0), "max_seqlen_k: expected at least 1"),
    (dict(max_seqlen_k=3.0), "max_seqlen_k: expected a Python int"),
    (dict(q=np.zeros((1, 10, 2, 64), np.float16)), "q: expected a rank-3 array"),
    (dict(smooth_q=True), "smooth_q: packed batches"),
])
def test_bad_packed_arguments_name_themselves(change, match):
    q, k, v, cq, ck = _packed([10], [12], hq=2, hk=2)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=10, max_seqlen_k=12)
    smooth_q = change.pop("smooth_q", False)
    args.update(change)
    with pytest.raises((ValueError, TypeError), match=match):
        if smooth_q:
            from sagebwd_cp.options import AttentionOptions
            from sagebwd_cp.problem import make_varlen_problem

            make_varlen_problem(*args.values(), AttentionOptions(smooth_q=True, layout="THD"))
        else:
            sagebwd_cp.attention_varlen(*args.values())


@pytest.mark.torch
def test_flash_attn_varlen_func_matches_flash_attn_func_per_sequence():
    torch = pytest.importorskip("torch")
    import sagebwd_cp.torch as sage

    torch.manual_seed(0)
    lens_q, lens_k = [3, 70, 1], [5, 70, 2]
    cq = torch.tensor([0] + np.cumsum(lens_q).tolist(), dtype=torch.int32)
    ck = torch.tensor([0] + np.cumsum(lens_k).tolist(), dtype=torch.int32)
    q = torch.randn(sum(lens_q), 4, 64, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(sum(lens_k), 2, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    out = sage.flash_attn_varlen_func(q, k, v, cq, ck, 70, 70, causal=True)
    g = torch.randn_like(out)
    out.backward(g)
    for b in range(3):
        sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        xs = [x[s].detach()[None].requires_grad_() for x, s in ((q, sq), (k, sk), (v, sk))]
        o1 = sage.flash_attn_func(*xs, causal=True)
        o1.backward(g[sq][None])
        assert torch.equal(o1[0], out[sq])
        for x, s, x1 in zip((q, k, v), (sq, sk, sk), xs):
            assert torch.equal(x.grad[s], x1.grad[0])
    with pytest.raises(ValueError, match=r"window_size\[1\]"):
        sage.flash_attn_varlen_func(q, k, v, cq, ck, 70, 70, window_size=(8, -3))


@pytest.mark.torch
def test_flash_attn_varlen_func_traces_with_fullgraph():
    torch = pytest.importorskip("torch")
    import sagebwd_cp.torch as sage

    cu = torch.tensor([0, 20, 50], dtype=torch.int32)
    q, k, v = (torch.randn(50, 2, 64, dtype=torch.float16, requires_grad=True) for _ in range(3))
    f = lambda q, k, v: sage.flash_attn_varlen_func(q, k, v, cu, cu, 30, 30, causal=True)
    eager = f(q, k, v)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    compiled.sum().backward()
    assert torch.equal(compiled, eager) and q.grad is not None and q.grad.shape == q.shape
