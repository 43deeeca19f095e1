"""Faults and concurrency on the CPU, with the GPU mocked (test_plan's FakeCuda): a failed launch names
the kernel, the shapes and the options; the in-memory caches (compiled kernels, loaded functions,
launch plans) hold under calls from many threads at once."""
import ctypes
import struct
import sys
import threading
import time

import pytest

import sagebwd_cp
from sagebwd_cp.gpu import compiler, kernel_cache, plan, specs
from sagebwd_cp.gpu.launch_errors import KernelLaunchError
from test_plan import cuda_desc, gpu, qkv  # noqa: F401  (gpu: the fixture)


class CUDADriverError(Exception):
    """Stands in for cupy's CUDADriverError."""


def _refuse(entry_name, fake):
    """A launchKernel that refuses the launches of the kernel whose handle ``fake`` resolved for
    ``entry_name`` (the gpu fixture's handles are hash((spec key, entry)))."""
    real = type(fake).launchKernel

    def launch(f, *rest):
        step = next((s for p in plan._plans.values() for s in p.steps if s.head[0] == f), None)
        if step is not None and step.entry == entry_name:
            raise CUDADriverError("CUDA_ERROR_INVALID_VALUE: invalid argument")
        return real(fake, f, *rest)

    return launch


def test_a_failed_launch_names_the_kernel_the_shapes_and_the_options(gpu):
    q, k, v = qkv(b=1, hq=2, hk=1, lq=100, lk=300, d=64)
    gpu.launchKernel = _refuse("attention_forward", gpu)
    with pytest.raises(KernelLaunchError) as info:
        sagebwd_cp.attention(q, k, v, causal=True, smooth_q=True)
    err = info.value
    msg = str(err)
    assert isinstance(err.__cause__, CUDADriverError) and "CUDA_ERROR_INVALID_VALUE" in err.cuda_error
    assert err.kernel.startswith("forward.") and err.kernel.endswith(":attention_forward")
    for part in ("kernel attention_forward of forward.", "CUDA_ERROR_INVALID_VALUE: invalid argument",
                 "q (1, 2, 100, 64) float16", "k (1, 1, 300, 64) float16", "v (1, 1, 300, 64) float16",
                 "causal=True", "smooth_q=True", "smooth_k=True", "layout='HND'", "softmax_scale=0.125",
                 "grid (", "block (", "bytes of dynamic shared memory", "compile options ", "on device 0"):
        assert part in msg, part
    del gpu.launchKernel  # the next call of the same plan launches
    gpu.calls.clear()
    sagebwd_cp.attention(q, k, v, causal=True, smooth_q=True)
    assert len(gpu.launches()) == len(next(iter(plan._plans.values())).steps)


def test_a_failed_backward_launch_names_its_kernel_and_options(gpu):
    q, k, v = qkv(lq=64, lk=64)
    out, saved = sagebwd_cp.attention_forward(q, k, v)
    gpu.launchKernel = _refuse("attention_backward", gpu)
    with pytest.raises(KernelLaunchError, match=r"kernel attention_backward of backward\..*q \(1, 2, 64, 64\) "
                                                r"float16.*causal=False"):
        sagebwd_cp.attention_backward(saved, cuda_desc(q.shape, base=7 << 44), deterministic=True)


def test_a_one_off_launch_failure_says_so():
    from sagebwd_cp.gpu.launch_errors import describe_problem

    assert "one-off" in describe_problem(None)


# ------------------------------------------------------------------------------ threads

