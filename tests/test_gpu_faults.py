"""Under load and faults, on the GPU: calls from many threads and streams at once give the bits of
serial calls; a damaged kernel cache is recompiled with a warning and the CUDA context stays usable; a
workspace that does not fit raises the framework's own out-of-memory error and the next call works; a
failed launch names its kernel, the shapes and the options."""
import contextlib
import os
import shutil
import sys
import threading
import warnings

import numpy as np
import pytest

import sagebwd_cp
from gpu_helpers import POISON, make_qkv
from sagebwd_cp.gpu import compiler, kernel_cache, plan
from sagebwd_cp.gpu.kernel_cache import KernelCacheWarning
from sagebwd_cp.gpu.launch_errors import KernelLaunchError

pytestmark = [pytest.mark.gpu, pytest.mark.torch]


def _bits(x):
    """A host copy of x's bits (torch or CuPy), comparable with ==."""
    import torch

    if isinstance(x, torch.Tensor):
        x = x.detach()
        return x.view(torch.int16).cpu().numpy() if x.element_size() == 2 else x.cpu().numpy().view(np.int32)
    a = x.get()
    return a.view(np.int16) if a.dtype.itemsize == 2 else a.view(np.int32)


def _same_bits(a, b):
    return all(x.shape == y.shape and np.array_equal(x, y) for x, y in zip(a, b))


# ------------------------------------------------------------------------------ threads and streams

_local = threading.local()


def _poisoning_allocator(shape, dtype, device_id):
    """Every buffer the library allocates starts as garbage, in the calling thread's framework and on
    its current stream (threads set _local.framework)."""
    value = POISON.get(dtype, 0x55)
    if getattr(_local, "framework", "torch") == "cupy":
        import cupy

        a = cupy.empty(shape, dtype=cupy.uint16 if dtype == "bfloat16" else dtype)
        if dtype in ("float16", "float32"):
            a.fill(value)
        else:  # integers (and bfloat16's raw 16 bits): the 0x55 byte pattern
            a.view(cupy.uint8).fill(0x55)
        return a
    import torch

    from sagebwd_cp.arrays import _torch_dtype

    t = torch.empty(shape, dtype=_torch_dtype(dtype), device=f"cuda:{device_id}")
    t.fill_(value)
    return t


# (B, Hq, Hkv, L, D, causal): GQA, a ragged length, both masks
CASES = [(2, 4, 2, 777, 128, True), (1, 8, 8, 1024, 64, False), (1, 4, 1, 300, 80, True)]


def _inputs(case, seed, framework):
    import torch

    b, hq, hk, n, d, causal = case
    q, k, v = make_qkv(b, hq, hk, n, n, d, "float16", seed=seed)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    do = torch.randn(q.shape, generator=g, device="cuda", dtype=torch.float32).to(q.dtype)
    arrays = (q, k, v, do)
    if framework == "cupy":
        import cupy

        arrays = tuple(cupy.from_dlpack(x.contiguous()) for x in arrays)
    return arrays, causal


def _fwd_bwd(arrays, causal):
    q, k, v, do = arrays
    out, lse, saved = sagebwd_cp.attention_forward(q, k, v, causal=causal, return_lse=True)
    dq, dk, dv = sagebwd_cp.attention_backward(saved, do, deterministic=True)
    return out, lse, dq, dk, dv


def test_threads_on_their_own_torch_and_cupy_streams_give_the_bits_of_serial_calls():
    """8 threads, each on its own stream (4 torch, 4 CuPy), each 5 deterministic forward + backward
    calls over shapes shared with other threads (one plan replayed from several threads at once) and
    its own inputs, every buffer poisoned first: every result equals, bit for bit, the same call made
    serially on the default stream."""
    import cupy
    import torch

    n_threads, calls = 8, 5
    jobs = {i: [(CASES[(i + c) % len(CASES)], 100 * i + c, "cupy" if i % 2 else "torch") for c in range(calls)]
            for i in range(n_threads)}
    inputs = {(i, c): _inputs(*job) for i, js in jobs.items() for c, job in enumerate(js)}
    torch.cuda.synchronize()
    sagebwd_cp.set_allocator(_poisoning_allocator)
    try:
        serial = {}
        for (i, c), (arrays, causal) in inputs.items():
            _local.framework = jobs[i][c][2]
            serial[(i, c)] = [_bits(x) for x in _fwd_bwd(arrays, causal)]
        _local.framework = "torch"
        torch.cuda.synchronize()
        plan.clear_plans()  # the threads build the plans again, concurrently
        results, errors = {}, []
        barrier = threading.Barrier(n_threads, timeout=300)

        def worker(i):
            try:
                framework = jobs[i][0][2]
                _local.framework = framework
                if framework == "torch":
                    stream = torch.cuda.Stream()
                    ctx = torch.cuda.stream(stream)
                else:
                    stream = cupy.cuda.Stream(non_blocking=True)
                    ctx = stream
                with ctx:
                    barrier.wait()
                    outs = [(c, _fwd_bwd(*inputs[(i, c)])) for c in range(calls)]
                    stream.synchronize()
                    for c, out in outs:
                        results[(i, c)] = [_bits(x) for x in out]
            except BaseException as exc:  # noqa: BLE001
                errors.append((i, exc))

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sagebwd_cp.set_allocator(None)
    assert not errors, errors
    differ = [key for key in serial if not _same_bits(serial[key], results[key])]
    assert not differ, f"threaded calls differ from serial ones: {differ}"


