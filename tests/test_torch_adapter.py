"""The PyTorch adapter on the CPU (tensors run through the emulator): gradients against exact
attention, autograd bookkeeping, argument errors, the custom operators (opcheck, torch.compile),
the drop-ins and the module wrapper, and the training example."""
import importlib.util
import os
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import sagebwd_cp  # noqa: E402
import sagebwd_cp.torch as st  # noqa: E402
from sagebwd_cp.host import reference  # noqa: E402
from sagebwd_cp.options import AttentionOptions  # noqa: E402
from sagebwd_cp.torch import _ops  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 0.03  # Rel-L2 of the quantized algorithm against exact attention at sigma ~ 1


def rel_l2(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def qkv(b=1, hq=2, hk=2, lq=150, lk=150, d=64, layout="HND", dtype=torch.float32, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)

    def mk(h, n):
        shape = (b, h, n, d) if layout == "HND" else (b, n, h, d)
        return torch.randn(shape, generator=g).to(dtype).requires_grad_(grad)

    return mk(hq, lq), mk(hk, lk), mk(hk, lk)


def hnd(x, layout):
    a = x.detach().double().numpy()
    return a if layout == "HND" else a.transpose(0, 2, 1, 3)


def exact(q, k, v, do, layout, causal, scale=None):
    args = [hnd(x, layout) for x in (q, k, v)]
    o, _ = reference.attention_reference(*args, causal=causal, softmax_scale=scale)
    grads = reference.attention_reference_backward(*args, hnd(do, layout), causal=causal, softmax_scale=scale)
    return o, grads


# ------------------------------------------------------------------------------ gradients


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hk,lq,lk", [(2, 2, 150, 150), (4, 1, 120, 180), (4, 2, 190, 100)])
def test_gradients_match_exact_attention(layout, causal, hq, hk, lq, lk):
    q, k, v = qkv(b=2, hq=hq, hk=hk, lq=lq, lk=lk, layout=layout, seed=lq + lk)
    out = st.attention(q, k, v, causal=causal, layout=layout)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(do)
    o_ref, grads_ref = exact(q, k, v, do, layout, causal)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert rel_l2(hnd(out, layout), o_ref) < TOL
    for name, x, ref in zip("qkv", (q, k, v), grads_ref):
        assert x.grad.shape == x.shape and x.grad.dtype == x.dtype
        assert rel_l2(hnd(x.grad, layout), ref) < TOL, name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_cpu_dtypes_keep_their_dtype(dtype):
    q, k, v = qkv(lq=100, lk=100, dtype=dtype)
    out = st.attention(q, k, v, causal=True)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    out.backward(do)
    o_ref, grads_ref = exact(q, k, v, do, "HND", True)
    assert out.dtype == dtype
    assert rel_l2(hnd(out, "HND"), o_ref) < TOL
    for x, ref in zip((q, k, v), grads_ref):
        assert x.grad.dtype == dtype
        assert rel_l2(hnd(x.grad, "HND"), ref) < TOL


@pytest.mark.parametrize("granularity,tol", [("fine", TOL), ("paper", 0.05)])  # "paper": one scale per tile
def test_softmax_scale_smooth_q_and_granularity(granularity, tol):
    q, k, v = qkv(lq=130, lk=130, seed=3)
    scale = 0.3
    out = st.attention(q, k, v, causal=True, softmax_scale=scale, smooth_q=True, granularity=granularity,
                       deterministic=True)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    out.backward(do)
    o_ref, grads_ref = exact(q, k, v, do, "HND", True, scale)
    assert rel_l2(hnd(out, "HND"), o_ref) < TOL
    for x, ref in zip((q, k, v), grads_ref):
        assert rel_l2(hnd(x.grad, "HND"), ref) < tol


def test_options_are_passed_to_the_backward(monkeypatch):
    seen = []
    real = _ops.run_backward

    def spy(*args, k_mean=None, **kw):
        (options,) = args[6:]  # after q, k, v, out, lse2, dout
        seen.append(tuple(options) + (None if k_mean is None else k_mean.shape,))
        return real(*args, k_mean=k_mean, **kw)

    monkeypatch.setattr(_ops, "run_backward", spy)
    q, k, v = qkv(lq=70, lk=80)
    st.attention(q, k, v, causal=True, softmax_scale=0.2, smooth_k=False, smooth_q=True, granularity="paper",
                 deterministic=True).sum().backward()
    st.attention(q, k, v, smooth_q=True).sum().backward()  # the forward's μ_K goes to the backward
    st.attention(q, k, v, window_size=(8, 3)).sum().backward()
    st.attention(q, k, v, causal=True, smooth_k=False, softcap=30.0).sum().backward()
    # A narrower V (MLA) keeps its own head dim; a wider one widens Q and K, the scale resolved from Q·K's 64.
    st.attention(q, k, v[..., :32].detach().requires_grad_(), causal=True).sum().backward()
    st.attention(q, k, torch.cat([v, v], -1).detach().requires_grad_(), causal=True).sum().backward()
    assert seen == [(True, 0.2, False, True, "HND", "paper", True, -1, -1, 0.0, None),
                    (False, None, True, True, "HND", "fine", False, -1, -1, 0.0, (1, 2, 64)),
                    (False, None, True, False, "HND", "fine", False, 8, 3, 0.0, (1, 2, 64)),
                    (True, None, False, False, "HND", "fine", False, -1, -1, 30.0, None),
                    (True, None, True, False, "HND", "fine", False, -1, -1, 0.0, (1, 2, 64)),
                    (True, 0.125, True, False, "HND", "fine", False, -1, -1, 0.0, (1, 2, 128))]


def test_matches_the_neutral_api_exactly():
    q, k, v = qkv(lq=90, lk=110, hq=4, hk=2)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(5))
    out = st.attention(q, k, v, causal=True)
    out.backward(do)
    o_api, saved = sagebwd_cp.attention_forward(*(x.detach().numpy() for x in (q, k, v)), causal=True)
    grads_api = sagebwd_cp.attention_backward(saved, do.numpy())
    np.testing.assert_array_equal(out.detach().numpy(), o_api)
    for x, g in zip((q, k, v), grads_api):
        np.testing.assert_array_equal(x.grad.numpy(), g)


