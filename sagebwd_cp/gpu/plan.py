"""Launch plans: what one call of the attention launches, resolved once and replayed per call.

A plan is built from the first call with a given key (shapes, strides, dtypes, device, layout,
options, pointer alignments: everything that decides the launches) and holds the loaded kernels,
their grids, blocks and shared memory, the packed arguments, the workspace layout and the arrays to
allocate.  A later call with the same key reads its stream, allocates its outputs and ONE workspace
buffer, writes the new pointers into the packed arguments and launches: no validation, no kernel
specs, no per-argument conversion.

Pointers a plan fills in per call come from a table: the caller's arrays (``inputs``, in order),
then the outputs it allocates, then the workspace bases.  The workspace is carved into sub-buffers
at ``WORKSPACE_ALIGN``-byte offsets; none needs to start zeroed (what must start at zero, the
backward's dQ accumulator, a kernel clears as it passes: backward_rows.cu row_stats).  A plan may
release part of its workspace midway (``PlanBuilder.release_workspace``): those buffers live in a
second allocation, dropped before the later launches, and the outputs that only later launches
write are allocated after it, so they can reuse its memory.
"""
from __future__ import annotations

import dataclasses
import math
import threading

from ..arrays import ArrayDesc, allocate, contiguous_strides, describe, stream_reader
from . import compiler
from .device import device_arch, shared_memory_limit
from .launch import PackedArgs, cuda
from .launch_errors import launch_error, note_allocation_failure

WORKSPACE_ALIGN = 256  # bytes: every sub-buffer starts 256-byte aligned (cp.async wants 16)
MAX_PLANS = 1024  # cached plans; the oldest is dropped past this (e.g. many distinct sequence lengths)
KERNEL_LAYOUT = None  # launch(shared=...): the size of the kernel's own shared layout (KernelSpec.layout)

_ITEMSIZE = {"int8": 1, "uint8": 1, "float16": 2, "bfloat16": 2, "int32": 4, "float32": 4, "float64": 8}


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


class Buffer:
    """A sub-buffer of the call's workspace (``offset`` is set when the plan is built)."""

    def __init__(self, name: str, shape: tuple, dtype: str):
        self.name, self.shape, self.dtype = name, tuple(int(s) for s in shape), dtype
        self.strides = contiguous_strides(self.shape)
        self.nbytes = math.prod(self.shape) * _ITEMSIZE[dtype]
        self.offset = None
        self.released = False  # lives in the part of the workspace released midway

    def __repr__(self):
        return f"Buffer({self.name!r}, {self.shape}, {self.dtype}, offset={self.offset})"


class Output:
    """An array allocated per call and returned to the caller (contiguous)."""

    def __init__(self, name: str, shape: tuple, dtype: str):
        self.name, self.shape, self.dtype = name, tuple(int(s) for s in shape), dtype
        self.strides = contiguous_strides(self.shape)

    def __repr__(self):
        return f"Output({self.name!r}, {self.shape}, {self.dtype})"


def carve(buffers) -> int:
    """Assign each Buffer its offset, in order, every offset a multiple of WORKSPACE_ALIGN.
    Returns the total bytes."""
    pos = 0
    for buf in buffers:
        buf.offset = pos
        pos = _round_up(pos + buf.nbytes, WORKSPACE_ALIGN)
    return pos


class Step:
    """One launch of a plan."""

    __slots__ = ("spec", "entry", "head", "args", "slots", "maps")

    def __init__(self, spec, entry, function: int, grid, block, shared: int, args: PackedArgs, slots: tuple,
                 maps: tuple = ()):
        self.spec, self.entry = spec, entry
        self.head = (function, *grid, *block, shared)  # cuLaunchKernel's arguments before the stream
        self.args = args
        self.slots = slots  # ((word index in args, pointer-table index, byte offset), ...)
        self.maps = maps  # ((argument address, tensor-map encoder, pointer-table index, byte offset), ...)


