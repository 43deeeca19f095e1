"""Sliding windows on the GPU, both kernel families (the default, wgmma on sm_90, and mma.sync), with
poisoned workspaces: the forward and backward against the emulator of the same quantized algorithm
(and, loosely, the exact FP64 reference), over ragged shapes, Lq != Lk, GQA, causal and not, windows
that leave rows without keys; a window wider than the sequence equal bit for bit to plain causal
attention (the window kernels skip nothing then and must compute the same); packed batches equal to
their dense calls; deterministic gradients repeatable."""
import numpy as np
import pytest

import sagebwd_cp
from gpu_helpers import KERNELS, KERNEL_IDS, forward_key_tile, make_qkv, poisoned_workspaces, rel_l2, to_hnd_numpy
from sagebwd_cp.host import emulator, reference

pytestmark = [pytest.mark.gpu, pytest.mark.torch]

EMU_TOL = {"float16": (2e-3, 4e-3), "bfloat16": (8e-3, 1e-2)}  # (forward, backward), as the dense tests'

# (B, Hq, Hkv, Lq, Lk, D), causal, window_size
CASES = [
    ((1, 4, 1, 1000, 1000, 64), True, (100, -1)),
    ((1, 2, 2, 300, 257, 128), False, (40, 17)),
    ((2, 2, 2, 17, 17, 128), True, (0, -1)),
    ((1, 4, 2, 100, 1000, 128), False, (-1, 30)),
    ((1, 2, 2, 1000, 100, 64), True, (50, -1)),  # rows before Lq - Lk - 50 see no key
    ((1, 1, 1, 4097, 4097, 64), True, (1000, -1)),
    ((1, 2, 1, 300, 300, 80), False, (64, 64)),
    ((1, 2, 2, 1, 1, 64), False, (3, 3)),
]
IDS = [f"{'x'.join(map(str, s))}-{'causal' if c else 'full'}-{w[0]}.{w[1]}" for s, c, w in CASES]


def _grad_output(q, seed):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(q.shape, generator=g, device="cuda", dtype=torch.float32).to(q.dtype)


def _run(q, k, v, do, causal, window, deterministic=False, smooth_q=False, granularity="fine"):
    with poisoned_workspaces():
        out, lse, saved = sagebwd_cp.attention_forward(q, k, v, causal=causal, window_size=window, smooth_q=smooth_q,
                                                       return_lse=True)
        grads = sagebwd_cp.attention_backward(saved, do, granularity=granularity, deterministic=deterministic)
    return out, lse, saved, grads


def _check_against_the_emulator(q, k, v, do, causal, window, dtype, smooth_q=False, granularity="fine",
                                deterministic=False):
    """Forward and backward on the GPU against the emulator of the same quantized algorithm, the rows that see
    no key, and (loosely) the exact FP64 reference."""
    import torch

    out, lse, saved, grads = _run(q, k, v, do, causal, window, deterministic, smooth_q, granularity)
    torch.cuda.synchronize()
    qh, kh, vh, oh, doh = (to_hnd_numpy(x, "HND") for x in (q, k, v, out, do))
    key_tile = forward_key_tile(q.shape[-1], causal=causal, window=window)
    o_emu, lse_emu, _ = emulator.emulate_forward(qh, kh, vh, causal=causal, window=window, smooth_q=smooth_q,
                                                  dtype=dtype, key_tile=key_tile)
    fwd_tol, bwd_tol = EMU_TOL[dtype]
    assert rel_l2(oh, o_emu) < fwd_tol
    lse = lse.cpu().numpy()
    finite = np.isfinite(lse_emu)
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    np.testing.assert_allclose(lse[finite], lse_emu[finite], rtol=1e-5, atol=1e-4)
    assert not oh[~np.broadcast_to(finite[..., None], oh.shape)].any()  # rows without keys give 0

    state = emulator.backward_state(qh, kh, vh, oh, saved.lse2.obj.cpu().numpy(), causal=causal, window=window,
                                    smooth_q=smooth_q, dtype=dtype)
    expected = emulator.emulate_backward(state, doh, granularity=granularity)
    exact = reference.attention_reference_backward(qh, kh, vh, doh, causal=causal, window=window)
    for name, g, e, x in zip(("dq", "dk", "dv"), grads, expected, exact):
        gh = to_hnd_numpy(g, "HND")
        assert np.isfinite(gh).all(), name
        assert rel_l2(gh, e) < bwd_tol, (name, rel_l2(gh, e))
        if np.abs(x).max() > 1e-3:  # the algorithm's own error against FP64 (windows of one key have none)
            assert rel_l2(gh, x) < 0.1, (name, rel_l2(gh, x))
    o_ref, _ = reference.attention_reference(qh, kh, vh, causal=causal, window=window)
    assert rel_l2(oh, o_ref) < 0.05


