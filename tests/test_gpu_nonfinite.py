"""Non-finite inputs on the GPU: every output and gradient that torch's SDPA makes non-finite (a NaN or
inf in q, k, v or dO) is non-finite here too, and every one that exact attention makes non-finite, on
both kernel families (the default, and mma.sync through SAGEBWD_WGMMA=0 on Hopper); the spread stays
inside the value's (batch, KV-head group) (docs/ALGORITHM.md, non-finite inputs).

One exception, on the mma.sync path only: SDPA's fused kernels multiply masked probabilities (0) by a
NaN or inf value of v in their 128-key blocks, so rows that do not see the key turn non-finite too;
the mma.sync forward's 64-key tiles skip those blocks for those rows. There the test asks for SDPA's
entries that exact attention also makes non-finite."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.torch]

import torch.nn.functional as F  # noqa: E402

import sagebwd_cp.torch as st  # noqa: E402
from sagebwd_cp.gpu import plan  # noqa: E402

from nonfinite_helpers import CASES, exact_nonfinite, heads_touched  # noqa: E402

# (B, Hq, Hkv, N, D): the shape of the report (1x2x256x64), and GQA with a ragged length and padded head dim.
SHAPES = [(1, 2, 2, 256, 64), (1, 4, 2, 200, 80)]


def _grads(fn, q, k, v, do):
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    out = fn(q, k, v)
    out.backward(do)
    return [t.detach().float().cpu().numpy() for t in (out, q.grad, k.grad, v.grad)]


@pytest.mark.parametrize("kernels", ["default", "mma.sync"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tensor,value", CASES)
def test_nonfinite_input_covers_sdpa(monkeypatch, kernels, shape, causal, tensor, value):
    b, hq, hkv, n, d = shape
    if kernels == "mma.sync":
        monkeypatch.setenv("SAGEBWD_WGMMA", "0")
    plan.clear_plans()
    g = torch.Generator(device="cuda").manual_seed(n + d)
    mk = lambda h: torch.randn((b, h, n, d), generator=g, device="cuda").half()  # noqa: E731
    x = {"q": mk(hq), "k": mk(hkv), "v": mk(hkv), "do": mk(hq)}
    at = (b - 1, 1, n // 3, 5)  # query head 1 reads KV head 0 or 1: either way one group
    x[tensor][at] = float(value)
    ours = _grads(lambda q, k, v: st.attention(q, k, v, causal=causal), x["q"], x["k"], x["v"], x["do"])
    sdpa = _grads(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv),
                  x["q"], x["k"], x["v"], x["do"])
    plan.clear_plans()
    host = {key: t.float().cpu().numpy() for key, t in x.items()}
    exact = exact_nonfinite(host["q"], host["k"], host["v"], host["do"], causal)
    bound = heads_touched(host["q"].shape, host["k"].shape, tensor, at)
    for name, o, s, e, u in zip(("out", "dq", "dk", "dv"), ours, sdpa, exact, bound):
        bad = ~np.isfinite(o)
        s = ~np.isfinite(s)
        if kernels == "mma.sync" and tensor == "v":
            s &= e  # SDPA's 0·NaN in masked products of its 128-key blocks (out, and dq through it): see above
        assert not (s & ~bad).any(), f"{name}: {int((s & ~bad).sum())} of SDPA's {int(s.sum())} non-finite entries are finite"
        assert not (e & ~bad).any(), f"{name}: finite where exact attention is not"
        assert not (bad & ~u).any(), f"{name}: non-finite outside the value's batch entry and head group"
    if tensor == "q":  # Q is coded per token: exactly exact attention's output rows
        assert np.array_equal(~np.isfinite(ours[0]), exact[0])
    if tensor == "do":
        assert np.isfinite(ours[0]).all()
