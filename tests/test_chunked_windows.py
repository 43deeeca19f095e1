"""Sliding windows and soft-capping over chunks of the keys: ``band_piece``'s calls cover the window
mask exactly and tightly, and ``chunked_attention`` (the emulator on the CPU) and the neutral pieces
match one call and exact attention; ring attention's windows are in tests/test_ring.py."""
import itertools

import numpy as np
import pytest

import sagebwd_cp
from sagebwd_cp.host import reference
from sagebwd_cp.options import AttentionOptions

torch = pytest.importorskip("torch")
import sagebwd_cp.torch as st  # noqa: E402


def rel_l2(x, ref):
    x, ref = (np.asarray(a.detach().double().cpu() if isinstance(a, torch.Tensor) else a, dtype=np.float64) for a in (x, ref))
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def _pieces_mask(lq, lk, bounds, causal, window):
    """The (lq, lk) mask the pieces of every chunk attend, checking each piece as it goes."""
    left, right = AttentionOptions(causal=causal, window_left=window[0], window_right=window[1]).band()
    seen = np.zeros((lq, lk), bool)
    for a, b in zip(bounds[:-1], bounds[1:]):
        piece = sagebwd_cp.band_piece(0, lq, a, b, lk - lq, left, right)
        if piece is None:
            continue
        r0, r1, k0, k1, call_window = piece
        assert 0 <= r0 < r1 <= lq and 0 <= k0 < k1 <= b - a
        assert all(side == -1 or side >= 0 for side in call_window)
        part = reference.causal_mask(r1 - r0, k1 - k0, False, call_window)
        # tight: every row of the call sees a key, and every key is seen by a row
        assert part.any(axis=1).all() and part.any(axis=0).all()
        assert not (seen[r0:r1, a + k0:a + k1] & part).any()
        seen[r0:r1, a + k0:a + k1] |= part
    return seen


@pytest.mark.parametrize("lq,lk,bounds", [(256, 256, [0, 64, 128, 192, 256]), (100, 300, [0, 37, 200, 300]),
                                          (300, 100, [0, 50, 100]), (64, 64, [0, 64]), (7, 90, [0, 1, 89, 90])])
def test_band_pieces_cover_the_window_mask(lq, lk, bounds):
    for causal, window in itertools.product((False, True), [(0, 0), (5, -1), (40, 3), (-1, 10), (120, 0), (1, 200)]):
        if not causal and window == (-1, -1):
            continue
        expected = reference.causal_mask(lq, lk, causal, window)
        np.testing.assert_array_equal(_pieces_mask(lq, lk, bounds, causal, window), expected, err_msg=str(window))


def test_band_piece_is_none_where_no_row_sees_the_chunk():
    # rows 0..9 with offset 0 and a window of 2 to the left, causal: keys 20..29 are after every row
    assert sagebwd_cp.band_piece(0, 10, 20, 30, 0, 2, 0) is None
    # and keys 0..4 before every row of 20..29
    assert sagebwd_cp.band_piece(20, 30, 0, 5, 0, 2, 0) is None
    with pytest.raises(ValueError, match="k_stop"):
        sagebwd_cp.band_piece(0, 10, 0, -1, 0, 2, 0)


def _torch_inputs(dtype=torch.float16, hq=4, hk=2, lq=256, lk=256, d=32, seed=0, layout="HND"):
    g = torch.Generator().manual_seed(seed)

    def rand(h, n, offset=0.0):
        x = (torch.randn((1, h, n, d), generator=g) + offset).to(dtype)
        return (x if layout == "HND" else x.transpose(1, 2).contiguous()).requires_grad_()

    return rand(hq, lq), rand(hk, lk, 1.5), rand(hk, lk), rand(hq, lq).detach()


def _exact(q, k, v, do, layout, **mask):
    to = lambda x: x.detach().double().numpy() if layout == "HND" else x.detach().double().transpose(1, 2).numpy()  # noqa: E731
    back = lambda a: a if layout == "HND" else np.swapaxes(a, 1, 2)  # noqa: E731
    out, _ = reference.attention_reference(to(q), to(k), to(v), **mask)
    grads = reference.attention_reference_backward(to(q), to(k), to(v), to(do), **mask)
    return back(out), [back(g) for g in grads]


# (causal, window, softcap, layout, lq, lk, chunks): chunks that cut the 64-token blocks, Lq != Lk.
CASES = [
    (True, (40, -1), 0.0, "HND", 256, 256, [64, 64, 64, 64]),
    (False, (30, 20), 0.0, "NHD", 128, 300, [100, 64, 136]),
    (True, (-1, -1), 3.0, "HND", 192, 192, [96, 96]),
    (False, (50, 0), 3.0, "NHD", 200, 160, [33, 127]),
    (False, (-1, -1), 3.0, "HND", 150, 200, [64, 100, 36]),
]