def test_strided_views_and_expanded_output_gradients():
    """q, k, v sliced out of one fused projection (no copies), and the expanded (stride-0)
    gradient that ``out.sum()`` sends back."""
    g = torch.Generator().manual_seed(0)
    fused = torch.randn(2, 100, 3, 2, 64, generator=g, requires_grad=True)
    q, k, v = fused.unbind(2)  # (B, N, H, D) views with token stride 3*H*D
    out = st.flash_attn_func(q, k, v, causal=True)
    out.sum().backward()
    do = torch.ones(out.shape)
    _, grads_ref = exact(q, k, v, do, "NHD", True)
    for i, ref in enumerate(grads_ref):
        assert rel_l2(hnd(fused.grad[:, :, i], "NHD"), ref) < TOL


def test_last_dim_strided_inputs_are_made_contiguous():
    q, k, v = qkv(lq=64, lk=64, grad=False)
    qt = q.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, stride(-1) != 1
    assert qt.stride(-1) != 1
    torch.testing.assert_close(st.attention(qt, k, v), st.attention(q, k, v), rtol=0, atol=0)


# ------------------------------------------------------------------------------ autograd bookkeeping


@pytest.mark.parametrize("needs", [(True, False, False), (False, True, False), (False, False, True),
                                   (True, True, False), (False, True, True)])
def test_partial_requires_grad(needs):
    base = qkv(lq=80, lk=96, hq=4, hk=2, grad=False)
    do = torch.randn(base[0].shape, generator=torch.Generator().manual_seed(9))
    full = [x.clone().requires_grad_() for x in base]
    st.attention(*full, causal=True).backward(do)
    part = [x.clone().requires_grad_(n) for x, n in zip(base, needs)]
    out = st.attention(*part, causal=True)
    assert out.requires_grad
    out.backward(do)
    for x, f, n in zip(part, full, needs):
        if n:
            torch.testing.assert_close(x.grad, f.grad, rtol=0, atol=0)
        else:
            assert x.grad is None


