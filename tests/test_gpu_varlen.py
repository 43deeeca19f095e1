"""Packed (variable-length) batches on the GPU: each sequence of a packed batch must come out exactly
as a dense call on that sequence alone (the kernels treat it as a batch of one: its own quantization
blocks, μ_K and causal alignment), for the forward, the LSE and the deterministic gradients, on
both kernel families, with poisoned workspaces; and the flash_attn_varlen_func drop-in under
torch.compile and a CUDA graph."""
import numpy as np
import pytest

import sagebwd_cp
from gpu_helpers import poisoned_workspaces

pytestmark = [pytest.mark.gpu, pytest.mark.torch]

# (query lengths, key lengths): length 1, ragged lengths, Lq != Lk inside a sequence, many short
# sequences, one long one beside a short one.
BATCHES = [
    ([1], [1]),
    ([1, 130, 7, 64, 300], [1, 130, 7, 64, 300]),
    ([100, 5, 257], [300, 900, 1]),
    ([17] * 40, [17] * 40),
    ([4097, 3], [4097, 3]),
]
KERNELS = [{}, {"SAGEBWD_WGMMA": "0"}]


def _packed(lens_q, lens_k, hq, hk, d, dtype, seed):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    tdt = getattr(torch, dtype)
    rand = lambda n, h: torch.randn((n, h, d), generator=g, device="cuda").to(tdt)
    cu = lambda lens: torch.tensor([0] + np.cumsum(lens).tolist(), dtype=torch.int32, device="cuda")
    q, k, v = rand(sum(lens_q), hq), rand(sum(lens_k), hk), rand(sum(lens_k), hk)
    return q, k, v, rand(sum(lens_q), hq), cu(lens_q), cu(lens_k)


@pytest.mark.parametrize("kernels", KERNELS, ids=["default", "mma.sync"])
@pytest.mark.parametrize("lens", BATCHES, ids=["one-token", "ragged", "lq-ne-lk", "many-short", "long-short"])
@pytest.mark.parametrize("causal", [False, True])
def test_each_packed_sequence_equals_its_dense_call(monkeypatch, kernels, lens, causal):
    import torch

    from sagebwd_cp.gpu import plan

    for name, value in kernels.items():
        monkeypatch.setenv(name, value)
    plan.clear_plans()
    lens_q, lens_k = lens
    d, dtype = (128, "bfloat16") if causal else (80, "float16")
    q, k, v, do, cq, ck = _packed(lens_q, lens_k, 4, 2, d, dtype, seed=len(lens_q) + causal)
    with poisoned_workspaces():
        out, lse, saved = sagebwd_cp.attention_varlen_forward(q, k, v, cq, ck, max(lens_q), max(lens_k),
                                                             causal=causal, return_lse=True)
        dq, dk, dv = sagebwd_cp.attention_backward(saved, do, deterministic=True)
        torch.cuda.synchronize()
        assert tuple(lse.shape) == (4, sum(lens_q)) and tuple(dk.shape) == tuple(k.shape)
        q0 = k0 = 0
        for lq, lk in zip(lens_q, lens_k):
            sq, sk = slice(q0, q0 + lq), slice(k0, k0 + lk)
            o1, l1, s1 = sagebwd_cp.attention_forward(q[None, sq], k[None, sk], v[None, sk], causal=causal,
                                                      layout="NHD", return_lse=True)
            g1 = sagebwd_cp.attention_backward(s1, do[None, sq].contiguous(), deterministic=True)
            assert torch.equal(out[sq], o1[0]), (lq, lk)
            assert torch.equal(lse[:, sq], l1[0]), (lq, lk)
            assert torch.equal(dq[sq], g1[0][0]) and torch.equal(dk[sk], g1[1][0]) and torch.equal(dv[sk], g1[2][0])
            q0, k0 = q0 + lq, k0 + lk
    plan.clear_plans()


def test_packed_emulator_agrees_with_the_kernels(monkeypatch):
    """The host path of a packed batch (the emulator per sequence, 64-key tiles) against the GPU's
    64-key forward; each side computes its own O and LSE, so the gradients differ by more than the
    dense tests' (which feed the emulator the GPU's O and LSE)."""
    import torch

    from sagebwd_cp.gpu import plan

    monkeypatch.setenv("SAGEBWD_FORWARD_KEY_TILE", "64")
    plan.clear_plans()
    lens_q, lens_k = [5, 200, 64], [70, 200, 1]
    q, k, v, do, cq, ck = _packed(lens_q, lens_k, 2, 1, 64, "float16", seed=3)
    out, saved = sagebwd_cp.attention_varlen_forward(q, k, v, cq, ck, 200, 200, causal=True)
    grads = sagebwd_cp.attention_backward(saved, do)
    host = [x.cpu() for x in (q, k, v, do, cq, ck)]
    out_h, saved_h = sagebwd_cp.attention_varlen_forward(*host[:3], *host[4:], 200, 200, causal=True)
    grads_h = sagebwd_cp.attention_backward(saved_h, host[3])
    rel = lambda a, b: float(torch.linalg.vector_norm((a.float().cpu() - b.float())) / torch.linalg.vector_norm(b.float()))
    assert rel(out, out_h) < 2e-3
    for g, h in zip(grads, grads_h):
        assert rel(g, h) < 1e-2
    plan.clear_plans()


def test_flash_attn_varlen_func_compiles_and_replays_in_a_cuda_graph():
    import torch

    import sagebwd_cp.torch as sage

    lens = [33, 400, 2]
    q, k, v, do, cq, ck = _packed(lens, lens, 4, 1, 64, "bfloat16", seed=9)
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def step(q, k, v):
        return sage.flash_attn_varlen_func(q, k, v, cq, ck, 400, 400, causal=True)

    eager = step(q, k, v)
    eager.backward(do)
    eager_grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    compiled = torch.compile(step, fullgraph=True)(q, k, v)
    compiled.backward(do)
    assert torch.equal(compiled, eager)
    for x, g in zip((q, k, v), eager_grads):
        assert (x.grad.float() - g.float()).abs().max() < 5e-2 * g.float().abs().max()  # dQ: atomics' order
    with torch.no_grad():
        static = step(q, k, v)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = step(q, k, v)
        q.data.mul_(0.5)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static, step(q, k, v))
