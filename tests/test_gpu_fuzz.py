"""Seeded fuzz of the GPU kernels: random shapes (N from 1 to 20K, Lq != Lk), strides (views of a fused
QKV), dtypes, head counts (GQA, MQA), head dims 8..128 and causal masks; the output and gradients against
an FP32 reference within bounds that grow with the score magnitude, and nothing non-finite from finite
inputs (the gradients' reference takes δ from our output, as the backward does). SAGEBWD_FUZZ_SEED and SAGEBWD_FUZZ_CASES change the seed and the number of cases (200); a
failure prints the seed and the case, which reproduce it alone:
    SAGEBWD_FUZZ_SEED=<seed> python -m pytest tests/test_gpu_fuzz.py -k "case_<i>]"
"""
import dataclasses
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.torch]

import torch.nn.functional as F  # noqa: E402

import sagebwd_cp.torch as st  # noqa: E402

SEED = int(os.environ.get("SAGEBWD_FUZZ_SEED", "20261125"))
CASES = int(os.environ.get("SAGEBWD_FUZZ_CASES", "200"))


@dataclasses.dataclass
class Case:
    b: int
    hq: int
    hkv: int
    lq: int
    lk: int
    d: int
    dtype: str
    causal: bool
    layout: str
    fused: bool   # q, k, v are views of one (B, N, 3, H, D) tensor
    sigma: float  # std of q and k: the score magnitude


def draw(index: int) -> Case:
    rng = np.random.default_rng([SEED, index])
    big = rng.random() < 0.1  # a long sequence (4K-20K tokens), one batch entry, few heads
    n = int(rng.integers(4096, 20001)) if big else int(np.exp(rng.uniform(0, np.log(2048))))
    hkv = int(rng.choice([1, 2, 3])) if not big else 1
    group = int(rng.choice([1, 2, 4])) if not big else int(rng.choice([1, 2]))
    fused = not big and rng.random() < 0.25
    if fused:
        group = 1
    lk = n
    if not big and not fused and rng.random() < 0.3:
        lk = int(np.exp(rng.uniform(0, np.log(2048))))
    return Case(b=1 if big else int(rng.choice([1, 2])), hq=hkv * group, hkv=hkv, lq=n, lk=lk,
                d=int(rng.integers(1, 17)) * 8, dtype=str(rng.choice(["float16", "bfloat16"])),
                causal=bool(rng.random() < 0.5), layout="NHD" if fused else str(rng.choice(["HND", "NHD"])),
                fused=fused, sigma=float(rng.choice([0.5, 1.0, 2.0, 3.0])))


def _inputs(c: Case, index: int):
    g = torch.Generator(device="cuda").manual_seed(SEED * 1000 + index)
    dt = getattr(torch, c.dtype)

    def rnd(*shape, std=1.0):
        return (torch.randn(shape, generator=g, device="cuda") * std).to(dt)

    if c.fused:
        fused = rnd(c.b, c.lq, 3, c.hq, c.d)
        fused[:, :, :2] = (fused[:, :, :2].float() * c.sigma).to(dt)
        q, k, v = fused[:, :, 0], fused[:, :, 1], fused[:, :, 2]  # (B, N, H, D) views, token stride 3·H·D
    else:
        q, k, v = rnd(c.b, c.lq, c.hq, c.d, std=c.sigma), rnd(c.b, c.lk, c.hkv, c.d, std=c.sigma), rnd(c.b, c.lk, c.hkv, c.d)
        if c.layout == "HND":
            q, k, v = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    do = rnd(*q.shape) if not c.fused else rnd(c.b, c.lq, c.hq, c.d)
    return q, k, v, do


def _attention(c: Case, q, kk, vv):
    """FP32 attention (HND, KV heads repeated), bottom-right causal; rows that see no key give 0."""
    if c.lq == c.lk or not c.causal:
        return F.scaled_dot_product_attention(q, kk, vv, is_causal=c.causal)
    rows = torch.arange(c.lq, device="cuda")[:, None]  # Lq != Lk: small N only
    mask = torch.arange(c.lk, device="cuda")[None, :] <= rows + (c.lk - c.lq)
    s = (q @ kk.transpose(-1, -2)) * c.d ** -0.5
    # -1e30, not -inf, then the mask again: a row that sees no key has P = 0 and no NaN in its gradients.
    p = torch.softmax(s.masked_fill(~mask, -1e30), dim=-1) * mask
    return p @ vv


