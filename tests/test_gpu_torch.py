"""The PyTorch adapter on the GPU: gradients against torch's SDPA, stream and device handling,
CUDA-graph capture, memory (torch's caching allocator only), autocast and torch.compile.

Tests that need the GPU backward skip, with the reason, while ``attention_backward`` on CUDA
arrays is not available."""
import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.torch]

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import sagebwd_cp.torch as st  # noqa: E402
from sagebwd_cp.host import reference  # noqa: E402
from sagebwd_cp.options import AttentionOptions  # noqa: E402

from gpu_helpers import cos_sim, rel_l2  # noqa: E402


@functools.lru_cache(maxsize=None)
def _gpu_backward_missing():
    """None when the GPU backward runs, else why not."""
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    q = torch.randn(1, 1, 64, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    try:
        st.attention(q, q.detach(), q.detach()).sum().backward()
    except NotImplementedError as exc:
        return f"GPU backward not implemented: {exc}"
    except ModuleNotFoundError as exc:
        if exc.name == "sagebwd_cp.gpu.backward":
            return "GPU backward not available: sagebwd_cp.gpu.backward is missing"
        raise
    return None


@pytest.fixture
def gpu_backward():
    reason = _gpu_backward_missing()
    if reason:
        pytest.skip(reason)


def make(shape, dtype, seed, device="cuda", grad=True):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dtype).requires_grad_(grad)


def sdpa_reference(q, k, v, do, causal, gqa):
    """torch SDPA in float32 on copies of q, k, v (HND): (out, dq, dk, dv)."""
    ref = [x.detach().float().requires_grad_() for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*ref, is_causal=causal, enable_gqa=gqa)
    out.backward(do.float())
    return (out.detach(),) + tuple(x.grad for x in ref)


def assert_close_metrics(x, ref, name, cos_min=0.99, rel_max=0.05):
    a, r = x.detach().float().cpu().numpy(), ref.detach().float().cpu().numpy()
    assert np.isfinite(a).all(), f"{name}: non-finite values"
    if np.sqrt(np.mean(r.astype(np.float64) ** 2)) < 1e-3:
        # One visible key (N=1): dq and dk are exactly 0; quantization noise is about 0.02 RMS.
        rms = float(np.sqrt(np.mean(a.astype(np.float64) ** 2)))
        assert rms < 0.05, f"{name}: expected ~0, got RMS {rms}"
        return
    assert cos_sim(a, r) > cos_min, f"{name}: cos sim {cos_sim(a, r)}"
    assert rel_l2(a, r) < rel_max, f"{name}: rel-L2 {rel_l2(a, r)}"


# ------------------------------------------------------------------------------ accuracy


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hq,hk", [(4, 4), (8, 2)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 17, 1000])
def test_gradients_match_sdpa(gpu_backward, n, causal, hq, hk, dtype):
    b, d = 2, 64
    q, k, v = make((b, hq, n, d), dtype, 1), make((b, hk, n, d), dtype, 2), make((b, hk, n, d), dtype, 3)
    do = make((b, hq, n, d), dtype, 4, grad=False)
    out = st.attention(q, k, v, causal=causal)
    out.backward(do)
    ref = sdpa_reference(q, k, v, do, causal, hq != hk)
    assert out.dtype == dtype and out.shape == q.shape and out.device == q.device
    for name, x, r in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), ref):
        assert x.dtype == dtype
        assert_close_metrics(x, r, name)


@pytest.mark.parametrize("head_dim", [32, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flash_attn_func_head_dims(gpu_backward, head_dim, dtype):
    b, n, h = 2, 300, 4
    q, k, v = (make((b, n, h, head_dim), dtype, s) for s in (5, 6, 7))
    do = make((b, n, h, head_dim), dtype, 8, grad=False)
    out = st.flash_attn_func(q, k, v, causal=True)
    out.backward(do)
    ref = sdpa_reference(*(x.transpose(1, 2) for x in (q, k, v, do)), True, False)
    ref = tuple(r.transpose(1, 2) for r in ref)
    for name, x, r in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), ref):
        assert_close_metrics(x, r, name)