@pytest.mark.parametrize("smooth_k", [True, False])
def test_saves_only_inputs_output_lse_and_key_mean(smooth_k):
    q, k, v = qkv(b=2, hq=4, hk=2, lq=70, lk=90)
    out = st.attention(q, k, v, causal=True, smooth_k=smooth_k)
    saved = out.grad_fn.saved_tensors
    assert len(saved) == 6
    for s, x in zip(saved[:3], (q, k, v)):
        assert s.data_ptr() == x.data_ptr() and s.shape == x.shape
    assert saved[3].data_ptr() == out.data_ptr()
    assert saved[4].shape == (2, 4, 70) and saved[4].dtype == torch.float32
    # μ_K (B, Hkv, D) with K-smoothing, an empty tensor without
    assert saved[5].shape == ((2, 2, k.shape[-1]) if smooth_k else (0,)) and saved[5].dtype == torch.float32
    if smooth_k:
        torch.testing.assert_close(saved[5], k.detach().double().mean(dim=2).float())


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "inputs_without_grad"])
def test_no_grad_saves_nothing_and_skips_the_training_forward(monkeypatch, mode):
    calls = []
    real = _ops.run_forward

    def spy(*args, **kwargs):
        if kwargs.get("training"):
            calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(_ops, "run_forward", spy)
    q, k, v = qkv(lq=64, lk=64, grad=mode != "inputs_without_grad")
    if mode == "no_grad":
        with torch.no_grad():
            out = st.attention(q, k, v, causal=True)
    elif mode == "inference_mode":
        with torch.inference_mode():
            out = st.attention(q, k, v, causal=True)
    else:
        out = st.attention(q, k, v, causal=True)
    assert out.grad_fn is None and not out.requires_grad and calls == []
    with torch.no_grad():
        ref = st.attention(q.detach(), k.detach(), v.detach(), causal=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    st.attention(q.detach().requires_grad_(), k, v, causal=True)
    assert calls == [1]


def test_autograd_function_directly():
    q, k, v = qkv(lq=70, lk=70)
    out = st.SageAttentionFunction.apply(q, k, v, True, None, True, False, "HND", "fine", False)
    out.sum().backward()
    ref = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    st.attention(*ref, causal=True).sum().backward()
    for x, r in zip((q, k, v), ref):
        torch.testing.assert_close(x.grad, r.grad, rtol=0, atol=0)


@pytest.mark.parametrize("function", ["attention", "SageAttentionFunction"])
def test_double_backward_is_refused(function):
    q, k, v = qkv(lq=64, lk=64)
    if function == "attention":
        out = st.attention(q, k, v)
    else:
        out = st.SageAttentionFunction.apply(q, k, v, False, None, True, False, "HND", "fine", False)
    do = torch.ones_like(out).requires_grad_()  # so that the gradients would be differentiable
    (gq,) = torch.autograd.grad(out, q, do, create_graph=True)
    (plain,) = torch.autograd.grad(out, q, do.detach())
    torch.testing.assert_close(gq, plain, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="differentiate twice a function that was marked with @once_differentiable"):
        gq.sum().backward()


# ------------------------------------------------------------------------------ the CUDA path, GPU stubbed


@pytest.fixture
def stubbed_cuda(monkeypatch):
    """CPU tensors take the adapter's CUDA path: described as CUDA arrays, plans built and cached,
    outputs from the library's allocation code ("device 0" mapped to the CPU), launches recorded
    instead of run (outputs hold no results: only their metadata is meaningful)."""
    from sagebwd_cp import arrays
    from sagebwd_cp.gpu import compiler, device, launch, plan, tensor_map

    real = arrays._from_torch

    def cuda_desc(x, name):
        d = real(x, name)
        d.device_type = "cuda"
        return d

    class FakeCuda:
        launches = 0

        def getDevice(self):
            return 0

        def ctxGetCurrent(self):
            return 1

        def memsetAsync(self, p, value, nbytes, stream):
            pass

        def launchKernel(self, *args):
            self.launches += 1

    fake = FakeCuda()
    monkeypatch.setattr(arrays, "_from_torch", cuda_desc)
    monkeypatch.setitem(arrays._TORCH_DEVICES, 0, torch.device("cpu"))
    monkeypatch.setattr(plan, "stream_reader", lambda framework: (lambda device_id: 0))
    monkeypatch.setattr(plan, "_plans", {})
    monkeypatch.setattr(compiler, "get_function_pointer", lambda spec, entry, device_id, shared=0: 0x1000)
    monkeypatch.setitem(device._device_limits, 0, 232448)
    monkeypatch.setitem(device._device_archs, 0, "sm_90")
    monkeypatch.setitem(device._device_sms, 0, 132)
    monkeypatch.setattr(launch, "_cuda_modules", (fake, fake))
    monkeypatch.setattr(tensor_map, "_encoder", lambda layout: (lambda out, address: None))  # the driver's job
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    return fake


def test_cuda_path_cached_calls_get_the_right_plan_or_a_clear_error(stubbed_cuda):
    from sagebwd_cp.gpu import plan

    def call(dtype=torch.float16, layout="HND", **opts):
        q, k, v = qkv(hq=2, hk=1, lq=64, lk=96, layout=layout, dtype=dtype)
        out = st.attention(q, k, v, layout=layout, **opts)
        assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
        lse2 = out.grad_fn.saved_tensors[4]
        assert lse2.shape == (1, 2, 64) and lse2.dtype == torch.float32
        out.backward(torch.ones_like(out))  # expanded dO made contiguous; a backward plan per key
        for x in (q, k, v):
            assert x.grad.shape == x.shape and x.grad.dtype == dtype
        return len(plan._plans)

    assert call() == 2  # a forward and a backward plan
    launches = stubbed_cuda.launches
    assert call() == 2 and stubbed_cuda.launches == 2 * launches  # replayed, not rebuilt
    assert call(causal=True) == 4
    assert call(dtype=torch.bfloat16) == 6
    assert call(layout="NHD") == 8  # other strides
    with pytest.raises(ValueError, match=r"head_dim: expected a multiple of 8"):
        st.attention(*(x[..., :60] for x in qkv(lq=64, lk=64, dtype=torch.float16)))
    with pytest.raises(TypeError, match=r"q, k, v: expected one dtype"):
        q, k, v = qkv(lq=64, lk=64, dtype=torch.float16)
        st.attention(q, k.bfloat16(), v)
    assert len(plan._plans) == 8


# ------------------------------------------------------------------------------ argument errors


@pytest.mark.parametrize("call,exc,message", [
    (lambda q, k, v: st.attention(q, k, v, layout="BHSD"), ValueError, r"layout: expected one of \('HND', 'NHD'\), got 'BHSD'"),
    (lambda q, k, v: st.attention(q, k, v, granularity="coarse"), ValueError, r"granularity: expected one of"),
    (lambda q, k, v: st.attention(q[..., :60], k[..., :60], v[..., :60]), ValueError, r"head_dim: expected a multiple of 8"),
    (lambda q, k, v: st.attention(q, k.double(), v), TypeError, r"q, k, v: expected one dtype"),
    (lambda q, k, v: st.attention(q[:, :3], k, v), ValueError, r"heads: expected the query heads \(3\)"),
    (lambda q, k, v: st.attention(q[0], k, v), ValueError, r"q: expected a rank-4 array"),
    (lambda q, k, v: st.attention(q.int(), k.int(), v.int()), TypeError,
     r"q: expected dtype float16, bfloat16, float32 or float64 for a host array, got int32"),
    (lambda q, k, v: st.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(64, 64, dtype=torch.bool)),
     ValueError, r"attn_mask: arbitrary attention masks are not supported"),
    (lambda q, k, v: st.scaled_dot_product_attention(q, k, v, dropout_p=0.1), ValueError, r"dropout_p: .* got 0.1"),
    (lambda q, k, v: st.scaled_dot_product_attention(q, k[:, :1], v[:, :1]), ValueError,
     r"enable_gqa: query has 4 heads and key/value 1; pass enable_gqa=True"),
    (lambda q, k, v: st.scaled_dot_product_attention(q, k, v[..., :20], enable_gqa=True), ValueError,
     r"v: expected a head_dim that is a multiple of 8 between 8 and q's and k's \(64\), got 20"),
    (lambda q, k, v: st.scaled_dot_product_attention(q, k[None], v[None]), ValueError, r"same number of dimensions"),
    (lambda q, k, v: st.flash_attn_func(q, k, v, 0.1), ValueError, r"dropout_p: attention dropout is not supported"),
    (lambda q, k, v: st.flash_attn_func(q, k, v, window_size=(-2, 0)), ValueError, r"window_size\[0\]: expected -1"),
    (lambda q, k, v: st.flash_attn_func(q, k, v, window_size=16), TypeError, r"window_size: expected a pair"),
    (lambda q, k, v: st.flash_attn_func(q, k, v, softcap=30.0, smooth_q=True), ValueError,
     r"softcap: soft-capping takes no Q-smoothing"),
    (lambda q, k, v: st.flash_attn_func(q, k, v, alibi_slopes=torch.ones(2)), ValueError, r"alibi_slopes: "),
    (lambda q, k, v: st.flash_attn_func(q, k, v, return_attn_probs=True), ValueError, r"return_attn_probs: "),
    (lambda q, k, v: st.SageAttention(layout="nhd"), ValueError, r"layout: expected one of"),
    (lambda q, k, v: st.SageAttention(granularity=64), ValueError, r"granularity: expected one of"),
    (lambda q, k, v: st.attention(q, k, v, causal="no"), TypeError, r"causal: expected True or False, got str 'no'"),
    (lambda q, k, v: st.attention(q, k, v, softmax_scale="0.1"), TypeError,
     r"softmax_scale: expected a float or None, got str '0.1'"),
    (lambda q, k, v: st.attention(q, k, v, deterministic=1), TypeError, r"deterministic: expected True or False, got int"),
    (lambda q, k, v: st.scaled_dot_product_attention(q, k, v, is_causal="no", enable_gqa=True), TypeError,
     r"is_causal: expected True or False, got str 'no'"),
    (lambda q, k, v: st.flash_attn_func(q, k, v, causal=None), TypeError, r"causal: expected True or False, got NoneType"),
    (lambda q, k, v: st.SageAttention(causal="yes"), TypeError, r"causal: expected True or False, got str 'yes'"),
])
def test_argument_errors(call, exc, message):
    q, k, v = qkv(hq=4, hk=2, lq=64, lk=64)
    with pytest.raises(exc, match=message):
        call(q, k, v)


