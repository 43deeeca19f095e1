"""Kernel arguments packed once into the driver's format.

The arguments of one launch are laid out in one buffer, each value at its natural alignment (a
struct argument laid out as C lays out a struct), next to the array of pointers to them that
``cuLaunchKernel`` reads (``kernelParams``).  Pointer values that are only known per call (the
caller's arrays, the workspace) are written as 0 and listed in ``PackedArgs.symbolic``: a launch
plan (``plan.py``) rewrites just those words before each launch.  A TMA tensor map argument holds the
address of its array too; one whose array is only known per call is listed in
``PackedArgs.symbolic_maps`` and encoded by the plan per call.
"""
from __future__ import annotations

import ctypes
import struct
from typing import NamedTuple

import numpy as np

from ..arrays import ArrayDesc
from .tensor_map import MAP_ALIGN, MAP_BYTES, TensorMapLayout


class KernelArg(NamedTuple):
    """One kernel argument: ``kind`` is "ptr", "i32", "i64", "f32", "struct" (``value`` then holds
    the struct's fields, themselves KernelArgs, in declaration order) or "tmap" (``value`` is a
    (TensorMapLayout, pointer) pair: a CUtensorMap passed by value)."""

    kind: str
    value: object


_SCALAR_FORMATS = {"ptr": "<Q", "i32": "<i", "i64": "<q", "f32": "<f"}


def ptr(x) -> KernelArg:
    """A device pointer: ``None`` (null), an int, an ArrayDesc, or a plan's symbolic pointer."""
    return KernelArg("ptr", x)


def i32(x) -> KernelArg:
    return KernelArg("i32", int(x))


def i64(x) -> KernelArg:
    return KernelArg("i64", int(x))


def f32(x) -> KernelArg:
    # Rounded to float32 once, as NumPy rounds (inf rather than an error past the float32 range).
    with np.errstate(over="ignore"):
        return KernelArg("f32", float(np.float32(x)))


def struct_arg(*fields: KernelArg) -> KernelArg:
    return KernelArg("struct", tuple(fields))


def tensor_map(layout: TensorMapLayout, pointer) -> KernelArg:
    """A TMA tensor map of the array at ``pointer`` (anything ``ptr`` takes)."""
    return KernelArg("tmap", (layout, pointer))


def _concrete_pointer(value):
    """The address of a pointer value known now (None, an int or an ArrayDesc), else None."""
    if value is None or isinstance(value, (int, np.integer)):
        return int(value or 0)
    if isinstance(value, ArrayDesc):
        return value.ptr
    return None


