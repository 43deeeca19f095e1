"""Head dims above 128 (to 256) on the GPU: the two-pass mma.sync kernels (forward.cu's O, backward.cu's dK, dV
and dQ a half of the head dim a pass) and sm_90's one-pass wgmma forward against the emulator (same algorithm:
tight) and exact FP64 attention, over ragged shapes, Lq != Lk, GQA, both dtypes and layouts, causal and not,
windows and soft caps, packed batches; the wgmma forward bit for bit the mma.sync one; the options these kernels
do not take are refused by name."""
import math

import numpy as np
import pytest

import sagebwd_cp
from gpu_helpers import forward_key_tile, make_qkv, poisoned_workspaces, rel_l2, to_hnd_numpy
from sagebwd_cp.host import emulator, reference

pytestmark = [pytest.mark.gpu, pytest.mark.torch]

FWD_TOL = {"float16": 2e-3, "bfloat16": 8e-3}
BWD_TOL = {"float16": 4e-3, "bfloat16": 1e-2}
SHAPES = [(1, 2, 2, 1, 1, 256), (2, 4, 2, 300, 257, 256), (1, 2, 1, 100, 700, 192), (1, 4, 2, 700, 130, 200),
          (1, 2, 2, 1100, 1100, 256)]


def _grad_output(q, seed):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(q.shape, generator=g, device="cuda", dtype=torch.float32).to(q.dtype)


@pytest.mark.parametrize("kernels", [{}, {"SAGEBWD_WGMMA": "0"}], ids=["default", "mma.sync"], indirect=True)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype,layout", [("float16", "HND"), ("bfloat16", "NHD")])
def test_forward_and_backward_match_the_emulator(kernels, shape, causal, dtype, layout):
    import torch

    b, hq, hk, lq, lk, d = shape
    q, k, v = make_qkv(b, hq, hk, lq, lk, d, dtype, layout, seed=lq * 7 + lk + d)
    do = _grad_output(q, seed=lq + 3 * lk)
    with poisoned_workspaces():
        out, lse = sagebwd_cp.attention(q, k, v, causal=causal, layout=layout, return_lse=True)
        out2, saved = sagebwd_cp.attention_forward(q, k, v, causal=causal, layout=layout)
        grads = sagebwd_cp.attention_backward(saved, do)
    torch.cuda.synchronize()
    torch.testing.assert_close(out2, out, rtol=0, atol=0)
    host = [to_hnd_numpy(x, layout) for x in (q, k, v)]
    o_emu, lse_emu, _ = emulator.emulate_forward(*host, causal=causal, dtype=dtype,
                                                key_tile=forward_key_tile(d, causal=causal))
    o = to_hnd_numpy(out, layout)
    assert np.isfinite(o).all() and rel_l2(o, o_emu) < FWD_TOL[dtype]
    lse = lse.cpu().numpy()
    finite = np.isfinite(lse_emu)
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    np.testing.assert_allclose(lse[finite], lse_emu[finite], rtol=1e-5, atol=1e-4)
    state = emulator.backward_state(*host, to_hnd_numpy(out2, layout), saved.lse2.obj.cpu().numpy(), causal=causal,
                                    dtype=dtype)
    expected = emulator.emulate_backward(state, to_hnd_numpy(do, layout))
    for name, g, e, x in zip(("dq", "dk", "dv"), grads, expected, (q, k, v)):
        assert tuple(g.shape) == tuple(x.shape) and g.dtype == x.dtype
        gh = to_hnd_numpy(g, layout)
        assert np.isfinite(gh).all(), name
        if not np.any(e):
            assert not np.any(gh), name
            continue
        assert rel_l2(gh, e) < BWD_TOL[dtype], f"{name} vs emulator Rel-L2 {rel_l2(gh, e):.2e}"
    if lq > 1:  # and the algorithm's accuracy against exact attention
        ref = [x.astype(np.float64) for x in host]
        o_ref, _ = reference.attention_reference(*ref, causal=causal)
        g_ref = reference.attention_reference_backward(*ref, to_hnd_numpy(do, layout).astype(np.float64), causal=causal)
        assert rel_l2(o, o_ref) < 0.03
        for g, r in zip(grads, g_ref):
            assert rel_l2(to_hnd_numpy(g, layout), r) < 0.06


# The wgmma forward's 64-key kernels: windows and soft caps at every shape, and the plain masks where V is narrower
# than the padded head dim (d=192); the plain masks' 128-key kernel (V of 256 columns) is checked against the emulator.
_SAME_TILES = [(shape, (90, 0), 20.0) for shape in SHAPES] + \
    [((1, 2, 1, 100, 700, 192), w, 0.0) for w in ((-1, -1), (-1, 0))]


