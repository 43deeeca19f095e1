"""TMA tensor maps (``CUtensorMap``) for the sm_90 kernels, encoded by the driver.

A ``TensorMapLayout`` is everything of a map but the global address: the element type, the
dimensions (innermost first), the byte strides of the outer ones, the box one load copies and the
shared-memory swizzle.  A launch plan holds the layout and encodes the 128-byte map per call, when
the array's address is known, straight into the kernel's argument buffer (``cuTensorMapEncodeTiled``
from ``libcuda``, through ctypes: CuPy does not bind it).  Elements outside the dimensions load as
zeros.
"""
from __future__ import annotations

import ctypes
import dataclasses

MAP_BYTES = 128  # sizeof(CUtensorMap)
MAP_ALIGN = 64  # alignof(CUtensorMap), also of the kernel parameter

# CUtensorMapDataType, CUtensorMapSwizzle (cuda.h)
DTYPE_UINT8, DTYPE_UINT16, DTYPE_FLOAT32 = 0, 1, 7
_DTYPE_BYTES = {DTYPE_UINT8: 1, DTYPE_UINT16: 2, DTYPE_FLOAT32: 4}
SWIZZLE_BYTES = {0: 0, 32: 1, 64: 2, 128: 3}
_L2_PROMOTION_128B = 2


@dataclasses.dataclass(frozen=True)
class TensorMapLayout:
    """A tiled tensor map without its address.  ``dims`` innermost first (elements); ``strides``
    the byte strides of dims[1:]; ``box`` the elements one load copies per dim; ``swizzle`` the
    shared-memory swizzle span in bytes (0, 32, 64 or 128)."""

    dtype: int
    dims: tuple
    strides: tuple
    box: tuple
    swizzle: int

    def __post_init__(self):
        rank, item = len(self.dims), _DTYPE_BYTES[self.dtype]
        if not (1 <= rank <= 5 and len(self.strides) == rank - 1 and len(self.box) == rank):
            raise ValueError(f"tensor map: rank {rank} with {len(self.strides)} strides and a {len(self.box)}-d box")
        if any(d < 1 or d > 2**32 for d in self.dims):
            raise ValueError(f"tensor map: dims {self.dims} must lie in [1, 2^32]")
        if any(s % 16 or s <= 0 or s >= 2**40 for s in self.strides):
            raise ValueError(f"tensor map: strides {self.strides} must be positive multiples of 16 bytes below 2^40")
        if any(b < 1 or b > 256 for b in self.box) or (self.box[0] * item) % 16:
            raise ValueError(f"tensor map: box {self.box} must be 1..256 per dim with 16-byte rows")
        if self.swizzle not in SWIZZLE_BYTES or (self.swizzle and self.box[0] * item > self.swizzle):
            raise ValueError(f"tensor map: a {self.box[0] * item}-byte box row does not fit swizzle {self.swizzle}")

    def encoder(self):
        """A function (out_address, global_address) writing the map of the array at
        ``global_address`` (16-byte aligned) to ``out_address``; a plan holds it for its calls."""
        return _encoder(self)


_libcuda = None


def _driver():
    global _libcuda
    if _libcuda is None:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuTensorMapEncodeTiled
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                       ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                       ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        _libcuda = fn
    return _libcuda


_encoders: dict = {}


def _encoder(layout: TensorMapLayout):
    """A function (out_address, global_address) -> None with the layout's arrays built once."""
    enc = _encoders.get(layout)
    if enc is None:
        rank = len(layout.dims)
        dims = (ctypes.c_uint64 * rank)(*layout.dims)
        strides = (ctypes.c_uint64 * max(1, rank - 1))(*layout.strides)
        box = (ctypes.c_uint32 * rank)(*layout.box)
        ones = (ctypes.c_uint32 * rank)(*([1] * rank))
        swizzle = SWIZZLE_BYTES[layout.swizzle]
        fn = _driver()

        def enc(out_address: int, global_address: int) -> None:
            if global_address % 16:
                raise ValueError(f"tensor map: global address {global_address:#x} is not 16-byte aligned")
            status = fn(out_address, layout.dtype, rank, global_address, dims, strides, box, ones, 0, swizzle,
                        _L2_PROMOTION_128B, 0)
            if status != 0:
                raise RuntimeError(f"cuTensorMapEncodeTiled failed (CUresult {status}) for {layout}")

        if len(_encoders) > 4096:
            _encoders.clear()
        enc = _encoders[layout] = enc
    return enc
