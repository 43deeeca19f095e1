"""Ring attention on torch.distributed with gloo on the CPU (the emulator): 2 and 4 spawned
processes, output and gradients of every rank's shard against one-process attention over the
whole sequence, causal (zig-zag shards) and not, sliding windows and soft-capping (zig-zag shards),
GQA, both layouts."""
import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import sagebwd_cp.torch as st  # noqa: E402
from sagebwd_cp.host import reference  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo unavailable")

# (causal, layout, dtype, Hq, Hkv, window, softcap): every rank holds 2 chunks of 64 tokens, so without
# a window the one call and the ring's calls quantize V in the same 64-token blocks and differ by merging
# and 16-bit rounding only; a window's calls start where the band does (checked against exact attention).
CONFIGS = {
    2: [(True, "HND", "float16", 2, 1, (-1, -1), 0.0), (False, "NHD", "bfloat16", 2, 2, (-1, -1), 0.0),
        (True, "HND", "float16", 2, 1, (70, -1), 0.0), (False, "NHD", "float16", 2, 1, (40, 90), 0.0),
        (False, "HND", "bfloat16", 2, 1, (-1, -1), 3.0)],
    4: [(True, "NHD", "float16", 2, 1, (-1, -1), 0.0), (False, "HND", "float16", 2, 1, (-1, -1), 0.0),
        (True, "HND", "float16", 2, 1, (100, -1), 3.0)],
}
CHUNK = 64
D = 16


def _inputs(world, causal, layout, dtype, hq, hk, seed):
    g = torch.Generator().manual_seed(seed)
    n = 2 * world * CHUNK

    def rand(h, offset=0.0):
        x = (torch.randn((1, h, n, D), generator=g) + offset).to(getattr(torch, dtype))
        return x if layout == "HND" else x.transpose(1, 2).contiguous()

    return rand(hq), rand(hk, 1.0), rand(hk), rand(hq)


def _shard(x, rank, world, zigzag, seq):
    return st.zigzag_shard(x, rank, world, seq) if zigzag else x.chunk(world, seq)[rank].contiguous()


def _options(causal, layout, window, softcap):
    return dict(causal=causal, layout=layout, window_size=window, softcap=softcap)  # K-smoothing on, capped too