@pytest.mark.parametrize("lq,lk", [(200, 500), (500, 200)])
def test_causal_alignment_of_the_drop_ins(gpu_backward, lq, lk):
    """SDPA's is_causal is top-left aligned, flash_attn_func's bottom-right."""
    dtype, b, h, d = torch.bfloat16, 1, 2, 64
    q, k, v = make((b, h, lq, d), dtype, 1), make((b, h, lk, d), dtype, 2), make((b, h, lk, d), dtype, 3)
    do = make((b, h, lq, d), dtype, 4, grad=False)
    out = st.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(do)
    for name, x, r in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad),
                          sdpa_reference(q, k, v, do, True, False)):
        assert_close_metrics(x, r, name)
    for x in (q, k, v):
        x.grad = None
    out = st.flash_attn_func(*(x.transpose(1, 2) for x in (q, k, v)), causal=True).transpose(1, 2)
    out.backward(do)
    host = [x.detach().double().cpu().numpy() for x in (q, k, v, do)]
    o_ref, _ = reference.attention_reference(*host[:3], causal=True)  # bottom-right; blind rows give 0
    grads_ref = reference.attention_reference_backward(*host, causal=True)
    for name, x, r in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), (o_ref,) + tuple(grads_ref)):
        assert_close_metrics(x, torch.from_numpy(r), name)


def test_inference_forward_matches_sdpa_without_backward():
    """The inference path needs no GPU backward."""
    q, k, v = (make((2, 4, 333, 64), torch.float16, s, grad=False) for s in (1, 2, 3))
    with torch.inference_mode():
        out = st.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert_close_metrics(out, ref, "out")


def test_strided_views_from_a_fused_projection(gpu_backward):
    fused = make((2, 257, 3, 4, 64), torch.bfloat16, 9)
    q, k, v = fused.unbind(2)
    out = st.flash_attn_func(q, k, v, causal=True)
    out.float().square().sum().backward()
    ref = [x.detach().float().transpose(1, 2).requires_grad_() for x in (q, k, v)]
    F.scaled_dot_product_attention(*ref, is_causal=True).transpose(1, 2).square().sum().backward()
    for i, r in enumerate(ref):
        assert_close_metrics(fused.grad[:, :, i], r.grad.transpose(1, 2), "dqkv"[i + 1])


# ------------------------------------------------------------------------------ streams, graphs, devices


def test_runs_on_the_current_non_default_stream(gpu_backward):
    """Inputs written late on a side stream are read correctly only if the kernels run on it."""
    shape, dtype = (1, 2, 512, 64), torch.float16
    src = [make(shape, dtype, s, grad=False) for s in (1, 2, 3)]
    do = make(shape, dtype, 4, grad=False)
    ref_inputs = [x.clone().requires_grad_() for x in src]
    ref_out = st.attention(*ref_inputs, causal=True, deterministic=True)
    ref_out.backward(do)
    torch.cuda.synchronize()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        inputs = [torch.zeros_like(x) for x in src]
        torch.cuda._sleep(50_000_000)  # keeps the side stream busy before the copies land
        for x, s in zip(inputs, src):
            x.copy_(s)
        for x in inputs:
            x.requires_grad_()
        out = st.attention(*inputs, causal=True, deterministic=True)
        out.backward(do)
        result = [out.detach()] + [x.grad for x in inputs]
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for x, r in zip(result, [ref_out.detach()] + [x.grad for x in ref_inputs]):
        torch.testing.assert_close(x, r, rtol=0, atol=0)


