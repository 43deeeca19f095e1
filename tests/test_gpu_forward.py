"""The INT8 forward kernel against the emulator (same algorithm: tight), exact FP64 attention
(the paper's accuracy) and torch's SDPA, over ragged shapes, layouts, dtypes, GQA and masks.

Bound against the emulator: both compute the same integer products exactly; they differ only in
ex2.approx/lg2.approx (2 ulp), FMA contraction and summation order, which flip a rounding of
127·e or of the 16-bit output now and then.  So O agrees to a few output ulps: Rel-L2 under
2e-3 (fp16) / 8e-3 (bf16), and the LSE to 1e-4 absolute plus 1e-5 relative.
"""
import numpy as np
import pytest

import sagebwd_cp
from gpu_helpers import SHAPES, cos_sim, forward_key_tile, make_qkv, poisoned_workspaces, rel_l2, to_hnd_numpy
from sagebwd_cp.host import emulator, reference

pytestmark = [pytest.mark.gpu, pytest.mark.torch]

EMU_TOL = {"float16": 2e-3, "bfloat16": 8e-3}


def _run(q, k, v, layout, causal, **kw):
    with poisoned_workspaces():
        out, lse = sagebwd_cp.attention(q, k, v, causal=causal, layout=layout, return_lse=True, **kw)
    return out, lse


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype,layout", [("float16", "HND"), ("bfloat16", "NHD")])
def test_forward_matches_emulator(shape, causal, dtype, layout):
    import torch

    b, hq, hk, lq, lk, d = shape
    q, k, v = make_qkv(b, hq, hk, lq, lk, d, dtype, layout, seed=lq * 7 + lk)
    out, lse = _run(q, k, v, layout, causal)
    torch.cuda.synchronize()
    o_emu, lse_emu, _ = emulator.emulate_forward(to_hnd_numpy(q, layout), to_hnd_numpy(k, layout),
                                                  to_hnd_numpy(v, layout), causal=causal, dtype=dtype,
                                                  key_tile=forward_key_tile(d))
    o = to_hnd_numpy(out, layout)
    lse = lse.cpu().numpy()
    assert np.isfinite(o).all()
    err = rel_l2(o, o_emu)
    assert err < EMU_TOL[dtype], f"O vs emulator Rel-L2 {err:.2e}"
    finite = np.isfinite(lse_emu)
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    np.testing.assert_allclose(lse[finite], lse_emu[finite], rtol=1e-5, atol=1e-4)
    # Rows that see no key (causal, Lq > Lk) give exactly zero.
    assert not o[~np.broadcast_to(finite[..., None], o.shape)].any()


@pytest.mark.parametrize("shape", [(2, 4, 2, 300, 200, 64), (1, 2, 1, 1, 70, 80), (1, 4, 4, 513, 513, 128),
                                   (1, 2, 1, 130, 300, 256)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype,layout,strided", [("float16", "HND", False), ("bfloat16", "NHD", False),
                                                  ("bfloat16", "NHD", True)])