def _worker(rank, world, store, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        for i, (causal, layout, dtype, hq, hk, window, softcap) in enumerate(CONFIGS[world]):
            seq = 2 if layout == "HND" else 1
            zigzag = causal or window != (-1, -1)
            q, k, v, do = (_shard(x, rank, world, zigzag, seq) for x in _inputs(world, causal, layout, dtype, hq, hk, i))
            q, k, v = (x.requires_grad_() for x in (q, k, v))
            out, lse = st.ring_attention(q, k, v, **_options(causal, layout, window, softcap), return_lse=True)
            grads = torch.autograd.grad(out, (q, k, v), do)
            torch.save({"out": out.detach(), "lse": lse, "grads": [g.detach() for g in grads]},
                       os.path.join(results, f"{i}_{rank}.pt"))
    finally:
        dist.destroy_process_group()


def rel_l2(x, ref):
    x, ref = x.detach().double(), ref.detach().double()
    return float((x - ref).norm() / ref.norm())


def _check_against_exact(q, k, v, do, layout, out, grads, o1, g1, **mask):
    """The ring's windowed output and gradients within what one quantized call errs against exact
    attention (its calls cut V's quantization blocks where the band starts)."""
    to = lambda x: (x if layout == "HND" else x.transpose(1, 2)).detach().double().numpy()  # noqa: E731
    back = lambda a: torch.from_numpy(a if layout == "HND" else np.swapaxes(a, 1, 2))  # noqa: E731
    ro, _ = reference.attention_reference(to(q), to(k), to(v), **mask)
    rgrads = reference.attention_reference_backward(to(q), to(k), to(v), to(do), **mask)
    assert rel_l2(out, back(ro)) < 1.5 * rel_l2(o1, back(ro)) + 2e-3
    for got, ref, r in zip(grads, g1, rgrads):
        assert got.dtype == ref.dtype and rel_l2(got, back(r)) < 1.5 * rel_l2(ref, back(r)) + 2e-3


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_matches_one_process_attention(world, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    # fork: the workers inherit the imported torch and library (spawning re-imports them, ~5 s a
    # process); not once JAX, whose threads do not survive a fork, is loaded, nor with a CUDA build of torch,
    # whose autograd threads (started by any earlier backward in this process) refuse to run in a forked child.
    forkable = "jax" not in sys.modules and not torch.cuda.is_available()
    mp.start_processes(_worker, args=(world, str(tmp_path / "store"), str(results)), nprocs=world, join=True,
                       start_method="fork" if forkable else "spawn")
    for i, (causal, layout, dtype, hq, hk, window, softcap) in enumerate(CONFIGS[world]):
        seq = 2 if layout == "HND" else 1
        zigzag, windowed = causal or window != (-1, -1), window != (-1, -1)
        q, k, v, do = _inputs(world, causal, layout, dtype, hq, hk, i)
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        opts = _options(causal, layout, window, softcap)
        out1, lse1 = st.attention_lse(q, k, v, **opts)
        o1 = st.attention(q, k, v, **opts)
        g1 = torch.autograd.grad(o1, (q, k, v), do)
        parts = [torch.load(results / f"{i}_{r}.pt") for r in range(world)]

        def whole(pick, dim=seq):
            xs = [pick(p) for p in parts]
            return st.zigzag_unshard(xs, dim) if zigzag else torch.cat(xs, dim)

        if windowed:
            _check_against_exact(q, k, v, do, layout, whole(lambda p: p["out"]), [whole(lambda p, j=j: p["grads"][j])
                                 for j in range(3)], o1, g1, causal=causal, window=window, softcap=softcap)
            torch.testing.assert_close(whole(lambda p: p["lse"], 2), lse1, rtol=0, atol=2e-2)
            continue
        tol = 5e-3 if dtype == "float16" else 1e-2
        assert rel_l2(whole(lambda p: p["out"]), out1) < tol, (world, i)
        torch.testing.assert_close(whole(lambda p: p["lse"], 2), lse1, rtol=0, atol=1e-4)
        for j, ref in enumerate(g1):
            got = whole(lambda p: p["grads"][j])
            assert got.dtype == ref.dtype and rel_l2(got, ref) < tol, (world, i, j)


def test_zigzag_shard_and_unshard_are_inverse():
    x = torch.arange(2 * 3 * 24).reshape(2, 3, 24)
    shards = [st.zigzag_shard(x, r, 3, 2) for r in range(3)]
    assert shards[0][0, 0].tolist() == [0, 1, 2, 3, 20, 21, 22, 23]
    assert torch.equal(st.zigzag_unshard(shards, 2), x)
    with pytest.raises(ValueError, match="divisible by 2·world_size"):
        st.zigzag_shard(x, 0, 5, 2)
    with pytest.raises(ValueError, match="rank, world_size"):
        st.zigzag_shard(x, 3, 3, 2)


def test_ring_attention_needs_an_initialized_group():
    q = torch.zeros(1, 1, 64, 16, dtype=torch.float16)
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    with pytest.raises(RuntimeError, match="init_process_group"):
        st.ring_attention(q, q, q)


def test_ring_attention_refuses_uneven_causal_shards(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        q = torch.zeros(1, 1, 64, 16, dtype=torch.float16)
        with pytest.raises(ValueError, match="zig-zag shards"):
            st.ring_attention(q, q[:, :, :32], q[:, :, :32], causal=True)
        # A world of one is attention over the one shard.
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 2, 128, 16, generator=g).half() for _ in range(3))
        np.testing.assert_array_equal(st.ring_attention(q, k, v, causal=True).numpy(),
                                      st.chunked_attention(q, [k], [v], causal=True).numpy())
    finally:
        dist.destroy_process_group()