class Release:
    """The workspace released midway: from launch ``step`` on, its ``nbytes`` are dropped and the
    outputs numbered ``late`` are allocated."""

    __slots__ = ("step", "nbytes", "late")

    def __init__(self, step: int, nbytes: int, late: tuple):
        self.step, self.nbytes, self.late = step, nbytes, late


class LaunchPlan:
    """Everything one call launches; ``run`` replays it with the call's pointers."""

    def __init__(self, device_id: int, framework: str, inputs: tuple, outputs: list, workspace_bytes: int,
                 steps: list, problem=None, release: Release | None = None):
        self.device_id = device_id
        self.framework = framework  # whose allocator and current stream a call uses
        self.inputs = inputs  # names of the caller's arrays, in the order ``run`` takes their pointers
        self.outputs = outputs  # Output objects, returned in this order
        self.workspace_bytes = workspace_bytes  # the workspace that lives through the call
        self.steps = steps
        self.release = release
        late = release.late if release else ()
        self._early = tuple(n for n in range(len(outputs)) if n not in late)  # allocated before any launch
        # (outputs to allocate first or None, steps): at the release point the released part is
        # dropped and the late outputs are allocated.
        cut = release.step if release else len(steps)
        self._phases = (None, steps[:cut]), (late, steps[cut:])
        self.problem = _detached(problem)  # what the plan was built from (pointers stale, arrays dropped)
        self.read_stream = stream_reader(framework)
        self._lock = threading.Lock()  # the packed arguments are shared: one call at a time packs and launches

    def run(self, input_ptrs, stream: int | None = None):
        """Launch for arrays at ``input_ptrs``; returns (output arrays, workspace array or None: the
        part that lived through the call)."""
        dev = self.device_id
        if stream is None:
            stream = self.read_stream(dev)
        fw = self.framework
        n_in, outputs, release = len(input_ptrs), self.outputs, self.release
        objs = [None] * len(outputs)
        table = list(input_ptrs) + [0] * len(outputs)
        for n in self._early:
            out = outputs[n]
            objs[n], table[n_in + n] = allocate(out.shape, out.dtype, fw, dev)
        workspace = self._allocate_workspace(self.workspace_bytes, table)
        released = None
        if release is not None:
            released = self._allocate_workspace(release.nbytes, table)
        runtime, driver = cuda()
        launch_kernel = driver.launchKernel
        with self._lock:
            # The device must be current for the driver; the usual case costs two cheap queries.
            previous = runtime.getDevice()
            if previous != dev or not driver.ctxGetCurrent():
                runtime.setDevice(dev)  # also binds the device's primary context to this thread
            try:
                for late, steps in self._phases:
                    if late is not None:
                        # Dropped while the queued launches still read it: the allocators are
                        # stream-ordered, so only later work on this stream gets the memory.
                        released = None
                        for n in late:
                            out = outputs[n]
                            objs[n], table[n_in + n] = allocate(out.shape, out.dtype, fw, dev)
                    for step in steps:
                        words = step.args.words
                        for word, source, offset in step.slots:
                            words[word] = table[source] + offset
                        for address, encode, source, offset in step.maps:
                            encode(address, table[source] + offset)
                        try:
                            launch_kernel(*step.head, stream, step.args.params_ptr, 0)
                        except Exception as exc:  # the driver's bare error, given the kernel and the call
                            raise launch_error(self, step, exc) from exc
            finally:
                if previous != dev:
                    runtime.setDevice(previous)
        del released
        return objs, workspace

    def _allocate_workspace(self, nbytes: int, table: list):
        """The array (None for no bytes); appends its 256-byte aligned base (0 if none) to ``table``."""
        array, base = None, 0
        if nbytes:
            # Room to align the base: a user allocator need not return 256-byte aligned memory.
            try:
                array, p = allocate((nbytes + WORKSPACE_ALIGN,), "uint8", self.framework, self.device_id)
            except Exception as exc:  # torch's and CuPy's out-of-memory errors: raised as they are, with a note
                note_allocation_failure(exc, self, nbytes + WORKSPACE_ALIGN)
                raise
            base = _round_up(p, WORKSPACE_ALIGN)
        table.append(base)
        return array

    def workspace_base_offset(self, workspace) -> int:
        """Where the aligned base lies in a workspace array that ``run`` returned."""
        p = describe(workspace, "workspace").ptr
        return _round_up(p, WORKSPACE_ALIGN) - p


