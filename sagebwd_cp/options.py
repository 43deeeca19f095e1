"""The attention options, validated once: ``AttentionOptions``.

One frozen, hashable value holds every option of a call (causal, softmax_scale, smooth_k,
smooth_q, layout, granularity, deterministic).  It is checked when it is made, with one TypeError
or ValueError naming the option; everything below the public functions takes it as it is: the
plan and kernel caches key on it, torch's autograd context saves it, JAX takes it as a static
argument, and the torch operators take its fields in order (``op(q, k, v, *options)``).
"""
from __future__ import annotations

import collections
import math
import numbers

import numpy as np

LAYOUTS = ("HND", "NHD", "THD")  # THD: packed (variable-length) batches, set by the varlen functions
DENSE_LAYOUTS = ("HND", "NHD")
GRANULARITIES = ("fine", "paper")
FIELDS = ("causal", "softmax_scale", "smooth_k", "smooth_q", "layout", "granularity", "deterministic")
_INF = float("inf")


def check_flag(value, name: str) -> bool:
    """``value`` as a bool; only True, False and NumPy's bools are taken (a string such as "no" is truthy)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{name}: expected True or False, got {type(value).__name__} {value!r}")


def check_softmax_scale(value) -> float | None:
    """``value`` as a float, or None (the default 1/sqrt(head_dim)); strings and bools are refused."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"softmax_scale: expected a float or None, got {type(value).__name__} {value!r}")
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"softmax_scale: expected a finite positive number, got {value}")
    return value


def _check_choice(value, name: str, choices: tuple) -> str:
    # The packed layout is set by the varlen functions, not asked of users: the message names the dense ones.
    shown = DENSE_LAYOUTS if choices == LAYOUTS else choices
    if not (isinstance(value, str) and value in choices):
        raise ValueError(f"{name}: expected one of {shown}, got {type(value).__name__} {value!r}"
                         if not isinstance(value, str) else f"{name}: expected one of {shown}, got {value!r}")
    return value


def check_layout(layout, choices: tuple = DENSE_LAYOUTS) -> str:
    """A dense layout ("HND" or "NHD"), for the functions that take a layout alone."""
    return _check_choice(layout, "layout", choices)


def check_granularity(granularity) -> str:
    return _check_choice(granularity, "granularity", GRANULARITIES)


_Fields = collections.namedtuple("_Fields", FIELDS)


class AttentionOptions(_Fields):
    """Every option of an attention call, checked once, when made (keywords or positions in FIELDS'
    order; the defaults are the public functions')."""

    __slots__ = ()

    def __new__(cls, causal=False, softmax_scale=None, smooth_k=True, smooth_q=False, layout="HND",
                granularity="fine", deterministic=False):
        # The usual call passes exact types and a valid choice: a few identity tests; else the full checks.
        if not (causal.__class__ is bool and smooth_k.__class__ is bool and smooth_q.__class__ is bool
                and deterministic.__class__ is bool
                and (softmax_scale is None or softmax_scale.__class__ is float and 0.0 < softmax_scale < _INF)
                and layout.__class__ is str and layout in LAYOUTS
                and granularity.__class__ is str and granularity in GRANULARITIES):
            causal, smooth_k, smooth_q, deterministic = (check_flag(v, n) for v, n in (
                (causal, "causal"), (smooth_k, "smooth_k"), (smooth_q, "smooth_q"), (deterministic, "deterministic")))
            softmax_scale = check_softmax_scale(softmax_scale)
            layout = _check_choice(layout, "layout", LAYOUTS)
            granularity = check_granularity(granularity)
        return tuple.__new__(cls, (causal, softmax_scale, smooth_k, smooth_q, layout, granularity, deterministic))

    def _replace(self, **changes) -> AttentionOptions:
        """A copy with ``changes``, checked as a new value is."""
        return type(self)(**{**self._asdict(), **changes})

    @property
    def fine(self) -> bool:
        """The backward's per-key / per-query scales (granularity "fine") rather than per-tile ones."""
        return self.granularity == "fine"

    def __repr__(self) -> str:
        return "AttentionOptions(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in FIELDS) + ")"
