"""Logit soft-capping on the GPU, both kernel families, with poisoned workspaces: forward and backward
against the emulator of the same algorithm (the kernels' tanh is the SFU's tanh.approx, within 2^-10.9
of NumPy's, so the bounds are a little wider than the dense tests') and the exact FP64 reference, over
ragged shapes, Lq != Lk, GQA, causal, windowed and unmasked, head dims 64 to 256, fp16 and bf16; packed
batches equal to their dense calls. (A Gemma 2 through transformers on the GPU: tests/test_transformers.py.)"""
import numpy as np
import pytest

import sagebwd_cp
from gpu_helpers import KERNELS, KERNEL_IDS, forward_key_tile, make_qkv, poisoned_workspaces, rel_l2, to_hnd_numpy
from sagebwd_cp.host import emulator, reference

pytestmark = [pytest.mark.gpu, pytest.mark.torch]

CASES = [  # (B, Hq, Hkv, Lq, Lk, D), causal, window, softcap
    ((1, 4, 1, 1000, 1000, 64), True, (-1, -1), 5.0),
    ((2, 2, 2, 17, 17, 128), True, (-1, -1), 30.0),
    ((1, 4, 2, 300, 257, 128), True, (50, -1), 5.0),
    ((1, 2, 2, 1000, 100, 64), True, (-1, -1), 2.0),
    ((1, 2, 1, 4097, 4097, 80), True, (1000, -1), 50.0),
    # No causal mask: the band test open on both sides (options.band_test), and a one-sided window.
    ((1, 4, 2, 300, 700, 128), False, (-1, -1), 5.0),
    ((2, 2, 1, 1000, 130, 64), False, (-1, -1), 30.0),
    ((1, 2, 2, 257, 300, 256), False, (-1, -1), 30.0),
    ((1, 4, 1, 500, 400, 64), False, (-1, 100), 5.0),
]


# With K-smoothing (each row's share added back before tanh), keys with a strong channel offset, which is what
# K-smoothing takes out of their quantization.
SMOOTHED_CASES = [CASES[0], CASES[2], CASES[4], CASES[5], CASES[7]]