def test_bad_options_fail_at_trace_time_under_compile():
    q, k, v = qkv(lq=64, lk=64, grad=False)
    with pytest.raises(Exception, match="granularity: expected one of"):
        torch.compile(lambda q, k, v: st.attention(q, k, v, granularity="x"), fullgraph=True,
                      backend="aot_eager")(q, k, v)


# ------------------------------------------------------------------------------ custom operators


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("needs", [(True, True, True), (False, True, False)])
def test_opcheck_forward_operator(layout, needs):
    q, k, v = qkv(b=2, hq=4, hk=2, lq=70, lk=90, layout=layout, grad=False)
    q, k, v = (x.requires_grad_(n) for x, n in zip((q, k, v), needs))
    torch.library.opcheck(torch.ops.sagebwd_cp.attention_forward.default,
                          (q, k, v, *AttentionOptions(causal=True, layout=layout)))


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_opcheck_inference_and_backward_operators(layout):
    q, k, v = qkv(b=2, hq=4, hk=2, lq=70, lk=90, layout=layout, grad=False)
    torch.library.opcheck(torch.ops.sagebwd_cp.attention.default, (q, k, v, *AttentionOptions(softmax_scale=0.2, layout=layout)))
    paper = AttentionOptions(causal=True, smooth_q=True, layout=layout, granularity="paper")
    out, lse2, k_mean = torch.ops.sagebwd_cp.attention_forward(q, k, v, *paper)
    assert lse2.shape == (2, 4, 70) and lse2.dtype == torch.float32 and out.shape == q.shape
    assert k_mean.shape == (2, 2, q.shape[-1]) and k_mean.dtype == torch.float32
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    torch.library.opcheck(torch.ops.sagebwd_cp.attention_backward.default,
                          (q, k, v, out, lse2, k_mean, do, *paper))
    # Without K-smoothing there is no μ_K: an empty tensor stands in for it.
    unsmoothed = AttentionOptions(causal=True, smooth_k=False, layout=layout)
    out, lse2, k_mean = torch.ops.sagebwd_cp.attention_forward(q, k, v, *unsmoothed)
    assert k_mean.shape == (0,)
    torch.library.opcheck(torch.ops.sagebwd_cp.attention_backward.default,
                          (q, k, v, out, lse2, k_mean, do, *unsmoothed))