def _detached(problem):
    """``problem`` (a dataclass) with its ArrayDescs no longer referring to the caller's arrays: a
    cached plan must not keep the first call's tensors alive."""
    if problem is None:
        return None
    arrays = {f.name: dataclasses.replace(getattr(problem, f.name), obj=None, keepalive=None)
              for f in dataclasses.fields(problem) if isinstance(getattr(problem, f.name), ArrayDesc)}
    return dataclasses.replace(problem, **arrays)


class PlanBuilder:
    """Records the launches of one call with symbolic pointers, then builds a LaunchPlan.

    ``inputs``: ``(name, ArrayDesc)`` pairs of the caller's arrays; a pointer argument that is one
    of these descriptors (the same object) becomes a per-call pointer.  Other ArrayDescs and ints are
    constants, allowed only in a plan that will not be cached (``build(cacheable=False)``)."""

    def __init__(self, device_id: int, framework: str, inputs):
        self.device_id, self.framework = device_id, framework
        self.inputs = tuple(inputs)
        self.buffers, self.outputs, self.launches = [], [], []
        self.release_at = None  # launches recorded before the workspace release, if there is one

    def workspace(self, name: str, shape, dtype: str) -> Buffer:
        buf = Buffer(name, shape, dtype)
        self.buffers.append(buf)
        return buf

    def release_workspace(self, keep=()) -> None:
        """The launches recorded from here on read no workspace buffer declared so far except those
        in ``keep``: the others are released before them, and outputs that only those launches use
        are allocated after that, where they can take the released memory (a lower peak)."""
        if self.release_at is not None:
            raise ValueError("a plan releases its workspace once")
        self.release_at = len(self.launches)
        kept = {id(b) for b in keep}
        for buf in self.buffers:
            buf.released = id(buf) not in kept

    def output(self, name: str, shape, dtype: str) -> Output:
        out = Output(name, shape, dtype)
        self.outputs.append(out)
        return out

    def launch(self, spec, entry: str, grid, block, args, shared: int | None = 0) -> None:
        """One launch; ``shared``: its dynamic shared memory in bytes, or KERNEL_LAYOUT."""
        self.launches.append((spec, entry, tuple(grid), tuple(block), shared, list(args)))

    def _layout_bytes(self, spec) -> int:
        """The dynamic shared memory of ``spec``'s layout on this device, checked against its limit."""
        arch = device_arch(self.device_id)
        shared, limit = compiler.dynamic_shared_bytes(spec, arch), shared_memory_limit(self.device_id)
        if shared > limit:
            raise RuntimeError(f"{spec.key}: needs {shared} bytes of shared memory, the device ({arch}) allows {limit}")
        return shared

    def _pointer_source(self, value, n_inputs: int):
        """(pointer-table index, byte offset) of a symbolic pointer."""
        if isinstance(value, Buffer):
            return n_inputs + len(self.outputs) + value.released, value.offset
        if isinstance(value, Output):
            return n_inputs + self.outputs.index(value), 0
        raise TypeError(f"unexpected pointer argument {value!r}")

    def build(self, problem=None, cacheable: bool = True, resolve=None) -> LaunchPlan:
        """The plan; ``resolve(spec, entry, device_id, shared) -> function handle`` loads the kernels
        (default: compiler.get_function_pointer, which needs the device)."""
        resolve = resolve or compiler.get_function_pointer
        total = carve([b for b in self.buffers if not b.released])
        released = carve([b for b in self.buffers if b.released])
        input_ids = {id(desc): i for i, (_, desc) in enumerate(self.inputs)}
        steps, first_use = [], {}
        for index, (spec, entry, grid, block, shared, args) in enumerate(self.launches):
            args = [_symbolize(a, input_ids) for a in args]
            packed = PackedArgs(args)
            if cacheable and _has_constant_pointer(args):
                raise ValueError(f"{spec.key}:{entry}: a cached plan cannot hold a constant pointer")
            def source_of(value):
                if isinstance(value, _Input):
                    return value.index, 0
                if isinstance(value, Buffer) and value.released and index >= self.release_at:
                    raise ValueError(f"{spec.key}:{entry}: reads workspace {value.name!r} after its release")
                if isinstance(value, Output):
                    first_use.setdefault(self.outputs.index(value), index)
                return self._pointer_source(value, len(self.inputs))

            slots = tuple((word, *source_of(value)) for word, value in packed.symbolic)
            maps = tuple((packed.base + off, layout.encoder(), *source_of(value))
                         for off, layout, value in packed.symbolic_maps)
            if shared is KERNEL_LAYOUT:
                shared = self._layout_bytes(spec)
            function = resolve(spec, entry, self.device_id, shared)
            steps.append(Step(spec, entry, function, grid, block, shared, packed, slots, maps))
        release = None
        if self.release_at is not None:
            late = tuple(n for n, step in sorted(first_use.items()) if step >= self.release_at)
            release = Release(self.release_at, released, late)
        return LaunchPlan(self.device_id, self.framework, tuple(name for name, _ in self.inputs), list(self.outputs),
                          total, steps, problem, release)


