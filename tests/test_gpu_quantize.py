"""The quantization kernels against the emulator: INT8 values and scales equal, bit for bit."""
import numpy as np
import pytest

from gpu_helpers import make_qkv, poisoned_workspaces, to_hnd_numpy
from sagebwd_cp import numerics
from sagebwd_cp.host import emulator

pytestmark = [pytest.mark.gpu, pytest.mark.torch]

PERM = np.array(numerics.KEY_PERMUTATION_16)


def _unpermute_tokens(t_int8, n_pad):
    """[.., D, N_pad] stored in fragment order -> natural token order."""
    idx = (np.arange(n_pad) // 16) * 16 + PERM[np.arange(n_pad) % 16]
    out = np.empty_like(t_int8)
    out[..., idx] = t_int8
    return out


CASES = [
    # (B, Hq, Hkv, Lq, Lk, D, dtype, layout, strided, smooth_q)
    (1, 2, 2, 1, 1, 64, "float16", "HND", False, False),
    (2, 4, 1, 63, 64, 128, "bfloat16", "NHD", False, False),
    (1, 2, 2, 63, 63, 64, "float16", "NHD", True, False),
    (1, 4, 2, 1000, 1000, 128, "float16", "HND", False, True),
    (1, 2, 2, 4097, 4097, 64, "bfloat16", "NHD", True, True),
    (1, 2, 1, 100, 4097, 80, "bfloat16", "HND", False, False),
    (1, 2, 1, 300, 300, 256, "bfloat16", "NHD", False, False),
    (2, 2, 2, 129, 129, 192, "float16", "HND", True, False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_quantize_matches_emulator_bitwise(case):
    import torch

    from sagebwd_cp.arrays import current_stream
    from sagebwd_cp.gpu.pieces import quantize_inputs_gpu
    from sagebwd_cp.options import AttentionOptions
    from sagebwd_cp.problem import make_problem

    b, hq, hk, lq, lk, d, dtype, layout, strided, smooth_q = case
    q, k, v = make_qkv(b, hq, hk, lq, lk, d, dtype, layout, sigma=2.0, seed=lq + lk, strided=strided)
    if not strided:
        k = k + 3.0 * (torch.arange(d, device="cuda") % 7 == 0).to(k.dtype)  # a channel bias for smoothing
    if lq > 2 and not smooth_q:  # a zero Q row and one under TINY_AMAX (bf16): codes 0, per-token scale 0
        tok = (slice(None), slice(None), slice(1, 3)) if layout == "HND" else (slice(None), slice(1, 3))
        q[tok] *= torch.tensor([0.0, 1e-37], device="cuda").view((2, 1) if layout == "HND" else (2, 1, 1)).to(q.dtype)
    prob = make_problem(q, k, v, AttentionOptions(layout=layout, smooth_q=smooth_q, softmax_scale=0.3))
    with poisoned_workspaces():
        qz = quantize_inputs_gpu(prob, True, current_stream(prob.q))  # the backward's layouts
        qf = quantize_inputs_gpu(prob, False, current_stream(prob.q))  # the forward's
    torch.cuda.synchronize()
    emu = emulator.quantize_inputs(to_hnd_numpy(q, layout), to_hnd_numpy(k, layout), to_hnd_numpy(v, layout),
                                   softmax_scale=0.3, smooth_q=smooth_q)

    def host(desc):
        return desc.obj.cpu().numpy()

    nqb, nkb = -(-lq // 64), -(-lk // 64)
    q8, k8 = host(qz.q8), host(qz.k8)
    np.testing.assert_array_equal(q8[:, :, :lq, :d], emu["q_int8"][:, :, :lq])
    q_scale, k_scale = host(qz.q_scale), host(qz.k_scale)  # per token
    np.testing.assert_array_equal(q_scale[..., :lq], emu["q_scale"][..., :lq])
    np.testing.assert_array_equal(k8[:, :, :lk, :d], emu["k_int8"][:, :, :lk])
    np.testing.assert_array_equal(k_scale[..., :lk], emu["k_scale"][..., :lk])
    assert (q_scale[..., lq:] == 0).all() and (k_scale[..., lk:] == 0).all()  # padded tokens count as zero
    np.testing.assert_array_equal(host(qz.k_mean)[..., :d], emu["k_mean"])
    np.testing.assert_array_equal(host(qf.v_scale)[..., :nkb], emu["v_scale"])
    assert qz.vt8 is None and qf.q8t is None and qf.k8t is None
    for name in ("q8", "q_scale", "k8", "k_scale", "k_mean"):  # the backward re-derives the forward's Q̂, K̂
        np.testing.assert_array_equal(host(getattr(qz, name)), host(getattr(qf, name)))
    if smooth_q:
        np.testing.assert_array_equal(host(qz.q_mean)[:, :, :nqb, :d], emu["q_mean"])
    # Padding (rows past N, columns past D) is zero in every layout.
    assert not q8[:, :, lq:].any() and not q8[..., d:].any()
    assert not k8[:, :, lk:].any() and not k8[..., d:].any()
    # Transposed copies: Q̂ᵀ in fragment token order, K̂ᵀ natural, both coded per 64-token block for
    # the backward (zero past N and D); V̂ᵀ in fragment token order.
    qt = _unpermute_tokens(host(qz.q8t), qz.nq_pad)
    np.testing.assert_array_equal(qt[:, :, :d, :lq], emu["qt_int8"][:, :, :lq].transpose(0, 1, 3, 2))
    np.testing.assert_array_equal(host(qz.qt_scale)[..., :nqb], emu["qt_scale"])
    kt = host(qz.k8t)
    np.testing.assert_array_equal(kt[:, :, :d, :lk], emu["kt_int8"][:, :, :lk].transpose(0, 1, 3, 2))
    np.testing.assert_array_equal(host(qz.kt_scale)[..., :nkb], emu["kt_scale"])
    assert not qt[:, :, :, lq:].any() and not qt[:, :, d:].any()
    assert not kt[:, :, :, lk:].any() and not kt[:, :, d:].any()
    vt = _unpermute_tokens(host(qf.vt8), qf.nk_pad)
    np.testing.assert_array_equal(vt[:, :, :d, :lk], emu["v_int8"][:, :, :lk].transpose(0, 1, 3, 2))
    assert not vt[:, :, :, lk:].any() and not vt[:, :, d:].any()


@pytest.mark.parametrize("lq,dtype,layout", [(1, "float16", "HND"), (1000, "bfloat16", "NHD"), (4097, "float16", "NHD")])
def test_quantize_grad_output_matches_psi(lq, dtype, layout):
    import torch

    from sagebwd_cp.arrays import current_stream, describe
    from sagebwd_cp.gpu.pieces import quantize_grad_output_gpu
    from sagebwd_cp.options import AttentionOptions
    from sagebwd_cp.problem import make_problem

    q, k, v = make_qkv(2, 4, 2, lq, 77, 64, dtype, layout, seed=lq)
    do = make_qkv(2, 4, 2, lq, 77, 64, dtype, layout, sigma=1e-3, seed=lq + 1)[0]  # tiny gradients
    prob = make_problem(q, k, v, AttentionOptions(layout=layout))
    with poisoned_workspaces():
        dot8, scale = quantize_grad_output_gpu(prob, describe(do, "do"), current_stream(prob.q))
    torch.cuda.synchronize()
    x = np.zeros((2, 4, dot8.shape[-1], 64), np.float32)
    x[:, :, :lq] = to_hnd_numpy(do, layout)
    nb = x.shape[2] // 64
    blocks, scales = numerics.quantize_block(x.reshape(2, 4, nb, 64 * 64), axis=-1)
    expected = blocks.reshape(x.shape).transpose(0, 1, 3, 2)
    np.testing.assert_array_equal(_unpermute_tokens(dot8.obj.cpu().numpy(), dot8.shape[-1]), expected)
    np.testing.assert_array_equal(scale.obj.cpu().numpy(), scales[..., 0])


FUSED_CASES = [
    # (B, Hkv, Lk, D, dtype, layout, strided): a head's K CTAs (one per 128 rows) from 1 to 33, and past the SMs;
    # head dim 64 keeps token_sum (unless SAGEBWD_FUSED_TOKEN_SUMS=1)
    (1, 1, 1, 128, "float16", "HND", False),
    (2, 2, 300, 64, "float16", "HND", False),
    (2, 3, 1000, 64, "bfloat16", "NHD", "forced"),  # SAGEBWD_FUSED_TOKEN_SUMS=1: head dim 64 fused
    (3, 2, 200, 80, "bfloat16", "NHD", True),
    (2, 3, 1000, 128, "float16", "NHD", False),
    (1, 4, 4097, 128, "bfloat16", "HND", False),
    (2, 2, 777, 256, "bfloat16", "HND", True),
    (8, 8, 2048, 128, "bfloat16", "HND", False),  # 16 CTAs a head, 2048 K and V CTAs: many waves of waiting heads
    (1, 1, 40000, 128, "float16", "HND", False),  # 313 CTAs a head: more than half an H100's SMs, token_sum's path
]


@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: "-".join(map(str, c)))
def test_forward_k_job_with_its_own_token_sums_matches_emulator_bitwise(case, monkeypatch):
    """The forward's pre-pass (K and V, Q left to the kernel): where the K job forms μ_K from its own loads
    (quantize_tensors_fused), K̂, its scales, μ_K and V̂ᵀ equal the emulator's bit for bit, as through token_sum."""
    import torch

    from sagebwd_cp.arrays import current_stream
    from sagebwd_cp.gpu.device import sm_count
    from sagebwd_cp.gpu.pieces import run_now
    from sagebwd_cp.gpu.plan import PlanBuilder
    from sagebwd_cp.gpu.quantize import FUSED_SUM_HEAD_DIMS, quantize_inputs
    from sagebwd_cp.options import AttentionOptions
    from sagebwd_cp.problem import make_problem

    b, hk, lk, d, dtype, layout, strided = case
    forced = strided == "forced"
    if forced:
        monkeypatch.setenv("SAGEBWD_FUSED_TOKEN_SUMS", "1")
        strided = False
    # (strided views: one fused tensor, so as many query heads and tokens as keys)
    hq, lq = (hk, lk) if strided else (2 * hk, 5)
    q, k, v = make_qkv(b, hq, hk, lq, lk, d, dtype, layout, sigma=2.0, seed=lk + d, strided=strided)
    if not strided:
        k = k + 3.0 * (torch.arange(d, device="cuda") % 7 == 0).to(k.dtype)  # a channel bias for smoothing
    prob = make_problem(q, k, v, AttentionOptions(layout=layout))
    plan = PlanBuilder(prob.q.device_id, prob.q.framework, [("q", prob.q), ("k", prob.k), ("v", prob.v)])
    with poisoned_workspaces():
        qz = quantize_inputs(plan, prob, False, quantize_q=False)
        entries = [entry for _, entry, *_ in plan.launches]
        qz = run_now(plan, current_stream(prob.q), qz)
    torch.cuda.synchronize()
    fused = (forced or prob.padded_head_dim in FUSED_SUM_HEAD_DIMS) and -(-lk // 128) <= sm_count(prob.q.device_id) // 2
    assert ("quantize_tensors_fused" in entries) == fused and ("token_sum" in entries) != fused
    emu = emulator.quantize_inputs(to_hnd_numpy(q, layout), to_hnd_numpy(k, layout), to_hnd_numpy(v, layout))

    def host(desc):
        return desc.obj.cpu().numpy()

    np.testing.assert_array_equal(host(qz.k_mean)[..., :d], emu["k_mean"])
    np.testing.assert_array_equal(host(qz.k8)[:, :, :lk, :d], emu["k_int8"][:, :, :lk])
    np.testing.assert_array_equal(host(qz.k_scale)[..., :lk], emu["k_scale"][..., :lk])
    assert not host(qz.k8)[:, :, lk:].any() and not host(qz.k_scale)[..., lk:].any()
    vt = _unpermute_tokens(host(qz.vt8), qz.nk_pad)
    np.testing.assert_array_equal(vt[:, :, :d, :lk], emu["v_int8"][:, :, :lk].transpose(0, 1, 3, 2))
    np.testing.assert_array_equal(host(qz.v_scale)[..., :-(-lk // 64)], emu["v_scale"])