@pytest.fixture
def switch_often():
    """Threads switch every few microseconds, so races have many chances to show."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def _in_threads(fn, n=8):
    """Run fn(i) in n threads released at once; re-raise the first failure."""
    barrier, errors = threading.Barrier(n), []

    def body(i):
        try:
            barrier.wait()
            fn(i)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def test_threads_asking_for_the_same_kernels_compile_each_once_and_share_one_entry(tmp_path, monkeypatch,
                                                                                    switch_often):
    monkeypatch.setenv("SAGEBWD_CP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compiler, "_memory_cache", {})
    compiled, lock = [], threading.Lock()
    real = compiler._nvrtc_compile

    def counted(source, spec, arch):
        with lock:
            compiled.append(spec.key)
        return real(source, spec, arch)

    monkeypatch.setattr(compiler, "_nvrtc_compile", counted)
    wanted = [specs.ceiling_spec(), specs.bias_spec("float16")]
    got = [[] for _ in range(8)]
    _in_threads(lambda i: [got[i].append(compiler.compile_spec(s, "sm_80")) for s in wanted * 3])
    assert sorted(compiled) == sorted(s.key for s in wanted)  # one compile each, whatever the threads
    for results in got:
        assert [id(r) for r in results] == [id(r) for r in got[0]]  # one CompiledKernel a key, for all


def test_loaded_functions_and_their_shared_memory_opt_ins_hold_under_threads(monkeypatch, switch_often):
    """get_function from 8 threads, each asking for the same kernels with growing shared memory: each
    kernel is loaded once, and its opt-in only ever grows (a thread never lowers the limit another
    thread's launch relies on)."""
    import cupy

    class Function:
        def __init__(self):
            self.history = []

        @property
        def max_dynamic_shared_size_bytes(self):
            return self.history[-1] if self.history else 48 * 1024

        @max_dynamic_shared_size_bytes.setter
        def max_dynamic_shared_size_bytes(self, value):
            self.history.append(value)

    class Device:
        def __init__(self, device_id):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    loads = []

    def load(load_fn, recompile, cubin_path):
        loads.append(cubin_path)
        return Function()

    monkeypatch.setattr(cupy.cuda, "Device", Device)
    monkeypatch.setattr(compiler, "device_arch", lambda device_id: "sm_80")
    monkeypatch.setattr(kernel_cache, "load_function", load)
    monkeypatch.setattr(compiler, "_modules", {})
    monkeypatch.setattr(compiler, "_smem_opt_in", {})
    spec = specs.ceiling_spec()
    returned = []

    def ask(i):
        for n in range(40):
            smem = 48 * 1024 + 1024 * ((n * 7 + i * 13) % 150)
            fn = compiler.get_function(spec, "ceiling", 0, smem)
            returned.append((fn, smem, fn.max_dynamic_shared_size_bytes))

    _in_threads(ask)
    assert len(loads) == 1 and len({id(fn) for fn, _, _ in returned}) == 1
    fn = returned[0][0]
    assert fn.history == sorted(fn.history)  # only ever raised
    assert all(limit >= smem for _, smem, limit in returned)


def test_plan_cache_writes_from_threads_keep_it_bounded(monkeypatch, switch_often):
    monkeypatch.setattr(plan, "MAX_PLANS", 16)
    monkeypatch.setattr(plan, "_plans", {})

    def churn(i):
        for n in range(300):
            key = (i, n % 40)
            if plan.cached_plan(key) is None:
                plan.remember_plan(key, object())
            if n % 97 == 0:
                plan.clear_plans()
            assert len(plan._plans) <= 16

    _in_threads(churn)
    assert len(plan._plans) <= 16


CALLS = 20


def test_calls_from_threads_launch_each_with_its_own_pointers(gpu, switch_often):
    """8 threads call the attention with their own arrays (same shapes, so one shared plan, and other
    shapes, so plans built concurrently): every launch reads the pointers of the thread that made it.
    The plan's packed arguments are shared; its lock makes writing them and launching one step."""
    real = type(gpu).launchKernel
    by_thread, wrong, lock = {}, [], threading.Lock()

    def launch(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        # token_sum's first argument is K: read it now, as the driver would copy it (after letting other
        # threads run: the real launch may release the GIL before it copies the arguments)
        time.sleep(0)
        mine = by_thread.get(threading.get_ident())
        first = ctypes.c_void_p.from_address(params).value
        value = struct.unpack("<Q", ctypes.string_at(first, 8))[0]
        step = next((s for p in list(plan._plans.values()) for s in p.steps if s.head[0] == f), None)
        if step is not None and step.entry == "token_sum" and value != mine:
            with lock:
                wrong.append((value, mine))
        return real(gpu, f, gx, gy, gz, bx, by, bz, shared, stream, params, extra)

    gpu.launchKernel = launch

    def call(i):
        for n in range(CALLS):
            q, k, v = qkv(lq=100 + 8 * (n % 2), lk=300 + 8 * (n % 2))
            shift = ((i + 1) << 36) + (n << 30)
            q, k, v = (cuda_desc(x.shape, base=x.ptr + shift) for x in (q, k, v))
            by_thread[threading.get_ident()] = k.ptr
            sagebwd_cp.attention(q, k, v, causal=bool(n % 4 < 2))

    _in_threads(call)
    assert not wrong
    assert sum(1 for c in gpu.launches()) == 8 * CALLS * 3  # token_sum, quantize, attention each call


# ------------------------------------------------------------------------------ out of memory

class OutOfMemoryError(RuntimeError):
    """Stands in for torch's (a RuntimeError) and CuPy's (a MemoryError) out-of-memory errors."""


def test_a_workspace_that_does_not_fit_raises_the_allocators_error_with_a_note(gpu, monkeypatch):
    """The framework's own error comes through unchanged (its type and message), with a note naming the
    workspace's size and the call; nothing is launched, and the next call (memory back) works."""
    q, k, v = qkv(lq=100, lk=300)
    sagebwd_cp.attention(q, k, v, out=cuda_desc(q.shape, base=9 << 44))
    real = plan.allocate
    full = []

    def allocate(shape, dtype, framework, device_id):
        if full and dtype == "uint8":
            raise OutOfMemoryError(f"CUDA out of memory. Tried to allocate {shape[0]} bytes")
        return real(shape, dtype, framework, device_id)

    monkeypatch.setattr(plan, "allocate", allocate)
    built = next(iter(plan._plans.values()))
    full.append(1)
    gpu.calls.clear()
    with pytest.raises(OutOfMemoryError, match=f"Tried to allocate {built.workspace_bytes + 256} bytes") as info:
        sagebwd_cp.attention(q, k, v, out=cuda_desc(q.shape, base=9 << 44))
    assert not gpu.launches()
    notes = getattr(info.value, "__notes__", [])
    if sys.version_info >= (3, 11):
        assert len(notes) == 1 and f"the workspace of {built.workspace_bytes + 256} bytes" in notes[0]
        assert "attention_forward" in notes[0] and "q (1, 2, 100, 64) float16" in notes[0]
    full.clear()
    sagebwd_cp.attention(q, k, v, out=cuda_desc(q.shape, base=9 << 44))
    assert len(gpu.launches()) == len(built.steps)