def test_operator_autograd_matches_the_eager_function():
    q, k, v = qkv(b=1, hq=4, hk=1, lq=100, lk=120)
    out, lse2, k_mean = torch.ops.sagebwd_cp.attention_forward(q, k, v, *AttentionOptions(causal=True))
    assert not lse2.requires_grad and not k_mean.requires_grad
    assert len(out.grad_fn.saved_tensors) == 6
    out.sum().backward()
    ref = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    st.attention(*ref, causal=True).sum().backward()
    for x, r in zip((q, k, v), ref):
        torch.testing.assert_close(x.grad, r.grad, rtol=0, atol=0)


class TinyBlock(nn.Module):
    """Pre-norm attention + MLP, attention through the adapter."""

    def __init__(self, d=128, heads=2, kind="flash"):
        super().__init__()
        self.heads, self.kind = heads, kind
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.attn = st.SageAttention(causal=True, layout="NHD")

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).unbind(2)
        if self.kind == "flash":
            a = st.flash_attn_func(q, k, v, causal=True)
        elif self.kind == "module":
            a = self.attn(q, k, v)
        else:
            a = st.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                is_causal=True).transpose(1, 2)
        x = x + self.proj(a.reshape(b, n, d))
        return x + self.mlp(self.norm2(x))


def _compiled_matches_eager(block, x, backend, tol):
    """Compiled and eager agree; inductor reorders float32 arithmetic before the quantizer, so a
    few INT8 roundings may flip: compare by Rel-L2 rather than elementwise."""
    compiled = torch.compile(block, fullgraph=True, backend=backend)
    y = compiled(x)
    y.square().mean().backward()
    grads = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    y_ref = block(x)
    y_ref.square().mean().backward()
    assert rel_l2(y.detach(), y_ref.detach()) <= tol
    for g, p in zip(grads, block.parameters()):
        assert rel_l2(g, p.grad) <= tol
    with torch.no_grad():
        assert rel_l2(compiled(x), y_ref.detach()) <= tol


