"""Chunked attention with exact LSE: partial calls over K/V chunks merged by LSE against one call
(output and gradients, causal and not, GQA, both layouts), the merge's edge cases, the LSE frame
conversion, and the torch adapter's ``chunked_attention`` (emulator on the CPU; the GPU tests at
the end run the kernels)."""
import numpy as np
import pytest

import sagebwd_cp
from sagebwd_cp.host import reference
from sagebwd_cp.options import AttentionOptions

torch = pytest.importorskip("torch")
import sagebwd_cp.torch as st  # noqa: E402

# One call and the merged chunks quantize alike (same μ_K, chunks on 64-token V blocks): they differ
# by float32 merging and the 16-bit rounding of each chunk's results, far below quantization error.
CHUNK_TOL = 5e-3


def rel_l2(x, ref):
    x, ref = (np.asarray(a.detach().double().cpu() if isinstance(a, torch.Tensor) else a, dtype=np.float64) for a in (x, ref))
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def _numpy_inputs(b=1, hq=2, hk=1, lq=256, lk=256, d=32, seed=0, k_offset=1.5):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, hq, lq, d)).astype(np.float16)
    # A common offset in K is what K-smoothing removes: it makes a wrong μ_K show in dQ.
    k = (rng.standard_normal((b, hk, lk, d)) + k_offset).astype(np.float16)
    v = rng.standard_normal((b, hk, lk, d)).astype(np.float16)
    do = rng.standard_normal((b, hq, lq, d)).astype(np.float16)
    return q, k, v, do


