"""Kernel launches on the caller's stream, with arguments typed the way the kernels declare them."""
from __future__ import annotations

import numpy as np

from . import compiler
from .arrays import ArrayDesc

_streams: dict = {}
_device_limits: dict = {}


def ptr(x) -> np.uint64:
    """A device pointer argument; ``None`` is the null pointer."""
    if x is None:
        return np.uint64(0)
    return np.uint64(x.ptr if isinstance(x, ArrayDesc) else x)


def i32(x) -> np.int32:
    return np.int32(x)


def i64(x) -> np.int64:
    return np.int64(x)


def f32(x) -> np.float32:
    return np.float32(x)


def stream_object(stream_ptr: int):
    import warnings

    import cupy

    s = _streams.get(stream_ptr)
    if s is None:
        with warnings.catch_warnings():
            # Stream.from_external wants a __cuda_stream__ object; a raw handle is what we hold.
            warnings.simplefilter("ignore", DeprecationWarning)
            s = cupy.cuda.ExternalStream(stream_ptr)
        _streams[stream_ptr] = s
    return s


def memset_async(desc, nbytes: int, device_id: int, stream_ptr: int) -> None:
    import cupy

    with cupy.cuda.Device(device_id):
        cupy.cuda.runtime.memsetAsync(desc.ptr, 0, nbytes, stream_ptr)


def shared_memory_limit(device_id: int) -> int:
    """The device's opt-in shared memory per block, in bytes."""
    lim = _device_limits.get(device_id)
    if lim is None:
        import cupy

        lim = cupy.cuda.runtime.getDeviceProperties(device_id)["sharedMemPerBlockOptin"]
        _device_limits[device_id] = lim
    return lim


def launch(spec, entry, device_id, stream_ptr, grid, block, args, shared=0):
    import cupy

    fn = compiler.get_function(spec, entry, device_id, shared)
    with cupy.cuda.Device(device_id):
        fn(tuple(grid), tuple(block), tuple(args), shared_mem=shared, stream=stream_object(stream_ptr))
