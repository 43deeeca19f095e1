"""Framework-neutral array descriptors, output allocation and streams.

``describe`` reads pointer, shape, strides (in elements), dtype and device from any object that
speaks DLPack (CuPy, PyTorch, JAX, NumPy), without copying.  PyTorch tensors and NumPy arrays
take a fast path through their own attributes; everything else goes through the DLPack capsule,
which is read but never consumed (the producer keeps ownership).
"""
from __future__ import annotations

import ctypes
import dataclasses
import sys

import numpy as np

# DLPack device types and dtype codes (dlpack.h)
KDL_CPU, KDL_CUDA, KDL_CUDA_HOST = 1, 2, 3
_DL_CODES = {(0, 8): "int8", (0, 32): "int32", (1, 8): "uint8", (1, 16): "uint16", (2, 16): "float16",
             (2, 32): "float32", (2, 64): "float64", (4, 16): "bfloat16", (6, 8): "bool"}


@dataclasses.dataclass
class ArrayDesc:
    """What a kernel needs to know about an array; ``obj`` keeps the memory alive."""

    ptr: int
    shape: tuple
    strides: tuple  # in elements
    dtype: str
    device_type: str  # "cuda" or "cpu"
    device_id: int
    obj: object  # the array itself
    framework: str  # "torch", "cupy", "numpy", "jax" or "dlpack"
    keepalive: object = None  # a DLPack capsule read but not consumed

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_cuda(self) -> bool:
        return self.device_type == "cuda"


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_get_name = ctypes.pythonapi.PyCapsule_GetName
_get_name.restype = ctypes.c_char_p
_get_name.argtypes = [ctypes.py_object]


def _framework(x) -> str:
    mod = type(x).__module__.split(".")[0]
    if mod in ("torch", "cupy", "numpy", "jax", "jaxlib"):
        return "jax" if mod == "jaxlib" else mod
    return "dlpack"


def _from_torch(x, name: str) -> ArrayDesc:
    dtype = str(x.dtype).replace("torch.", "")
    dev = x.device
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"{name}: expected a CUDA or CPU tensor, got device {dev}")
    return ArrayDesc(x.data_ptr(), tuple(x.shape), tuple(x.stride()), dtype, dev.type,
                     dev.index if dev.index is not None else 0, x, "torch")


