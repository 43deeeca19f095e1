"""Launch plans on the CPU: workspace carving, argument packing, the plan cache, and the per-call
pointer updates, with every GPU call replaced by a recorder (no device needed).  The packed
arguments are also checked against the kernels' own parameter lists (NVRTC's PTX)."""
import ctypes
import dataclasses
import re
import struct

import numpy as np
import pytest

import sagebwd_cp
from sagebwd_cp import numerics
from sagebwd_cp.gpu import compiler, device, launch, params, plan, tensor_map
from sagebwd_cp.arrays import ArrayDesc
from sagebwd_cp.gpu.launch import PackedArgs, f32, i32, i64, ptr, struct_arg

H200_SHARED = 232448


# ------------------------------------------------------------------------------ workspace carving

def test_carve_aligns_in_order_and_never_overlaps():
    sizes = [1, 1000, 256, 3, 513, 4096]
    bufs = [plan.Buffer(f"b{i}", (n,), "int8") for i, n in enumerate(sizes)]
    total = plan.carve(bufs)
    spans = [(b.offset, b.offset + b.nbytes) for b in bufs]
    assert all(start % plan.WORKSPACE_ALIGN == 0 for start, _ in spans)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # in the order given
    assert spans[-1][1] <= total and total % plan.WORKSPACE_ALIGN == 0


def test_carve_sizes_by_dtype():
    bufs = [plan.Buffer("a", (3, 5), "float32"), plan.Buffer("b", (7,), "float64"), plan.Buffer("c", (2, 2), "int8")]
    assert plan.carve(bufs) == 768
    assert [b.offset for b in bufs] == [0, 256, 512]
    assert [b.nbytes for b in bufs] == [60, 56, 4]


# ------------------------------------------------------------------------------ argument packing

class Symbol:
    """A pointer known only per call (what a plan fills in)."""


def test_packed_bytes_equal_the_values_given():
    sym = Symbol()
    desc = ArrayDesc(0xABC0, (1,), (1,), "float16", "cuda", 0, None, "torch")
    args = [ptr(0x1234), i32(-7), i64(-(2 ** 40)), f32(0.1), ptr(None), i32(3), ptr(desc), ptr(sym), f32(1e300)]
    p = PackedArgs(args)
    # Natural alignment, as in a C struct: the i64 after an i32 starts at 16.
    assert p.offsets == [0, 8, 16, 24, 32, 40, 48, 56, 64]
    assert p.sizes == [8, 4, 8, 4, 8, 4, 8, 8, 4]
    assert p.argument_bytes(0) == struct.pack("<Q", 0x1234)
    assert p.argument_bytes(1) == struct.pack("<i", -7)
    assert p.argument_bytes(2) == struct.pack("<q", -(2 ** 40))
    assert p.argument_bytes(3) == np.float32(0.1).tobytes()
    assert p.argument_bytes(4) == bytes(8)
    assert p.argument_bytes(6) == struct.pack("<Q", 0xABC0)
    assert p.argument_bytes(7) == bytes(8) and p.symbolic == [(7, sym)]
    assert p.argument_bytes(8) == np.float32(np.inf).tobytes()  # float32 rounding, as NumPy does
    # The kernelParams array points at each argument.
    params = (ctypes.c_void_p * len(args)).from_address(p.params_ptr)
    base = p.base
    assert base % 64 == 0  # tensor maps are 64-byte aligned
    assert [params[i] - base for i in range(len(args))] == p.offsets
    assert ctypes.string_at(params[1], 4) == struct.pack("<i", -7)


def test_struct_argument_is_laid_out_like_c():
    sym = Symbol()
    s = struct_arg(i32(1), ptr(sym), i32(2))  # 4 bytes of padding after the first i32, and at the end
    p = PackedArgs([i32(9), s, i32(5)])
    assert p.offsets == [0, 8, 32] and p.sizes == [4, 24, 4]
    assert p.argument_bytes(1) == struct.pack("<i4xQi4x", 1, 0, 2)
    assert p.symbolic == [(2, sym)]  # the struct's pointer: word 2 (byte 16)


def test_pointer_updates_land_at_their_offsets():
    a, b = Symbol(), Symbol()
    p = PackedArgs([i32(1), ptr(a), struct_arg(ptr(None), ptr(b), i64(4)), f32(2.0)])
    words = dict((id(v), w) for w, v in p.symbolic)
    p.words[words[id(a)]] = 0x1111_2222_3333
    p.words[words[id(b)]] = 0xDEAD_BEEF_0000
    assert p.argument_bytes(0) == struct.pack("<i", 1)
    assert p.argument_bytes(1) == struct.pack("<Q", 0x1111_2222_3333)
    assert p.argument_bytes(2) == struct.pack("<QQq", 0, 0xDEAD_BEEF_0000, 4)
    assert p.argument_bytes(3) == struct.pack("<f", 2.0)


def test_quantize_job_matches_the_kernel_struct():
    """params.cuh QuantizeJob: 8 pointers, 3 i64, 6 x 4 bytes, the CTA count (then 4 bytes of padding), the packed
    batch's offsets pointer and two ints: 136 bytes."""
    from sagebwd_cp.gpu import params

    p = PackedArgs([params.zeros("QuantizeJob")])
    assert p.sizes == [136] and p.argument_bytes(0) == bytes(136)


# ------------------------------------------------------------------------------ plans with the GPU mocked