def _size_align(arg: KernelArg) -> tuple:
    if arg.kind == "tmap":
        return MAP_BYTES, MAP_ALIGN
    if arg.kind != "struct":
        size = struct.calcsize(_SCALAR_FORMATS[arg.kind])
        return size, size
    pos, align = 0, 1
    for field in arg.value:
        size, a = _size_align(field)
        pos = -(-pos // a) * a + size
        align = max(align, a)
    return -(-pos // align) * align, align


class PackedArgs:
    """The arguments of one launch in ``kernelParams`` form.

    ``offsets[i]`` and ``sizes[i]`` locate argument i from ``base`` (the buffer's address, 64-byte
    aligned for tensor maps); ``params_ptr`` is the address of the pointer array for the driver;
    ``words`` views the arguments as 64-bit words, and ``symbolic`` lists ``(word index, value)`` for
    each pointer whose value is neither None, an int nor an ArrayDesc (written as 0 here, for a plan
    to fill in per call); ``symbolic_maps`` lists ``(byte offset, layout, value)`` for each tensor
    map whose pointer is such a value."""

    def __init__(self, args):
        self.offsets, self.sizes, fields = [], [], []
        pos = 0
        for arg in args:
            size, align = _size_align(arg)
            pos = -(-pos // align) * align
            self.offsets.append(pos)
            self.sizes.append(size)
            self._flatten(arg, pos, fields)
            pos += size
        self.nbytes = pos
        size = max(8, -(-pos // 8) * 8)
        self.buffer = ctypes.create_string_buffer(size + MAP_ALIGN)
        self._pad = -ctypes.addressof(self.buffer) % MAP_ALIGN
        self.base = ctypes.addressof(self.buffer) + self._pad
        self.params = (ctypes.c_void_p * max(1, len(args)))(*(self.base + off for off in self.offsets))
        self.params_ptr = ctypes.addressof(self.params)
        self.words = memoryview(self.buffer).cast("B")[self._pad:self._pad + size].cast("Q")
        self.symbolic, self.symbolic_maps = [], []
        for offset, kind, value in fields:
            if kind == "tmap":
                layout, pointer = value
                address = _concrete_pointer(pointer)
                if address is None:
                    self.symbolic_maps.append((offset, layout, pointer))
                else:
                    layout.encoder()(self.base + offset, address)
                continue
            if kind == "ptr":
                address = _concrete_pointer(value)
                if address is None:
                    self.symbolic.append((offset // 8, value))
                value = address or 0
            struct.pack_into(_SCALAR_FORMATS[kind], self.buffer, self._pad + offset, value)

    @staticmethod
    def _flatten(arg: KernelArg, offset: int, out: list) -> None:
        if arg.kind != "struct":
            out.append((offset, arg.kind, arg.value))
            return
        pos = 0
        for field in arg.value:
            size, align = _size_align(field)
            pos = -(-pos // align) * align
            PackedArgs._flatten(field, offset + pos, out)
            pos += size

    def argument_bytes(self, index: int) -> bytes:
        """The bytes the driver copies for argument ``index``."""
        start = self._pad + self.offsets[index]
        return self.buffer.raw[start:start + self.sizes[index]]


_cuda_modules = None


def cuda() -> tuple:
    """(cupy.cuda.runtime, cupy.cuda.driver), imported once (not per call)."""
    global _cuda_modules
    if _cuda_modules is None:
        from cupy.cuda import driver, runtime

        _cuda_modules = runtime, driver
    return _cuda_modules


GRID_YZ_LIMIT = 65535  # CUDA's largest gridDim.y and gridDim.z

# An attention kernel's grid orders (kernels/backward_common.cuh backward_cell; the causal forward is
# HEADS_BATCH_FIRST). The hardware starts CTAs x first, then y, then z.
BLOCKS_FIRST = 0        # (blocks, heads, batch): a head's CTAs start together and share its tiles in L2
HEADS_FIRST = 1         # (heads, blocks, batch): a batch entry's heads go block by block
HEADS_BATCH_FIRST = 2   # (heads, batch, blocks): every (head, batch entry)'s first block before any one's second


def attention_grid(tokens: int, block: int, heads: int, batch: int, order: int, arg: str, parts: int = 1) -> tuple:
    """The grid of an attention kernel in ``order``. Under a causal mask a head's blocks differ in work
    and the kernels start the heaviest first; the heads-first orders start the heavy blocks of many heads
    before the light ones, so that the grid ends without a tail of heavy CTAs that started last
    (docs/history/PERFORMANCE_LOG.md, causal grids). The kernels read block, head and batch entry from
    the matching axes. ``tokens`` of ``arg`` make blocks of ``block``, each ``parts`` CTAs next to one
    another on the blocks' axis (block index · parts + part)."""
    blocks = (tokens + block - 1) // block * parts
    if order != BLOCKS_FIRST and blocks > GRID_YZ_LIMIT:
        raise ValueError(f"{arg}: causal attention takes at most {GRID_YZ_LIMIT // parts * block} tokens "
                         f"({GRID_YZ_LIMIT // parts} blocks of {block}), got {tokens}")
    if heads > GRID_YZ_LIMIT and order == BLOCKS_FIRST or batch > GRID_YZ_LIMIT:
        raise ValueError(f"{arg}: at most {GRID_YZ_LIMIT} heads and {GRID_YZ_LIMIT} batch entries, "
                         f"got {heads} heads and batch {batch}")
    return {BLOCKS_FIRST: (blocks, heads, batch), HEADS_FIRST: (heads, blocks, batch),
            HEADS_BATCH_FIRST: (heads, batch, blocks)}[order]
