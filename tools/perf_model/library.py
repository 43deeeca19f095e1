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
