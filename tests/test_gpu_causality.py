"""What causal attention guarantees under quantization (docs/ALGORITHM.md, causality), on both kernel
families (the default, wgmma on sm_90, and mma.sync), through the public API with torch CUDA tensors:

* a loss on rows 0..p gives exactly zero dQ, dK, dV at every later position;
* without K-smoothing, or with ``prefix_key_mean``'s μ_K, the output, LSE and dQ (deterministic) of the
  rows before the forward key tile (64 or 128 keys) of the first changed token are bit for bit unchanged;
* with the default μ_K, rows 0..p move by less than the stated bound;
* in a packed batch no sequence's output, LSE or gradients depend on another sequence.
The emulator's side of the same is tests/test_causality.py.
"""
import pytest

import sagebwd_cp
from gpu_helpers import KERNELS, KERNEL_IDS, forward_key_tile, make_qkv, poisoned_workspaces

pytestmark = [pytest.mark.gpu, pytest.mark.torch]


def _randn_like(x, seed):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(x.shape, generator=g, device="cuda", dtype=torch.float32).to(x.dtype)


def _change_after(xs, p, seed):
    """Clones of the HND tensors ``xs`` with every row after token p redrawn."""
    out = []
    for i, x in enumerate(xs):
        y = x.clone()
        y[:, :, p + 1:] = _randn_like(y[:, :, p + 1:], seed + i)
        out.append(y)
    return out


def _run(q, k, v, do, mean, deterministic=True):
    kw = {"smooth_k": mean != "none"}
    if mean == "prefix":
        kw["k_mean"] = sagebwd_cp.prefix_key_mean(k)
    with poisoned_workspaces():
        o, lse, saved = sagebwd_cp.attention_forward(q, k, v, causal=True, return_lse=True, **kw)
        grads = sagebwd_cp.attention_backward(saved, do, deterministic=deterministic)
    return (o, lse) + tuple(grads)


def _rel(x, ref):
    import torch

    x, ref = x.double(), ref.double()
    return float(torch.linalg.vector_norm(x - ref) / torch.linalg.vector_norm(ref))


@pytest.mark.parametrize("kernels", KERNELS, ids=KERNEL_IDS, indirect=True)
@pytest.mark.parametrize("mean", ["sequence", "none", "prefix"])
@pytest.mark.parametrize("shape,p,dtype", [((1, 4, 2, 1000, 1000, 64), 450, "float16"),
                                           ((1, 4, 2, 700, 1000, 128), 300, "bfloat16")],
                         ids=["lq=lk-d64-fp16", "lq<lk-d128-bf16"])
def test_a_loss_on_early_rows_gives_later_positions_exactly_zero_gradients(kernels, mean, shape, p, dtype):
    import torch

    b, hq, hk, lq, lk, d = shape
    q, k, v = make_qkv(b, hq, hk, lq, lk, d, dtype, "HND", seed=lq + p)
    do = _randn_like(q, 1)
    do[:, :, p + 1:] = 0  # the loss reads rows 0..p only
    _, _, dq, dk, dv = _run(q, k, v, do, mean, deterministic=False)
    torch.cuda.synchronize()
    last_key = p + lk - lq  # row p sees keys up to p + Lk - Lq
    assert dq[:, :, :p + 1].abs().max() > 0 and dk[:, :, :last_key + 1].abs().max() > 0
    assert not dq[:, :, p + 1:].any()
    assert not dk[:, :, last_key + 1:].any()
    assert not dv[:, :, last_key + 1:].any()