@pytest.mark.parametrize("causal,window,softcap,layout,lq,lk,chunks", CASES)
def test_chunked_attention_with_a_window_or_a_soft_cap_matches_one_call(causal, window, softcap, layout, lq, lk,
                                                                         chunks):
    """Against exact attention, within what one quantized call errs (the chunks cut V's quantization
    blocks elsewhere than one call, so the two differ by more than merging); and the mask matters:
    without the window (or the cap) the result is far off."""
    q, k, v, do = _torch_inputs(lq=lq, lk=lk, layout=layout)
    seq = 2 if layout == "HND" else 1
    opts = dict(causal=causal, window_size=window, softcap=softcap, layout=layout)  # K-smoothing on
    o = st.chunked_attention(q, k.split(chunks, seq), v.split(chunks, seq), **opts)
    grads = torch.autograd.grad(o, (q, k, v), do)
    o1 = st.attention(q, k, v, **opts)
    g1 = torch.autograd.grad(o1, (q, k, v), do)
    ro, rgrads = _exact(q, k, v, do, layout, causal=causal, window=window, softcap=softcap)
    assert rel_l2(o, ro) < 1.5 * rel_l2(o1, ro) + 2e-3
    for a, b, r in zip(grads, g1, rgrads):
        assert a.dtype == q.dtype and rel_l2(a, r) < 1.5 * rel_l2(b, r) + 2e-3
    unmasked, _ = _exact(q, k, v, do, layout, causal=causal)
    assert rel_l2(unmasked, ro) > 10 * rel_l2(o, ro)


def test_neutral_pieces_with_a_window_match_one_call():
    """The neutral API's pieces (``band_piece``, ``attention`` and ``attention_backward_lse`` with the
    call's window) over three chunks give one windowed call's output and gradients."""
    rng = np.random.default_rng(3)
    lq = lk = 192
    q, k, v, do = (rng.standard_normal((1, 2, n, 16)).astype(np.float16) for n in (lq, lk, lk, lq))
    window = (50, 0)
    left, right = AttentionOptions(window_left=50, window_right=0).band()
    mean = sagebwd_cp.key_mean([k])
    out = np.zeros(q.shape, np.float32)
    lse = np.full(q.shape[:3], -np.inf, np.float32)
    calls = []
    for a, b in ((0, 64), (64, 128), (128, 192)):
        r0, r1, k0, k1, w = sagebwd_cp.band_piece(0, lq, a, b, lk - lq, left, right)
        calls.append((r0, r1, a + k0, a + k1, w))
        o, l = sagebwd_cp.attention(q[:, :, r0:r1], k[:, :, a + k0:a + k1], v[:, :, a + k0:a + k1], window_size=w,
                                    return_lse=True, k_mean=mean)
        out[:, :, r0:r1], lse[:, :, r0:r1] = sagebwd_cp.merge_attention([out[:, :, r0:r1], o], [lse[:, :, r0:r1], l])
    out16 = out.astype(np.float16)
    grads = [np.zeros(x.shape, np.float32) for x in (q, k, v)]
    for r0, r1, c0, c1, w in calls:
        g = sagebwd_cp.attention_backward_lse(q[:, :, r0:r1], k[:, :, c0:c1], v[:, :, c0:c1], out16[:, :, r0:r1],
                                              np.ascontiguousarray(lse[:, :, r0:r1]), do[:, :, r0:r1], window_size=w,
                                              k_mean=mean)
        grads[0][:, :, r0:r1] += g[0]
        grads[1][:, :, c0:c1] += g[1]
        grads[2][:, :, c0:c1] += g[2]
    ro, _ = reference.attention_reference(*(x.astype(np.float64) for x in (q, k, v)), window=window)
    rgrads = reference.attention_reference_backward(*(x.astype(np.float64) for x in (q, k, v, do)), window=window)
    o1, saved = sagebwd_cp.attention_forward(q, k, v, window_size=window)
    g1 = sagebwd_cp.attention_backward(saved, do)
    assert rel_l2(out16, ro) < 1.5 * rel_l2(o1, ro) + 2e-3
    for a, b, r in zip(grads, g1, rgrads):
        assert rel_l2(a, r) < 1.5 * rel_l2(b, r) + 2e-3


# ------------------------------------------------------------------------------ GPU