def test_one_plan_replayed_from_threads_at_once():
    """The same shape from 8 threads on 8 torch streams, 10 calls each, one plan: the shared packed
    arguments are written and launched one call at a time, so every call reads its own arrays."""
    import torch

    case = CASES[0]
    inputs = [_inputs(case, 7 + i, "torch") for i in range(8)]
    expected = [[_bits(x) for x in _fwd_bwd(*inputs[i])] for i in range(8)]
    torch.cuda.synchronize()
    results, errors = {}, []

    def worker(i):
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                outs = [_fwd_bwd(*inputs[i]) for _ in range(10)]
                stream.synchronize()
                results[i] = [[_bits(x) for x in out] for out in outs]
        except BaseException as exc:  # noqa: BLE001
            errors.append((i, exc))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(8):
        assert all(_same_bits(r, expected[i]) for r in results[i]), f"thread {i}"


# ------------------------------------------------------------------------------ a damaged kernel cache

def _forget_loaded(monkeypatch, compiled_too=True):
    """Empty in-memory caches (restored after the test): loaded functions, plans and, with
    ``compiled_too``, the compiled entries (so the disk cache is read, and checked, again)."""
    for name in ("_modules", "_smem_opt_in") + (("_memory_cache",) if compiled_too else ()):
        monkeypatch.setattr(compiler, name, {})
    monkeypatch.setattr(plan, "_plans", {})


class PrivateCache(tuple):
    """(arrays, causal, cubins, first), and ``specs``: the (spec, arch) of each entry."""

    def __new__(cls, arrays, causal, cubins, first, specs):
        self = super().__new__(cls, (arrays, causal, cubins, first))
        self.specs = specs
        return self


@pytest.fixture
def private_forward_cache(tmp_path, monkeypatch):
    """``(arrays, causal, cubins, first)``: a forward's kernels compiled (or found in the session's
    cache), their entries copied into a private cache directory that the process then uses, and the
    forward's first result (bits) computed from them; ``.specs``: each entry's (spec, arch)."""
    arrays, causal = _inputs(CASES[0], 3, "torch")
    _forget_loaded(monkeypatch)
    first = _bits(sagebwd_cp.attention(*arrays[:3], causal=causal))
    private = tmp_path / "cache"
    private.mkdir()
    cubins, entries = [], list(compiler._memory_cache.values())
    for compiled in entries:
        for src in (compiled.cubin_path, kernel_cache.record_path(compiled.cubin_path)):
            shutil.copy(src, private / src.name)
        cubins.append(private / compiled.cubin_path.name)
    monkeypatch.setenv("SAGEBWD_CP_CACHE_DIR", str(private))
    _forget_loaded(monkeypatch)
    return PrivateCache(arrays, causal, sorted(cubins), first, [(c.spec, c.arch) for c in entries])


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_damaged_cubins_are_recompiled_and_the_results_are_unchanged(private_forward_cache, monkeypatch, damage):
    """Every cubin of a forward damaged on disk, as another process would find them: the next process
    (memory caches empty) warns naming each file, recompiles, and computes the same bits; the CUDA
    context is fine (torch still works)."""
    import torch

    arrays, causal, cubins, first = private_forward_cache
    assert cubins
    for path in cubins:
        data = path.read_bytes()
        path.write_bytes(data[:len(data) // 3] if damage == "truncated" else bytes(np.random.default_rng(0).integers(
            0, 256, len(data), dtype=np.uint8)))
    with pytest.warns(KernelCacheWarning) as record:
        again = _bits(sagebwd_cp.attention(*arrays[:3], causal=causal))
    named = {str(w.message).split("entry ")[1].split(" (")[0] for w in record.list
             if isinstance(w.message, KernelCacheWarning)}
    assert named == {str(p) for p in cubins}
    assert np.array_equal(first, again)
    assert all(kernel_cache.check_entry(p)[1] is None for p in cubins)
    assert float(torch.ones(4, device="cuda").sum()) == 4.0