@pytest.mark.parametrize("kernels", KERNELS, ids=KERNEL_IDS, indirect=True)
@pytest.mark.parametrize("mean", ["none", "prefix"])
@pytest.mark.parametrize("d,dtype", [(64, "float16"), (128, "bfloat16")])
def test_rows_before_the_key_tile_of_the_first_changed_token_are_bit_identical(kernels, mean, d, dtype):
    import torch

    n, p = 1000, 450  # the first changed token, 451, is in the key tile 384..511 (128) or 448..511 (64)
    tile = forward_key_tile(d)
    boundary = (p + 1) // tile * tile
    q, k, v = make_qkv(1, 4, 2, n, n, d, dtype, "HND", seed=d)
    do = _randn_like(q, 2)
    first = _run(q, k, v, do, mean)
    q2, k2, v2, do2 = _change_after((q, k, v, do), p, seed=3)
    v2[:, :, p + 1:] *= 2  # so that the changed V block's scale surely changes
    second = _run(q2, k2, v2, do2, mean)
    torch.cuda.synchronize()
    for name, a, b in zip(("out", "lse", "dq"), first[:3], second[:3]):
        assert torch.equal(a[:, :, :boundary], b[:, :, :boundary]), (name, tile)
    # ... and no further: rows boundary..p share the tile with the changed tokens.
    assert not torch.equal(first[0][:, :, boundary:p + 1], second[0][:, :, boundary:p + 1])


@pytest.mark.parametrize("kernels", KERNELS, ids=KERNEL_IDS, indirect=True)
@pytest.mark.parametrize("d,dtype", [(64, "float16"), (128, "bfloat16")])
def test_with_the_sequence_mean_early_rows_move_at_quantization_noise_level(kernels, d, dtype):
    """docs/ALGORITHM.md's bound: over rows 0..p, ΔO under 2% Rel-L2 and below the output's own error
    against exact attention there (whose exact values do not change); dQ's rows under 4%."""
    import torch

    n, p = 1000, 450
    q, k, v = make_qkv(1, 4, 2, n, n, d, dtype, "HND", seed=d + 1)
    do = _randn_like(q, 4)
    o1, _, dq1, _, _ = _run(q, k, v, do, "sequence")
    o2, _, dq2, _, _ = _run(*_change_after((q, k, v, do), p, seed=5), "sequence")
    ke, ve = (x.double().repeat_interleave(2, dim=1) for x in (k, v))  # GQA: query head h reads KV head h // 2
    exact = torch.nn.functional.scaled_dot_product_attention(q.double(), ke, ve, is_causal=True)
    rows = slice(0, p + 1)
    moved = _rel(o2[:, :, rows], o1[:, :, rows])
    error = _rel(o1[:, :, rows], exact[:, :, rows])
    assert moved < 0.02 and moved < error, (moved, error)
    assert _rel(dq2[:, :, rows], dq1[:, :, rows]) < 0.04


LENS = [100, 130, 37, 300]


@pytest.mark.parametrize("kernels", KERNELS, ids=KERNEL_IDS, indirect=True)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("changed", [0, 1, 3])
def test_packed_sequences_do_not_depend_on_each_other(kernels, causal, changed):
    import numpy as np
    import torch

    total, hq, hk, d = sum(LENS), 4, 2, 64
    g = torch.Generator(device="cuda").manual_seed(11)
    rand = lambda h: torch.randn((total, h, d), generator=g, device="cuda").to(torch.bfloat16)
    q, k, v, do = rand(hq), rand(hk), rand(hk), rand(hq)
    cu = torch.tensor([0] + np.cumsum(LENS).tolist(), dtype=torch.int32, device="cuda")

    def run(q, k, v, do):
        with poisoned_workspaces():
            o, lse, saved = sagebwd_cp.attention_varlen_forward(q, k, v, cu, cu, max(LENS), max(LENS),
                                                               causal=causal, return_lse=True)
            return (o, lse.T) + tuple(sagebwd_cp.attention_backward(saved, do, deterministic=True))

    first = run(q, k, v, do)
    a, b = int(cu[changed]), int(cu[changed + 1])
    q2, k2, v2, do2 = (x.clone() for x in (q, k, v, do))
    for x in (q2, k2, v2, do2):
        x[a:b] = torch.randn(x[a:b].shape, generator=g, device="cuda").to(x.dtype)
    second = run(q2, k2, v2, do2)
    torch.cuda.synchronize()
    keep = torch.ones(total, dtype=torch.bool, device="cuda")
    keep[a:b] = False
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), first, second):
        assert torch.equal(x[keep], y[keep]), name
        assert not torch.equal(x[~keep], y[~keep]), name