def test_returned_lse_is_lse2_with_k_smoothings_share_bit_for_bit(shape, dtype, layout, strided):
    """kernels/lse.cu natural_lse: LSE = fmaf(LSE2, ln 2, c·q·μ_K) with q·μ_K in row_dot.cuh's order, bit for bit
    numerics.natural_lse over the kernel's own LSE2 and μ_K (rows that see no key: -inf); Lq > Lk causal leaves
    rows with no key, head dims 64 to 256, GQA, strided views."""
    import torch

    from sagebwd_cp import numerics

    b, hq, hk, lq, lk, d = shape
    if strided:
        hk, lk = hq, lq
    q, k, v = make_qkv(b, hq, hk, lq, lk, d, dtype, layout=layout, sigma=2.0, seed=d, strided=strided)
    k = k + torch.linspace(-3, 3, d, device="cuda").to(k.dtype)  # a channel offset for μ_K to carry
    with poisoned_workspaces():
        _, lse, saved = sagebwd_cp.attention_forward(q, k, v, causal=True, layout=layout, return_lse=True)
    torch.cuda.synchronize()
    q32 = to_hnd_numpy(q, layout)
    k_mean = np.repeat(saved.k_mean.obj.cpu().numpy(), hq // hk, axis=1)
    expected = numerics.natural_lse(saved.lse2.obj.cpu().numpy(), numerics.row_dot_mean(q32, k_mean),
                                    numerics.default_softmax_scale(d))
    got = lse.cpu().numpy()
    np.testing.assert_array_equal(got, expected)
    assert np.isfinite(got).any() and (lq <= lk or np.isneginf(got).any())


def test_strided_views_from_fused_qkv():
    import torch

    q, k, v = make_qkv(2, 4, 4, 333, 333, 64, "float16", "NHD", strided=True, seed=5)
    assert not q.is_contiguous()
    out = _run(q, k, v, "NHD", True)[0]
    ref = _run(q.contiguous(), k.contiguous(), v.contiguous(), "NHD", True)[0]
    torch.cuda.synchronize()
    assert torch.equal(out, ref)


def test_q_quantized_by_the_kernel_from_unaligned_rows():
    """Without Q-smoothing the forward kernel quantizes Q itself: rows that are not 16-byte aligned
    (an odd row stride) are read value by value and give bitwise the output of aligned ones; so at a
    padded head dim (40), against the emulator: O and the LSE, whose 1e-4 bound a Q̂ code off by one
    in a row's largest score would break."""
    import torch

    q, k, v = make_qkv(1, 2, 2, 300, 300, 64, "float16", "HND", seed=31)
    wide = torch.zeros((1, 2, 300, 65), device="cuda", dtype=q.dtype)
    wide[..., :64] = q
    q_odd = wide[..., :64]
    assert q_odd.stride(2) % 8 != 0
    aligned, unaligned = _run(q, k, v, "HND", False)[0], _run(q_odd, k, v, "HND", False)[0]
    torch.cuda.synchronize()
    assert torch.equal(aligned, unaligned)

    q, k, v = make_qkv(1, 2, 1, 200, 200, 40, "bfloat16", "HND", seed=32)
    wide = torch.zeros((1, 2, 200, 41), device="cuda", dtype=q.dtype)
    wide[..., :40] = q
    out, lse = _run(wide[..., :40], k, v, "HND", True)
    torch.cuda.synchronize()
    o_emu, lse_emu, _ = emulator.emulate_forward(*(to_hnd_numpy(x, "HND") for x in (q, k, v)), causal=True,
                                                  dtype="bfloat16", key_tile=forward_key_tile(40))
    assert rel_l2(out.float().cpu().numpy(), o_emu) < EMU_TOL["bfloat16"]
    lse = lse.cpu().numpy()
    finite = np.isfinite(lse_emu)
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    np.testing.assert_allclose(lse[finite], lse_emu[finite], rtol=1e-5, atol=1e-4)


def test_output_into_caller_buffer_and_smooth_q():
    import torch

    q, k, v = make_qkv(1, 2, 2, 200, 300, 128, "bfloat16", "HND", seed=9)
    out = torch.full_like(q, float("nan"))
    res = sagebwd_cp.attention(q, k, v, out=out, smooth_q=True)
    assert res is out
    o_emu, _, _ = emulator.emulate_forward(to_hnd_numpy(q, "HND"), to_hnd_numpy(k, "HND"), to_hnd_numpy(v, "HND"),
                                           smooth_q=True, dtype="bfloat16", key_tile=forward_key_tile(128))
    torch.cuda.synchronize()
    assert rel_l2(out.float().cpu().numpy(), o_emu) < EMU_TOL["bfloat16"]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hk,lq,lk", [(4, 2, 333, 300), (2, 2, 100, 1000)])
def test_smooth_q_ragged_causal_gqa(causal, hq, hk, lq, lk):
    """Q-smoothing's FP32 bias path, with rows that see no key of a tile (Lq > Lk, causal)."""
    import torch

    q, k, v = make_qkv(1, hq, hk, lq, lk, 64, "float16", "HND", seed=lq + lk)
    k = k + 2.0 * (torch.arange(64, device="cuda") % 5 == 0).to(k.dtype)
    out, lse = _run(q, k, v, "HND", causal, smooth_q=True)
    torch.cuda.synchronize()
    o_emu, lse_emu, _ = emulator.emulate_forward(*(to_hnd_numpy(x, "HND") for x in (q, k, v)), causal=causal,
                                                  smooth_q=True, key_tile=forward_key_tile(64))
    assert rel_l2(out.float().cpu().numpy(), o_emu) < EMU_TOL["float16"]
    lse = lse.cpu().numpy()
    finite = np.isfinite(lse_emu)
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    np.testing.assert_allclose(lse[finite], lse_emu[finite], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("causal", [False, True])
def test_row_max_climbing_and_falling_over_key_tiles(causal):
    """Logits that climb ~16 (log2) per 64-key tile move the kernel's reference max on every tile
    (the lazy rescale of O); falling ones leave later tiles 2^-16.. 2^-160 below it (weights that
    underflow). Both against the emulator's running max."""
    import torch

    q, k, v = make_qkv(1, 4, 4, 300, 700, 64, "float16", "HND", seed=21)
    ramp = torch.arange(700, device="cuda", dtype=torch.float32) * 0.17
    sign = torch.tensor([1.0, -1.0, 1.0, -1.0], device="cuda")[:, None]
    k[0, :, :, 0] = (sign * ramp).half()
    q[0, :, :, 0] = 8.0
    out, lse = _run(q, k, v, "HND", causal)
    torch.cuda.synchronize()
    o_emu, lse_emu, _ = emulator.emulate_forward(*(to_hnd_numpy(x, "HND") for x in (q, k, v)), causal=causal,
                                                  key_tile=forward_key_tile(64))
    o = out.float().cpu().numpy()
    assert np.isfinite(o).all()
    assert rel_l2(o, o_emu) < EMU_TOL["float16"]
    lse = lse.cpu().numpy()
    finite = np.isfinite(lse_emu)
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    np.testing.assert_allclose(lse[finite], lse_emu[finite], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("d", [64, 128])
def test_zero_value_blocks(d):
    """All-zero V blocks (scale 0): one next to a nonzero block in a 128-key tile, and a tile of two
    (s_max = 0); against the emulator and against exact attention (O as accurate as without them)."""
    import torch

    q, k, v = make_qkv(1, 2, 2, 200, 300, d, "float16", "HND", seed=22)
    v[:, :, 64:128] = 0
    v[:, 1, 128:256] = 0
    out, lse = _run(q, k, v, "HND", False)
    torch.cuda.synchronize()
    qn, kn, vn = (to_hnd_numpy(x, "HND") for x in (q, k, v))
    o_emu, _, _ = emulator.emulate_forward(qn, kn, vn, key_tile=forward_key_tile(d))
    o = to_hnd_numpy(out, "HND")
    assert np.isfinite(o).all()
    assert rel_l2(o, o_emu) < EMU_TOL["float16"]
    assert rel_l2(o, reference.attention_reference(qn, kn, vn)[0]) < 0.02


def test_cached_plans_follow_each_calls_arrays():
    """Calls that replay one launch plan (same shapes, other tensors) give what a new plan gives."""
    import torch

    from sagebwd_cp.gpu import plan

    inputs = [make_qkv(1, 4, 2, 300, 300, 64, "float16", seed=s) for s in range(3)]  # 300 keys: two token-sum parts
    plan.clear_plans()
    first = [sagebwd_cp.attention(*x, causal=True, return_lse=True) for x in inputs]  # one plan, three calls
    for x, (out, lse) in zip(inputs, first):
        plan.clear_plans()
        out2, lse2 = sagebwd_cp.attention(*x, causal=True, return_lse=True)
        torch.cuda.synchronize()
        assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_against_sdpa_and_cupy_inputs():
    import cupy
    import torch
    import torch.nn.functional as F

    q, k, v = make_qkv(2, 8, 2, 1000, 1500, 128, "float16", "HND", seed=3)
    ref = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(4, 1), v.float().repeat_interleave(4, 1),
                                         is_causal=False)
    out = sagebwd_cp.attention(q, k, v)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float16
    assert rel_l2(out.float().cpu().numpy(), ref.cpu().numpy()) < 0.03
    # CuPy arrays in, CuPy array out, same values.
    qc, kc, vc = (cupy.from_dlpack(x.contiguous()) for x in (q, k, v))
    outc = sagebwd_cp.attention(qc, kc, vc)
    assert isinstance(outc, cupy.ndarray)
    torch.cuda.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(outc), out.cpu().numpy())


def test_no_nan_for_zero_inputs_and_masked_rows():
    import torch

    q = torch.zeros((1, 2, 130, 64), device="cuda", dtype=torch.float16)
    k = torch.zeros((1, 2, 70, 64), device="cuda", dtype=torch.float16)
    v = torch.randn((1, 2, 70, 64), device="cuda").half()
    out, lse = sagebwd_cp.attention(q, k, v, causal=True, return_lse=True)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()
    assert torch.all(out[:, :, :60] == 0) and torch.isinf(lse[:, :, :60]).all()
    # Zero scores: visible rows average the visible values.
    exp = torch.stack([v[:, :, : i - 60 + 1].float().mean(2) for i in range(60, 130)], 2)
    assert torch.allclose(out[:, :, 60:].float(), exp, atol=2e-2)


SIGMA_PAPER_O = {1: (0.9999, 0.0160), 3: (0.9992, 0.0389), 5: (0.9982, 0.0603), 8: (0.9953, 0.0972), 10: (0.9933, 0.1161)}


@pytest.mark.parametrize("d", [64, 128])
def test_sigma_sweep_against_exact(d):
    import torch

    rows = []
    for sigma, (cos_paper, rl2_paper) in SIGMA_PAPER_O.items():
        q, k, v = make_qkv(1, 8, 8, 2048, 2048, d, "float16", "HND", sigma=sigma, seed=sigma)
        out = sagebwd_cp.attention(q, k, v)
        qd, kd, vd = (x.double() for x in (q, k, v))
        p = torch.softmax((qd @ kd.transpose(-1, -2)) / d**0.5, dim=-1)
        ref = (p @ vd).cpu().numpy()
        o = out.double().cpu().numpy()
        cs, rl = cos_sim(o, ref), rel_l2(o, ref)
        rows.append((sigma, cs, rl, cos_paper, rl2_paper))
    table = "\n".join(f"sigma={s:>2} O CosSim {c:.5f} RelL2 {r:.4f} (paper {cp:.4f} / {rp:.4f})" for s, c, r, cp, rp in rows)
    print(f"\nhead dim {d}\n{table}")
    # At least as good as SB26 Table 1's O column (its CosSim is printed to 4 digits).
    for sigma, cs, rl, cos_paper, rl2_paper in rows:
        assert rl <= rl2_paper and round(cs, 4) >= cos_paper, table


def test_no_local_memory_on_this_device():
    """Spills show up as local memory in the cubin the device actually loads."""
    import torch

    from sagebwd_cp.gpu import compiler, specs

    dev = torch.cuda.current_device()
    for spec in specs.all_specs():
        for entry in spec.entries:
            fn = compiler.get_function(spec, entry, dev)
            assert fn.local_size_bytes == 0, f"{spec.key}:{entry} uses {fn.local_size_bytes} bytes of local memory"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,dtype", [(64, "float16"), (128, "bfloat16"), (96, "float16")])
def test_mma_sync_path_equals_the_64_key_wgmma_kernel(monkeypatch, causal, d, dtype):
    """The mma.sync kernel (sm_80-89; SAGEBWD_WGMMA=0 on Hopper) does the same arithmetic in the
    same order as the 64-key wgmma kernel (SAGEBWD_FORWARD_KEY_TILE=64): the outputs are bitwise
    equal. Each, and the default (128-key tiles on Hopper), matches the emulator of its tiling."""
    import torch

    from sagebwd_cp.gpu import plan

    q, k, v = make_qkv(2, 4, 2, 333, 517, d, dtype, "NHD", seed=d + causal)
    emu = {kt: emulator.emulate_forward(*(to_hnd_numpy(x, "NHD") for x in (q, k, v)), causal=causal, dtype=dtype,
                                        key_tile=kt)[0] for kt in {64, forward_key_tile(d)}}
    outs = {}
    for name, env in (("default", {}), ("wgmma64", {"SAGEBWD_FORWARD_KEY_TILE": "64"}),
                      ("mma.sync", {"SAGEBWD_WGMMA": "0"})):
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        plan.clear_plans()
        outs[name] = _run(q, k, v, "NHD", causal)
        for key in env:
            monkeypatch.delenv(key)
    plan.clear_plans()
    torch.cuda.synchronize()
    assert torch.equal(outs["wgmma64"][0], outs["mma.sync"][0]) and torch.equal(outs["wgmma64"][1], outs["mma.sync"][1])
    for name, key_tile in (("default", forward_key_tile(d)), ("mma.sync", 64)):
        assert rel_l2(to_hnd_numpy(outs[name][0], "NHD"), emu[key_tile]) < EMU_TOL[dtype], name


WS_SHAPES = ["c=1", "c=2", "c=2,pp=1", "c=3", "c=3,pp=1", "c=2,s=2,ps=0", "c=1,s=4"]
WS_ENV = {"c": "SAGEBWD_FORWARD_CONSUMERS", "s": "SAGEBWD_FORWARD_STAGES", "pp": "SAGEBWD_FORWARD_PINGPONG",
          "ps": "SAGEBWD_FORWARD_PERSISTENT", "wk": "SAGEBWD_FORWARD_WS_KEYS"}


def _run_ws(monkeypatch, ws_shape, q, k, v, causal):
    """_run on the warp-specialized forward (SAGEBWD_FORWARD_WS=1) in the shape ``ws_shape`` ("c=1,s=2", the
    names of WS_ENV), its switches unset again after."""
    import torch

    from sagebwd_cp.gpu import plan

    monkeypatch.setenv("SAGEBWD_FORWARD_WS", "1")
    for item in ws_shape.split(","):
        key, value = item.split("=")
        monkeypatch.setenv(WS_ENV[key], value)
    plan.clear_plans()
    try:
        out = _run(q, k, v, "NHD", causal)
        torch.cuda.synchronize()
    finally:
        for name in ["SAGEBWD_FORWARD_WS", *WS_ENV.values()]:
            monkeypatch.delenv(name, raising=False)
    return out


# Above head dim 128 the consumers, stages and key tile are fixed (specs.forward_ws_tiles): the switches left.
WS_SHAPES_WIDE = ["pp=0", "pp=1", "pp=1,ps=1"]


@pytest.mark.parametrize("shape", SHAPES + [(2, 8, 2, 2048, 2048, 128), (3, 2, 2, 129, 700, 64), (2, 4, 2, 300, 517, 256),
                                            (1, 2, 2, 1, 129, 256), (1, 4, 4, 1000, 1000, 256), (1, 4, 1, 257, 300, 200)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
def test_warp_specialized_forward_equals_the_default_kernel(monkeypatch, shape, causal):
    """kernels/forward_ws.cu (SAGEBWD_FORWARD_WS=1) in each of its shapes computes what the 128-key
    forward.cu kernel computes (one warpgroup; two above head dim 128), bit for bit (O and the LSE), outputs
    poisoned first: the same products, scales and FP32 order in another structure. Hopper only."""
    import torch

    from sagebwd_cp.gpu import device, plan

    if device.device_arch(torch.cuda.current_device()) != "sm_90":
        pytest.skip("the warp-specialized forward is an sm_90 kernel")
    b, hq, hk, lq, lk, d = shape
    dtype = "bfloat16" if d % 128 == 0 else "float16"
    q, k, v = make_qkv(b, hq, hk, lq, lk, d, dtype, "NHD", seed=lq + 3 * lk + causal)
    monkeypatch.setenv("SAGEBWD_FORWARD_WS", "0")  # forward.cu (the default takes forward_ws.cu at d=128 unmasked)
    plan.clear_plans()
    ref = _run(q, k, v, "NHD", causal)
    for ws_shape in WS_SHAPES if d <= 128 else WS_SHAPES_WIDE:
        out, lse = _run_ws(monkeypatch, ws_shape, q, k, v, causal)
        assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1]), ws_shape
    plan.clear_plans()


WS_WIDE_SHAPES = ["wk=192,c=1,s=2", "wk=192,c=2", "wk=192,c=2,pp=1", "wk=192,c=1,s=3,ps=0"]


@pytest.mark.parametrize("shape", [(1, 2, 2, 1, 1, 128), (2, 4, 1, 300, 700, 128), (1, 2, 2, 777, 385, 64),
                                   (3, 4, 2, 200, 456, 96), (1, 2, 2, 192, 192, 128), (1, 3, 3, 1000, 1000, 64)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
def test_warp_specialized_forward_192_key_tiles_match_the_emulator(monkeypatch, shape, causal):
    """forward_ws.cu with 192-key tiles (SAGEBWD_FORWARD_WS_KEYS=192: three V scale blocks a tile, P̂'s
    row scale and O's rescale per 192 keys) against the emulator's forward with key_tile 192, in each
    shape of the kernel, outputs poisoned first; Lk past the head's padded keys (the last tile's key
    scales end there) and rows that see no key included. Hopper only."""
    import torch

    from sagebwd_cp.gpu import device, plan

    if device.device_arch(torch.cuda.current_device()) != "sm_90":
        pytest.skip("the warp-specialized forward is an sm_90 kernel")
    b, hq, hk, lq, lk, d = shape
    dtype = "bfloat16" if d % 128 == 0 else "float16"
    q, k, v = make_qkv(b, hq, hk, lq, lk, d, dtype, "NHD", seed=lq + 5 * lk + causal)
    o_emu, lse_emu, _ = emulator.emulate_forward(*(to_hnd_numpy(x, "NHD") for x in (q, k, v)), causal=causal,
                                                 dtype=dtype, key_tile=192)
    finite = np.isfinite(lse_emu)
    for ws_shape in WS_WIDE_SHAPES:
        out, lse = _run_ws(monkeypatch, ws_shape, q, k, v, causal)
        o, lse = to_hnd_numpy(out, "NHD"), lse.cpu().numpy()
        assert rel_l2(o, o_emu) < EMU_TOL[dtype], ws_shape
        np.testing.assert_array_equal(np.isfinite(lse), finite)
        np.testing.assert_allclose(lse[finite], lse_emu[finite], rtol=1e-5, atol=1e-4, err_msg=ws_shape)
        assert not o[~np.broadcast_to(finite[..., None], o.shape)].any(), ws_shape
    plan.clear_plans()


def test_warp_specialized_forward_packed_batches(monkeypatch):
    """The warp-specialized forward on packed sequences (flash_attn_varlen_func) equals the default."""
    import torch

    import sagebwd_cp.torch as st
    from sagebwd_cp.gpu import device, plan

    if device.device_arch(torch.cuda.current_device()) != "sm_90":
        pytest.skip("the warp-specialized forward is an sm_90 kernel")
    lens = [1, 130, 257, 64, 700]
    cu = torch.tensor([0] + np.cumsum(lens).tolist(), device="cuda", dtype=torch.int32)
    g = torch.Generator(device="cuda").manual_seed(5)
    for d, causal in ((128, True), (64, False), (64, True)):
        q, k, v = (torch.randn((int(cu[-1]), 4, d), generator=g, device="cuda").half() for _ in range(3))
        outs = []
        for ws in ("0", "1"):
            monkeypatch.setenv("SAGEBWD_FORWARD_WS", ws)
            plan.clear_plans()
            outs.append(st.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=causal))
        assert torch.equal(outs[0], outs[1]), (d, causal)
    plan.clear_plans()


@pytest.mark.parametrize("causal", [False, True])
def test_warp_specialized_forward_non_finite_inputs_as_the_default(monkeypatch, causal):
    """A NaN in V and an inf in K reach the same rows, with the same bits, in the warp-specialized
    forward as in the default kernel (the first consumers of a causal CTA stop where the default's
    64-row CTAs stop)."""
    import torch

    from sagebwd_cp.gpu import device, plan

    if device.device_arch(torch.cuda.current_device()) != "sm_90":
        pytest.skip("the warp-specialized forward is an sm_90 kernel")
    q, k, v = make_qkv(1, 2, 2, 700, 700, 64, "float16", "NHD", seed=11)
    v[0, 450, 0, 3] = float("nan")
    k[0, 300, 1, 5] = float("inf")
    outs = []
    for ws in ("0", "1"):
        monkeypatch.setenv("SAGEBWD_FORWARD_WS", ws)
        plan.clear_plans()
        out, lse = _run(q, k, v, "NHD", causal)
        outs.append((out.view(torch.int16).clone(), lse.view(torch.int32).clone()))
    plan.clear_plans()
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert torch.isnan(outs[0][0].view(torch.float16)).any()  # the inputs did reach the outputs