def _reference(c: Case, q, k, v, do, out):
    """FP32 attention and gradients of the same 16-bit inputs (HND, float32). The gradients take
    δ = rowsum(dO ∘ O) from ``out``, the output the backward reads (ours, 16-bit), as the algorithm
    does: dS = P ∘ (dP - δ) is linear in δ, so this adds -c·δ_err·P(K - μ_K) to dQ (K-smoothing's dQ
    reads K - μ_K) and -c·Pᵀ(δ_err·Q) to dK exactly (δ_err = rowsum(dO ∘ (out - O))). Without it, where dS nearly vanishes (one key: dS = 0) the
    output's own rounding would dominate the gradients' error."""
    hnd = (lambda x: x) if c.layout == "HND" else (lambda x: x.transpose(1, 2))
    group = c.hq // c.hkv
    q, k, v, do = (hnd(x).float().detach().requires_grad_(True) for x in (q, k, v, do))
    o = _attention(c, q, *(x.repeat_interleave(group, dim=1) for x in (k, v)))
    o.backward(do.detach())
    q0, k0, do0 = q.detach(), k.detach().repeat_interleave(group, dim=1), do.detach()
    delta_err = (do0 * (hnd(out).float() - o.detach())).sum(-1, keepdim=True)
    with torch.no_grad():  # P·(K - μ_K): with K-smoothing dQ = c·dS·(K - μ_K), exact only where rowsum(dS) = 0
        pk = _attention(c, q0, k0, k0 - k0.double().mean(dim=2, keepdim=True).float())
    values = k0.clone().requires_grad_(True)  # the gradient w.r.t. the values is Pᵀ·(upstream)
    _attention(c, q0, k0, values).backward(delta_err * q0)
    scale = c.d ** -0.5
    b, _, lk, d = values.shape
    dk_shift = values.grad.reshape(b, c.hkv, group, lk, d).sum(2)
    return [o.detach(), q.grad - scale * delta_err * pk, k.grad - scale * dk_shift, v.grad]


def _rel(x, ref):
    """Rel-L2 with a floor under ‖ref‖ (1e-3 per entry's RMS): gradients that are exactly zero, or zero
    but for FP32 rounding (one key, whose dS vanishes), are compared absolutely."""
    x, ref = x.detach().double(), ref.detach().double()
    floor = 1e-3 * ref.numel() ** 0.5
    return float((x - ref).norm() / max(float(ref.norm()), floor))


def _bounds(c: Case):
    """Rel-L2 bounds of O and of the gradients: about 2.5x the errors measured against exact attention at
    the score magnitude sigma (docs/ALGORITHM.md: O 0.014, dQ 0.018 at sigma 1, 0.029 and 0.054 at 3),
    plus bfloat16's coarser rounding of the output."""
    extra = 0.01 if c.dtype == "bfloat16" else 0.0
    return 0.04 * max(1.0, c.sigma) + extra, 0.05 * max(1.0, c.sigma) ** 1.5 + extra


@pytest.mark.parametrize("index", range(CASES), ids=lambda i: f"case_{i}")
def test_fuzz(index):
    c = draw(index)
    q, k, v, do = _inputs(c, index)
    qg, kg, vg = (x.detach().requires_grad_(True) for x in (q, k, v))
    out = st.attention(qg, kg, vg, causal=c.causal, layout=c.layout)
    out.backward(do)
    ref = _reference(c, q, k, v, do, out.detach())
    hnd = (lambda x: x) if c.layout == "HND" else (lambda x: x.transpose(1, 2))
    ours = [hnd(x).float() for x in (out, qg.grad, kg.grad, vg.grad)]
    where = f"seed {SEED}, case {index}: {c}"
    o_bound, g_bound = _bounds(c)
    for name, x, r, bound in zip(("out", "dq", "dk", "dv"), ours, ref, (o_bound, g_bound, g_bound, o_bound)):
        assert torch.isfinite(x).all(), f"{name}: non-finite values from finite inputs ({where})"
        err = _rel(x, r)
        assert err < bound, f"{name}: Rel-L2 {err:.4f} above {bound:.3f} ({where})"