def _neutral_chunked(q, k, v, do, bounds, causal, shared_mean=True):
    """Out, LSE and grads of attention over key chunks ``bounds`` through the neutral API alone."""
    lq, lk = q.shape[2], k.shape[2]
    chunks = [(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    means = [sagebwd_cp.key_mean([k]) if shared_mean else sagebwd_cp.key_mean([k[:, :, a:b]]) for a, b in chunks]
    out = np.zeros(q.shape, np.float32)
    lse = np.full(q.shape[:3], -np.inf, np.float32)
    for (a, b), mean in zip(chunks, means):
        for r0, r1, c in sagebwd_cp.causal_pieces(lq, lk, a, b, causal):
            o, l = sagebwd_cp.attention(q[:, :, r0:r1], k[:, :, a:b], v[:, :, a:b], causal=c, return_lse=True,
                                        k_mean=mean)
            out[:, :, r0:r1], lse[:, :, r0:r1] = sagebwd_cp.merge_attention([out[:, :, r0:r1], o],
                                                                            [lse[:, :, r0:r1], l])
    out16 = out.astype(q.dtype)
    dq, dk, dv = (np.zeros(x.shape, np.float32) for x in (q, k, v))
    for (a, b), mean in zip(chunks, means):
        for r0, r1, c in sagebwd_cp.causal_pieces(lq, lk, a, b, causal):
            g = sagebwd_cp.attention_backward_lse(q[:, :, r0:r1], k[:, :, a:b], v[:, :, a:b], out16[:, :, r0:r1],
                                                  np.ascontiguousarray(lse[:, :, r0:r1]), do[:, :, r0:r1], causal=c,
                                                  k_mean=mean)
            dq[:, :, r0:r1] += g[0]
            dk[:, :, a:b] += g[1]
            dv[:, :, a:b] += g[2]
    return out16, lse, (dq, dk, dv)


@pytest.mark.parametrize("causal", [False, True])
def test_neutral_api_four_chunks_match_one_call(causal):
    q, k, v, do = _numpy_inputs()
    o1, lse1, saved = sagebwd_cp.attention_forward(q, k, v, causal=causal, return_lse=True)
    g1 = sagebwd_cp.attention_backward(saved, do)
    out, lse, grads = _neutral_chunked(q, k, v, do, [0, 64, 128, 192, 256], causal)
    assert rel_l2(out, o1) < CHUNK_TOL
    np.testing.assert_allclose(lse, lse1, rtol=0, atol=1e-4)
    for g, ref in zip(grads, g1):
        assert rel_l2(g, ref) < CHUNK_TOL
    # And both are the quantized attention, close to the exact one.
    ro, _ = reference.attention_reference(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                                          causal=causal)
    assert rel_l2(out, ro) < 0.05


def test_per_chunk_key_means_would_break_dq():
    """Why the chunks share one μ_K: with each chunk's own, dQ misses c·Σ_chunks rowsum(dS)·μ_K(chunk)."""
    q, k, v, do = _numpy_inputs()
    _, saved = sagebwd_cp.attention_forward(q, k, v)
    dq1 = sagebwd_cp.attention_backward(saved, do)[0]
    bounds = [0, 64, 128, 192, 256]
    shared = rel_l2(_neutral_chunked(q, k, v, do, bounds, False)[2][0], dq1)
    own = rel_l2(_neutral_chunked(q, k, v, do, bounds, False, shared_mean=False)[2][0], dq1)
    assert own > 10 * shared and own > 0.02


def test_causal_pieces_cover_the_bottom_right_mask():
    for lq, lk, bounds in [(256, 256, [0, 64, 128, 192, 256]), (100, 300, [0, 37, 200, 300]),
                           (300, 100, [0, 50, 100]), (64, 64, [0, 64])]:
        seen = np.zeros((lq, lk), bool)
        for a, b in zip(bounds[:-1], bounds[1:]):
            for r0, r1, c in sagebwd_cp.causal_pieces(lq, lk, a, b, True):
                seen[r0:r1, a:b] |= reference.causal_mask(r1 - r0, b - a, c)
        np.testing.assert_array_equal(seen, reference.causal_mask(lq, lk, True))
    assert sagebwd_cp.causal_pieces(10, 20, 5, 5, True) == []
    assert sagebwd_cp.causal_pieces(10, 20, 0, 20, False) == [(0, 10, False)]
    with pytest.raises(ValueError, match="start, stop"):
        sagebwd_cp.causal_pieces(10, 20, 5, 30, True)


# ------------------------------------------------------------------------------ merge and LSE frame

def test_merge_is_the_softmax_over_the_union():
    rng = np.random.default_rng(1)
    s = rng.standard_normal((1, 2, 5, 12)) * 3  # scores of 5 rows over 12 keys
    vals = rng.standard_normal((1, 2, 12, 4))

    def part(a, b):
        m = s[..., a:b]
        lse = np.log(np.exp(m).sum(-1))
        return (np.exp(m - lse[..., None]) @ vals[:, :, a:b]).astype(np.float32), lse.astype(np.float32)

    parts = [part(0, 3), part(3, 8), part(8, 12)]
    out, lse = sagebwd_cp.merge_attention([p[0] for p in parts], [p[1] for p in parts])
    full_o, full_l = part(0, 12)
    assert out.dtype == np.float32 and lse.dtype == np.float32
    np.testing.assert_allclose(out, full_o, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, full_l, rtol=1e-6)
    # NHD: the same rows, the output's token and head axes swapped.
    out_n, _ = sagebwd_cp.merge_attention([p[0].transpose(0, 2, 1, 3) for p in parts], [p[1] for p in parts],
                                          layout="NHD")
    np.testing.assert_allclose(out_n, out.transpose(0, 2, 1, 3), rtol=1e-6)


def test_merge_rows_without_keys_and_nans():
    o_a = np.full((1, 1, 4, 2), 2.0, np.float32)
    o_b = np.full((1, 1, 4, 2), 5.0, np.float32)
    ninf, nan = -np.inf, np.nan
    lse_a = np.array([[[ninf, ninf, 0.0, nan]]], np.float32)
    lse_b = np.array([[[ninf, 1.0, ninf, 0.0]]], np.float32)
    out, lse = sagebwd_cp.merge_attention([o_a, o_b], [lse_a, lse_b])
    np.testing.assert_array_equal(out[0, 0, 0], [0, 0])  # no key in either: 0, LSE -inf
    assert lse[0, 0, 0] == ninf
    np.testing.assert_array_equal(out[0, 0, 1], [5, 5])  # only b
    np.testing.assert_array_equal(out[0, 0, 2], [2, 2])  # only a
    assert lse[0, 0, 1] == 1.0 and lse[0, 0, 2] == 0.0
    assert np.isnan(lse[0, 0, 3]) and np.isnan(out[0, 0, 3]).all()
    o_nan = o_b.copy()
    o_nan[0, 0, 1, 0] = nan
    assert np.isnan(sagebwd_cp.merge_attention([o_a, o_nan], [lse_a, lse_b])[0][0, 0, 1, 0])
    # torch tensors: the same function, torch's math
    out_t, lse_t = sagebwd_cp.merge_attention([torch.from_numpy(o_a), torch.from_numpy(o_b)],
                                              [torch.from_numpy(lse_a), torch.from_numpy(lse_b)])
    np.testing.assert_array_equal(out_t.numpy(), out)
    np.testing.assert_array_equal(lse_t.numpy(), lse)
    with pytest.raises(ValueError, match="outs, lses"):
        sagebwd_cp.merge_attention([o_a], [lse_a, lse_b])


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_natural_lse_converts_back_to_the_kernels_lse2(layout):
    """lse_to_lse2 inverts the returned LSE's add-back: the saved base-2 LSE, +inf for rows that see
    no key (causal with more queries than keys)."""
    q, k, v, _ = _numpy_inputs(hq=4, hk=2, lq=100, lk=70, d=16)
    if layout == "NHD":
        q, k, v = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v))
    _, lse, saved = sagebwd_cp.attention_forward(q, k, v, causal=True, layout=layout, return_lse=True)
    lse2 = sagebwd_cp.lse_to_lse2(lse, q, saved.k_mean.obj, layout=layout)
    ref = saved.lse2.obj
    assert np.isinf(ref).any()
    np.testing.assert_array_equal(np.isinf(lse2), np.isinf(ref))
    live = np.isfinite(ref)
    np.testing.assert_allclose(lse2[live], ref[live], rtol=0, atol=2e-5)
    with pytest.raises(ValueError, match="lse: expected shape"):
        sagebwd_cp.lse_to_lse2(lse[:, :, 1:], q, saved.k_mean.obj, layout=layout)
    with pytest.raises(TypeError, match="lse: expected dtype float32"):
        sagebwd_cp.lse_to_lse2(lse.astype(np.float64), q, saved.k_mean.obj, layout=layout)
    with pytest.raises(ValueError, match="k_mean: expected shape"):
        sagebwd_cp.lse_to_lse2(lse, q, saved.k_mean.obj[:, :, :8], layout=layout)