@pytest.mark.parametrize("kernels", KERNELS, ids=KERNEL_IDS, indirect=True)
@pytest.mark.parametrize("shape,causal,window,cap", CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_soft_capped_attention_matches_the_emulator(kernels, shape, causal, window, cap, dtype):
    _check_soft_capped(shape, causal, window, cap, dtype, smooth_k=False)


@pytest.mark.parametrize("kernels", KERNELS, ids=KERNEL_IDS, indirect=True)
@pytest.mark.parametrize("shape,causal,window,cap", SMOOTHED_CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_soft_capped_attention_with_k_smoothing_matches_the_emulator(kernels, shape, causal, window, cap, dtype):
    _check_soft_capped(shape, causal, window, cap, dtype, smooth_k=True)


def _check_soft_capped(shape, causal, window, cap, dtype, smooth_k):
    import torch

    b, hq, hk, lq, lk, d = shape
    q, k, v = make_qkv(b, hq, hk, lq, lk, d, dtype, sigma=2.0, seed=lq + lk)
    g = torch.Generator(device="cuda").manual_seed(1)
    if smooth_k:
        k = (k.float() + 3 * torch.randn(d, generator=g, device="cuda")).to(k.dtype)
    do = torch.randn(q.shape, generator=g, device="cuda").to(q.dtype)
    kw = dict(causal=causal, window_size=window, softcap=cap, smooth_k=smooth_k)
    with poisoned_workspaces():
        out, lse, saved = sagebwd_cp.attention_forward(q, k, v, return_lse=True, **kw)
        grads = sagebwd_cp.attention_backward(saved, do)
    torch.cuda.synchronize()
    qh, kh, vh, oh, doh = (to_hnd_numpy(x, "HND") for x in (q, k, v, out, do))
    o_emu, lse_emu, _ = emulator.emulate_forward(qh, kh, vh, causal=causal, window=window, softcap=cap,
                                                  smooth_k=smooth_k, dtype=dtype,
                                                  key_tile=forward_key_tile(d, causal=causal, window=window, softcap=cap))
    assert rel_l2(oh, o_emu) < (4e-3 if dtype == "float16" else 1e-2)
    lse = lse.cpu().numpy()
    fin = np.isfinite(lse_emu)
    np.testing.assert_array_equal(np.isfinite(lse), fin)
    np.testing.assert_allclose(lse[fin], lse_emu[fin], rtol=1e-4, atol=1e-3)
    state = emulator.backward_state(qh, kh, vh, oh, saved.lse2.obj.cpu().numpy(), causal=causal, window=window,
                                    softcap=cap, smooth_k=smooth_k, dtype=dtype)
    exact = reference.attention_reference_backward(qh, kh, vh, doh, causal=causal, window=window, softcap=cap)
    for name, gr, e, x in zip("qkv", grads, emulator.emulate_backward(state, doh), exact):
        gh = to_hnd_numpy(gr, "HND")
        assert np.isfinite(gh).all(), name
        assert rel_l2(gh, e) < (8e-3 if dtype == "float16" else 1.5e-2), (name, rel_l2(gh, e))
        assert rel_l2(gh, x) < 0.12, (name, rel_l2(gh, x))
    o_ref, _ = reference.attention_reference(qh, kh, vh, causal=causal, window=window, softcap=cap)
    assert rel_l2(oh, o_ref) < 0.05


@pytest.mark.parametrize("kernels", KERNELS, ids=KERNEL_IDS, indirect=True)
@pytest.mark.parametrize("causal", [True, False])
def test_each_packed_sequence_equals_its_dense_call(kernels, causal):
    import torch

    lens = [1, 130, 300, 1000]
    g = torch.Generator(device="cuda").manual_seed(3)
    rand = lambda n, h: (2 * torch.randn((n, h, 128), generator=g, device="cuda")).to(torch.bfloat16)
    cu = torch.tensor([0] + np.cumsum(lens).tolist(), dtype=torch.int32, device="cuda")
    q, k, v, do = rand(sum(lens), 4), rand(sum(lens), 2), rand(sum(lens), 2), rand(sum(lens), 4)
    kw = dict(causal=causal, softcap=10.0, smooth_k=causal)  # K-smoothing on in the causal case
    with poisoned_workspaces():
        out, lse, saved = sagebwd_cp.attention_varlen_forward(q, k, v, cu, cu, max(lens), max(lens), return_lse=True, **kw)
        _, dk, dv = sagebwd_cp.attention_backward(saved, do)
    for b in range(len(lens)):
        s = slice(int(cu[b]), int(cu[b + 1]))
        with poisoned_workspaces():
            o1, l1, s1 = sagebwd_cp.attention_forward(q[s][None], k[s][None], v[s][None], layout="NHD", return_lse=True,
                                                      **kw)
            g1 = sagebwd_cp.attention_backward(s1, do[s][None])
        torch.cuda.synchronize()
        assert torch.equal(out[s], o1[0]) and torch.equal(lse[:, s], l1[0]), b
        assert torch.equal(dk[s], g1[1][0]) and torch.equal(dv[s], g1[2][0]), b


@pytest.mark.parametrize("d", [64, 128])
def test_a_given_mean_off_16_byte_alignment_gives_the_aligned_results(d):
    """A μ_K passed at a 4-byte offset (as chunked attention may hold it): the row kernels read it a float at a
    time (kernels/row_dot.cuh) and every output, the returned LSE and the gradients equal those of an aligned
    copy, bit for bit, soft-capped with K-smoothing."""
    import torch

    q, k, v = make_qkv(1, 4, 2, 200, 260, d, "bfloat16", sigma=2.0, seed=d)
    k = k + torch.linspace(-3, 3, d, device="cuda").to(k.dtype)
    do = torch.randn(q.shape, generator=torch.Generator(device="cuda").manual_seed(5), device="cuda").to(q.dtype)
    mean = k.float().mean(dim=2)
    buf = torch.empty(mean.numel() + 4, device="cuda")
    shifted = buf[1:1 + mean.numel()].view(mean.shape)
    shifted.copy_(mean)
    assert shifted.data_ptr() % 16 == 4
    results = []
    for given in (mean.contiguous(), shifted):
        with poisoned_workspaces():
            out, lse, saved = sagebwd_cp.attention_forward(q, k, v, causal=True, softcap=20.0, k_mean=given,
                                                           return_lse=True)
            grads = sagebwd_cp.attention_backward(saved, do)
        results.append((out, lse) + tuple(grads))
    torch.cuda.synchronize()
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert torch.equal(a, b), name