def _from_numpy(x: np.ndarray, name: str) -> ArrayDesc:
    item = x.dtype.itemsize
    if any(s % item for s in x.strides):
        raise ValueError(f"{name}: strides must be multiples of the element size, got {x.strides}")
    dtype = x.dtype.name
    return ArrayDesc(x.ctypes.data, x.shape, tuple(s // item for s in x.strides), dtype, "cpu", 0, x, "numpy")


def _from_dlpack(x, name: str) -> ArrayDesc:
    dev_type, dev_id = x.__dlpack_device__() if hasattr(x, "__dlpack_device__") else (KDL_CPU, 0)
    try:
        # stream=-1: the producer must not synchronize; the kernels run on the caller's stream.
        # JAX has no current stream and takes any integer as one to wait on: see _jax_stream.
        if dev_type == KDL_CUDA:
            capsule = x.__dlpack__(stream=-1 if _framework(x) != "jax" else _jax_stream(dev_id))
        else:
            capsule = x.__dlpack__()
    except TypeError:
        capsule = x.__dlpack__()
    cname = _get_name(capsule)
    if cname != b"dltensor":
        raise ValueError(f"{name}: unsupported DLPack capsule {cname!r}")
    # DLManagedTensor starts with its DLTensor (the versioned capsule has another name).
    t = _DLTensor.from_address(_get_pointer(capsule, cname))
    if t.dtype.lanes != 1 or (t.dtype.code, t.dtype.bits) not in _DL_CODES:
        raise TypeError(f"{name}: unsupported DLPack dtype (code {t.dtype.code}, bits {t.dtype.bits})")
    dtype = _DL_CODES[(t.dtype.code, t.dtype.bits)]
    shape = tuple(t.shape[i] for i in range(t.ndim))
    if t.strides:
        strides = tuple(t.strides[i] for i in range(t.ndim))
    else:
        strides, acc = [], 1
        for s in reversed(shape):
            strides.insert(0, acc)
            acc *= s
        strides = tuple(strides)
    dtype_name = {KDL_CUDA: "cuda", KDL_CPU: "cpu", KDL_CUDA_HOST: "cpu"}.get(t.device.device_type)
    if dtype_name is None:
        raise ValueError(f"{name}: expected a CUDA or CPU array, got DLPack device type {t.device.device_type}")
    ptr = (t.data or 0) + t.byte_offset
    return ArrayDesc(ptr, shape, strides, dtype, dtype_name, t.device.device_id, x, _framework(x), capsule)


# ---------------------------------------------------------------------------------------------
# Argument checks of the public functions: every array argument is an array, all from one
# framework (results come back in q's, so a mix has no one answer), each error naming the argument.

FRAMEWORK_NAMES = {"torch": "torch", "numpy": "NumPy", "cupy": "CuPy", "jax": "JAX", "dlpack": "DLPack"}
_NOT_AN_ARRAY = "expected an array supporting DLPack (CuPy, PyTorch, JAX, NumPy)"
_frameworks: dict = {}  # type -> its framework, "" for a type that is not an array


def framework_of(x) -> str:
    """The framework of an array argument ("torch", "numpy", "cupy", "jax", or "dlpack" for any other
    object with ``__dlpack__``; an ArrayDesc's own), or "" for an object that is not an array."""
    if x.__class__ is ArrayDesc:
        return x.framework
    kind = _frameworks.get(type(x))
    if kind is None:
        if isinstance(x, np.ndarray):
            kind = "numpy"
        elif _framework(x) == "torch":
            kind = "torch" if hasattr(x, "data_ptr") else ""  # torch.Size, dtypes and devices are no arrays
        else:
            kind = _framework(x) if hasattr(type(x), "__dlpack__") else ""
        _frameworks[type(x)] = kind
    return kind


def what_came(x) -> str:
    """A short description of an argument for error messages: its kind, dtype and shape for an
    array, its type and value otherwise."""
    if x is None:
        return "None"
    kind = framework_of(x)
    if kind:
        if isinstance(x, ArrayDesc):
            return f"an ArrayDesc of a {FRAMEWORK_NAMES[kind]} {x.dtype} array of shape {tuple(x.shape)}"
        if kind == "dlpack":
            return f"a {type(x).__module__}.{type(x).__qualname__}"
        dtype = getattr(x, "dtype", None)
        dtype = "" if dtype is None else str(dtype).replace("torch.", "") + " "
        text = f"a {FRAMEWORK_NAMES[kind]} {dtype}{'tensor' if kind == 'torch' else 'array'}"
        try:
            return text + f" of shape {tuple(x.shape)}"
        except (AttributeError, TypeError):
            return text
    value = repr(x)
    return f"{type(x).__name__} {value if len(value) <= 40 else value[:37] + '...'}"


_split_names: dict = {}  # "q, k, v" -> ("q", "k", "v")


def array_namespace(x, name: str = "array"):
    """The module whose functions compute on ``x``: numpy, torch, cupy or jax.numpy (the elementwise helpers
    around the kernels, chunked.py and sinks.py, are written once for them; JAX's traced arrays too)."""
    mod = type(x).__module__.split(".")[0]
    if mod in ("jax", "jaxlib"):
        import jax.numpy

        return jax.numpy
    if mod == "numpy":
        return np
    if mod == "torch":
        import torch

        return torch
    if mod == "cupy":
        import cupy

        return cupy
    raise TypeError(f"{name}: expected a NumPy array, a torch tensor, a CuPy or a JAX array, got {type(x).__name__}")


def as_dtype(xp, x, dtype):
    """``x`` as ``dtype`` (a name, or another array's dtype) in namespace ``xp``."""
    if isinstance(dtype, str):
        dtype = getattr(xp, dtype)
    if xp.__name__ == "torch":
        return x.to(dtype)
    return xp.asarray(x, dtype=dtype)


def check_arrays(names: str, *arrays, optional: tuple = ()) -> str:
    """The one framework of a public function's array arguments (``names``: theirs, comma-separated,
    in order; None is taken for those in ``optional``).  TypeError naming the first argument that is
    not an array, or whose framework is not the first array's."""
    split = _split_names.get(names)
    if split is None:
        split = _split_names[names] = tuple(names.split(", "))
    first = first_name = None
    for name, x in zip(split, arrays):
        if x is None and name in optional:
            continue
        kind = x.framework if x.__class__ is ArrayDesc else _frameworks.get(x.__class__) or framework_of(x)
        if not kind:
            raise TypeError(f"{name}: {_NOT_AN_ARRAY}, got {what_came(x)}")
        if first is None:
            first, first_name = kind, name
        elif kind != first:
            raise TypeError(f"{name}: expected a {FRAMEWORK_NAMES[first]} array like {first_name}, got "
                            f"{what_came(x)}; the arrays of one call come from one framework")
    return first


def check_rank(x, name: str, dims: tuple) -> None:
    """ValueError unless array ``x`` has one dimension per name in ``dims``."""
    if len(x.shape) != len(dims):
        raise ValueError(f"{name}: expected a rank-{len(dims)} array ({', '.join(dims)}), got shape {tuple(x.shape)}")


def layout_dims(layout: str) -> tuple:
    """The dimensions of a dense q, k, v or output in ``layout`` ("HND" or "NHD")."""
    return ("batch", "heads", "seqlen", "head_dim") if layout == "HND" else ("batch", "seqlen", "heads", "head_dim")


def array_list(xs, name: str) -> list:
    """A sequence argument of arrays (chunks of keys, outputs to merge) as a list: TypeError for an
    array, None, a string or a mapping in its place (the elements are checked by check_arrays)."""
    if xs is None or framework_of(xs) or isinstance(xs, (str, bytes, dict)) or not hasattr(xs, "__iter__"):
        raise TypeError(f"{name}: expected a list or tuple of arrays, got {what_came(xs)}")
    return list(xs)


def describe(x, name: str = "array") -> ArrayDesc:
    """An ``ArrayDesc`` for ``x`` (no copy).  Raises TypeError for objects that are not arrays."""
    if isinstance(x, ArrayDesc):
        return x
    fw = _framework(x)
    if fw == "torch":
        return _from_torch(x, name)
    if isinstance(x, np.ndarray):
        return _from_numpy(x, name)
    if not hasattr(x, "__dlpack__"):
        raise TypeError(f"{name}: {_NOT_AN_ARRAY}, got {what_came(x)}")
    return _from_dlpack(x, name)


# ---------------------------------------------------------------------------------------------
# Host arrays: what the CPU emulator reads, and its results in the caller's framework and dtype.

_HOST_NUMPY_DTYPES = {"float16": np.float16, "float32": np.float32, "float64": np.float64}


def host_numpy(desc: ArrayDesc, name: str) -> np.ndarray:
    """The host array behind ``desc`` as NumPy, without a copy where NumPy can read it.  A torch
    tensor is read detached (the neutral API computes no autograd graph: ``sagebwd_cp.torch`` does),
    and a bfloat16 one, which NumPy lacks, as a float32 copy."""
    obj = desc.obj
    if isinstance(obj, np.ndarray):
        return obj
    if desc.framework == "torch":
        t = obj.detach()
        return (t.float() if desc.dtype == "bfloat16" else t).numpy()
    try:
        return np.from_dlpack(obj)
    except (BufferError, TypeError, RuntimeError, ValueError) as exc:
        raise TypeError(f"{name}: NumPy cannot read this {desc.framework} {desc.dtype} host array through "
                        f"DLPack ({exc}); pass a NumPy array or a torch tensor") from None


def host_result(x: np.ndarray, like: ArrayDesc, dtype: str):
    """A host result in ``like``'s framework and ``dtype``: a torch CPU tensor for torch inputs
    (bfloat16 included), else a NumPy array (bfloat16, which NumPy lacks, as float32)."""
    if like.framework == "torch":
        return sys.modules["torch"].from_numpy(np.ascontiguousarray(x)).to(_torch_dtype(dtype))
    return np.ascontiguousarray(x, dtype=_HOST_NUMPY_DTYPES.get(dtype, np.float32))


def copy_into(dst: ArrayDesc, src) -> None:
    """Write a host result into the caller's ``out`` array (NumPy or a torch CPU tensor)."""
    if dst.framework == "torch":
        torch = sys.modules["torch"]
        with torch.no_grad():  # ``out`` may require grad; the neutral API records no graph
            dst.obj.copy_(src if isinstance(src, torch.Tensor) else torch.from_numpy(src))
    else:
        np.copyto(host_numpy(dst, "out"), src)


# ---------------------------------------------------------------------------------------------
# Per-call reads for the launch-plan cache: what ``describe`` would read, straight from the
# attributes of the common array types.

def _torch_signature(x):
    p = x.data_ptr()
    return p, (x.shape, x.stride(), x.dtype, x.get_device(), p % 16)


def _cupy_signature(x):
    p = x.data.ptr
    return p, (x.shape, x.strides, x.dtype, x.data.device_id, p % 16)


def _desc_signature(x):
    p = x.ptr
    return p, (x.shape, x.strides, x.dtype, x.device_type, x.device_id, x.framework, p % 16)


_signature_readers: dict = {}


def _pick_signature_reader(x):
    if isinstance(x, ArrayDesc):
        return _desc_signature
    fw = _framework(x)
    if fw == "torch" and hasattr(x, "data_ptr"):
        return _torch_signature
    if fw == "cupy" and hasattr(x, "data") and hasattr(x, "strides"):
        return _cupy_signature
    return None


def signature(x):
    """``(pointer, key)`` for a torch tensor, a CuPy array or an ArrayDesc: ``key`` holds everything
    ``describe`` reads but the pointer (shape, strides, dtype, device; type-specific values, so equal
    keys mean equal descriptors) plus the pointer's alignment mod 16.  ``None`` for other objects."""
    reader = _signature_readers.get(type(x), False)
    if reader is False:
        reader = _signature_readers[type(x)] = _pick_signature_reader(x)
    return reader(x) if reader is not None else None


# ---------------------------------------------------------------------------------------------
# Allocation: outputs and workspaces come from the framework of the inputs (torch inputs ->
# torch's caching allocator, so training never grows a second pool), or from a user allocator.

_user_allocator = None


def set_allocator(fn) -> None:
    """Route every device allocation through ``fn(shape, dtype_name, device_id) -> array``.

    The array must be contiguous, start 16-byte aligned and support DLPack (or be a torch tensor).  Workspaces are
    dropped while kernels queued on the current stream may still read them: ``fn`` must hand out
    freed memory in stream order (as torch's caching allocator and CuPy's pool do).  ``None``
    restores the default.
    """
    global _user_allocator
    _user_allocator = fn


_TORCH_DTYPES = {}
_TORCH_DEVICES = {}


def _torch_dtype(name: str):
    import torch

    if not _TORCH_DTYPES:
        _TORCH_DTYPES.update({"int8": torch.int8, "float16": torch.float16, "bfloat16": torch.bfloat16,
                              "float32": torch.float32, "float64": torch.float64, "int32": torch.int32,
                              "uint8": torch.uint8})
    return _TORCH_DTYPES[name]


def _torch_device(device_id: int):
    dev = _TORCH_DEVICES.get(device_id)
    if dev is None:
        import torch

        dev = _TORCH_DEVICES[device_id] = torch.device("cuda", device_id)
    return dev


def contiguous_strides(shape) -> tuple:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


def allocate(shape: tuple, dtype: str, framework: str, device_id: int):
    """``(array, pointer)``: uninitialized contiguous device memory of ``dtype`` on ``device_id``, from
    the user allocator if one is set, else torch's caching allocator for ``framework`` "torch", else
    CuPy's pool (bfloat16 as raw 16-bit storage: CuPy has no bfloat16 dtype)."""
    if _user_allocator is not None:
        d = describe(_user_allocator(shape, dtype, device_id), "allocator result")
        if tuple(d.shape) != shape or d.strides != contiguous_strides(shape):
            raise ValueError(f"allocator result: expected a contiguous array of shape {shape}, got shape "
                             f"{tuple(d.shape)} and strides {d.strides}")
        if d.ptr % 16:  # the kernels store 16-byte vectors into outputs and workspaces
            raise ValueError(f"allocator result: expected a 16-byte aligned pointer, got {d.ptr:#x}")
        return d.obj, d.ptr
    if framework == "torch":
        # Every output of every call comes here: the dtype and device objects from their caches,
        # torch from sys.modules (the first call's _torch_dtype imported it), and the sizes as
        # separate arguments, which torch parses faster than one tuple (~0.4 µs per allocation).
        tdtype, device = _TORCH_DTYPES.get(dtype), _TORCH_DEVICES.get(device_id)
        if tdtype is None or device is None:
            tdtype, device = _torch_dtype(dtype), _torch_device(device_id)
        t = sys.modules["torch"].empty(*shape, dtype=tdtype, device=device)
        return t, t.data_ptr()
    import cupy

    with cupy.cuda.Device(device_id):
        arr = cupy.empty(shape, dtype=cupy.uint16 if dtype == "bfloat16" else dtype)
    return arr, arr.data.ptr


def empty(shape, dtype: str, like: ArrayDesc) -> ArrayDesc:
    """Uninitialized device memory of ``dtype`` on ``like``'s device, from ``like``'s framework."""
    shape = tuple(int(s) for s in shape)
    obj, _ = allocate(shape, dtype, like.framework, like.device_id)
    d = describe(obj, "workspace")
    if _user_allocator is None and like.framework != "torch" and dtype == "bfloat16":
        d.dtype = "bfloat16"
    return d


def byte_view(buffer, byte_offset: int, shape: tuple, dtype: str) -> ArrayDesc:
    """An ArrayDesc of ``shape`` and ``dtype`` over bytes of a 1-D uint8 ``buffer`` from ``allocate``
    (a torch tensor or a CuPy array), its ``obj`` a view of the buffer's framework."""
    shape = tuple(int(s) for s in shape)
    if _framework(buffer) == "torch":
        nbytes = int(np.prod(shape)) * _torch_dtype(dtype).itemsize
        view = buffer[byte_offset:byte_offset + nbytes].view(_torch_dtype(dtype)).view(shape)
        return describe(view, "workspace")
    if _framework(buffer) == "cupy":
        import cupy

        arr = cupy.ndarray(shape, dtype=cupy.uint16 if dtype == "bfloat16" else dtype, memptr=buffer.data + byte_offset)
        d = describe(arr, "workspace")
        d.dtype = dtype
        return d
    raise TypeError(f"workspace: expected a torch tensor or a CuPy array to view, got {type(buffer).__name__}")


def stream_reader(framework: str):
    """``read(device_id) -> stream handle``: the caller's current stream on a device, torch's for torch
    arrays, else CuPy's."""
    if framework == "torch":
        import torch

        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what torch.compile's code uses
        if raw is not None:
            return raw
        return lambda device_id: torch.cuda.current_stream(device_id).cuda_stream

    def cupy_stream(device_id):
        import cupy

        return cupy.cuda.get_current_stream(device_id).ptr

    return cupy_stream


def current_stream(desc: ArrayDesc) -> int:
    """The caller's current stream on ``desc``'s device: torch's for torch arrays, else CuPy's."""
    return stream_reader(desc.framework)(desc.device_id)


# ---------------------------------------------------------------------------------------------
# JAX arrays through the neutral API.  JAX has no current stream: the kernels run on CuPy's, and
# the DLPack handshake orders them both ways.  In: ``__dlpack__(stream=S)`` makes S wait until
# JAX has written the array.  Out: the CuPy arrays the library allocates go to JAX through
# ``jax.dlpack.from_dlpack``, which hands CuPy JAX's stream to make wait for S.  No copies.

def _jax_stream(device_id: int) -> int:
    """The DLPack stream argument for a JAX array on a device: CuPy's current stream, where the
    kernels will run.  JAX passes it to cuStreamWaitEvent as it is, so -1 ("do not synchronize"
    in the DLPack protocol) fails there with CUDA_ERROR_INVALID_HANDLE; CuPy's null stream
    (handle 0, which DLPack reserves) is the legacy default stream, DLPack's and CUDA's 1."""
    return stream_reader("jax")(device_id) or 1


# Capsules of JAX arrays that queued kernels may still read, with an event recorded after those
# kernels: JAX does not see that use, and could reuse the memory of an array deleted meanwhile.
_jax_pending: list = []


def _retain_until_done(descs: list, device_id: int) -> None:
    import cupy

    while _jax_pending and _jax_pending[0][0].done:  # in recording order, so the oldest first
        _jax_pending.pop(0)
    with cupy.cuda.Device(device_id):
        event = cupy.cuda.Event(block=False, disable_timing=True)
        event.record()
    _jax_pending.append((event, descs))


class _CupyToJax:
    """A CuPy array as JAX's ``from_dlpack`` reads it: CuPy's capsule, with bfloat16 restored where
    CuPy holds it as uint16 (the capsule is patched before JAX consumes it; the bits are the same)."""

    def __init__(self, arr, bfloat16: bool):
        self._arr, self._bfloat16 = arr, bfloat16

    def __dlpack_device__(self):
        return self._arr.__dlpack_device__()

    def __dlpack__(self, *, stream=None, max_version=None, **_):
        kwargs = {} if max_version is None else {"max_version": max_version}
        capsule = self._arr.__dlpack__(stream=stream, **kwargs)  # CuPy makes `stream` wait for its own
        if self._bfloat16:
            cname = _get_name(capsule)
            # DLManagedTensorVersioned puts version, manager_ctx, deleter and flags (32 bytes) first.
            offset = {b"dltensor": 0, b"dltensor_versioned": 32}[cname]
            t = _DLTensor.from_address(_get_pointer(capsule, cname) + offset)
            t.dtype.code = 4  # kDLBfloat
        return capsule


def is_jax_array(x) -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(x, jax.Array)


def _to_jax(obj, dtype: str, like: ArrayDesc):
    """A JAX array over an array the library returned (no copy on a GPU)."""
    import jax
    import jax.dlpack

    if isinstance(obj, np.ndarray):  # the emulator's output, on the host
        return jax.device_put(obj, jax.devices("cpu")[like.device_id])
    import cupy

    with cupy.cuda.Device(like.device_id):
        return jax.dlpack.from_dlpack(_CupyToJax(obj, dtype == "bfloat16" and obj.dtype == np.uint16))


def _jax_tracer_type(jax):
    tracer = getattr(jax.core, "Tracer", None)
    if tracer is None:
        from jax._src.core import Tracer as tracer
    return tracer


def jax_boundary(fn):
    """Lets ``fn`` (a public function of the API) take and return JAX arrays: JAX arguments are
    described once (with the stream handshake), outputs become JAX arrays, and the JAX arguments
    stay referenced until the launched kernels are done.  Other calls go straight through."""
    import functools
    import inspect

    params = inspect.signature(fn).parameters
    names = list(params)
    # ``out=`` (keyword-only) is a buffer to write; attention_backward_arrays' ``out`` is an input.
    writes_out = "out" in params and params["out"].kind == inspect.Parameter.KEYWORD_ONLY

    @functools.wraps(fn)
    def call(*args, **kwargs):
        jax = sys.modules.get("jax")
        if jax is None or not any(isinstance(a, jax.Array) for a in (*args, *kwargs.values())):
            return fn(*args, **kwargs)
        descs = []

        def take(x, name):
            if isinstance(x, _jax_tracer_type(jax)):
                raise TypeError(f"{name}: got a traced JAX array (inside jax.jit, grad or vmap); the neutral API "
                                "runs on concrete arrays, use sagebwd_cp.jax.attention there")
            if not isinstance(x, jax.Array):
                return x
            if name == "out" and writes_out:
                raise ValueError("out: JAX arrays are immutable and cannot be written in place; pass out=None")
            d = describe(x, name)
            descs.append(d)
            return d

        args = [take(a, names[i] if i < len(names) else "array") for i, a in enumerate(args)]
        kwargs = {n: take(a, n) for n, a in kwargs.items()}
        result = fn(*args, **kwargs)
        like, done = descs[0], {}

        def give(x, dtype=None):
            if x is None or is_jax_array(x):
                return x
            if id(x) not in done:
                done[id(x)] = _to_jax(x, dtype or like.dtype, like)
            return done[id(x)]

        def give_all(r):
            if isinstance(r, tuple):
                return tuple(give_all(x) for x in r)
            if isinstance(r, ArrayDesc) or not dataclasses.is_dataclass(r):
                return give(r)
            # A saved state: its arrays' descriptors now hold the JAX arrays (same memory).
            return dataclasses.replace(r, **{
                f.name: dataclasses.replace(d, obj=give(d.obj, d.dtype), framework="jax", keepalive=d.obj)
                for f in dataclasses.fields(r) for d in [getattr(r, f.name)]
                if isinstance(d, ArrayDesc) and not is_jax_array(d.obj)})

        result = give_all(result)
        if like.is_cuda:
            _retain_until_done(descs, like.device_id)
        return result

    return call