def test_forward_with_a_given_key_mean_quantizes_with_it():
    q, k, v, do = _numpy_inputs(lq=64, lk=64, d=16)
    own = sagebwd_cp.key_mean([k])
    o1, s1 = sagebwd_cp.attention_forward(q, k, v)
    o2, s2 = sagebwd_cp.attention_forward(q, k, v, k_mean=own)
    np.testing.assert_array_equal(o1, o2)  # the token mean is what the forward computes itself
    np.testing.assert_array_equal(s2.k_mean.obj, own)
    o3, s3 = sagebwd_cp.attention_forward(q, k, v, k_mean=own + 0.5)
    np.testing.assert_array_equal(s3.k_mean.obj, own + 0.5)
    assert 0 < rel_l2(o3, o1) < 0.05  # another quantization of the same attention
    with pytest.raises(ValueError, match="k_mean: expected shape"):
        sagebwd_cp.attention(q, k, v, k_mean=own[:, :, :8])
    with pytest.raises(ValueError, match="k_mean: μ_K belongs to K-smoothing"):
        sagebwd_cp.attention(q, k, v, k_mean=own, smooth_k=False)


def test_backward_from_the_natural_lse_of_one_call():
    q, k, v, do = _numpy_inputs(lq=100, lk=130, d=16)
    out, lse, saved = sagebwd_cp.attention_forward(q, k, v, causal=True, return_lse=True)
    g1 = sagebwd_cp.attention_backward(saved, do)
    g2 = sagebwd_cp.attention_backward_lse(q, k, v, out, lse, do, causal=True)  # μ_K computed again
    for a, b in zip(g2, g1):
        assert rel_l2(a, b) < 1e-3