def test_torch_compile_fullgraph_inductor_block():
    """fullgraph=True raises on any graph break; inductor needs a C++ compiler on the CPU."""
    torch.manual_seed(0)
    _compiled_matches_eager(TinyBlock(kind="flash"), torch.randn(2, 100, 128), "inductor", 1e-3)


@pytest.mark.parametrize("kind", ["module", "sdpa"])
def test_torch_compile_fullgraph_aot_eager(kind):
    torch.manual_seed(0)
    _compiled_matches_eager(TinyBlock(kind=kind), torch.randn(2, 80, 128), "aot_eager", 0.0)


def test_torch_compile_autograd_function_and_top_left_causal():
    q, k, v = qkv(lq=50, lk=120, seed=7)

    def f(q, k, v):
        a = st.SageAttentionFunction.apply(q, k, v, False, None, True, False, "HND", "fine", False)
        b = st.scaled_dot_product_attention(q, k, v, is_causal=True)
        return (a * b).sum()

    f(q, k, v).backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v).backward()
    for x, g in zip((q, k, v), grads):
        torch.testing.assert_close(x.grad, g, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ drop-ins and module


@pytest.mark.parametrize("lq,lk,causal,gqa", [(150, 150, False, False), (150, 150, True, False),
                                              (100, 180, True, False), (180, 100, True, False),
                                              (120, 120, True, True), (90, 130, False, True)])
def test_sdpa_drop_in_matches_torch_sdpa(lq, lk, causal, gqa):
    q, k, v = qkv(b=2, hq=4, hk=2 if gqa else 4, lq=lq, lk=lk, seed=lq * lk)
    ref = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = st.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.11, enable_gqa=gqa)
    out_ref = F.scaled_dot_product_attention(*ref, is_causal=causal, scale=0.11, enable_gqa=gqa)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    out.backward(do)
    out_ref.backward(do)
    assert out.shape == out_ref.shape
    assert rel_l2(out.detach(), out_ref.detach()) < TOL
    for x, r in zip((q, k, v), ref):
        assert rel_l2(x.grad, r.grad) < TOL