@pytest.mark.parametrize("kernels", KERNELS, ids=KERNEL_IDS, indirect=True)
@pytest.mark.parametrize("shape,causal,window", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_windowed_attention_matches_the_emulator(kernels, shape, causal, window, dtype):
    b, hq, hk, lq, lk, d = shape
    q, k, v = make_qkv(b, hq, hk, lq, lk, d, dtype, seed=lq + 5 * lk)
    _check_against_the_emulator(q, k, v, _grad_output(q, seed=lq + lk), causal, window, dtype)


# Causal, a band open on neither side, Lq < Lk with the band right of the diagonal, rows that see no key.
SMOOTH_Q_CASES = [CASES[0], CASES[1], CASES[3], CASES[4]]


@pytest.mark.parametrize("kernels", KERNELS, ids=KERNEL_IDS, indirect=True)
@pytest.mark.parametrize("shape,causal,window", SMOOTH_Q_CASES, ids=[IDS[CASES.index(c)] for c in SMOOTH_Q_CASES])
@pytest.mark.parametrize("dtype,granularity,deterministic", [("float16", "fine", False), ("bfloat16", "paper", True)])
def test_windowed_q_smoothing_matches_the_emulator(kernels, shape, causal, window, dtype, granularity, deterministic):
    """Q-smoothing under a window (the windowed kernels with SB_BIAS), queries with a common offset for the
    smoothing to take out."""
    b, hq, hk, lq, lk, d = shape
    q, k, v = make_qkv(b, hq, hk, lq, lk, d, dtype, seed=lq + 3 * lk)
    q = q + 1.0
    _check_against_the_emulator(q, k, v, _grad_output(q, seed=lq + 2 * lk), causal, window, dtype, smooth_q=True,
                                granularity=granularity, deterministic=deterministic)


@pytest.mark.parametrize("kernels", KERNELS, ids=KERNEL_IDS, indirect=True)
@pytest.mark.parametrize("d,dtype", [(64, "float16"), (128, "bfloat16")])
def test_a_window_wider_than_the_sequence_is_causal_attention_bit_for_bit(kernels, d, dtype):
    """O, the LSE, dK and dV bit for bit (dQ's atomic adds come in any order: close) where the window is wider than
    specs.NARROW_BAND_KEYS too; a narrower one takes the wgmma forward's 64-key tiles (specs.forward_key_tile), the
    same attention with P̂ rounded per 64 keys: close."""
    import torch

    from sagebwd_cp.gpu import specs

    q, k, v = make_qkv(1, 4, 2, 700, 700, d, dtype, seed=9)
    do = _grad_output(q, seed=10)
    causal = _run(q, k, v, do, True, (-1, -1))
    wide = _run(q, k, v, do, True, (specs.NARROW_BAND_KEYS + 1, -1))
    torch.cuda.synchronize()
    assert torch.equal(causal[0], wide[0]) and torch.equal(causal[1], wide[1])
    assert torch.equal(causal[3][1], wide[3][1]) and torch.equal(causal[3][2], wide[3][2])
    dq, dq_wide = causal[3][0].float(), wide[3][0].float()
    assert (dq - dq_wide).abs().max() <= 1e-2 * dq.abs().max()
    covering = _run(q, k, v, do, True, (700, -1))  # (its P̂'s rounding moves O by 5-6e-3 on an H200)
    for a, b in zip((covering[0], *covering[3]), (causal[0], *causal[3])):
        assert rel_l2(a.float().cpu().numpy(), b.float().cpu().numpy()) < 1e-2
    narrow = _run(q, k, v, do, True, (100, -1))[0]
    assert not torch.equal(causal[0], narrow)


@pytest.mark.parametrize("kernels", KERNELS, ids=KERNEL_IDS, indirect=True)
@pytest.mark.parametrize("causal,window", [(True, (70, -1)), (False, (33, 5))])
def test_each_packed_sequence_equals_its_dense_call(kernels, causal, window):
    import torch

    lens_q, lens_k = [1, 130, 300, 64, 1000], [1, 130, 257, 64, 900]
    g = torch.Generator(device="cuda").manual_seed(3)
    # (The packed and dense deterministic kernels add dQ in the same order.)
    rand = lambda n, h: torch.randn((n, h, 128), generator=g, device="cuda").to(torch.float16)
    cu = lambda lens: torch.tensor([0] + np.cumsum(lens).tolist(), dtype=torch.int32, device="cuda")
    q, k, v, do = rand(sum(lens_q), 4), rand(sum(lens_k), 2), rand(sum(lens_k), 2), rand(sum(lens_q), 4)
    cq, ck = cu(lens_q), cu(lens_k)
    with poisoned_workspaces():
        out, lse, saved = sagebwd_cp.attention_varlen_forward(q, k, v, cq, ck, max(lens_q), max(lens_k), causal=causal,
                                                              window_size=window, return_lse=True)
        dq, dk, dv = sagebwd_cp.attention_backward(saved, do, deterministic=True)
    for b in range(len(lens_q)):
        sq, sk = slice(int(cq[b]), int(cq[b + 1])), slice(int(ck[b]), int(ck[b + 1]))
        with poisoned_workspaces():
            o1, l1, s1 = sagebwd_cp.attention_forward(q[sq][None], k[sk][None], v[sk][None], causal=causal,
                                                      window_size=window, layout="NHD", return_lse=True)
            g1 = sagebwd_cp.attention_backward(s1, do[sq][None], deterministic=True)
        torch.cuda.synchronize()
        assert torch.equal(out[sq], o1[0]) and torch.equal(lse[:, sq], l1[0]), b
        assert torch.equal(dq[sq], g1[0][0]) and torch.equal(dk[sk], g1[1][0]) and torch.equal(dv[sk], g1[2][0]), b


@pytest.mark.parametrize("kernels", KERNELS, ids=KERNEL_IDS, indirect=True)
def test_windowed_deterministic_gradients_repeat_bit_for_bit(kernels):
    import torch

    q, k, v = make_qkv(2, 8, 2, 2000, 2000, 128, "bfloat16", seed=4)
    do = _grad_output(q, seed=5)
    first = _run(q, k, v, do, True, (300, -1), deterministic=True)[3]
    for _ in range(2):
        again = _run(q, k, v, do, True, (300, -1), deterministic=True)[3]
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_flash_attn_func_window_size_is_sdpa_with_the_window_mask():
    import torch

    import sagebwd_cp.torch as st

    q, k, v = make_qkv(2, 8, 2, 1500, 1500, 128, "bfloat16", layout="NHD", seed=12)
    for x in (q, k, v):
        x.requires_grad_()
    out = st.flash_attn_func(q, k, v, causal=True, window_size=(256, 0))
    n = q.shape[1]
    i = torch.arange(n, device="cuda")
    mask = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - 256)
    qt, kt, vt = (x.detach().transpose(1, 2).float().requires_grad_() for x in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(qt, kt.repeat_interleave(4, 1), vt.repeat_interleave(4, 1),
                                                           attn_mask=mask)
    g = torch.randn_like(ref)
    out.backward(g.transpose(1, 2).to(out.dtype))
    ref.backward(g)
    assert rel_l2(out.float().transpose(1, 2).detach().cpu().numpy(), ref.detach().cpu().numpy()) < 0.03
    for x, r in zip((q, k, v), (qt, kt, vt)):
        assert rel_l2(x.grad.float().transpose(1, 2).cpu().numpy(), r.grad.cpu().numpy()) < 0.06


@pytest.mark.parametrize("kernels", KERNELS, ids=KERNEL_IDS, indirect=True)
@pytest.mark.parametrize("layout,window", [("HND", (-1, -1)), ("NHD", (200, -1))])
def test_sinks_against_the_exact_reference(kernels, layout, window):
    """Attention sinks around the kernels (sagebwd_cp/sinks.py): output, dQ, dK, dV and dσ through torch's
    autograd, against FP64 on the host; inference equal to the training forward bit for bit."""
    import torch

    import sagebwd_cp.torch as st

    q, k, v = make_qkv(2, 8, 2, 1000, 1000, 128, "bfloat16", layout=layout, seed=21)
    sinks = (2 * torch.randn(8, generator=torch.Generator().manual_seed(2))).cuda().requires_grad_()
    for x in (q, k, v):
        x.requires_grad_()
    out = st.attention(q, k, v, causal=True, layout=layout, window_size=window, sinks=sinks)
    do = _grad_output(out, seed=22)
    out.backward(do)
    with torch.no_grad():
        assert torch.equal(st.attention(q, k, v, causal=True, layout=layout, window_size=window, sinks=sinks), out)
    host = [to_hnd_numpy(x.detach(), layout).astype(np.float64) for x in (q, k, v)]
    s = sinks.detach().cpu().double().numpy()
    o_ref, _ = reference.attention_reference(*host, causal=True, window=window, sinks=s)
    refs = reference.attention_reference_backward(*host, to_hnd_numpy(do, layout), causal=True, window=window, sinks=s)
    assert rel_l2(to_hnd_numpy(out.detach(), layout), o_ref) < 0.03
    for x, ref in zip((q, k, v), refs):
        assert rel_l2(to_hnd_numpy(x.grad, layout), ref) < 0.06
    assert rel_l2(sinks.grad.cpu().numpy(), refs[3]) < 0.06


@pytest.mark.parametrize("layout,shape", [("HND", (2, 8, 2, 300, 257, 128)), ("NHD", (1, 4, 4, 77, 77, 64))])
def test_the_sinks_gradient_reads_delta_from_the_row_statistics(layout, shape):
    """A dense sink backward takes δ = rowsum(dO ∘ O) from the backward's own row statistics (api.run_backward
    want_delta: a view of the kept `stats`, backward_rows.cu row_stats): δ within float32 sums of float64's, in
    (B, Hq, Lq) whatever the layout, and dσ as the formula over O and dO gives it; through the neutral API
    and torch's autograd alike."""
    import torch

    import sagebwd_cp.torch as st
    from sagebwd_cp.api import run_backward
    from sagebwd_cp.options import AttentionOptions
    from sagebwd_cp.sinks import sinks_grad

    b, hq, hk, lq, lk, d = shape
    q, k, v = make_qkv(b, hq, hk, lq, lk, d, "bfloat16", layout=layout, seed=31)
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(3)).cuda()
    out, lse, saved = sagebwd_cp.attention_forward(q, k, v, causal=True, layout=layout, sinks=sinks, return_lse=True)
    do = _grad_output(out, seed=32)
    opts = AttentionOptions(causal=True, layout=layout)
    with poisoned_workspaces():
        grads, delta = run_backward(q, k, v, out, saved.lse2.obj, do, opts, k_mean=saved.k_mean.obj, want_delta=True)
        plain = run_backward(q, k, v, out, saved.lse2.obj, do, opts, k_mean=saved.k_mean.obj)
    torch.cuda.synchronize()
    torch.testing.assert_close(grads[0], plain[0], rtol=1e-2, atol=1e-2)  # dQ's reduction order is not fixed
    assert torch.equal(grads[1], plain[1]) and torch.equal(grads[2], plain[2])
    exact = (to_hnd_numpy(do, layout).astype(np.float64) * to_hnd_numpy(out, layout)).sum(-1)
    assert delta.shape == (b, hq, lq)
    np.testing.assert_allclose(delta.cpu().numpy(), exact, rtol=1e-4, atol=1e-4)
    *_, dsinks = sagebwd_cp.attention_backward(saved, do)
    formula = sinks_grad(out, lse, do, sinks, layout)
    torch.testing.assert_close(dsinks, formula, rtol=1e-4, atol=1e-4)
    sink_param = sinks.clone().requires_grad_()
    st.attention(q, k, v, causal=True, layout=layout, sinks=sink_param).backward(do)
    torch.testing.assert_close(sink_param.grad, formula, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout,shape,window", [("HND", (2, 8, 2, 300, 257, 128), (-1, -1)),
                                                 ("NHD", (1, 4, 4, 200, 200, 64), (50, -1))])