@pytest.mark.parametrize("shape,window,softcap", _SAME_TILES,
                         ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
def test_the_wgmma_forward_is_the_mma_sync_forward_bit_for_bit(monkeypatch, shape, window, softcap):
    """sm_90's one-pass wgmma forward on 64-key tiles and the two-pass mma.sync forward compute the same numerics
    (the same products and folds in the same order): outputs and LSE equal, bit for bit."""
    import torch

    from sagebwd_cp.gpu import plan
    from sagebwd_cp.gpu.device import device_arch

    if device_arch(0) != "sm_90":
        pytest.skip("the wgmma kernels run on sm_90 only")
    b, hq, hk, lq, lk, d = shape
    opts = dict(causal=window[1] == 0, window_size=window, softcap=softcap, smooth_k=not softcap)
    q, k, v = make_qkv(b, hq, hk, lq, lk, d, "bfloat16", "NHD", seed=lq + lk)
    results = []
    for family in ("1", "0"):
        monkeypatch.setenv("SAGEBWD_WGMMA", family)
        plan.clear_plans()
        with poisoned_workspaces():
            results.append(sagebwd_cp.attention(q, k, v, layout="NHD", return_lse=True, **opts))
        torch.cuda.synchronize()
    plan.clear_plans()
    (out, lse), (out_ref, lse_ref) = results
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, out_ref, rtol=0, atol=0)
    torch.testing.assert_close(lse, lse_ref, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("window,softcap", [((90, 0), 0.0), ((-1, -1), 20.0), ((60, 40), 0.0), ((90, 0), 20.0),
                                            ((-1, -1), 0.0), ((-1, 0), 0.0)])
def test_windows_soft_caps_and_packed_batches(window, softcap):
    """A window or a soft cap (or neither: the plain masks' 128-key forward) at head dim 256 against the emulator; a
    packed batch of three sequences equals its dense calls (each sequence quantized alone in both)."""
    import torch

    causal = window[1] == 0 or softcap > 0
    opts = dict(causal=causal, window_size=window, softcap=softcap, smooth_k=not softcap)
    q, k, v = make_qkv(1, 4, 2, 333, 400, 256, "bfloat16", "NHD", seed=11)
    do = _grad_output(q, seed=12)
    with poisoned_workspaces():
        out, saved = sagebwd_cp.attention_forward(q, k, v, layout="NHD", **opts)
        grads = sagebwd_cp.attention_backward(saved, do)
    torch.cuda.synchronize()
    host = [to_hnd_numpy(x, "NHD") for x in (q, k, v)]
    o_emu, _, _ = emulator.emulate_forward(*host, causal=causal, dtype="bfloat16",
                                           key_tile=forward_key_tile(256, causal=causal, window=window,
                                                                     softcap=softcap),
                                           window=window, softcap=softcap, smooth_k=not softcap)
    assert rel_l2(to_hnd_numpy(out, "NHD"), o_emu) < FWD_TOL["bfloat16"]
    state = emulator.backward_state(*host, to_hnd_numpy(out, "NHD"), saved.lse2.obj.cpu().numpy(), causal=causal,
                                    dtype="bfloat16", window=window, softcap=softcap, smooth_k=not softcap)
    for g, e in zip(grads, emulator.emulate_backward(state, to_hnd_numpy(do, "NHD"))):
        assert rel_l2(to_hnd_numpy(g, "NHD"), e) < BWD_TOL["bfloat16"]

    lens_q, lens_k = [1, 200, 132], [50, 200, 150]
    cu = lambda lens: torch.tensor([0] + list(np.cumsum(lens)), dtype=torch.int32, device="cuda")  # noqa: E731
    qp, kp, vp = (x[0, :n] for x, n in ((q, sum(lens_q)), (k, sum(lens_k)), (v, sum(lens_k))))
    qp, kp, vp = (x.detach().clone().requires_grad_() for x in (qp, kp, vp))
    import sagebwd_cp.torch as st

    packed = st.flash_attn_varlen_func(qp, kp, vp, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k), causal=causal,
                                       window_size=window, softcap=softcap)
    dense = []
    for i in range(3):
        rq = slice(sum(lens_q[:i]), sum(lens_q[:i + 1]))
        rk = slice(sum(lens_k[:i]), sum(lens_k[:i + 1]))
        dense.append(st.flash_attn_func(qp[None, rq], kp[None, rk], vp[None, rk], causal=causal, window_size=window,
                                        softcap=softcap)[0])
    torch.testing.assert_close(packed, torch.cat(dense), rtol=0, atol=0)