# ------------------------------------------------------------------------------ torch adapter

def _torch_inputs(layout, dtype, b=1, hq=4, hk=2, lq=256, lk=256, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rand(h, n, offset=0.0):
        x = torch.randn((b, h, n, d), generator=g) + offset
        x = x.to(dtype)
        return (x if layout == "HND" else x.transpose(1, 2).contiguous()).requires_grad_()

    return rand(hq, lq), rand(hk, lk, 1.5), rand(hk, lk), rand(hq, lq).detach()


@pytest.mark.parametrize("layout,dtype,causal", [("HND", torch.float16, False), ("HND", torch.float16, True),
                                                 ("NHD", torch.bfloat16, True), ("NHD", torch.float16, False)])
def test_chunked_attention_matches_one_call(layout, dtype, causal):
    q, k, v, do = _torch_inputs(layout, dtype)
    seq = 2 if layout == "HND" else 1
    o1 = st.attention(q, k, v, causal=causal, layout=layout)
    g1 = torch.autograd.grad(o1, (q, k, v), do)
    o2, lse = st.chunked_attention(q, k.chunk(4, seq), v.chunk(4, seq), causal=causal, layout=layout,
                                   return_lse=True)
    g2 = torch.autograd.grad(o2, (q, k, v), do)
    assert o2.dtype == dtype and lse.dtype == torch.float32 and not lse.requires_grad
    tol = CHUNK_TOL if dtype == torch.float16 else 2 * CHUNK_TOL  # bf16: coarser rounding of each chunk
    assert rel_l2(o2, o1) < tol
    for a, b in zip(g2, g1):
        assert a.dtype == dtype and rel_l2(a, b) < tol
    _, lse1 = st.attention_lse(q, k, v, causal=causal, layout=layout)
    torch.testing.assert_close(lse, lse1, rtol=0, atol=1e-4)


def test_chunked_attention_uneven_chunks_more_keys_than_queries():
    """Bottom-right causal over Lq < Lk with chunks of different lengths; the chunk of 100 keys cuts
    V's 64-token quantization blocks differently, so the bound is against exact attention."""
    q, k, v, do = _torch_inputs("HND", torch.float16, hq=2, hk=2, lq=128, lk=300, d=16)
    chunks = [100, 64, 136]
    o = st.chunked_attention(q, k.split(chunks, 2), v.split(chunks, 2), causal=True)
    grads = torch.autograd.grad(o, (q, k, v), do)
    ro, _ = reference.attention_reference(*(x.detach().double().numpy() for x in (q, k, v)), causal=True)
    rgrads = reference.attention_reference_backward(*(x.detach().double().numpy() for x in (q, k, v, do)),
                                                    causal=True)
    o1 = st.attention(q, k, v, causal=True)
    g1 = torch.autograd.grad(o1, (q, k, v), do)
    assert rel_l2(o, ro) < 1.5 * rel_l2(o1, ro) + 1e-3
    for a, b, r in zip(grads, g1, rgrads):
        assert rel_l2(a, r) < 1.5 * rel_l2(b, r) + 1e-3


def test_chunked_attention_options_and_rows_without_keys():
    """Options reach every chunk's forward and backward (no K-smoothing, Q-smoothing, paper
    granularity, deterministic), and with more queries than keys (causal) the rows that see no key
    are 0 with zero gradient, as in one call."""
    q, k, v, do = _torch_inputs("HND", torch.float16, hq=2, hk=1, lq=192, lk=128, d=16)
    opts = dict(causal=True, smooth_k=False, smooth_q=True, granularity="paper", deterministic=True)
    o1 = st.attention(q, k, v, **opts)
    g1 = torch.autograd.grad(o1, (q, k, v), do)
    o2, lse = st.chunked_attention(q, k.chunk(2, 2), v.chunk(2, 2), return_lse=True, **opts)
    g2 = torch.autograd.grad(o2, (q, k, v), do)
    assert torch.isneginf(lse[:, :, :64]).all() and torch.isfinite(lse[:, :, 64:]).all()
    assert not o2[:, :, :64].any() and not g2[0][:, :, :64].any()
    assert rel_l2(o2, o1) < CHUNK_TOL
    for a, b in zip(g2, g1):
        assert rel_l2(a, b) < CHUNK_TOL


def test_attention_backward_lse_torch_single_chunk():
    q, k, v, do = _torch_inputs("NHD", torch.float16, lq=80, lk=80, d=16)
    o1 = st.attention(q, k, v, layout="NHD")
    g1 = torch.autograd.grad(o1, (q, k, v), do)
    out, lse = st.attention_lse(q, k, v, layout="NHD")
    torch.testing.assert_close(out, o1.detach(), rtol=0, atol=0)
    g2 = st.attention_backward_lse(q, k, v, out, lse, do, layout="NHD")
    for a, b in zip(g2, g1):
        assert rel_l2(a, b) < 1e-3


def test_chunked_attention_argument_errors():
    q, k, v, _ = _torch_inputs("HND", torch.float16, lq=64, lk=64, d=16)
    with pytest.raises(ValueError, match="ks, vs"):
        st.chunked_attention(q, [k], [v, v])
    with pytest.raises(ValueError, match="layout"):
        st.chunked_attention(q, [k], [v], layout="BHSD")
    with pytest.raises(TypeError, match="causal"):
        st.chunked_attention(q, [k], [v], causal="yes")


def test_chunked_attention_compiles_fullgraph():
    q, k, v, do = _torch_inputs("HND", torch.float16, hq=2, hk=2, lq=128, lk=128, d=16)

    def f(q, k, v):
        return st.chunked_attention(q, k.chunk(2, 2), v.chunk(2, 2), causal=True)

    o = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    g = torch.autograd.grad(o, (q, k, v), do)
    oe = f(q, k, v)
    ge = torch.autograd.grad(oe, (q, k, v), do)
    torch.testing.assert_close(o, oe, rtol=0, atol=0)
    for a, b in zip(g, ge):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_attention_lse_op_passes_opcheck():
    q, k, v, _ = _torch_inputs("HND", torch.float16, hq=2, hk=1, lq=64, lk=64, d=16)
    mean = st.key_mean([k.detach()])
    torch.library.opcheck(torch.ops.sagebwd_cp.attention_lse.default,
                          (q.detach(), k.detach(), v.detach(), mean, *AttentionOptions(causal=True)))


# ------------------------------------------------------------------------------ GPU

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_gpu_chunked_attention_matches_one_call(dtype, causal, layout):
    from gpu_helpers import make_qkv

    q, k, v = make_qkv(2, 8, 2, 2048, 2048, 128 if layout == "HND" else 64, dtype, layout=layout, seed=3)
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    do = torch.randn_like(q)
    seq = 2 if layout == "HND" else 1
    o1 = st.attention(q, k, v, causal=causal, layout=layout)
    g1 = torch.autograd.grad(o1, (q, k, v), do)
    # Chunks of 512 keys: whole 128-key forward tiles, so each tile's P̂ is quantized as in one call.
    o2 = st.chunked_attention(q, k.chunk(4, seq), v.chunk(4, seq), causal=causal, layout=layout)
    g2 = torch.autograd.grad(o2, (q, k, v), do)
    tol = CHUNK_TOL if dtype == "float16" else 2 * CHUNK_TOL
    assert rel_l2(o2, o1) < tol
    for a, b in zip(g2, g1):
        assert rel_l2(a, b) < tol


@pytest.mark.gpu
def test_gpu_neutral_api_chunks_and_given_key_mean():
    from gpu_helpers import make_qkv

    q, k, v = make_qkv(1, 4, 4, 1024, 1024, 64, "float16", seed=4)
    do = torch.randn_like(q)
    o1, lse1, saved = sagebwd_cp.attention_forward(q, k, v, causal=True, return_lse=True)
    g1 = sagebwd_cp.attention_backward(saved, do)
    mean = sagebwd_cp.key_mean([k])
    torch.testing.assert_close(mean, saved.k_mean.obj, rtol=1e-6, atol=1e-6)
    out = torch.zeros(q.shape, dtype=torch.float32, device="cuda")
    lse = torch.full(q.shape[:3], float("-inf"), device="cuda")
    bounds = [0, 256, 512, 768, 1024]
    for a, b in zip(bounds[:-1], bounds[1:]):
        for r0, r1, c in sagebwd_cp.causal_pieces(1024, 1024, a, b, True):
            o, l = sagebwd_cp.attention(q[:, :, r0:r1], k[:, :, a:b], v[:, :, a:b], causal=c, return_lse=True,
                                        k_mean=mean)
            out[:, :, r0:r1], lse[:, :, r0:r1] = sagebwd_cp.merge_attention([out[:, :, r0:r1], o],
                                                                            [lse[:, :, r0:r1], l])
    out = out.half()
    assert rel_l2(out, o1) < CHUNK_TOL
    torch.testing.assert_close(lse, lse1, rtol=0, atol=1e-4)
    dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float32, device="cuda") for x in (q, k, v))
    for a, b in zip(bounds[:-1], bounds[1:]):
        for r0, r1, c in sagebwd_cp.causal_pieces(1024, 1024, a, b, True):
            g = sagebwd_cp.attention_backward_lse(q[:, :, r0:r1], k[:, :, a:b], v[:, :, a:b], out[:, :, r0:r1],
                                                  lse[:, :, r0:r1].contiguous(), do[:, :, r0:r1], causal=c,
                                                  k_mean=mean)
            dq[:, :, r0:r1] += g[0]
            dk[:, :, a:b] += g[1]
            dv[:, :, a:b] += g[2]
    for a, b in zip((dq, dk, dv), g1):
        assert rel_l2(a, b) < CHUNK_TOL


