"""The library's modules this tool reads, imported in one place (their package layout may move)."""
from __future__ import annotations

import importlib


def _first(*names):
    errors = []
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise ImportError("; ".join(errors))


def compiler():
    return _first("sagebwd_cp.gpu.compiler", "sagebwd_cp.compiler")


def specs():
    return _first("sagebwd_cp.gpu.specs", "sagebwd_cp.specs")


def options():
    """The AttentionOptions class (every option of an attention call in one value)."""
    return _first("sagebwd_cp.options").AttentionOptions


def write_json(path: str, obj) -> None:
    """``obj`` as the benchmarks' results are written (benchmarks/report_common.json_text: a record a
    line), through a temporary file; values JSON does not know are written as text."""
    import json
    import os
    import sys

    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    from report_common import json_text

    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(json_text(json.loads(json.dumps(obj, default=str))) + "\n")
    os.replace(tmp, path)