class FakeCuda:
    """Stands in for cupy.cuda.runtime and cupy.cuda.driver: records memsets and launches (with the
    argument bytes read through kernelParams, as the driver reads them)."""

    def __init__(self, current_device=0):
        self.device = current_device
        self.calls = []

    # runtime
    def getDevice(self):
        return self.device

    def setDevice(self, d):
        self.calls.append(("setDevice", d))
        self.device = d

    def memsetAsync(self, p, value, nbytes, stream):
        self.calls.append(("memset", p, value, nbytes, stream))

    # driver
    def ctxGetCurrent(self):
        return 1

    def launchKernel(self, f, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        self.calls.append(("launch", f, (gx, gy, gz), (bx, by, bz), shared, stream, params))

    def launches(self):
        return [c for c in self.calls if c[0] == "launch"]


@pytest.fixture
def gpu(monkeypatch):
    """CUDA-looking ArrayDescs run their plans against FakeCuda; allocations come from a counter."""
    fake = FakeCuda()
    monkeypatch.setattr(launch, "_cuda_modules", (fake, fake))
    monkeypatch.setitem(device._device_limits, 0, H200_SHARED)
    monkeypatch.setitem(device._device_archs, 0, "sm_90")
    monkeypatch.setitem(device._device_sms, 0, 132)
    monkeypatch.setattr(compiler, "get_function_pointer",
                        lambda spec, entry, device_id, shared=0: hash((spec.key, entry)) & 0xFFFFFFFF)
    monkeypatch.setattr(plan, "stream_reader", lambda framework: (lambda device_id: 0x5157))
    # Tensor maps are encoded by the driver: record what would be encoded, and where.
    monkeypatch.setattr(tensor_map, "_encoder", lambda layout: (lambda out, address: fake.calls.append(
        ("tensor_map", layout, out, address))))
    allocations = []

    def allocate(shape, dtype, framework, device_id):
        p = (len(allocations) + 1) << 36
        allocations.append((p, shape, dtype))
        return cuda_desc(shape, dtype, p), p

    monkeypatch.setattr(plan, "allocate", allocate)
    monkeypatch.setattr(plan, "_plans", {})
    fake.allocations = allocations
    return fake


def cuda_desc(shape, dtype="float16", base=1 << 44, strides=None):
    if strides is None:
        strides = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    return ArrayDesc(base, tuple(shape), tuple(strides), dtype, "cuda", 0, None, "torch")


def qkv(b=1, hq=2, hk=1, lq=100, lk=300, d=64, dtype="float16", dv=None):
    """q, k, v descriptors (HND), v of head dim ``dv`` (default ``d``)."""
    return (cuda_desc((b, hq, lq, d), dtype, 1 << 44), cuda_desc((b, hk, lk, d), dtype, 2 << 44),
            cuda_desc((b, hk, lk, d if dv is None else dv), dtype, 3 << 44))


def test_same_key_same_plan_and_no_second_check(gpu, monkeypatch):
    q, k, v = qkv()
    sagebwd_cp.attention(q, k, v, causal=True)
    assert len(plan._plans) == 1
    built = next(iter(plan._plans.values()))

    def no_check(*a, **kw):
        raise AssertionError("a cached call must not check its arrays again")

    monkeypatch.setattr(sagebwd_cp.api, "make_problem", no_check)
    q2, k2, v2 = (cuda_desc(x.shape, base=x.ptr + (5 << 40)) for x in (q, k, v))  # same layout, other memory
    out = sagebwd_cp.attention(q2, k2, v2, causal=True)
    assert len(plan._plans) == 1 and next(iter(plan._plans.values())) is built
    assert out.ptr == gpu.allocations[-2][0]  # the output came from the plan's allocation (then the workspace)


def test_arrays_without_a_cheap_signature_reuse_a_plan_keyed_by_their_descriptors(gpu, monkeypatch):
    import sagebwd_cp.gpu.forward as forward

    builds = []
    real = forward.forward_plan
    monkeypatch.setattr(forward, "forward_plan", lambda *a: builds.append(1) or real(*a))

    class Opaque:  # an array type with no cheap signature (as JAX or a plain DLPack producer)
        def __init__(self, desc):
            self.desc = desc

        def __dlpack__(self, stream=None):  # what makes it an array; read through the patched describe
            raise AssertionError("described through its desc")

    import sagebwd_cp.problem as problem

    real_describe = problem.describe
    monkeypatch.setattr(problem, "describe", lambda x, name="array": real_describe(getattr(x, "desc", x), name))
    for shift in range(3):
        q, k, v = (Opaque(dataclasses.replace(x, ptr=x.ptr + (shift << 30))) for x in qkv())
        sagebwd_cp.attention(q, k, v, causal=True)
    assert builds == [1] and len(plan._plans) == 1
    assert len(gpu.launches()) == 3 * 3


def test_a_cached_plan_keeps_no_array_alive(gpu):
    import gc
    import weakref

    class Tensor:  # stands for the caller's array object behind a descriptor
        pass

    t = Tensor()
    q, k, v = (dataclasses.replace(x, obj=t) for x in qkv())
    sagebwd_cp.attention_forward(q, k, v)
    ref = weakref.ref(t)
    del t, q, k, v
    gc.collect()
    assert ref() is None and len(plan._plans) == 1


def test_caches_stay_bounded_under_a_stream_of_sequence_lengths(gpu, monkeypatch):
    """Training with varied sequence lengths makes a new plan per length: the plan cache keeps at most
    MAX_PLANS of them (the oldest go), and the compiled kernels do not grow with the lengths (a
    specialization does not depend on them)."""
    monkeypatch.setattr(plan, "MAX_PLANS", 8)
    resolved = set()
    monkeypatch.setattr(compiler, "get_function_pointer",
                        lambda spec, entry, device_id, shared=0: resolved.add((spec.key, entry)) or 1)
    for n in range(100, 140):
        q, k, v = qkv(lq=n, lk=n)
        sagebwd_cp.attention(q, k, v, causal=True)
        assert len(plan._plans) <= 8
    assert len(plan._plans) == 8
    assert {entry for _, entry in resolved} == {"token_sum", "quantize_tensors", "attention_forward"}
    assert len(resolved) == 3  # one kernel each, whatever the length


def test_compiled_kernel_caches_stay_bounded_under_a_stream_of_shapes(gpu, monkeypatch):
    """The compiler's caches (compiled cubins in memory, loaded functions) are keyed by specialization,
    which depends on the padded head dim, dtype and options but not on the shape: a stream of distinct
    batch sizes, head counts, lengths and head dims (8..64, one padded head dim) adds no entry after the
    first call, however long it runs."""
    monkeypatch.setattr(plan, "MAX_PLANS", 4)
    resolved = set()
    monkeypatch.setattr(compiler, "get_function_pointer",
                        lambda spec, entry, device_id, shared=0: resolved.add((spec.key, entry)) or 1)
    rng = np.random.default_rng(0)
    sizes = []
    for i in range(30):
        hk = int(rng.integers(1, 4))
        q, k, v = qkv(b=int(rng.integers(1, 4)), hq=hk * int(rng.integers(1, 4)), hk=hk,
                      lq=int(rng.integers(1, 5000)), lk=int(rng.integers(1, 5000)), d=8 * int(rng.integers(1, 9)))
        sagebwd_cp.attention(q, k, v, causal=True)
        sizes.append((len(resolved), len(compiler._memory_cache)))
        assert len(plan._plans) <= 4
    assert len({entry for _, entry in resolved}) == 3 and len(resolved) == 3
    assert sizes[-1] == sizes[0], "the compiled-kernel cache grew with the shapes"


@pytest.mark.parametrize("change", ["strides", "options", "alignment", "dtype", "out"])
def test_a_different_key_builds_a_different_plan(gpu, change):
    q, k, v = qkv()
    sagebwd_cp.attention(q, k, v, causal=True)
    first = next(iter(plan._plans.values()))
    opts = dict(causal=True)
    if change == "strides":  # NHD-ordered memory, viewed as HND
        b, h, n, d = q.shape
        q = cuda_desc(q.shape, strides=(n * h * d, d, h * d, 1), base=q.ptr)
    elif change == "options":
        opts = dict(causal=True, smooth_q=True)
    elif change == "alignment":
        v = cuda_desc(v.shape, base=v.ptr + 8)
    elif change == "dtype":
        q, k, v = qkv(dtype="bfloat16")
    else:
        opts["out"] = cuda_desc(q.shape, base=9 << 44)
    sagebwd_cp.attention(q, k, v, **opts)
    assert len(plan._plans) == 2
    second = [p for p in plan._plans.values() if p is not first]
    assert len(second) == 1


def test_bad_input_still_names_the_argument_after_a_cached_call(gpu):
    q, k, v = qkv()
    sagebwd_cp.attention(q, k, v)
    with pytest.raises(ValueError, match=r"head_dim: expected a multiple of 8"):
        sagebwd_cp.attention(*(cuda_desc(x.shape[:3] + (60,), base=x.ptr) for x in (q, k, v)))
    with pytest.raises(ValueError, match=r"layout: expected one of"):
        sagebwd_cp.attention(q, k, v, layout=["HND"])  # unhashable: no cache lookup, the check reports it
    with pytest.raises(ValueError, match=r"out: expected 4-byte aligned rows"):
        sagebwd_cp.attention(q, k, v, out=cuda_desc(q.shape, base=(9 << 44) + 2))
    assert len(plan._plans) == 1


def _argument_bytes(params_ptr, sizes):
    params = (ctypes.c_void_p * len(sizes)).from_address(params_ptr)
    return [ctypes.string_at(params[i], n) for i, n in enumerate(sizes)]


def test_each_call_writes_its_pointers_where_the_kernels_read_them(gpu, monkeypatch):
    """Two calls of one plan: every pointer argument holds this call's array, output or workspace
    sub-buffer (base + carved offset); nothing else in the arguments changes. (token_sum's path: the
    fused one has a test of its own below.)"""
    from sagebwd_cp.gpu.forward import forward_plan

    monkeypatch.setenv("SAGEBWD_FUSED_TOKEN_SUMS", "0")
    from sagebwd_cp.options import AttentionOptions
    from sagebwd_cp.problem import make_problem

    q, k, v = qkv(lq=100, lk=600)  # two token-sum parts, stored apart (nothing to zero) and added by the K job
    prob = make_problem(q, k, v, AttentionOptions(causal=True))
    built = forward_plan(prob, None, True, False)
    names = {b.name: b for b in _buffers(built)}
    snapshots = []
    for call in range(2):
        shift = call << 40
        gpu.calls.clear()
        start = len(gpu.allocations)
        built.run([q.ptr + shift, k.ptr + shift, v.ptr + shift])
        out_ptr, k_mean_ptr, ws_ptr = (gpu.allocations[start + i][0] for i in (0, 2, 3))
        # out, lse2 and μ_K (which the backward reuses), then the workspace
        assert [a[1:] for a in gpu.allocations[start:]] == [((1, 2, 100, 64), "float16"), ((1, 2, 100), "float32"),
                                                             ((1, 1, 64), "float32"),
                                                             ((built.workspace_bytes + 256,), "uint8")]
        assert [c for c in gpu.calls if c[0] == "memset"] == []
        assert names["k_sum"].shape == (1, 1, 2, 64)
        launches = gpu.launches()
        assert [c[1] for c in launches] == [s.head[0] for s in built.steps]
        args = {s.entry: _argument_bytes(c[6], s.args.sizes) for s, c in zip(built.steps, launches)}
        u64 = lambda b: struct.unpack("<Q", b)[0]
        ts = args["token_sum"]
        assert u64(ts[0]) == k.ptr + shift and u64(ts[9]) == ws_ptr + names["k_sum"].offset
        assert struct.unpack("<i", ts[8])[0] == 300  # tokens a part
        launch = next(c for c in launches if c[1] == next(s.head[0] for s in built.steps if s.entry == "token_sum"))
        assert launch[2] == (2, 1, 1)  # (parts, Hkv, B)
        assert struct.unpack("<i", args["quantize_tensors"][-3])[0] == 2  # the K job adds both parts (sum_parts)
        # Q is quantized by the forward kernel itself (no Q-smoothing): the pre-pass has K and V.
        assert "q8" not in names and "q_scale" not in names
        qt = args["quantize_tensors"]
        job = lambda i: struct.unpack("<8Q3q5ifi4xQii", qt[i])[:18]  # without the packed-batch fields
        assert "k_mean" not in names
        assert job(0)[:8] == (k.ptr + shift, ws_ptr + names["k_sum"].offset, k_mean_ptr, 0,
                              ws_ptr + names["k8"].offset, 0, ws_ptr + names["k_scale"].offset, 0)
        assert job(1)[:8] == (v.ptr + shift, 0, 0, 0, 0, ws_ptr + names["vt8"].offset, ws_ptr + names["v_scale"].offset,
                              0)
        assert (job(0)[-1], job(1)[-1], job(2)[-1]) == (10 * 1 // 2, 10 * 1 // 2, 0)  # CTAs: blocks of 64 x heads / 2
        fw = dict(zip([n for _, n in params.lists()["ForwardParams"]], args["attention_forward"]))
        assert [u64(fw[n]) for n in ("q8", "q_scale", "bias", "out", "lse2", "q")] == [
            0, 0, 0, out_ptr, gpu.allocations[start + 1][0], q.ptr + shift]
        assert [u64(fw[n]) for n in ("k8", "k_scale", "vt8", "v_scale")] == [
            ws_ptr + names[n].offset for n in ("k8", "k_scale", "vt8", "v_scale")]
        assert struct.unpack("<f", fw["q_prescale"])[0] == np.float32(numerics.qk_prescale(1 / 8))
        snapshots.append({e: [b for b in a] for e, a in args.items()})
    # Between the two calls only pointer words changed: scalars are packed once.
    for entry in snapshots[0]:
        for b0, b1 in zip(snapshots[0][entry], snapshots[1][entry]):
            if len(b0) == 4:
                assert b0 == b1


def test_the_forward_k_job_sums_its_own_tokens_where_a_head_fits_the_device(gpu, monkeypatch):
    """At head dims 128 and 256, where a head's K CTAs (one per 128 rows) number at most half the device's SMs, the
    forward's pre-pass is zero_counts then quantize_tensors_fused, whose K job forms μ_K (no token_sum); elsewhere
    (head dim 64, more CTAs than SMs, Q-smoothing, SAGEBWD_FUSED_TOKEN_SUMS=0; packed batches) token_sum and
    quantize_tensors."""
    from sagebwd_cp.gpu import quantize
    from sagebwd_cp.gpu.forward import forward_plan
    from sagebwd_cp.options import AttentionOptions
    from sagebwd_cp.problem import make_problem

    q, k, v = qkv(b=2, hq=4, hk=2, lq=100, lk=600, d=128)  # 640 key rows: 5 CTAs a head
    built = forward_plan(make_problem(q, k, v, AttentionOptions(causal=True)), None, True, False)
    assert [s.entry for s in built.steps] == ["zero_counts", "quantize_tensors_fused", "attention_forward"]
    names = {b.name: b for b in _buffers(built)}
    assert names["k_sum"].shape == (2, 2, 5, 128) and names["k_arrive"].shape == (2, 2)
    gpu.calls.clear()
    start = len(gpu.allocations)
    built.run([q.ptr, k.ptr, v.ptr])
    k_mean_ptr, ws_ptr = gpu.allocations[start + 2][0], gpu.allocations[start + 3][0]
    args = {s.entry: _argument_bytes(c[6], s.args.sizes) for s, c in zip(built.steps, gpu.launches())}
    u64, i32 = (lambda b: struct.unpack("<Q", b)[0]), (lambda b: struct.unpack("<i", b)[0])
    zc = args["zero_counts"]
    assert (u64(zc[0]), i32(zc[1])) == (ws_ptr + names["k_arrive"].offset, 4)  # B x Hkv counts
    qt = args["quantize_tensors_fused"]
    assert i32(qt[-3]) == 5 and u64(qt[-2]) == ws_ptr + names["k_sum"].offset
    assert u64(qt[-1]) == ws_ptr + names["k_arrive"].offset
    k_job = struct.unpack("<8Q3q5ifi4xQii", qt[0])
    assert k_job[1:3] == (0, k_mean_ptr) and k_job[14] == quantize.PER_TOKEN | quantize.FUSED_SUM
    assert struct.unpack("<8Q3q5ifi4xQii", qt[1])[14] == quantize.PERMUTE_T  # V
    narrow = qkv(b=2, hq=4, hk=2, lq=100, lk=600, d=64)
    for change in ("head dim", "sms", "smooth_q", "env"):
        monkeypatch.setitem(device._device_sms, 0, 9 if change == "sms" else 132)  # 5 CTAs a head > 9 // 2
        if change == "env":
            monkeypatch.setenv("SAGEBWD_FUSED_TOKEN_SUMS", "0")
        prob = make_problem(*(narrow if change == "head dim" else (q, k, v)),
                            AttentionOptions(causal=True, smooth_q=change == "smooth_q"))
        entries = [s.entry for s in forward_plan(prob, None, True, False).steps]
        assert entries[:2] == ["token_sum", "quantize_tensors"], change
    monkeypatch.setenv("SAGEBWD_FUSED_TOKEN_SUMS", "1")  # asked for: at head dim 64 too
    prob = make_problem(*narrow, AttentionOptions(causal=True))
    assert forward_plan(prob, None, True, False).steps[1].entry == "quantize_tensors_fused"


def _buffers(built):
    """The Buffers a plan's steps point into (from their symbolic pointers)."""
    seen = {}
    for step in built.steps:
        for _, value in step.args.symbolic:
            if isinstance(value, plan.Buffer):
                seen[value.name] = value
    return seen.values()


def test_device_is_switched_only_when_needed(gpu):
    q, k, v = qkv()
    sagebwd_cp.attention(q, k, v)
    assert not [c for c in gpu.calls if c[0] == "setDevice"]
    gpu.device = 3  # another device is current: switch for the launches, then switch back
    gpu.calls.clear()
    sagebwd_cp.attention(q, k, v)
    kinds = [c[0] for c in gpu.calls]
    assert kinds[0] == "setDevice" and gpu.calls[0][1] == 0 and kinds[-1] == "setDevice" and gpu.device == 3
    assert "launch" in kinds[1:-1]


def test_forward_and_backward_plans_have_no_memset(gpu):
    q, k, v = qkv(lq=64, lk=64)
    out, saved = sagebwd_cp.attention_forward(q, k, v, causal=True)
    assert not [c for c in gpu.calls if c[0] == "memset"]  # one token-sum CTA stores its sums
    # token_sum; K and V (two blocks a CTA; the forward kernel quantizes Q); the attention (causal: heads in x)
    assert [c[2] for c in gpu.launches()] == [(1, 1, 1), ((2 * 1 + 2 * 1) // 2, 1, 1), (2, 1, 1)]
    gpu.calls.clear()
    do = cuda_desc(q.shape, base=7 << 44)
    sagebwd_cp.attention_backward(saved, do, deterministic=True)
    # dQ's accumulator and the turn counters are cleared by row_stats (backward_rows.cu), not by a memset.
    assert not [c for c in gpu.calls if c[0] == "memset"]
    bwd = [p for p in plan._plans.values() if p.outputs and p.outputs[0].name == "dq"][0]
    assert {"dq_acc", "lock"} <= {b.name for b in _buffers(bwd)}


def test_backward_reuses_the_forwards_key_mean(gpu):
    """With the saved state the backward quantizes K with the forward's μ_K (QUANT_MEAN_GIVEN; no
    token sums); from plain arrays without k_mean it sums K again, into a workspace μ_K."""
    from sagebwd_cp.gpu.quantize import MEAN_GIVEN, PER_TOKEN

    q, k, v = qkv(lq=100, lk=300)
    out, saved = sagebwd_cp.attention_forward(q, k, v)
    assert saved.k_mean.shape == (1, 1, 64) and saved.k_mean.dtype == "float32"
    do = cuda_desc(q.shape, base=7 << 44)
    job = lambda args, i: struct.unpack("<8Q3q5ifi4xQii", args[i])[:18]
    for given in (True, False):
        gpu.calls.clear()
        if given:
            sagebwd_cp.attention_backward(saved, do)
        else:
            sagebwd_cp.attention_backward_arrays(q, k, v, saved.out, saved.lse2, do)
        bwd = [p for p in plan._plans.values() if p.outputs and p.outputs[0].name == "dq"
               and ("k_mean" in p.inputs) == given][0]
        entries = [s.entry for s in bwd.steps]
        assert ("token_sum" in entries) == (not given)
        step = next(s for s in bwd.steps if s.entry == "quantize_tensors")
        launch_args = next(c for c in gpu.launches() if c[1] == step.head[0])
        k_job = job(_argument_bytes(launch_args[6], step.args.sizes), 1)  # Q, K, dO
        assert k_job[0] == k.ptr
        if given:
            assert k_job[1] == 0 and k_job[2] == saved.k_mean.ptr and k_job[14] == PER_TOKEN | MEAN_GIVEN
        else:
            names = {b.name: b for b in _buffers(bwd)}
            assert "k_sum" in names and "k_mean" in names and k_job[14] == PER_TOKEN


@pytest.mark.parametrize("d, lq", [(64, 1), (104, 300), (200, 129), (128, 4096)])
def test_backward_row_kernels_cover_every_row_once(gpu, d, lq):
    """row_stats' grid covers the padded query rows exactly (D_pad / 8 lanes a row: a CTA past them would store
    statistics past the buffer), and dq_convert's covers Lq rows of D / 8 groups with less than one CTA to spare."""
    from sagebwd_cp.gpu import specs
    q, k, v = qkv(hq=2, hk=1, lq=lq, lk=200, d=d)
    out, saved = sagebwd_cp.attention_forward(q, k, v)
    sagebwd_cp.attention_backward(saved, cuda_desc(q.shape, base=7 << 44))
    bwd = [p for p in plan._plans.values() if p.outputs and p.outputs[0].name == "dq"][0]
    grids = {s.entry: (s.head[1:4], s.head[4]) for s in bwd.steps}
    dp, nq = specs.padded_head_dim(d), -(-lq // 128) * 128
    (gx, gy, gz), threads = grids["row_stats"]
    assert gx * threads // (dp // 8) == nq and (gy, gz) == (2, 1)
    (gx, gy, gz), threads = grids["dq_convert"]
    assert (gx - 1) * threads < lq * (d // 8) <= gx * threads and (gy, gz) == (2, 1)


def test_backward_pads_keys_to_whole_cta_tiles(gpu):
    """K̂ and K̂ᵀ are padded to the backward's key tile (128 keys), whatever the heads and determinism; the
    forward to 128."""
    for hk, deterministic, nk in ((2, True, 128), (2, False, 128), (1, True, 128)):
        q, k, v = qkv(hk=hk, lq=64, lk=64)
        out, saved = sagebwd_cp.attention_forward(q, k, v, causal=True)
        do = cuda_desc(q.shape, base=7 << 44)
        plan.clear_plans()
        sagebwd_cp.attention_backward(saved, do, deterministic=deterministic)
        bwd = [p for p in plan._plans.values() if p.outputs and p.outputs[0].name == "dq"][0]
        shapes = {b.name: b.shape for b in _buffers(bwd)}
        assert shapes["k8"][2] == nk and shapes["k8t"][3] == nk and shapes["k_scale"][2] == nk, (hk, deterministic)
        assert shapes["q8"][2] == 128


def test_backward_releases_its_quantized_inputs_before_dq_is_allocated(gpu, monkeypatch):
    """The peak of a backward: Q̂, Q̂ᵀ, K̂, K̂ᵀ, dÔᵀ and the row statistics go back to the allocator
    after the main kernel is queued, and dq (which only dq_convert writes) is allocated after that;
    the FP32 dQ accumulator lives on until dq_convert has read it."""
    import weakref

    live = []  # (name, weak reference) of every allocation, in order

    def allocate(shape, dtype, framework, device_id):
        p = (len(live) + 1) << 36
        obj = cuda_desc(shape, dtype, p)
        alive_then = [name for name, ref in live if ref() is not None]
        live.append(((shape, dtype), weakref.ref(obj)))
        gpu.calls.append(("allocate", shape, dtype, p, alive_then))
        return obj, p

    monkeypatch.setattr(plan, "allocate", allocate)
    q, k, v = qkv(lq=100, lk=300)
    out, saved = sagebwd_cp.attention_forward(q, k, v)
    bwd_start = len(gpu.calls)
    dq, dk, dv = sagebwd_cp.attention_backward(saved, cuda_desc(q.shape, base=7 << 44))
    calls = gpu.calls[bwd_start:]
    bwd = [p for p in plan._plans.values() if p.outputs and p.outputs[0].name == "dq"][0]
    kept = sorted(b.name for b in _buffers(bwd) if not b.released)
    assert kept == ["dq_acc"]
    assert bwd.release is not None and bwd.release.late == (0,)  # dq, output number 0
    allocs = [c for c in calls if c[0] == "allocate"]
    sizes = [c[1] for c in allocs]
    assert sizes == [q.shape[:1] + k.shape[1:], k.shape, (bwd.workspace_bytes + 256,),
                     (bwd.release.nbytes + 256,), q.shape]  # dk, dv, kept, released, then dq
    released_shape = (bwd.release.nbytes + 256,)
    # dq is allocated after the main kernel was launched and once the released part is gone.
    order = [c[0] if c[0] != "allocate" else c[1] for c in calls]
    main = [i for i, c in enumerate(calls) if c[0] == "launch"][-2]
    assert order.index(q.shape, order.index(released_shape) + 1) > main
    assert (released_shape, "uint8") not in allocs[-1][4] and (bwd.workspace_bytes + 256,) in [a[0] for a in allocs[-1][4]]
    # The launches after the release read the kept buffer and dq, nothing released.
    names = {b.name: b for b in _buffers(bwd)}
    convert = bwd.steps[-1]
    assert convert.entry == "dq_convert" and bwd.release.step == len(bwd.steps) - 1
    kept_slot = len(bwd.inputs) + len(bwd.outputs)
    assert {(src, off) for _, src, off in convert.slots} == {(kept_slot, names["dq_acc"].offset),
                                                              (len(bwd.inputs), 0)}


def test_backward_encodes_its_query_tile_maps_per_call(gpu):
    """On sm_90 the backward kernel loads Q̂, Q̂ᵀ, dÔᵀ and dO by TMA and adds dQ's partials into dq_acc by
    TMA: the plan encodes their five tensor maps at every call, with that call's addresses, into the kernel's
    64-byte aligned arguments; dO's map has its strides (bytes) and zero fill past Lq and D."""
    q, k, v = qkv(b=2, hq=4, hk=2, lq=100, lk=300, d=80)
    out, saved = sagebwd_cp.attention_forward(q, k, v)
    nq, dp = 128, 128
    for base in (7 << 44, 9 << 44):
        gpu.calls.clear()
        sagebwd_cp.attention_backward(saved, cuda_desc(q.shape, base=base))
        maps = [c for c in gpu.calls if c[0] == "tensor_map"]
        assert len(maps) == 5
        layouts = [m[1] for m in maps]
        assert layouts[0].dims == (dp, 2 * 4 * nq, 1) and layouts[0].box == (dp, 64, 1) and layouts[0].swizzle == 128
        assert layouts[1] == layouts[2] and layouts[1].dims == (nq, 2 * 4 * dp) and layouts[1].box == (64, dp)
        assert layouts[3].dims == (80, 100, 4, 2) and layouts[3].strides == (160, 100 * 160, 4 * 100 * 160)
        assert layouts[3].box == (64, 64, 1, 1) and maps[3][3] == base
        # dq_acc: rows of dp + 8 floats, a box of a dQ tile's rows (unswizzled: the tile's padding is zeros)
        assert layouts[4].dims == (dp + 8, 2 * 4 * nq) and layouts[4].strides == (4 * (dp + 8),)
        assert layouts[4].box == (dp + 8, 64) and layouts[4].swizzle == 0
        bwd = [p for p in plan._plans.values() if p.outputs and p.outputs[0].name == "dq"][0]
        step = [st for st in bwd.steps if st.entry == "attention_backward"][0]
        names = {b.name: b for b in _buffers(bwd)}
        assert [m[2] for m in maps] == [step.args.base + off for off in step.args.offsets[-5:]]
        assert all(m[2] % 64 == 0 for m in maps)
        # Q̂, Q̂ᵀ and dÔᵀ at their offsets in one workspace allocation of this call.
        bases = {m[3] - names[n].offset for m, n in zip(maps, ("q8", "q8t", "dot8"))}
        assert len(bases) == 1 and bases.pop() % 256 == 0


def test_wide_backward_maps_split_q_into_column_blocks_and_d_into_passes(gpu):
    """Above head dim 128 the wgmma backward runs two CTAs a key block, a half of dK, dV and dQ each: Q̂'s
    256-byte rows load as two 128-byte column blocks in one box, Q̂ᵀ and dÔᵀ a half's rows, and dQ's partial
    tile (a half's columns and 8 of zeros) adds into its columns of dq_acc's rows; a key block's two CTAs are
    neighbours on the grid's blocks axis."""
    q, k, v = qkv(b=2, hq=4, hk=2, lq=100, lk=300, d=256)
    out, saved = sagebwd_cp.attention_forward(q, k, v)
    gpu.calls.clear()
    sagebwd_cp.attention_backward(saved, cuda_desc(q.shape, base=7 << 44))
    maps = [c[1] for c in gpu.calls if c[0] == "tensor_map"]
    nq, dp = 128, 256
    assert maps[0].dims == (128, 2 * 4 * nq, 2) and maps[0].strides == (dp, 128) and maps[0].box == (128, 64, 2)
    assert maps[1].dims == (nq, 2 * 4 * dp) and maps[1].box == (64, 128)
    assert maps[4].dims == (dp + 8, 2 * 4 * nq) and maps[4].box == (136, 64)
    # The backward's launch: two computing warpgroups and the producer's (the other launches take 256 threads).
    launch = [c for c in gpu.launches() if c[3] == (384, 1, 1)]
    assert len(launch) == 1 and launch[0][2] == (3 * 2, 2, 2)  # key blocks of 128 x two halves, key heads, batch


def test_tensor_map_layouts_are_checked():
    from sagebwd_cp.gpu.tensor_map import DTYPE_UINT8, DTYPE_UINT16, TensorMapLayout

    TensorMapLayout(DTYPE_UINT16, (80, 100, 4, 2), (160, 16000, 64000), (64, 64, 1, 1), 128)
    with pytest.raises(ValueError, match="multiples of 16"):
        TensorMapLayout(DTYPE_UINT16, (80, 100), (170,), (64, 64), 128)
    with pytest.raises(ValueError, match="does not fit swizzle 64"):
        TensorMapLayout(DTYPE_UINT8, (128, 1000), (128,), (128, 64), 64)
    with pytest.raises(ValueError, match="box"):
        TensorMapLayout(DTYPE_UINT8, (64, 1000), (64,), (8, 64), 64)  # 8-byte box rows
    with pytest.raises(ValueError, match="rank"):
        TensorMapLayout(DTYPE_UINT8, (64, 1000), (), (64, 64), 64)


def test_a_launch_may_not_read_a_released_buffer():
    spec = compiler.KernelSpec("test", "test.cu", (), ("f",))
    builder = plan.PlanBuilder(0, "cupy", [])
    early = builder.workspace("early", (64,), "float32")
    builder.launch(spec, "f", (1, 1, 1), (32, 1, 1), [ptr(early)])
    builder.release_workspace()
    builder.launch(spec, "f", (1, 1, 1), (32, 1, 1), [ptr(early)])
    with pytest.raises(ValueError, match="reads workspace 'early' after its release"):
        builder.build(resolve=lambda *a: 1)
    with pytest.raises(ValueError, match="once"):
        builder.release_workspace()


# ------------------------------------------------------------------------------ against the kernels' parameters

_PTX_PARAM = re.compile(r"\.param\s+(?:\.align\s+(\d+)\s+)?\.([a-z]+)(\d+)\s+\w+(?:\[(\d+)\])?")


def _ptx_entry(spec, entry):
    """(the byte size of each parameter of ``entry``, its launch bounds' threads), from NVRTC's PTX for compute_90."""
    from cupy_backends.cuda.libs import nvrtc

    options = [o.replace("sm_90", "compute_90") for o in spec.options("sm_90") if not o.startswith("-Xptxas")]
    prog = nvrtc.createProgram(compiler.flatten_source(spec.filename), f"{spec.key}.cu", [], [])
    try:
        nvrtc.compileProgram(prog, options)
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    m = re.search(r"\.entry\s+" + entry + r"\s*\((.*?)\)", ptx, re.S)
    assert m, f"{entry} not in the PTX of {spec.key}"
    threads = re.search(r"\.maxntid\s+(\d+)", ptx[m.end():ptx.index("{", m.end())])
    sizes = [int(count) if count else int(bits) // 8 for _, _, bits, count in _PTX_PARAM.findall(m.group(1))]
    return sizes, int(threads.group(1))


def _check_against_kernel(step, checked: dict) -> None:
    """A plan step passes the arguments its kernel declares, each of the declared size, and the threads
    the kernel was compiled for (specs.py's defines; at most those, D_pad, for quantize_tensors)."""
    key = (step.spec.key, step.entry)
    if key not in checked:
        checked[key] = _ptx_entry(step.spec, step.entry)
    sizes, threads = checked[key]
    assert step.args.sizes == sizes, key
    block = step.head[4:7]
    assert block[1:] == (1, 1) and (block[0] <= threads if step.entry == "quantize_tensors" else block[0] == threads), (key, block)


def test_packed_arguments_match_every_kernel_signature(gpu):
    """Every launch of the forward and backward plans passes as many arguments as its kernel declares,
    each of the declared size (an i32 where an i64 is expected would shift every later argument), with
    the threads it was compiled for."""
    q, k, v = qkv(hq=2, hk=1, lq=100, lk=300, d=80)
    v = cuda_desc(v.shape, base=v.ptr + 4)  # misaligned: the backward packs V's rows first
    do = cuda_desc(q.shape, base=6 << 44)
    for smooth_q in (False, True):
        out, lse, saved = sagebwd_cp.attention_forward(q, k, v, causal=True, smooth_q=smooth_q, return_lse=True)
        sagebwd_cp.attention_backward(saved, do, deterministic=True)
    checked = {}
    for built in plan._plans.values():
        for step in built.steps:
            _check_against_kernel(step, checked)
    entries = {e for _, e in checked}
    assert entries == {"token_sum", "quantize_tensors", "smooth_q_bias", "attention_forward", "natural_lse",
                       "row_stats", "pack_rows", "attention_backward", "dq_convert", "zero_counts",
                       "quantize_tensors_fused"}


# ------------------------------------------------------------------------------ allocation helpers

def test_user_allocator_results_must_be_contiguous_and_aligned():
    from sagebwd_cp import arrays

    calls = []

    def alloc(shape, dtype, device_id):
        calls.append((shape, dtype, device_id))
        return np.empty(shape, dtype=dtype)

    sagebwd_cp.set_allocator(alloc)
    try:
        obj, p = arrays.allocate((1000,), "uint8", "torch", 0)
        assert calls == [((1000,), "uint8", 0)] and p == obj.ctypes.data
        sagebwd_cp.set_allocator(lambda shape, dtype, device_id: np.empty(shape[::-1], dtype=dtype).T)
        with pytest.raises(ValueError, match=r"allocator result: expected a contiguous array of shape \(2, 3\)"):
            arrays.allocate((2, 3), "float32", "torch", 0)

        def misaligned(shape, dtype, device_id):
            base = np.empty(64 + 16, dtype=np.uint8)
            start = -base.ctypes.data % 16 + 2  # 2 bytes past a 16-byte boundary
            return base[start:start + 8].view(np.float16)

        sagebwd_cp.set_allocator(misaligned)
        with pytest.raises(ValueError, match=r"allocator result: expected a 16-byte aligned pointer, got 0x"):
            arrays.allocate((4,), "float16", "torch", 0)
    finally:
        sagebwd_cp.set_allocator(None)


def test_torch_allocations_have_the_shape_dtype_and_device_asked_for(monkeypatch):
    torch = pytest.importorskip("torch")
    from sagebwd_cp import arrays

    monkeypatch.setitem(arrays._TORCH_DEVICES, 0, torch.device("cpu"))  # "device 0", to run without a GPU
    monkeypatch.setitem(arrays._TORCH_DEVICES, 1, torch.device("meta"))
    for shape, dtype, device_id in [((2, 3, 4, 8), "float16", 0), ((2, 3, 4), "float32", 0), ((7,), "uint8", 0),
                                    ((2, 3, 4, 8), "bfloat16", 0), ((5, 6), "float16", 1), ((5, 6), "int32", 0)]:
        t, p = arrays.allocate(shape, dtype, "torch", device_id)
        assert t.shape == shape and t.dtype == arrays._torch_dtype(dtype) and t.is_contiguous()
        assert t.device == arrays._TORCH_DEVICES[device_id] and p == t.data_ptr()


def test_byte_view_of_a_torch_buffer():
    torch = pytest.importorskip("torch")
    from sagebwd_cp import arrays

    buf = torch.zeros(4096, dtype=torch.uint8)
    d = arrays.byte_view(buf, 512, (2, 3, 4), "float32")
    assert d.ptr == buf.data_ptr() + 512 and d.shape == (2, 3, 4) and d.dtype == "float32"
    d.obj[1, 2, 3] = 1.5
    assert buf[512 + 4 * 23:512 + 4 * 24].view(torch.float32).item() == 1.5


@pytest.mark.parametrize("batch,heads,n", [(1, 1, 1), (1, 1, 300), (4, 16, 4096), (1, 16, 16384), (1, 2, 4097),
                                           (64, 32, 512), (1, 1, 1 << 20)])
def test_token_sum_parts_cover_every_token_once(batch, heads, n):
    """token_sum's parts tile the tokens (the last may be short, none empty), at most SUM_MAX_PARTS of
    them (the K job adds them all), each over at least SUM_MIN_SPAN tokens unless there is one."""
    from sagebwd_cp.gpu.quantize import SUM_MAX_PARTS, SUM_MIN_SPAN, token_sum_parts

    parts, span = token_sum_parts(batch, heads, n)
    assert 1 <= parts <= SUM_MAX_PARTS and (parts - 1) * span < n <= parts * span
    assert parts == 1 or span >= SUM_MIN_SPAN


def test_causal_grids_start_every_heads_heaviest_block_first():
    """Causal grids put heads in x, which the hardware starts first: in start order every head's first
    (heaviest) block comes before any head's second. Non-causal grids keep blocks in x, without the
    65535 limit of y and z; a causal length past it is refused, naming the argument."""
    assert launch.attention_grid(1000, 64, 8, 2, launch.BLOCKS_FIRST, "q") == (16, 8, 2)
    assert launch.attention_grid(1000, 64, 8, 2, launch.HEADS_BATCH_FIRST, "q") == (8, 2, 16)
    assert launch.attention_grid(1000, 64, 8, 2, launch.HEADS_FIRST, "q") == (8, 16, 2)
    longest = launch.GRID_YZ_LIMIT * 64
    assert launch.attention_grid(longest, 64, 8, 1, launch.HEADS_BATCH_FIRST, "q") == (8, 1, launch.GRID_YZ_LIMIT)
    assert launch.attention_grid(longest + 1, 64, 8, 1, launch.BLOCKS_FIRST, "q") == (launch.GRID_YZ_LIMIT + 1, 8, 1)
    with pytest.raises(ValueError, match=rf"^k: causal attention takes at most {longest} tokens .* got {longest + 1}$"):
        launch.attention_grid(longest + 1, 64, 8, 1, launch.HEADS_FIRST, "k")
    with pytest.raises(ValueError, match=r"^q: at most 65535 heads and 65535 batch entries, got 8 heads and batch 65536$"):
        launch.attention_grid(64, 64, 8, 65536, launch.HEADS_BATCH_FIRST, "q")


def test_backward_grid_goes_heads_first_where_causal_and_few_waves():
    """The wgmma backward's causal grid starts heads first where the heads' chains of blocks are shorter
    than a wave, with the batch beside the heads in grids of at most FEW_WAVES CTAs an SM (a GQA model's
    2K step) where one entry fills at most half the SMs (deterministic: in every grid of few waves); chains
    of a wave or more (deterministic: heads and batch first), every non-causal grid and the mma.sync kernel's default grid keep key blocks in x."""
    from sagebwd_cp.gpu.backward import FEW_WAVES, backward_grid
    from sagebwd_cp.gpu.launch import BLOCKS_FIRST, HEADS_BATCH_FIRST, HEADS_FIRST
    from sagebwd_cp.options import AttentionOptions
    from sagebwd_cp.problem import make_problem

    def grid(b, hq, hk, n, causal, det=False, wgmma=True):
        q, k = np.zeros((b, hq, n, 8), np.float16), np.zeros((b, hk, n, 8), np.float16)
        return backward_grid(make_problem(q, k, k, AttentionOptions(causal=causal)), 128, det, wgmma, 132)

    assert grid(8, 8, 2, 2048, True) == ((2, 8, 16), HEADS_BATCH_FIRST)  # 256 CTAs, 32 an entry
    assert grid(2, 8, 2, 8192, True) == ((2, 64, 2), HEADS_FIRST)  # 128 CTAs an entry
    assert grid(1, 16, 16, 16384, True) == ((16, 128, 1), HEADS_FIRST)  # many waves, chains of 128 blocks
    assert grid(2, 16, 16, 8192, True) == ((16, 64, 2), HEADS_FIRST)  # many waves, one entry over half the SMs
    assert grid(64, 8, 2, 2048, True) == ((2, 16, 64), HEADS_FIRST)  # many waves: the batch stays in z
    assert grid(1, 8, 2, 32768, True) == ((256, 2, 1), BLOCKS_FIRST)  # 512 CTAs, but chains of 256 blocks
    assert grid(1, 16, 16, 16384, True, det=True) == ((16, 128, 1), HEADS_FIRST)  # many waves, short chains
    assert grid(1, 8, 2, 32768, True, det=True) == ((2, 1, 256), HEADS_BATCH_FIRST)  # chains of 256 blocks
    assert grid(8, 8, 2, 2048, True, det=True) == ((2, 8, 16), HEADS_BATCH_FIRST)  # few waves
    q, k = np.zeros((16, 16, 4096, 8), np.float16), np.zeros((16, 16, 4096, 8), np.float16)
    wide = make_problem(q, k, k, AttentionOptions(causal=True))  # two-pass: chains of 64 CTAs, many waves
    assert backward_grid(wide, 128, False, True, 132, passes=2) == ((16, 64, 16), HEADS_FIRST)
    # The pair kernel (64-key CTAs) keeps the batch in z where the others would put it beside the heads.
    q, k = np.zeros((8, 16, 1024, 8), np.float16), np.zeros((8, 4, 1024, 8), np.float16)
    mla = make_problem(q, k, k, AttentionOptions(causal=True))
    assert backward_grid(mla, 64, False, True, 132) == ((4, 8, 16), HEADS_BATCH_FIRST)
    assert backward_grid(mla, 64, False, True, 132, batch_beside_heads=False) == ((4, 16, 8), HEADS_FIRST)
    assert grid(8, 8, 2, 2048, False) == ((16, 2, 8), BLOCKS_FIRST)
    assert grid(8, 8, 2, 2048, True, wgmma=False) == ((16, 2, 8), BLOCKS_FIRST)
    assert grid(8, 8, 2, 2048, True, det=True, wgmma=False) == ((2, 8, 16), HEADS_BATCH_FIRST)
    assert 16 * 2 * 8 <= FEW_WAVES * 132 < 128 * 16


def test_grid_orders_match_the_kernels():
    """launch.py's grid-order values are the ones kernels/config.cuh names (SB_GRID_ORDER)."""
    import re
    from sagebwd_cp.gpu import launch
    from sagebwd_cp.gpu.compiler import source_dirs

    text = (source_dirs()[0] / "config.cuh").read_text()
    enum = dict((n, int(v)) for n, v in re.findall(r"(\w+) = (\d+)", re.search(r"enum GridOrder \{([^}]*)\}", text).group(1)))
    assert enum == {n: getattr(launch, n) for n in ("BLOCKS_FIRST", "HEADS_FIRST", "HEADS_BATCH_FIRST")}


def _packed(lens_q, lens_k, hq=2, hk=1, d=64, dtype="float16"):
    """CUDA-looking packed q, k, v (total, heads, d) and offsets."""
    tq, tk = sum(lens_q), sum(lens_k)
    cu = lambda lens, base: cuda_desc((len(lens) + 1,), "int32", base)
    return (cuda_desc((tq, hq, d), dtype, 1 << 44), cuda_desc((tk, hk, d), dtype, 2 << 44),
            cuda_desc((tk, hk, d), dtype, 3 << 44), cu(lens_q, 7 << 44), cu(lens_k, 8 << 44))


def test_packed_batches_launch_the_varlen_kernels_with_their_offsets(gpu):
    """A packed batch's plans: varlen specializations, grids over the longest sequence and the batch,
    INT8 buffers with every sequence's padded rows, the offsets passed per call, and arguments that
    match every kernel's signature."""
    lens_q, lens_k = [1, 130, 7], [5, 300, 7]
    q, k, v, cq, ck = _packed(lens_q, lens_k, d=80)
    v = cuda_desc(v.shape, base=v.ptr + 4)  # misaligned: the backward packs V's rows first
    do = cuda_desc(q.shape, base=6 << 44)
    out, lse, saved = sagebwd_cp.attention_varlen_forward(q, k, v, cq, ck, 130, 300, causal=True, return_lse=True)
    assert tuple(out.shape) == (138, 2, 80) and tuple(lse.shape) == (2, 138)
    dq, dk, dv = sagebwd_cp.attention_backward(saved, do, deterministic=True)
    assert tuple(dq.shape) == (138, 2, 80) and tuple(dk.shape) == tuple(dv.shape) == (312, 1, 80)
    checked = {}
    for built in plan._plans.values():
        for step in built.steps:
            assert step.spec.key.endswith(".varlen") or step.entry == "pack_rows", step.spec.key
            _check_against_kernel(step, checked)
        assert built.inputs[-2:] == ("cu_seqlens_q", "cu_seqlens_k")
    fwd, bwd = plan._plans.values()
    grids = {s.entry: s.head[1:4] for s in fwd.steps + bwd.steps}
    assert grids["attention_forward"][2] == 3 and grids["quantize_tensors"][2] == 3  # one z per sequence
    assert grids["token_sum"][2] == 3
    # Query rows: round_up(138, 128) + 3·128 = 640 a head; the wgmma backward's keys pad to 128.
    names = {b.name: b for b in _buffers(bwd)}
    assert names["q8"].shape == (1, 2, 640, 128) and names["k8"].shape == (1, 1, 384 + 384, 128)
    assert names["stats"].shape == (1, 2, 640, 4)


def test_a_narrower_value_head_dim_reaches_the_kernels(gpu):
    """V's head dim below Q·K's (MLA's 192/128, value_head_dim.py): the forward and the backward launches carry
    Dv = 128 beside D = 192, so that the kernels skip the zero columns' products and take V, O, dO and dV at 128
    columns: O and dV are allocated so, V's and dO's quantize jobs take 128 columns, row_stats reads 128 of dO and O,
    and dO's tensor map is 128 columns wide; a V of Q·K's head dim gives Dv = D."""
    from sagebwd_cp.api import run_forward
    from sagebwd_cp.options import AttentionOptions

    def launched(entry, list_name):
        step = [st for p in plan._plans.values() for st in p.steps if st.entry == entry][-1]
        call = [c for c in gpu.launches() if c[1] == step.head[0]][-1]
        values = dict(zip([n for _, n in params.lists()[list_name]], _argument_bytes(call[6], step.args.sizes)))
        return {n: struct.unpack("<i", values[n])[0] for n in ("D", "Dv")}

    for dv in (128, 192):
        plan._plans.clear()
        q, k, v = qkv(b=1, hq=4, hk=2, lq=100, lk=300, d=192, dv=dv)
        options = AttentionOptions(causal=True, smooth_k=False)
        out, _, saved = run_forward(q, k, v, options, training=True, want_saved=True)
        assert launched("attention_forward", "ForwardParams") == {"D": 192, "Dv": dv}
        assert tuple(out.shape) == (1, 4, 100, dv)
        gpu.calls.clear()
        grads = sagebwd_cp.attention_backward(saved, cuda_desc((1, 4, 100, dv), base=7 << 44))
        assert [tuple(g.shape) for g in grads] == [(1, 4, 100, 192), (1, 2, 300, 192), (1, 2, 300, dv)]
        assert launched("attention_backward", "BackwardParams") == {"D": 192, "Dv": dv}
        assert launched("row_stats", "RowStatsParams") == {"D": 192, "Dv": dv}
        # The quantize jobs' column counts (QuantizeJob.D): Q's and K's 192, dO's V's.
        step = [st for p in plan._plans.values() for st in p.steps if st.entry == "quantize_tensors"][-1]
        call = [c for c in gpu.launches() if c[1] == step.head[0]][-1]
        jobs = [struct.unpack("<8Q3q5ifi4xQii", b)[15] for b in _argument_bytes(call[6], step.args.sizes)[:3]]
        assert jobs == [192, 192, dv], jobs
        do_maps = [c[1] for c in gpu.calls if c[0] == "tensor_map" and c[1].dtype == tensor_map.DTYPE_UINT16]
        assert [m.dims[0] for m in do_maps] == [dv], do_maps
        # The backward splits 192 columns and V's (specs.narrow_backward_tiles) in the pair kernel's CTA: Q̂ᵀ's and
        # dÔᵀ's boxes take all 192 rows and V's.
        step = [st for p in plan._plans.values() for st in p.steps if st.entry == "attention_backward"][-1]
        assert f".qk192.v{dv}" in step.spec.key and ".pair." in step.spec.key, step.spec.key
        boxes = {c[1].box for c in gpu.calls if c[0] == "tensor_map" and len(c[1].dims) == 2 and c[1].swizzle == 64}
        assert boxes == {(64, 192), (64, dv)}, boxes


def test_the_phase_specialized_pair_backward_is_the_default_where_v_fits_128(gpu, monkeypatch):
    """kernels/backward_phases.cu runs MLA's 192/128 (V's tiles of 128 columns) by default, adding dQ into dq_acc's
    unpadded rows 64 columns at a time (two swizzled 32-column blocks a box); V's 192 columns keep the pair kernel
    (a warpgroup's 96 columns a box), as SAGEBWD_BACKWARD_PHASES=0 does at 192/128."""
    from sagebwd_cp.api import run_forward
    from sagebwd_cp.options import AttentionOptions

    for env, dv, phases in ((None, 128, True), ("1", 192, False), ("0", 128, False), ("1", 128, True)):
        if env is None:
            monkeypatch.delenv("SAGEBWD_BACKWARD_PHASES", raising=False)
        else:
            monkeypatch.setenv("SAGEBWD_BACKWARD_PHASES", env)
        plan._plans.clear()
        q, k, v = qkv(b=1, hq=4, hk=2, lq=100, lk=300, d=192, dv=dv)
        options = AttentionOptions(causal=True, smooth_k=False)
        _, _, saved = run_forward(q, k, v, options, training=True, want_saved=True)
        gpu.calls.clear()
        sagebwd_cp.attention_backward(saved, cuda_desc((1, 4, 100, dv), base=7 << 44))
        step = [st for p in plan._plans.values() for st in p.steps if st.entry == "attention_backward"][-1]
        assert (step.spec.filename == "backward_phases.cu") == phases and ".pair" in step.spec.key, step.spec.key
        dq_boxes = {c[1].box for c in gpu.calls if c[0] == "tensor_map" and c[1].dtype == tensor_map.DTYPE_FLOAT32}
        assert dq_boxes == ({(32, 64, 2)} if phases else {(32, 64, 3)}), dq_boxes
