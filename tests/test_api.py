"""The array layer and the public API on the CPU: descriptors without copies, clear errors for bad
input, and host arrays running through the emulator."""
import re
import subprocess
import sys

import numpy as np
import pytest

import sagebwd_cp
from sagebwd_cp.host import emulator, reference
from sagebwd_cp.arrays import ArrayDesc, describe


def _qkv(b=1, hq=4, hk=2, lq=70, lk=90, d=64, dtype=np.float16, seed=0):
    rng = np.random.default_rng(seed)
    mk = lambda h, n: rng.standard_normal((b, h, n, d)).astype(dtype)
    return mk(hq, lq), mk(hk, lk), mk(hk, lk)


class DLPackOnly:
    """Exposes nothing but the DLPack protocol, forcing the generic capsule path."""

    def __init__(self, x):
        self._x = x

    def __dlpack__(self, stream=None):
        return self._x.__dlpack__()

    def __dlpack_device__(self):
        return self._x.__dlpack_device__()


def test_describe_numpy_strided_view():
    x = np.zeros((2, 3, 8, 16), dtype=np.float16)[:, :, ::2]
    d = describe(x, "x")
    assert d.shape == (2, 3, 4, 16) and d.strides == (384, 128, 32, 1)
    assert d.dtype == "float16" and d.device_type == "cpu" and d.ptr == x.ctypes.data


