"""The kernels' parameter lists, read from their one definition in ``kernels/params.cuh``.

There each kernel's parameters are an X-macro list of ``F(type, name)`` entries, named for the host by
``SB_STRUCT(Name, SB_..._FIELDS)`` (the kernel also reads them through that struct) or
``SB_PARAM_LIST(Name, ...)``.  This module parses the lists once and turns keyword fields into the
kernel's arguments in list order (``args``), or into a struct argument for a struct-typed field
(``struct``): every field must be named, no other may be, and each is converted by its C type
(pointers, ``i64``, ``int``, ``float``, ``TensorMap``, or a struct of the file), so the host and the
kernels cannot disagree on order, type or layout.
"""
from __future__ import annotations

import functools
import re

from .compiler import source_dirs
from .launch import KernelArg, f32, i32, i64, ptr, struct_arg

HEADER = "params.cuh"
_LIST = re.compile(r"#define\s+(SB_\w+)\(F0,\s*F\)((?:[^\n]*\\\n)*[^\n]*)")
_ENTRY = re.compile(r"\bF0?\(\s*([^,()]+?)\s*,\s*(\w+)\s*\)")
_NAMED = re.compile(r"^SB_(?:STRUCT|PARAM_LIST)\(\s*(\w+)\s*,\s*(SB_\w+)\s*\)", re.MULTILINE)
_SCALARS = {"i64": i64, "int": i32, "float": f32}


def _strip_comments(text: str) -> str:
    return re.sub(r"/\*.*?\*/", "", text, flags=re.DOTALL)


def parse_lists(text: str) -> dict:
    """{name: ((C type, field name), ...)} of every list a params header names."""
    text = _strip_comments(text)
    lists = {macro: tuple(_ENTRY.findall(body)) for macro, body in _LIST.findall(text)}
    named = {}
    for name, macro in _NAMED.findall(text):
        if macro not in lists:
            raise ValueError(f"{HEADER}: {name} names the list {macro}, which is not defined")
        named[name] = lists[macro]
    return named


@functools.lru_cache(maxsize=None)
def lists() -> dict:
    for d in source_dirs():
        path = d / HEADER
        if path.is_file():
            return parse_lists(path.read_text())
    raise FileNotFoundError(f"kernel header {HEADER!r} not found")


def _c_type(ctype: str) -> str:
    return ctype.replace("__restrict__", "").strip()


def _convert(ctype: str, value, where: str) -> KernelArg:
    ctype = _c_type(ctype)
    if ctype.endswith("*"):
        return ptr(value)
    if ctype in _SCALARS:
        return _SCALARS[ctype](value)
    if ctype == "TensorMap":
        if not isinstance(value, KernelArg) or value.kind != "tmap":
            raise TypeError(f"{where}: expected a tensor map (launch.tensor_map), got {value!r}")
        return value
    if ctype in lists():
        if not isinstance(value, KernelArg) or value.kind != "struct":
            raise TypeError(f"{where}: expected a {ctype} (params.struct), got {value!r}")
        return value
    raise TypeError(f"{where}: {HEADER} type {ctype!r} has no host conversion")


def args(name: str, **fields) -> list:
    """The kernel arguments of list ``name`` of params.cuh, its fields given by name (all of them)."""
    layout = lists().get(name)
    if layout is None:
        raise KeyError(f"{HEADER} defines no parameter list {name!r}; it has {sorted(lists())}")
    names = [n for _, n in layout]
    missing, unknown = [n for n in names if n not in fields], sorted(set(fields) - set(names))
    if missing or unknown:
        raise TypeError(f"{name}: missing fields {missing}, unknown fields {unknown}")
    return [_convert(ctype, fields[n], f"{name}.{n}") for ctype, n in layout]


def struct(name: str, **fields) -> KernelArg:
    """Struct ``name`` of params.cuh as one argument (a struct-typed field), its fields given by name."""
    return struct_arg(*args(name, **fields))


def zeros(name: str) -> KernelArg:
    """Struct ``name`` with every field zero (null pointers): an absent item, e.g. an unused QuantizeJob."""
    def zero(ctype):
        ctype = _c_type(ctype)
        return None if ctype.endswith("*") else zeros(ctype) if ctype in lists() else 0

    return struct(name, **{n: zero(ctype) for ctype, n in lists()[name]})


def field(arg: KernelArg, name: str, field_name: str):
    """The value of field ``field_name`` in ``arg``, a ``name`` struct made by ``struct``."""
    names = [n for _, n in lists()[name]]
    return arg.value[names.index(field_name)].value