@pytest.mark.gpu
def test_gpu_ring_attention_world_of_one_is_chunked_attention(tmp_path):
    import torch.distributed as dist
    from gpu_helpers import make_qkv

    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        q, k, v = make_qkv(1, 4, 2, 2048, 2048, 128, "bfloat16", seed=5)
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        do = torch.randn_like(q)
        # Deterministic backwards: the default one adds dQ's partials in whatever order they come.
        o1 = st.chunked_attention(q, [k], [v], causal=True, deterministic=True)
        g1 = torch.autograd.grad(o1, (q, k, v), do)
        o2 = st.ring_attention(q, k, v, causal=True, deterministic=True)
        g2 = torch.autograd.grad(o2, (q, k, v), do)
        torch.testing.assert_close(o2, o1, rtol=0, atol=0)
        for a, b in zip(g2, g1):
            assert rel_l2(a, b) < 1e-6
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.parametrize("smooth_q", [False, True])
def test_gpu_forward_with_a_given_key_mean_matches_the_emulator(smooth_q):
    """The kernels quantize K with the μ_K given (the pre-pass's MEAN_GIVEN path in the forward),
    the returned LSE adds back c·q·μ_K of that μ_K, and a training forward returns it as its saved μ_K."""
    from gpu_helpers import forward_key_tile, make_qkv, poisoned_workspaces, to_hnd_numpy
    from sagebwd_cp.host import emulator

    q, k, v = make_qkv(1, 4, 2, 300, 333, 64, "float16", seed=6)
    mean = sagebwd_cp.key_mean([k]) + 0.25  # not K's own token mean
    with poisoned_workspaces():
        out, lse = sagebwd_cp.attention(q, k, v, causal=True, return_lse=True, k_mean=mean, smooth_q=smooth_q)
        _, lse_t, saved = sagebwd_cp.attention_forward(q, k, v, causal=True, return_lse=True, k_mean=mean,
                                                       smooth_q=smooth_q)
    torch.cuda.synchronize()
    assert saved.k_mean.obj is mean
    o_emu, lse_emu, _ = emulator.emulate_forward(*(to_hnd_numpy(x, "HND") for x in (q, k, v)), causal=True,
                                                  smooth_q=smooth_q, key_tile=forward_key_tile(64),
                                                  k_mean=mean.cpu().numpy())
    assert rel_l2(out, o_emu) < 2e-3
    np.testing.assert_allclose(lse.cpu().numpy(), lse_emu, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(lse_t, lse, rtol=0, atol=0)