def test_cuda_graph_capture_and_replay_forward_backward(gpu_backward):
    shape, dtype = (2, 4, 300, 64), torch.bfloat16
    static = [make(shape, dtype, s) for s in (1, 2, 3)]
    static_do = make(shape, dtype, 4, grad=False)

    def step():
        out = st.attention(*static, causal=True, deterministic=True)
        out.backward(static_do)
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles the kernels outside the capture
        for _ in range(3):
            for x in static:
                x.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    for x in static:
        x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()

    for seed in (10, 20):
        new = [make(shape, dtype, seed + i, grad=False) for i in range(4)]
        with torch.no_grad():
            for x, n in zip(static + [static_do], new):
                x.copy_(n)
        graph.replay()
        torch.cuda.synchronize()
        eager = [n.clone().requires_grad_() for n in new[:3]]
        out = st.attention(*eager, causal=True, deterministic=True)
        out.backward(new[3])
        torch.testing.assert_close(static_out, out.detach(), rtol=0, atol=0)
        for x, e in zip(static, eager):
            torch.testing.assert_close(x.grad, e.grad, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_second_device(gpu_backward):
    shape, dtype = (1, 4, 200, 64), torch.float16
    torch.cuda.set_device(0)
    on0 = [make(shape, dtype, s, device="cuda:0") for s in (1, 2, 3)]
    on1 = [x.detach().to("cuda:1").requires_grad_() for x in on0]
    do0 = make(shape, dtype, 4, device="cuda:0", grad=False)
    out0 = st.attention(*on0, causal=True, deterministic=True)
    out0.backward(do0)
    out1 = st.attention(*on1, causal=True, deterministic=True)
    out1.backward(do0.to("cuda:1"))
    assert torch.cuda.current_device() == 0
    assert out1.device == torch.device("cuda:1") and all(x.grad.device == torch.device("cuda:1") for x in on1)
    torch.testing.assert_close(out1.cpu(), out0.detach().cpu(), rtol=0, atol=0)
    for a, b in zip(on1, on0):
        torch.testing.assert_close(a.grad.cpu(), b.grad.cpu(), rtol=0, atol=0)


# ------------------------------------------------------------------------------ memory


class Block(nn.Module):
    def __init__(self, d=256, heads=4):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, self.heads, d // self.heads).unbind(2)
        return x + self.proj(st.flash_attn_func(q, k, v, causal=True).reshape(b, n, d))


def test_training_allocates_through_torch_only(gpu_backward):
    cupy = pytest.importorskip("cupy")
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block()).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 384, 256, device="cuda")

    def train_step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(3):
        train_step()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    for _ in range(50):
        train_step()
    torch.cuda.synchronize()
    assert cupy.get_default_memory_pool().used_bytes() == 0
    assert torch.cuda.memory_allocated() == baseline  # nothing leaks from step to step


def test_outputs_are_torch_tensors_from_the_caching_allocator():
    q, k, v = (make((1, 2, 128, 64), torch.float16, s, grad=False) for s in (1, 2, 3))
    before = torch.cuda.memory_allocated()
    out = st.attention(q, k, v)
    assert isinstance(out, torch.Tensor) and out.is_cuda and out.is_contiguous()
    assert torch.cuda.memory_allocated() >= before + out.numel() * out.element_size()


# ------------------------------------------------------------------------------ autocast, operators, compile


def test_autocast_casts_float32_inputs(gpu_backward):
    q, k, v = (make((1, 2, 256, 64), torch.float32, s) for s in (1, 2, 3))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = st.attention(q, k, v, causal=True)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert all(x.grad is not None and x.grad.dtype == torch.float32 for x in (q, k, v))


def test_opcheck_on_cuda(gpu_backward):
    """deterministic=True: opcheck compares gradients of repeated runs."""
    q, k, v = (make((2, 4, 100, 64), torch.float16, s) for s in (1, 2, 3))
    torch.library.opcheck(torch.ops.sagebwd_cp.attention_forward.default,
                          (q, k, v, *AttentionOptions(causal=True, deterministic=True)))
    with torch.no_grad():
        torch.library.opcheck(torch.ops.sagebwd_cp.attention.default,
                              (q.detach(), k.detach(), v.detach(), *AttentionOptions(causal=True)))


def test_torch_compile_fullgraph_on_cuda(gpu_backward):
    torch.manual_seed(0)
    block = Block().cuda().to(torch.bfloat16)
    x = torch.randn(2, 256, 256, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(block, fullgraph=True)
    y = compiled(x)
    y.float().square().mean().backward()
    grads = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    y_ref = block(x)
    y_ref.float().square().mean().backward()
    assert_close_metrics(y, y_ref, "out", cos_min=0.999, rel_max=0.02)
    for g, p in zip(grads, block.parameters()):
        assert_close_metrics(g, p.grad, "grad", cos_min=0.99, rel_max=0.05)