def test_the_sinks_joined_where_the_lse_is_formed_match_join_sinks(layout, shape, window):
    """kernels/lse.cu natural_lse joins the sinks in its pass (O rescaled in place, both LSEs moved): against
    sinks.join_sinks applied to the same forward without sinks, O within one 16-bit rounding, the LSEs within
    float32 rounding, rows that see no key (the window) included; the output buffer a caller passes is the one
    rescaled."""
    import torch

    from sagebwd_cp.sinks import join_sinks

    b, hq, hk, lq, lk, d = shape
    q, k, v = make_qkv(b, hq, hk, lq, lk, d, "bfloat16", layout=layout, seed=41)
    sinks = (3 * torch.randn(hq, generator=torch.Generator().manual_seed(4))).cuda()
    kw = dict(causal=True, layout=layout, window_size=window, return_lse=True)
    with poisoned_workspaces():
        out, lse, saved = sagebwd_cp.attention_forward(q, k, v, sinks=sinks, **kw)
        o0, lse0, saved0 = sagebwd_cp.attention_forward(q, k, v, **kw)
        buf = torch.full_like(out, float("nan"))
        out_b, lse_b = sagebwd_cp.attention(q, k, v, sinks=sinks, out=buf, **kw)
    torch.cuda.synchronize()
    o_ref, lse_ref, lse2_ref = join_sinks(o0, lse0, saved0.lse2.obj, sinks, layout)
    torch.testing.assert_close(out.float(), o_ref.float(), rtol=8e-3, atol=1e-6)
    assert (out != o_ref).float().mean() < 1e-3
    torch.testing.assert_close(lse, lse_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(saved.lse2.obj, lse2_ref, rtol=1e-6, atol=1e-6)
    assert out_b.data_ptr() == buf.data_ptr() and torch.equal(out_b, out) and torch.equal(lse_b, lse)


def test_sinks_with_a_value_head_dim_of_its_own():
    """Sinks on MLA's 192/128 (the join on an output of V's head dim, natural_lse's column count): output, LSE
    and the four gradients against FP64 on the host, through the neutral API and torch's autograd."""
    import torch

    import sagebwd_cp.torch as st

    g = torch.Generator(device="cuda").manual_seed(51)
    q, k = (torch.randn(1, 4, n, 192, generator=g, device="cuda").to(torch.bfloat16) for n in (300, 257))
    v = torch.randn(1, 2, 257, 128, generator=g, device="cuda").to(torch.bfloat16)
    k = k[:, :2]
    sinks = torch.randn(4, generator=g, device="cuda")
    do = torch.randn(1, 4, 300, 128, generator=g, device="cuda").to(torch.bfloat16)
    with poisoned_workspaces():
        out, lse, saved = sagebwd_cp.attention_forward(q, k, v, causal=True, sinks=sinks, return_lse=True)
        grads = sagebwd_cp.attention_backward(saved, do)
    torch.cuda.synchronize()
    host = [x.float().cpu().double().numpy() for x in (q, k, v)]
    s = sinks.cpu().double().numpy()
    o_ref, lse_ref = reference.attention_reference(*host, causal=True, sinks=s)
    refs = reference.attention_reference_backward(*host, do.float().cpu().numpy(), causal=True, sinks=s)
    assert out.shape[-1] == 128 and rel_l2(out.float().cpu().numpy(), o_ref) < 0.03
    np.testing.assert_allclose(lse.cpu().numpy(), lse_ref, atol=0.05)
    for gr, ref in zip(grads, refs):
        assert rel_l2(gr.float().cpu().numpy(), ref) < 0.06
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    st.attention(*leaves[:3], causal=True, sinks=leaves[3]).backward(do)
    for leaf, gr in zip(leaves, grads):
        torch.testing.assert_close(leaf.grad.float(), gr.float(), rtol=2e-2, atol=2e-2)