def test_describe_generic_dlpack_capsule_no_copy():
    x = np.arange(2 * 3 * 5 * 8, dtype=np.float32).reshape(2, 3, 5, 8).transpose(0, 2, 1, 3)
    d = describe(DLPackOnly(x), "x")
    assert d.framework == "dlpack" and d.ptr == x.ctypes.data
    assert d.shape == x.shape and d.strides == tuple(s // 4 for s in x.strides)
    assert d.dtype == "float32" and d.device_type == "cpu"


def test_describe_torch_tensor_without_copy():
    torch = pytest.importorskip("torch")
    t = torch.zeros((2, 4, 6, 8), dtype=torch.bfloat16).transpose(1, 2)
    d = describe(t, "t")
    assert d.framework == "torch" and d.dtype == "bfloat16" and d.ptr == t.data_ptr()
    assert d.strides == tuple(t.stride())
    g = describe(DLPackOnly(t), "t")
    assert g.dtype == "bfloat16" and g.ptr == t.data_ptr() and g.strides == tuple(t.stride())


def test_describe_rejects_non_arrays():
    with pytest.raises(TypeError, match="q: expected an array supporting DLPack"):
        sagebwd_cp.attention([[1.0]], *_qkv()[1:])


@pytest.mark.parametrize("make,exc,message", [
    (lambda q, k, v: (q.astype(np.int32), k, v), TypeError,
     r"q: expected dtype float16, bfloat16, float32 or float64 for a host array, got int32$"),
    (lambda q, k, v: (q, k.astype(np.float32), v), TypeError, r"q, k, v: expected one dtype, got q float16, k float32"),
    (lambda q, k, v: (q[0], k, v), ValueError, r"q: expected a rank-4 array .* got shape \(4, 70, 64\)"),
    (lambda q, k, v: (q[..., :60], k[..., :60], v[..., :60]), ValueError, r"head_dim: expected a multiple of 8 .* got 60"),
    (lambda q, k, v: tuple(np.zeros(x.shape[:3] + (264,), x.dtype) for x in (q, k, v)), ValueError,
     r"head_dim: expected a multiple of 8 between 8 and 256, got 264"),
    (lambda q, k, v: (q[:, :3], k, v), ValueError, r"heads: expected the query heads \(3\) to be a multiple of the key/value heads \(2\)"),
    (lambda q, k, v: (q, k, v[:, :, :50]), ValueError, r"k, v: expected the same \(heads, seqlen\)"),
    (lambda q, k, v: (q[:1], k, np.concatenate([v, v])), ValueError, r"q, k, v: expected one batch size"),
    (lambda q, k, v: (q[..., ::2], k[..., ::2], v[..., ::2]), ValueError, r"q: expected a contiguous last dimension"),
    (lambda q, k, v: (q[:, :, :0], k, v), ValueError, r"expected batch, heads and seqlen of at least 1"),
])
def test_bad_inputs_have_clear_errors(make, exc, message):
    q, k, v = make(*_qkv())
    with pytest.raises(exc, match=message):
        sagebwd_cp.attention(q, k, v)


def test_mixed_devices_and_options_errors():
    q, k, v = _qkv()
    # one framework (a mix is refused first: tests/test_bad_inputs.py), another device
    fake_gpu = ArrayDesc(0, k.shape, (1, 1, 1, 1), "float16", "cuda", 0, None, "numpy")
    with pytest.raises(ValueError, match=r"q, k, v: expected arrays on one device, got q on cpu:0, k on cuda:0"):
        sagebwd_cp.attention(q, fake_gpu, v)
    with pytest.raises(ValueError, match=r"layout: expected one of \('HND', 'NHD'\), got 'BHSD'"):
        sagebwd_cp.attention(q, k, v, layout="BHSD")
    with pytest.raises(ValueError, match=r"softmax_scale: expected a finite positive number, got -1.0"):
        sagebwd_cp.attention(q, k, v, softmax_scale=-1)
    out, saved = sagebwd_cp.attention_forward(q, k, v)
    with pytest.raises(ValueError, match=r"granularity: expected one of \('fine', 'paper'\), got 'coarse'"):
        sagebwd_cp.attention_backward(saved, out, granularity="coarse")
    with pytest.raises(ValueError, match=r"do: expected shape \(1, 4, 70, 64\), got \(1, 4, 69, 64\)"):
        sagebwd_cp.attention_backward(saved, out[:, :, 1:])
    with pytest.raises(TypeError, match=r"do: expected dtype float16, got float32"):
        sagebwd_cp.attention_backward(saved, out.astype(np.float32))
    with pytest.raises(TypeError, match=r"saved: expected the AttentionSaved"):
        sagebwd_cp.attention_backward({}, out)
    with pytest.raises(ValueError, match=r"out: expected shape \(1, 4, 70, 64\), got \(1, 4, 70, 32\)"):
        sagebwd_cp.attention(q, k, v, out=np.empty((1, 4, 70, 32), np.float16))


def test_backward_from_arrays_takes_the_forwards_key_mean():
    """attention_backward_arrays: k_mean (the forward's μ_K) gives the same gradients as summing K
    again; a wrong one is refused by name."""
    q, k, v = _qkv(seed=5)
    out, saved = sagebwd_cp.attention_forward(q, k, v, causal=True)
    k_mean = saved.k_mean.obj
    assert k_mean.shape == sagebwd_cp.k_mean_shape(1, 2, 64) and k_mean.dtype == np.float32
    np.testing.assert_array_equal(k_mean, k.astype(np.float64).mean(axis=2).astype(np.float32))
    lse2 = saved.lse2.obj
    do = np.random.default_rng(2).standard_normal(q.shape).astype(np.float16)
    again = sagebwd_cp.attention_backward_arrays(q, k, v, out, lse2, do, causal=True)
    for given in (sagebwd_cp.attention_backward_arrays(q, k, v, out, lse2, do, causal=True, k_mean=k_mean),
                  sagebwd_cp.attention_backward(saved, do)):
        for g, r in zip(given, again):
            np.testing.assert_array_equal(g, r)
    with pytest.raises(ValueError, match=r"k_mean: expected shape \(1, 2, 64\), got \(1, 4, 64\)"):
        sagebwd_cp.attention_backward_arrays(q, k, v, out, lse2, do, k_mean=np.zeros((1, 4, 64), np.float32))
    with pytest.raises(TypeError, match=r"k_mean: expected dtype float32, got float16"):
        sagebwd_cp.attention_backward_arrays(q, k, v, out, lse2, do, k_mean=k_mean.astype(np.float16))
    with pytest.raises(ValueError, match=r"k_mean: expected a contiguous array"):
        sagebwd_cp.attention_backward_arrays(q, k, v, out, lse2, do, k_mean=np.zeros((1, 2, 128), np.float32)[..., ::2])
    with pytest.raises(ValueError, match=r"k_mean: μ_K belongs to K-smoothing, but smooth_k is False"):
        sagebwd_cp.attention_backward_arrays(q, k, v, out, lse2, do, smooth_k=False, k_mean=k_mean)
    _, saved = sagebwd_cp.attention_forward(q, k, v, smooth_k=False)
    assert saved.k_mean is None


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("causal", [False, True])
def test_host_arrays_run_the_emulator(layout, causal):
    q, k, v = _qkv(seed=3)
    perm = (lambda x: x) if layout == "HND" else (lambda x: np.ascontiguousarray(x.transpose(0, 2, 1, 3)))
    out, lse, saved = sagebwd_cp.attention_forward(perm(q), perm(k), perm(v), causal=causal, layout=layout,
                                                   return_lse=True)
    o_emu, lse_emu, _ = emulator.emulate_forward(q, k, v, causal=causal)
    assert out.dtype == np.float16 and out.shape == perm(q).shape
    np.testing.assert_array_equal(perm(o_emu.astype(np.float16)), out)
    np.testing.assert_array_equal(lse, lse_emu)
    do = np.random.default_rng(1).standard_normal(q.shape).astype(np.float16)
    grads = sagebwd_cp.attention_backward(saved, perm(do))
    ref = reference.attention_reference_backward(*(x.astype(np.float64) for x in (q, k, v, do)), causal=causal)
    for g, r, x in zip(grads, ref, (q, k, v)):
        assert g.shape == perm(x).shape
        gh = g if layout == "HND" else g.transpose(0, 2, 1, 3)
        assert np.linalg.norm(gh - r) / np.linalg.norm(r) < 0.03
    buf = np.full_like(perm(q), np.nan)
    assert sagebwd_cp.attention(perm(q), perm(k), perm(v), causal=causal, layout=layout, out=buf) is buf
    np.testing.assert_array_equal(buf, out)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_numpy_in_numpy_out_in_the_callers_dtype(dtype):
    q, k, v = _qkv(lq=40, lk=50, dtype=dtype, seed=4)
    out, lse, saved = sagebwd_cp.attention_forward(q, k, v, causal=True, return_lse=True)
    assert type(out) is np.ndarray and out.dtype == dtype and out.shape == q.shape
    assert type(lse) is np.ndarray and lse.dtype == np.float32
    grads = sagebwd_cp.attention_backward(saved, np.ones_like(q))
    assert [(type(g), g.dtype, g.shape) for g in grads] == [(np.ndarray, dtype, x.shape) for x in (q, k, v)]


def _torch_qkv(torch, dtype, requires_grad=False, layout="HND"):
    q, k, v = (torch.from_numpy(x) for x in _qkv(lq=40, lk=50, dtype=np.float32, seed=6))
    if layout == "NHD":
        q, k, v = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    return tuple(x.to(dtype).requires_grad_(requires_grad) for x in (q, k, v))


@pytest.mark.torch
@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_torch_cpu_tensors_come_back_as_torch_in_their_dtype(name, layout):
    """Torch in, torch out, in q's dtype (bfloat16 included), from tensors that require grad (read
    detached: the results carry no graph); the values are those of the NumPy path."""
    import torch

    dtype = getattr(torch, name)
    q, k, v = _torch_qkv(torch, dtype, requires_grad=True, layout=layout)
    out, lse, saved = sagebwd_cp.attention_forward(q, k, v, causal=True, layout=layout, return_lse=True)
    assert isinstance(out, torch.Tensor) and out.dtype == dtype and out.shape == q.shape and out.device.type == "cpu"
    assert not out.requires_grad and out.grad_fn is None
    assert isinstance(lse, torch.Tensor) and lse.dtype == torch.float32
    assert isinstance(saved.lse2.obj, torch.Tensor) and isinstance(saved.k_mean.obj, torch.Tensor)
    do = torch.ones_like(out)
    grads = sagebwd_cp.attention_backward(saved, do)
    for g, x in zip(grads, (q, k, v)):
        assert isinstance(g, torch.Tensor) and g.dtype == dtype and g.shape == x.shape
    if name != "bfloat16":  # NumPy has no bfloat16: the emulator runs the bfloat16 rules on float32 values
        host = [x.detach().numpy() for x in (q, k, v)]
        out_np = sagebwd_cp.attention(*host, causal=True, layout=layout)
        np.testing.assert_array_equal(out.numpy(), out_np)
        grads_np = sagebwd_cp.attention_backward_arrays(*host, out_np, saved.lse2.obj.numpy(), do.numpy(),
                                                        causal=True, layout=layout)
        for g, r in zip(grads, grads_np):
            np.testing.assert_array_equal(g.numpy(), r)
    else:  # against float32 inputs of the same values: bfloat16 rounding apart, the same attention
        ref = sagebwd_cp.attention(*(x.detach().float() for x in (q, k, v)), causal=True, layout=layout)
        assert ref.dtype == torch.float32
        assert (out.float() - ref).norm() / ref.norm() < 0.02
    buf = torch.full_like(q, float("nan")).requires_grad_(True)
    assert sagebwd_cp.attention(q, k, v, causal=True, layout=layout, out=buf) is buf
    assert torch.equal(buf.detach(), out)


@pytest.mark.parametrize("kwargs,message", [
    ({"softmax_scale": "0.1"}, "softmax_scale: expected a float or None, got str '0.1'"),
    ({"softmax_scale": True}, "softmax_scale: expected a float or None, got bool True"),
    ({"causal": "no"}, "causal: expected True or False, got str 'no'"),
    ({"causal": 1}, "causal: expected True or False, got int 1"),
    ({"smooth_k": None}, "smooth_k: expected True or False, got NoneType None"),
    ({"smooth_q": "False"}, "smooth_q: expected True or False, got str 'False'"),
    ({"return_lse": 0}, "return_lse: expected True or False, got int 0"),
])
def test_options_take_their_own_types_only(kwargs, message):
    q, k, v = _qkv(lq=8, lk=8)
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        sagebwd_cp.attention(q, k, v, **kwargs)
    with pytest.raises(TypeError, match=message.split(":")[0]):
        sagebwd_cp.attention_forward(q, k, v, **kwargs)


def test_option_values_of_numpy_types_are_taken():
    q, k, v = _qkv(lq=8, lk=8)
    np.testing.assert_array_equal(sagebwd_cp.attention(q, k, v, causal=np.True_, softmax_scale=np.float32(0.125)),
                                  sagebwd_cp.attention(q, k, v, causal=True, softmax_scale=0.125))


def test_backward_options_take_their_own_types_only():
    q, k, v = _qkv(lq=8, lk=8)
    out, saved = sagebwd_cp.attention_forward(q, k, v)
    with pytest.raises(TypeError, match="deterministic: expected True or False, got str 'yes'"):
        sagebwd_cp.attention_backward(saved, out, deterministic="yes")
    lse2 = saved.lse2.obj
    with pytest.raises(TypeError, match="causal: expected True or False, got str 'no'"):
        sagebwd_cp.attention_backward_arrays(q, k, v, out, lse2, out, causal="no")
    with pytest.raises(TypeError, match="softmax_scale: expected a float or None, got str '0.1'"):
        sagebwd_cp.attention_backward_arrays(q, k, v, out, lse2, out, softmax_scale="0.1")


def test_torch_adapter_without_torch_names_the_extra():
    code = "import sys; sys.modules['torch'] = None; import sagebwd_cp.torch"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: sagebwd_cp.torch needs PyTorch")
    assert 'pip install "sagebwd_cp[torch]"' in last


def test_host_training_with_one_query_token():
    """The saved LSE of one query token is a (B, H, 1) slice of the padded rows, whose size-1 dimensions
    keep the slice's strides: the backward must take it (it checks strides where a dimension has more
    than one entry)."""
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((1, 1, n, 64)).astype(np.float16) for n in (1, 5, 5, 1))
    out, saved = sagebwd_cp.attention_forward(q, k, v)
    dq, dk, dv = sagebwd_cp.attention_backward(saved, do)
    assert dq.shape == q.shape and dk.shape == k.shape and np.isfinite(dv).all()