def test_a_cubin_damaged_after_its_check_is_rejected_by_the_driver_then_recompiled(private_forward_cache,
                                                                                    monkeypatch):
    """The cubins change on disk after the process checked them and before it loads them (the compiled
    entries are in memory, so they are not checked again): the driver rejects each image
    (CUDA_ERROR_INVALID_IMAGE), the entry is recompiled with a warning and loaded, and the results are
    unchanged. (Once CuPy has loaded a cubin it keeps the module for that path: the entries are
    checked here without loading them.)"""
    arrays, causal, cubins, first = private_forward_cache
    for spec, arch in private_forward_cache.specs:
        compiler.compile_spec(spec, arch)  # checks the private entries into memory, loads no module
    for path in cubins:
        path.write_bytes(np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    _forget_loaded(monkeypatch, compiled_too=False)
    with pytest.warns(KernelCacheWarning, match="rejected") as record:
        again = _bits(sagebwd_cp.attention(*arrays[:3], causal=causal))
    assert any(name in str(w.message) for w in record.list for name in kernel_cache.IMAGE_ERRORS)
    assert np.array_equal(first, again)
    assert all(kernel_cache.check_entry(p)[1] is None for p in cubins)


# ------------------------------------------------------------------------------ out of memory

@contextlib.contextmanager
def filled_memory(headroom=False):
    """The device full for the block (``_fill_memory``), its memory back to the driver afterwards (for
    CuPy's pool and the later tests). Skipped where other pytest-xdist workers share the device: their
    tests would run out of memory meanwhile (run these with ``-n 0``)."""
    import torch

    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        pytest.skip("fills the whole device, so other test workers on it would fail: run with -n 0")
    blocks = _fill_memory(headroom)
    try:
        yield
    finally:
        del blocks[:]
        torch.cuda.empty_cache()


def _fill_memory(headroom=False):
    """Torch tensors holding all free device memory but under 2 MiB (the last in 1 MiB pieces, which
    torch takes from 2 MiB segments); with ``headroom``, 8 blocks of 2 MiB and 4 of 1 MiB handed back
    to torch's cache, where a call's small outputs (not a large workspace) can take them."""
    import cupy
    import torch

    torch.cuda.synchronize()
    cupy.get_default_memory_pool().free_all_blocks()
    torch.cuda.empty_cache()
    blocks = []

    def fill(size):
        while True:
            try:
                blocks.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError:
                return

    try:
        fill(1 << 30)
        if blocks:  # the last GiB in 2 MiB pieces (one segment), so that the headroom is made of them
            blocks.pop()
        # Some 1 MiB pieces first: where the 2 MiB ones leave less than a 2 MiB segment of torch's small
        # pool free (an H100's 80 GB did), the last fill below finds none.
        for _ in range(8):
            blocks.append(torch.empty(1 << 20, dtype=torch.uint8, device="cuda"))
        fill(1 << 21)
        fill(1 << 20)
        if headroom:
            for size, count in ((1 << 21, 8), (1 << 20, 4)):
                index = [i for i, b in enumerate(blocks) if b.numel() == size][-count:]
                assert len(index) == count, f"fewer than {count} blocks of {size} bytes"
                for i in reversed(index):
                    del blocks[i]
    except BaseException:  # the memory back before the error leaves (its traceback would hold it)
        del blocks[:]
        torch.cuda.empty_cache()
        raise
    return blocks


def _workspace_note(exc):
    """Whether the error carries the note naming the workspace (Python 3.11+ has notes)."""
    if sys.version_info < (3, 11):
        return True
    return any("sagebwd_cp: the workspace of" in note for note in getattr(exc, "__notes__", []))


def test_a_forward_workspace_that_does_not_fit_raises_torchs_out_of_memory_error():
    import torch

    (q, k, v, _), causal = _inputs((1, 16, 16, 8192, 128, True), 11, "torch")  # K̂, V̂ᵀ: 32 MiB
    out = torch.empty_like(q)  # only the workspace is allocated by the call
    sagebwd_cp.attention(q, k, v, causal=causal, out=out)  # kernels loaded, plan built
    expected = _bits(out)
    out.fill_(float("nan"))
    with filled_memory():
        with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate \d") as info:
            sagebwd_cp.attention(q, k, v, causal=causal, out=out)
        assert _workspace_note(info.value)
    sagebwd_cp.attention(q, k, v, causal=causal, out=out)
    assert np.array_equal(_bits(out), expected)


def test_a_backward_workspace_that_does_not_fit_raises_torchs_out_of_memory_error():
    """GQA 16:1 keeps dK and dV small (2 MiB each, allocated before the workspace, within the 16 MiB
    left); the backward's workspace (quantized Q, Qᵀ, dOᵀ, the FP32 dQ accumulator: over 100 MiB) is
    far larger."""
    import torch

    (q, k, v, do), causal = _inputs((1, 16, 1, 8192, 128, True), 12, "torch")
    out, saved = sagebwd_cp.attention_forward(q, k, v, causal=causal)
    expected = [_bits(x) for x in sagebwd_cp.attention_backward(saved, do, deterministic=True)]
    with filled_memory(headroom=True):
        with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate \d") as info:
            sagebwd_cp.attention_backward(saved, do, deterministic=True)
        assert _workspace_note(info.value)
    again = [_bits(x) for x in sagebwd_cp.attention_backward(saved, do, deterministic=True)]
    assert _same_bits(expected, again)


def test_a_workspace_that_does_not_fit_raises_cupys_out_of_memory_error():
    import cupy

    (q, k, v, do), causal = _inputs((1, 16, 16, 8192, 128, False), 13, "cupy")
    out = cupy.empty_like(q)
    sagebwd_cp.attention(q, k, v, causal=causal, out=out)
    expected = _bits(out)
    _, saved = sagebwd_cp.attention_forward(q, k, v, causal=causal)
    grads = [_bits(x) for x in sagebwd_cp.attention_backward(saved, do, deterministic=True)]
    cupy.cuda.get_current_stream().synchronize()
    with filled_memory():  # CuPy's pool takes its memory from the driver: torch holds it all
        with pytest.raises(cupy.cuda.memory.OutOfMemoryError, match=r"allocating [\d,]+ bytes") as info:
            sagebwd_cp.attention(q, k, v, causal=causal, out=out)
        assert _workspace_note(info.value)
        with pytest.raises(cupy.cuda.memory.OutOfMemoryError, match=r"allocating [\d,]+ bytes"):
            sagebwd_cp.attention_backward(saved, do, deterministic=True)
    sagebwd_cp.attention(q, k, v, causal=causal, out=out)
    assert np.array_equal(_bits(out), expected)
    assert _same_bits(grads, [_bits(x) for x in sagebwd_cp.attention_backward(saved, do, deterministic=True)])


# ------------------------------------------------------------------------------ a failed launch

def test_a_failed_launch_names_the_kernel_shapes_and_options_and_the_next_call_works(monkeypatch):
    """A launch the driver refuses (here: a block of 2048 threads, past CUDA's 1024) raises
    KernelLaunchError with the driver's error as its cause; the context is not poisoned."""
    arrays, causal = _inputs(CASES[1], 21, "torch")
    q, k, v, _ = arrays
    monkeypatch.setattr(plan, "_plans", {})
    expected = _bits(sagebwd_cp.attention(q, k, v, causal=causal))
    built = next(iter(plan._plans.values()))
    step = next(s for s in built.steps if s.entry == "attention_forward")
    head = step.head
    step.head = head[:4] + (2048,) + head[5:]
    try:
        with pytest.raises(KernelLaunchError) as info:
            sagebwd_cp.attention(q, k, v, causal=causal)
    finally:
        step.head = head
    msg = str(info.value)
    assert "CUDA_ERROR_INVALID_VALUE" in msg and type(info.value.__cause__).__name__ == "CUDADriverError"
    for part in ("kernel attention_forward of forward.", "block (2048, 1, 1)", "q (1, 8, 1024, 64) float16",
                 "causal=False", "smooth_k=True"):
        assert part in msg, part
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert np.array_equal(_bits(sagebwd_cp.attention(q, k, v, causal=causal)), expected)