def test_the_options_these_kernels_do_not_take_are_refused_by_name():
    q, k, v = make_qkv(1, 2, 2, 64, 64, 256, "float16")
    with pytest.raises(ValueError, match=r"head dims above 128 \(got 256\) take no smooth_q=True"):
        sagebwd_cp.attention_forward(q, k, v, smooth_q=True)
    _, saved = sagebwd_cp.attention_forward(q, k, v)
    with pytest.raises(ValueError, match="head dims above 128 \\(got 256\\) take no granularity='paper'"):
        sagebwd_cp.attention_backward(saved, q, granularity="paper")


@pytest.mark.parametrize("dqk,dv,opts", [(256, 256, {}), (256, 256, {"causal": True}), (192, 128, {"causal": True}),
                                         (256, 256, {"causal": True, "window_size": (300, 0)}),
                                         (200, 200, {"causal": True, "softcap": 20.0, "smooth_k": False}),
                                         (256, 256, {"causal": True, "window_size": (300, 0), "softcap": 20.0}),
                                         (200, 200, {"softcap": 20.0})])
def test_the_deterministic_backward_repeats_bit_for_bit(dqk, dv, opts):
    """deterministic=True on sm_90's wgmma kernels: the two CTAs of a key block add their halves of dQ in turns of
    one counter a query block (kernels/backward_wgmma.cu), so that dQ repeats bit for bit; the gradients are the
    default order's to rounding. The mma.sync kernels refuse it by name."""
    import torch

    import sagebwd_cp.torch as sage
    from sagebwd_cp.gpu.device import device_arch

    rng = np.random.default_rng(dqk + dv)
    shapes = ((2, 1100, 4, dqk), (2, 1100, 2, dqk), (2, 1100, 2, dv), (2, 1100, 4, dv))
    q, k, v, do = (torch.from_numpy(rng.standard_normal(s).astype(np.float32)).to("cuda", torch.bfloat16)
                   for s in shapes)
    if device_arch(0) != "sm_90":
        with pytest.raises(ValueError, match="deterministic: head dims above 128 take deterministic=True on sm_90"):
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            sage.flash_attn_func(*leaves, deterministic=True, **opts).backward(do)
        return
    runs = []
    for det in (True, True, False):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        with poisoned_workspaces():
            sage.flash_attn_func(*leaves, deterministic=det, **opts).backward(do)
        runs.append([x.grad for x in leaves])
    for a, b in zip(runs[0], runs[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(runs[0], runs[2]):  # (causal, the default order walks a CTA's query blocks from another start)
        assert rel_l2(a.float().cpu().numpy(), b.float().cpu().numpy()) < 1e-4


def _value_arrays(b, hq, hk, lq, lk, dqk, dv, dtype, layout, seed):
    """q, k, v and dO with V's (and dO's) head dim ``dv``; layout "strided": NHD views whose V and dO rows start 8
    bytes into rows of dv + 4 values (not 16-byte aligned: the backward packs them, pack_rows)."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    tdt = getattr(torch, dtype)
    rand = lambda *shape: torch.randn(shape, generator=g, device="cuda").to(tdt)  # noqa: E731
    if layout == "strided":
        return (rand(b, lq, hq, dqk), rand(b, lk, hk, dqk), rand(b, lk, hk, dv + 4)[..., 4:],
                rand(b, lq, hq, dv + 4)[..., 4:])
    q, k, v, do = rand(b, lq, hq, dqk), rand(b, lk, hk, dqk), rand(b, lk, hk, dv), rand(b, lq, hq, dv)
    return (q, k, v, do) if layout == "NHD" else tuple(x.transpose(1, 2) for x in (q, k, v, do))


@pytest.mark.parametrize("kernels", [{}, {"SAGEBWD_WGMMA": "0"}], ids=["default", "mma.sync"], indirect=True)
@pytest.mark.parametrize("shape", [(1, 4, 2, 300, 257, 192, 128), (2, 2, 1, 1, 70, 128, 64), (1, 2, 2, 130, 130, 64, 32),
                                   (1, 4, 1, 90, 200, 256, 72)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype,layout", [("float16", "HND"), ("bfloat16", "NHD"), ("bfloat16", "strided")])
def test_a_narrower_v_matches_the_emulator(kernels, shape, causal, dtype, layout):
    """V, O, dO and dV at V's own head dim below Q·K's (the kernels' loads zero-fill past it, their stores stop at
    it): output, LSE and gradients against the emulator on V, O and dO zero-padded (value_head_dim.py), with the
    library's workspaces and the caller's output buffer poisoned."""
    import torch

    b, hq, hk, lq, lk, dqk, dv = shape
    q, k, v, do = _value_arrays(b, hq, hk, lq, lk, dqk, dv, dtype, layout, seed=lq + lk + dv)
    lay = "HND" if layout == "HND" else "NHD"
    out = torch.full(q.shape[:-1] + (dv,), float("nan"), dtype=q.dtype, device="cuda")
    with poisoned_workspaces():
        sagebwd_cp.attention(q, k, v, causal=causal, layout=lay, out=out)
        out2, lse, saved = sagebwd_cp.attention_forward(q, k, v, causal=causal, layout=lay, return_lse=True)
        grads = sagebwd_cp.attention_backward(saved, do)
    torch.cuda.synchronize()
    torch.testing.assert_close(out2, out, rtol=0, atol=0)
    pad = lambda x: np.pad(x, [(0, 0)] * 3 + [(0, dqk - dv)])  # noqa: E731
    host = [to_hnd_numpy(x, lay) for x in (q, k)] + [pad(to_hnd_numpy(v, lay))]
    o_emu, lse_emu, _ = emulator.emulate_forward(*host, causal=causal, dtype=dtype,
                                                 key_tile=forward_key_tile(dqk, causal=causal, value_dim=dv))
    o = to_hnd_numpy(out, lay)
    assert o.shape[-1] == dv and np.isfinite(o).all() and not np.any(o_emu[..., dv:])
    assert rel_l2(o, o_emu[..., :dv]) < FWD_TOL[dtype]
    finite = np.isfinite(lse_emu)
    np.testing.assert_array_equal(np.isfinite(lse.cpu().numpy()), finite)
    np.testing.assert_allclose(lse.cpu().numpy()[finite], lse_emu[finite], rtol=1e-5, atol=1e-4)
    state = emulator.backward_state(*host, pad(to_hnd_numpy(out2, lay)), saved.lse2.obj.cpu().numpy(), causal=causal,
                                    dtype=dtype)
    expected = emulator.emulate_backward(state, pad(to_hnd_numpy(do, lay)))
    for name, g, e, x in zip(("dq", "dk", "dv"), grads, expected, (q, k, v)):
        assert tuple(g.shape) == tuple(x.shape) and g.dtype == x.dtype, name
        gh, e = to_hnd_numpy(g, lay), e[..., :x.shape[-1]]
        assert np.isfinite(gh).all(), name
        if not np.any(e):
            assert not np.any(gh), name
            continue
        assert rel_l2(gh, e) < BWD_TOL[dtype], f"{name} vs emulator Rel-L2 {rel_l2(gh, e):.2e}"


@pytest.mark.parametrize("dqk,dv", [(192, 128), (64, 128), (136, 64), (128, 64)])
@pytest.mark.parametrize("causal", [False, True])
def test_a_value_head_dim_of_its_own(dqk, dv, causal):
    """Multi-head latent attention's 192/128 (and V wider than Q·K): the torch adapter and the neutral API
    against exact attention, and bit for bit the call with the narrower side zero-padded by hand."""
    import torch

    import sagebwd_cp.torch as sage

    rng = np.random.default_rng(dqk + dv + causal)
    shapes = ((2, 4, 300, dqk), (2, 2, 257, dqk), (2, 2, 257, dv), (2, 4, 300, dv))
    q, k, v, do = (torch.from_numpy(rng.standard_normal(s).astype(np.float32)).to("cuda", torch.bfloat16)
                   for s in shapes)
    host = [x.float().cpu().numpy() for x in (q, k, v, do)]
    o_ref, _ = reference.attention_reference(*host[:3], causal=causal)
    g_ref = reference.attention_reference_backward(*host, causal=causal)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = sage.attention(*leaves, causal=causal)
    out.backward(do)
    torch.cuda.synchronize()
    assert out.shape == (2, 4, 300, dv) and rel_l2(out.detach().float().cpu().numpy(), o_ref) < 0.03
    for x, r in zip(leaves, g_ref):
        assert x.grad.shape == x.shape and rel_l2(x.grad.float().cpu().numpy(), r) < 0.06
    d = max(dqk, dv)
    pad = lambda x: torch.nn.functional.pad(x, (0, d - x.shape[-1]))  # noqa: E731
    hand = [pad(x).requires_grad_() for x in (q, k, v)]
    out_hand = sage.attention(*hand, causal=causal, softmax_scale=1.0 / math.sqrt(dqk))
    out_hand.backward(pad(do))
    # Bit for bit, but dQ: its default accumulation order varies from run to run (deterministic=False).
    def same(a, b, name):
        if name == "dq":
            assert rel_l2(a.float().cpu().numpy(), b.float().cpu().numpy()) < 1e-3
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=0)

    same(out, out_hand[..., :dv], "out")
    for x, h, name in zip(leaves, hand, ("dq", "dk", "dv")):
        same(x.grad, h.grad[..., :x.shape[-1]], name)
    o2, saved = sagebwd_cp.attention_forward(q, k, v, causal=causal)
    grads = sagebwd_cp.attention_backward(saved, do)
    same(o2, out.detach(), "out")
    for g, x, name in zip(grads, leaves, ("dq", "dk", "dv")):
        same(g, x.grad, name)