@pytest.mark.parametrize("shape", [(100, 64), (3, 100, 64), (2, 3, 2, 100, 64)])
def test_sdpa_drop_in_other_ranks(shape):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=g) for _ in range(3))
    out = st.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.shape == ref.shape
    assert rel_l2(out, ref) < TOL


@pytest.mark.parametrize("lq,lk", [(120, 120), (80, 150), (150, 80)])
def test_flash_attn_func_is_bottom_right_causal(lq, lk):
    q, k, v = qkv(b=2, hq=4, hk=1, lq=lq, lk=lk, layout="NHD", seed=lq)
    out = st.flash_attn_func(q, k, v, causal=True, softmax_scale=0.1, deterministic=True)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(8))
    out.backward(do)
    o_ref, grads_ref = exact(q, k, v, do, "NHD", True, 0.1)
    assert out.shape == q.shape
    assert rel_l2(hnd(out, "NHD"), o_ref) < TOL
    if lq > lk:  # the first lq - lk queries see no key: zero output, zero gradient
        assert torch.all(out[:, :lq - lk] == 0) and torch.all(q.grad[:, :lq - lk] == 0)
    for x, ref in zip((q, k, v), grads_ref):
        assert rel_l2(hnd(x.grad, "NHD"), ref) < TOL


def test_module_wrapper():
    m = st.SageAttention(causal=True, layout="NHD", softmax_scale=0.2, granularity="paper")
    assert list(m.parameters()) == [] and "layout='NHD'" in repr(m) and "granularity='paper'" in repr(m)
    q, k, v = qkv(hq=4, hk=2, lq=90, lk=90, layout="NHD")
    out = m(q, k, v)
    ref = st.attention(q, k, v, causal=True, softmax_scale=0.2, layout="NHD", granularity="paper")
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    out.sum().backward()
    assert all(x.grad is not None for x in (q, k, v))


def test_cpu_autocast_bfloat16():
    lin = nn.Linear(64, 3 * 64)
    x = torch.randn(2, 100, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q, k, v = lin(x).view(2, 100, 3, 1, 64).unbind(2)
        out = st.flash_attn_func(q, k, v, causal=True)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert lin.weight.grad is not None and torch.isfinite(lin.weight.grad).all()


# ------------------------------------------------------------------------------ example


def test_train_tiny_example_runs_on_cpu(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("train_tiny", os.path.join(REPO, "examples", "train_tiny.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    start = time.perf_counter()
    out = tmp_path / "curves.png"
    summary = module.main(["--steps", "3", "--device", "cpu", "--dtype", "float32", "--d-model", "64", "--heads", "2",
                           "--layers", "1", "--seq-len", "64", "--batch-size", "2", "--corpus-mb", "0.25",
                           "--qk-norm", "--out", str(out)])
    assert time.perf_counter() - start < 20
    text = capsys.readouterr().out
    assert "final loss: sdpa" in text and "max gap between the smoothed curves" in text and "step time" in text
    assert (tmp_path / "curves.json").exists()
    assert np.isfinite(summary["final_loss_sage"]) and abs(summary["final_loss_sage"] - summary["final_loss_sdpa"]) < 0.05
    assert summary["max_smoothed_gap"] < 0.05
