"""Framework-neutral array descriptors, output allocation and streams.

``describe`` reads pointer, shape, strides (in elements), dtype and device from any object that
speaks DLPack (CuPy, PyTorch, JAX, NumPy), without copying.  PyTorch tensors and NumPy arrays
take a fast path through their own attributes; everything else goes through the DLPack capsule,
which is read but never consumed (the producer keeps ownership).
"""
from __future__ import annotations

import ctypes
import dataclasses

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
        capsule = x.__dlpack__(stream=-1) if dev_type == KDL_CUDA else x.__dlpack__()
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
        raise TypeError(f"{name}: expected an array supporting DLPack (CuPy, PyTorch, JAX, NumPy), got {type(x).__name__}")
    return _from_dlpack(x, name)


# ---------------------------------------------------------------------------------------------
# Allocation: outputs and workspaces come from the framework of the inputs (torch inputs ->
# torch's caching allocator, so training never grows a second pool), or from a user allocator.

_user_allocator = None


def set_allocator(fn) -> None:
    """Route every device allocation through ``fn(shape, dtype_name, device_id) -> array``.

    The array must support DLPack (or be a torch tensor).  ``None`` restores the default.
    """
    global _user_allocator
    _user_allocator = fn


_TORCH_DTYPES = {}


def _torch_dtype(name: str):
    import torch

    if not _TORCH_DTYPES:
        _TORCH_DTYPES.update({"int8": torch.int8, "float16": torch.float16, "bfloat16": torch.bfloat16,
                              "float32": torch.float32, "float64": torch.float64, "int32": torch.int32,
                              "uint8": torch.uint8})
    return _TORCH_DTYPES[name]


def empty(shape, dtype: str, like: ArrayDesc) -> ArrayDesc:
    """Uninitialized device memory of ``dtype`` on ``like``'s device, from ``like``'s framework."""
    shape = tuple(int(s) for s in shape)
    if _user_allocator is not None:
        return describe(_user_allocator(shape, dtype, like.device_id), "allocator result")
    if like.framework == "torch":
        import torch

        return describe(torch.empty(shape, dtype=_torch_dtype(dtype), device=f"cuda:{like.device_id}"), "workspace")
    import cupy

    with cupy.cuda.Device(like.device_id):
        if dtype == "bfloat16":
            # CuPy has no bfloat16 dtype: hand out raw 16-bit storage.
            arr = cupy.empty(shape, dtype=cupy.uint16)
            d = describe(arr, "workspace")
            d.dtype = "bfloat16"
            return d
        return describe(cupy.empty(shape, dtype=dtype), "workspace")


def current_stream(desc: ArrayDesc) -> int:
    """The caller's current stream on ``desc``'s device: torch's for torch arrays, else CuPy's."""
    if desc.framework == "torch":
        import torch

        return torch.cuda.current_stream(desc.device_id).cuda_stream
    import cupy

    with cupy.cuda.Device(desc.device_id):
        return cupy.cuda.get_current_stream().ptr
