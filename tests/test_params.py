"""The host-kernel contract (kernels/params.cuh, sagebwd_cp/gpu/params.py): the host reads each kernel's
parameter list from the header and fills it by name."""
from __future__ import annotations

import re
import struct

import pytest

from sagebwd_cp.gpu import compiler, params
from sagebwd_cp.gpu.launch import PackedArgs, tensor_map
from sagebwd_cp.gpu.tensor_map import DTYPE_UINT8, TensorMapLayout

HEADER = """
#define SB_DEMO_FIELDS(F0, F) \\
    F0(const i8* __restrict__, a)   /* a pointer, comment, F(int, not_a_field) */ \\
    F(i64, stride) F(int, n) \\
    F(float, scale)
SB_STRUCT(Demo, SB_DEMO_FIELDS)
#define SB_OUTER_FIELDS(F0, F) F0(Demo, inner) F(int, count)
SB_STRUCT(Outer, SB_OUTER_FIELDS)
#define SB_MAPS(F0, F) F0(TensorMap, tm)
SB_PARAM_LIST(Maps, SB_MAPS)
"""


def test_lists_are_parsed_in_order_with_comments_ignored():
    lists = params.parse_lists(HEADER)
    assert lists["Demo"] == (("const i8* __restrict__", "a"), ("i64", "stride"), ("int", "n"), ("float", "scale"))
    assert lists["Outer"] == (("Demo", "inner"), ("int", "count"))
    assert lists["Maps"] == (("TensorMap", "tm"),)


def test_a_name_without_its_list_is_an_error():
    with pytest.raises(ValueError, match="SB_NOWHERE_FIELDS"):
        params.parse_lists("SB_STRUCT(Lost, SB_NOWHERE_FIELDS)\n")


def test_every_field_is_named_and_no_other(monkeypatch):
    monkeypatch.setattr(params, "lists", lambda: params.parse_lists(HEADER))
    with pytest.raises(TypeError, match=r"missing fields \['scale'\]"):
        params.args("Demo", a=None, stride=1, n=2)
    with pytest.raises(TypeError, match=r"unknown fields \['scal'\]"):
        params.args("Demo", a=None, stride=1, n=2, scale=1.0, scal=2.0)
    with pytest.raises(KeyError, match="Nope"):
        params.args("Nope")
    packed = PackedArgs(params.args("Demo", a=0x1234, stride=-3, n=7, scale=0.5))
    assert [packed.argument_bytes(i) for i in range(4)] == [struct.pack("<Q", 0x1234), struct.pack("<q", -3),
                                                           struct.pack("<i", 7), struct.pack("<f", 0.5)]
    inner = params.struct("Demo", a=0x10, stride=2, n=3, scale=1.0)
    outer = PackedArgs(params.args("Outer", inner=inner, count=5))
    assert outer.argument_bytes(0) == struct.pack("<QqifQ", 0x10, 2, 3, 1.0, 0)[:24]  # C layout: 24 bytes
    assert params.field(inner, "Demo", "n") == 3
    with pytest.raises(TypeError, match="Outer.inner"):
        params.args("Outer", inner=7, count=5)
    with pytest.raises(TypeError, match="Maps.tm"):
        params.args("Maps", tm=0)
    layout = TensorMapLayout(DTYPE_UINT8, (64, 128), (64,), (64, 64), 64)
    assert params.args("Maps", tm=tensor_map(layout, None))[0].kind == "tmap"


def test_the_kernel_header_lists_every_kernel_the_host_launches():
    lists = params.lists()
    assert {"ForwardParams", "BackwardParams", "BackwardMaps", "QuantizeJob", "QuantizeParams", "TokenSumParams",
            "RowStatsParams", "DqConvertParams", "PackRowsParams", "NaturalLseParams", "SmoothQBiasParams"} <= set(lists)
    for name in lists:  # every type converts: a zero argument list packs
        PackedArgs(params.args(name, **{n: _zero(t) for t, n in lists[name]}))
    # Each kernel declares its parameters from a list the host knows by name.
    named = set(re.findall(r"SB_(?:STRUCT|PARAM_LIST)\(\w+, (SB_\w+)\)",
                           (compiler.source_dirs()[0] / "params.cuh").read_text()))
    used = set()
    for path in compiler.source_dirs()[0].glob("*.cu"):
        used |= set(re.findall(r"SB_KERNEL_(?:PARAMS|MAPS)\((SB_\w+)\)", path.read_text()))
    assert "SB_FORWARD_FIELDS" in used and used <= named


def _zero(ctype):
    ctype = ctype.replace("__restrict__", "").strip()
    if ctype == "TensorMap":
        return tensor_map(TensorMapLayout(DTYPE_UINT8, (64, 128), (64,), (64, 64), 64), object())  # encoded per call
    if ctype in params.lists():
        return params.zeros(ctype)
    return None if ctype.endswith("*") else 0
