"""The attention options, validated once: ``AttentionOptions``.

One frozen, hashable value holds every option of a call (causal, softmax_scale, smooth_k,
smooth_q, layout, granularity, deterministic, window_left, window_right, softcap).  It is
checked when it is made, with one TypeError or ValueError naming the option; everything below the public
functions takes it as it is: the plan and kernel caches key on it, torch's autograd context saves it, JAX
takes it as a static argument, and the torch operators take its fields in order (``op(q, k, v, *options)``).
"""
from __future__ import annotations

import collections
import math
import numbers

import numpy as np

LAYOUTS = ("HND", "NHD", "THD")  # THD: packed (variable-length) batches, set by the varlen functions
DENSE_LAYOUTS = ("HND", "NHD")
GRANULARITIES = ("fine", "paper")
FIELDS = ("causal", "softmax_scale", "smooth_k", "smooth_q", "layout", "granularity", "deterministic",
          "window_left", "window_right", "softcap")
_INF = float("inf")
# A window side this wide or wider is unbounded: the kernels add it (and both sides' sum) to token
# indices in int32, and no sequence reaches it.
UNBOUNDED = 1 << 29


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


def check_window_side(value, name: str) -> int:
    """One side of a sliding window: an int ≥ 0 (keys that far from the diagonal are seen), or -1
    (unbounded), as FlashAttention's ``window_size``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int (-1 for unbounded), got {type(value).__name__} {value!r}")
    value = int(value)
    if value < -1:
        raise ValueError(f"{name}: expected -1 (unbounded) or a count of keys >= 0, got {value}")
    return min(value, UNBOUNDED)


def check_window_size(window_size) -> tuple:
    """FlashAttention's ``window_size=(left, right)`` as (window_left, window_right)."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise TypeError(f"window_size: expected a pair (left, right) of ints, -1 for unbounded, got "
                        f"{window_size!r}") from None
    return check_window_side(left, "window_size[0]"), check_window_side(right, "window_size[1]")


def window_options(window_size) -> dict:
    """FlashAttention's ``window_size`` as AttentionOptions keywords."""
    left, right = check_window_size(window_size)
    return {"window_left": left, "window_right": right}


def check_softcap(value) -> float:
    """Logit soft-capping's c (scores become c·tanh(s/c)), a finite float > 0, or 0.0 for none (as
    FlashAttention's ``softcap``)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"softcap: expected a float (0.0 for none), got {type(value).__name__} {value!r}")
    value = float(value)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"softcap: expected a finite number >= 0 (0.0 for none), got {value}")
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
                granularity="fine", deterministic=False, window_left=-1, window_right=-1, softcap=0.0):
        # The usual call passes exact types and a valid choice: a few identity tests; else the full checks.
        if not (causal.__class__ is bool and smooth_k.__class__ is bool and smooth_q.__class__ is bool
                and deterministic.__class__ is bool
                and window_left.__class__ is int and -1 <= window_left < UNBOUNDED
                and window_right.__class__ is int and -1 <= window_right < UNBOUNDED
                and softcap.__class__ is float and 0.0 <= softcap < _INF
                and (softmax_scale is None or softmax_scale.__class__ is float and 0.0 < softmax_scale < _INF)
                and layout.__class__ is str and layout in LAYOUTS
                and granularity.__class__ is str and granularity in GRANULARITIES):
            causal, smooth_k, smooth_q, deterministic = (check_flag(v, n) for v, n in (
                (causal, "causal"), (smooth_k, "smooth_k"), (smooth_q, "smooth_q"), (deterministic, "deterministic")))
            softmax_scale = check_softmax_scale(softmax_scale)
            layout = _check_choice(layout, "layout", LAYOUTS)
            granularity = check_granularity(granularity)
            window_left = check_window_side(window_left, "window_left")
            window_right = check_window_side(window_right, "window_right")
            softcap = check_softcap(softcap)
        self = tuple.__new__(cls, (causal, softmax_scale, smooth_k, smooth_q, layout, granularity, deterministic,
                                   window_left, window_right, softcap))
        if softcap:
            self._check_softcap()
        return self

    def _check_softcap(self) -> None:
        """The soft-capped kernels that are built: fine granularity, without Q-smoothing (K-smoothing adds each
        row's share back before tanh: numerics.py)."""
        if self.smooth_q:
            raise ValueError("softcap: soft-capping takes no Q-smoothing (its per-key shift would have to pass "
                             "through tanh); pass smooth_q=False")
        if self.granularity != "fine":
            raise ValueError(f"softcap: soft-capped backward kernels are built for granularity 'fine', got "
                             f"{self.granularity!r}")

    def _replace(self, **changes) -> AttentionOptions:
        """A copy with ``changes``, checked as a new value is."""
        return type(self)(**{**self._asdict(), **changes})

    @property
    def fine(self) -> bool:
        """The backward's per-key / per-query scales (granularity "fine") rather than per-tile ones."""
        return self.granularity == "fine"

    @property
    def windowed(self) -> bool:
        """A sliding window bounds some side of the mask (causal bounds the right side by itself)."""
        return self.window_left >= 0 or (self.window_right >= 0 and not self.causal)

    @property
    def band_test(self) -> bool:
        """The kernels read the band's edges (SB_WINDOW): a sliding window, or a soft cap without a causal mask
        (soft-capped kernels are built causal or banded; a band open on both sides masks no key)."""
        return self.windowed or (bool(self.softcap) and not self.causal)

    @property
    def banded(self) -> bool:
        """The kernels' SB_CAUSAL: keys masked by position (causal, a sliding window or both), or a band open on
        both sides (band_test)."""
        return self.causal or self.band_test

    def band(self) -> tuple:
        """(left, right): query r sees key c iff -left <= c - r - (Lk - Lq) <= right (bottom-right aligned,
        as FlashAttention's windows), UNBOUNDED for an open side; causal sets right to 0."""
        left = UNBOUNDED if self.window_left < 0 else self.window_left
        right = 0 if self.causal else UNBOUNDED if self.window_right < 0 else self.window_right
        return left, right

    def __repr__(self) -> str:
        return "AttentionOptions(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in FIELDS) + ")"