@pytest.mark.gpu
@pytest.mark.parametrize("kernels", [{}, {"SAGEBWD_WGMMA": "0"}], ids=["default", "mma.sync"], indirect=True)
@pytest.mark.parametrize("dtype,d,causal,window,softcap", [("bfloat16", 128, True, (700, -1), 0.0),
                                                           ("float16", 64, False, (300, 500), 0.0),
                                                           ("bfloat16", 128, True, (-1, -1), 20.0),
                                                           ("float16", 64, False, (-1, -1), 20.0)])
def test_gpu_chunked_attention_with_a_window_or_a_soft_cap(kernels, dtype, d, causal, window, softcap):
    """The kernels' chunked windows and soft caps (calls that start mid-tile, Lq != Lk, GQA) within what
    one call errs against exact attention, on the CUDA tensors of both kernel families."""
    from gpu_helpers import make_qkv

    q, k, v = make_qkv(1, 4, 2, 1000, 1500, d, dtype, layout="NHD", seed=5)
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    do = torch.randn_like(q)
    opts = dict(causal=causal, window_size=window, softcap=softcap, layout="NHD")  # K-smoothing on
    o = st.chunked_attention(q, k.split([300, 700, 500], 1), v.split([300, 700, 500], 1), **opts)
    grads = torch.autograd.grad(o, (q, k, v), do)
    o1 = st.attention(q, k, v, **opts)
    g1 = torch.autograd.grad(o1, (q, k, v), do)
    ro, rgrads = _exact(q.cpu(), k.cpu(), v.cpu(), do.cpu(), "NHD", causal=causal, window=window, softcap=softcap)
    assert rel_l2(o, ro) < 1.5 * rel_l2(o1, ro) + 2e-3
    for a, b, r in zip(grads, g1, rgrads):
        assert a.dtype == q.dtype and rel_l2(a, r) < 1.5 * rel_l2(b, r) + 2e-3


def _two_gpu_worker(rank, store, results):
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        for i, opts in enumerate(TWO_GPU_CASES):
            q, k, v, do = _two_gpu_inputs(i, f"cuda:{rank}")
            q, k, v = (st.zigzag_shard(x, rank, 2, 1).detach().requires_grad_() for x in (q, k, v))
            out = st.ring_attention(q, k, v, layout="NHD", **opts)
            grads = torch.autograd.grad(out, (q, k, v), st.zigzag_shard(do, rank, 2, 1))
            torch.save({"out": out.detach().cpu(), "grads": [g.cpu() for g in grads]}, f"{results}/{i}_{rank}.pt")
    finally:
        dist.destroy_process_group()


TWO_GPU_CASES = [dict(causal=True, window_size=(1000, -1)), dict(causal=True, softcap=20.0, smooth_k=False),
                 dict(causal=False, window_size=(700, 300))]


def _two_gpu_inputs(i, device):
    g = torch.Generator().manual_seed(20 + i)
    make = lambda h: torch.randn((1, 4096, h, 128), generator=g).to(device=device, dtype=torch.bfloat16)  # noqa: E731
    return make(8), make(2), make(2), make(8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_gpu_ring_attention_with_windows_and_a_soft_cap_on_two_gpus(tmp_path):
    """NCCL, two ranks with zig-zag shards of 4096 tokens: each rank's rows (output and gradients) within
    what one call errs against exact attention, for a causal window, a soft cap and a two-sided window."""
    import torch.multiprocessing as mp

    results = tmp_path / "results"
    results.mkdir()
    mp.start_processes(_two_gpu_worker, args=(str(tmp_path / "store"), str(results)), nprocs=2, join=True,
                       start_method="spawn")
    for i, opts in enumerate(TWO_GPU_CASES):
        q, k, v, do = _two_gpu_inputs(i, "cuda:0")
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        o1 = st.attention(q, k, v, layout="NHD", **opts)
        g1 = torch.autograd.grad(o1, (q, k, v), do)
        parts = [torch.load(results / f"{i}_{r}.pt") for r in range(2)]
        whole = lambda pick: st.zigzag_unshard([pick(p) for p in parts], 1)  # noqa: E731
        mask = dict(causal=opts["causal"], window=opts.get("window_size", (-1, -1)), softcap=opts.get("softcap", 0.0))
        ro, rgrads = _exact(q.cpu(), k.cpu(), v.cpu(), do.cpu(), "NHD", **mask)
        assert rel_l2(whole(lambda p: p["out"]), ro) < 1.5 * rel_l2(o1, ro) + 2e-3, i
        for j, (b, r) in enumerate(zip(g1, rgrads)):
            assert rel_l2(whole(lambda p: p["grads"][j]), r) < 1.5 * rel_l2(b, r) + 2e-3, (i, j)