class _Input:
    """A pointer to the caller's array number ``index``."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def _symbolize(arg, input_ids: dict):
    """The argument with the caller's array descriptors replaced by _Input markers."""
    if arg.kind == "struct":
        return arg._replace(value=tuple(_symbolize(f, input_ids) for f in arg.value))
    if arg.kind == "ptr" and isinstance(arg.value, ArrayDesc) and id(arg.value) in input_ids:
        return arg._replace(value=_Input(input_ids[id(arg.value)]))
    if arg.kind == "tmap" and isinstance(arg.value[1], ArrayDesc) and id(arg.value[1]) in input_ids:
        return arg._replace(value=(arg.value[0], _Input(input_ids[id(arg.value[1])])))
    return arg


def _has_constant_pointer(args) -> bool:
    for arg in args:
        if arg.kind == "struct":
            if _has_constant_pointer(arg.value):
                return True
        elif arg.kind in ("ptr", "tmap"):
            value = arg.value[1] if arg.kind == "tmap" else arg.value
            if not (value is None or isinstance(value, (_Input, Buffer, Output))):
                return True
    return False


# ---------------------------------------------------------------------------------------------
# The cache.

_plans: dict = {}


def cached_plan(key):
    """The plan stored under ``key``, or None (also for an unhashable key: the full path then
    reports whatever option made it so)."""
    try:
        return _plans.get(key)
    except TypeError:
        return None


_plans_lock = threading.Lock()  # writers take it; a reader's lookup is one dict.get of a finished plan


def remember_plan(key, plan: LaunchPlan) -> None:
    with _plans_lock:
        if len(_plans) >= MAX_PLANS:
            _plans.pop(next(iter(_plans), None), None)  # the oldest
        try:
            _plans[key] = plan
        except TypeError:
            pass


def clear_plans() -> None:
    with _plans_lock:
        _plans.clear()


def launch_now(spec, entry: str, device_id: int, stream: int, grid, block, args, shared: int = 0) -> None:
    """One launch, now (benchmarks and one-off kernels): pointer arguments are None, ints or
    ArrayDescs."""
    plan = PlanBuilder(device_id, "cupy", [])
    plan.launch(spec, entry, (tuple(grid) + (1, 1))[:3], (tuple(block) + (1, 1))[:3], args, shared)
    plan.build(cacheable=False).run([], stream)
