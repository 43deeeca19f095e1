"""Attention over chunks of the keys: the pieces ring (context-parallel) attention is built from.

A call over one chunk returns its output and natural-log LSE in the frame of the unsmoothed keys
(``attention(..., return_lse=True)``); ``merge_attention`` combines such partial results exactly;
``attention_backward_lse`` runs the backward of one chunk against the merged output and LSE.  All
chunks are quantized with one μ_K (``key_mean`` of every chunk's keys, passed as ``k_mean``): the
kernels' dQ omits the term c·rowsum(dS)·μ_K, which vanishes over a whole row only when every chunk
shifts its keys by the same μ_K (docs/ALGORITHM.md, chunked attention).

The helpers here are elementwise math on the caller's arrays, written once for NumPy, PyTorch and
CuPy (``array_namespace``): on CUDA they run in the caller's framework on its current stream.
"""
from __future__ import annotations

import numpy as np

from .api import attention_backward_arrays
from .arrays import array_list, array_namespace, as_dtype as _cast, check_arrays, check_rank, layout_dims
from .numerics import BLOCK_KV, LOG2E, default_softmax_scale
from .options import UNBOUNDED, AttentionOptions, check_layout, window_options

_INF = float("inf")


def _seq_axis(layout: str) -> int:
    return 2 if check_layout(layout) == "HND" else 1


def key_sum(k, layout: str = "HND", xp=None):
    """K's token sums per (batch, KV head), float64 (B, Hkv, D): what ``key_mean`` divides, and what
    ranks holding shards of K add up before dividing."""
    xp = xp or array_namespace(k, "k")
    return _cast(xp, k, "float64").sum(axis=_seq_axis(layout))


def key_mean(ks, layout: str = "HND", xp=None):
    """μ_K of the keys of all chunks ``ks`` (a sequence of (B, Hkv, Lk_i, D) arrays in ``layout``):
    the float64 token sum over every chunk divided by the token count, rounded to float32, as a
    single call over the concatenated keys computes it (numerics.token_mean)."""
    ks = array_list(ks, "ks")
    check_arrays(", ".join(f"ks[{i}]" for i in range(len(ks))), *ks)
    if not ks:
        raise ValueError("ks: expected at least one chunk of keys, got none")
    xp = xp or array_namespace(ks[0], "ks")
    axis = _seq_axis(layout)
    for i, k in enumerate(ks):
        check_rank(k, f"ks[{i}]", layout_dims(layout))
        if _rows(k, layout) != _rows(ks[0], layout):
            raise ValueError(f"ks[{i}]: expected (batch, heads, head_dim) = {_rows(ks[0], layout)} like ks[0], got "
                             f"shape {tuple(k.shape)}")
    total = key_sum(ks[0], layout, xp)
    for k in ks[1:]:
        total = total + key_sum(k, layout, xp)
    count = sum(int(k.shape[axis]) for k in ks)
    return _cast(xp, total / float(max(count, 1)), "float32")


def prefix_key_mean(k, layout: str = "HND", tokens: int = BLOCK_KV, xp=None):
    """μ_K of the first ``tokens`` keys of k (B, Hkv, Lk, D) in ``layout`` (all of them if Lk is
    shorter), float32 (B, Hkv, D), computed as ``key_mean`` computes it.  Passed as ``k_mean`` to a
    causal ``attention`` or ``attention_forward`` (whose saved state hands it to the backward), it
    makes K-smoothing add no dependence on later tokens: with the default 64, the first V block,
    which every row that sees a key already reads, the outputs are as causal as without K-smoothing
    (row i depends on no key beyond the end of the forward's key tile holding key i;
    docs/ALGORITHM.md, causality)."""
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise ValueError(f"tokens: expected a positive int, got {tokens!r}")
    check_arrays("k", k)
    axis = _seq_axis(layout)
    check_rank(k, "k", layout_dims(layout))
    first = k[:, :, :tokens] if axis == 2 else k[:, :tokens]
    return key_mean([first], layout, xp)


def _rows(k, layout: str) -> tuple:
    """(batch, heads, head_dim) of a rank-4 array in ``layout``."""
    return (k.shape[0], k.shape[1 if layout == "HND" else 2], k.shape[3])


def _check_lse(lse, q, layout: str) -> None:
    axis = _seq_axis(layout)
    expected = (q.shape[0], q.shape[3 - axis], q.shape[axis])
    if tuple(lse.shape) != tuple(expected):
        raise ValueError(f"lse: expected shape (B, Hq, Lq) = {tuple(expected)}, got {tuple(lse.shape)}")
    if "float32" not in str(lse.dtype):
        raise TypeError(f"lse: expected dtype float32, got {lse.dtype}")


def key_shift(q, k_mean, layout: str = "HND", xp=None):
    """q·μ_K per query row, (B, Hq, Lq) float32: the part of every score of the row that
    K-smoothing removes (before the softmax scale)."""
    xp = xp or array_namespace(q, "q")
    q32 = _cast(xp, q, "float32")
    if layout == "NHD":
        q32 = xp.moveaxis(q32, 1, 2)
    b, hq, lq, d = q32.shape
    hk = k_mean.shape[1]
    if tuple(k_mean.shape) != (b, hk, d) or hq % hk:
        raise ValueError(f"k_mean: expected shape (B, Hkv, D) with Hq = {hq} a multiple of Hkv and D = {d}, "
                         f"got {tuple(k_mean.shape)}")
    grouped = q32.reshape(b, hk, hq // hk, lq, d)
    return xp.einsum("bhgld,bhd->bhgl", grouped, _cast(xp, k_mean, "float32")).reshape(b, hq, lq)


def lse_to_lse2(lse, q, k_mean=None, softmax_scale=None, layout: str = "HND", xp=None):
    """The kernels' base-2 LSE in the frame of K − μ_K from a natural-log LSE in the frame of the
    unsmoothed keys: lse2 = (lse − c·q·μ_K)·log₂e, the inverse of the returned LSE's add-back
    (kernels/lse.cu); +∞ where lse is −∞ (a row that sees no key: P = 0 in the backward); NaN stays
    NaN.  ``k_mean`` None: no K-smoothing (no shift)."""
    check_arrays("lse, q, k_mean", lse, q, k_mean, optional=("k_mean",))
    xp = xp or array_namespace(lse, "lse")
    check_rank(q, "q", layout_dims(check_layout(layout)))
    _check_lse(lse, q, layout)
    if softmax_scale is None:
        softmax_scale = default_softmax_scale(q.shape[-1])
    shifted = lse
    if k_mean is not None:
        shifted = lse - float(softmax_scale) * key_shift(q, k_mean, layout, xp)
    return xp.where(lse == -_INF, _INF, shifted * LOG2E)


def _row_weights(w, layout: str, xp):
    """(B, Hq, Lq) row weights broadcast against an output in ``layout``."""
    return (w if layout == "HND" else xp.moveaxis(w, 1, 2))[..., None]


def merge_attention(outs, lses, layout: str = "HND", xp=None):
    """(out, lse) of attention over the union of disjoint key sets from each set's output and
    natural-log LSE (same rows): lse = log Σᵢ exp(lseᵢ), out = Σᵢ exp(lseᵢ − lse)·outᵢ, both float32.
    A row with lseᵢ = −∞ (it saw no key of set i) takes nothing from outᵢ; a row that sees no key
    of any set gets lse −∞ and out 0; a NaN in an LSE or output propagates to that row."""
    outs, lses = array_list(outs, "outs"), array_list(lses, "lses")
    check_arrays(", ".join([f"lses[{i}]" for i in range(len(lses))] + [f"outs[{i}]" for i in range(len(outs))]),
                 *lses, *outs)
    if not outs or len(outs) != len(lses):
        raise ValueError(f"outs, lses: expected the same positive number of outputs and LSEs, got {len(outs)} and "
                         f"{len(lses)}")
    xp = xp or array_namespace(lses[0], "lses")
    rows = tuple(lses[0].shape)
    check_rank(lses[0], "lses[0]", ("batch", "heads", "seqlen"))
    for i, (o, x) in enumerate(zip(outs, lses)):
        if tuple(x.shape) != rows:
            raise ValueError(f"lses[{i}]: expected shape {rows} like lses[0], got {tuple(x.shape)}")
        check_rank(o, f"outs[{i}]", layout_dims(check_layout(layout)))
        if (o.shape[0], *(o.shape[1:3] if layout == "HND" else o.shape[2:0:-1])) != rows:
            raise ValueError(f"outs[{i}]: expected the rows of lses[{i}] (batch, heads, seqlen) = {rows}, got shape "
                             f"{tuple(o.shape)}")
    if xp is np:  # NaN and -inf - -inf are handled below: no warnings for them
        with np.errstate(invalid="ignore"):
            return _merge(outs, lses, layout, xp)
    return _merge(outs, lses, layout, xp)


def _merge(outs, lses, layout, xp):
    lse = _cast(xp, lses[0], "float32")
    for x in lses[1:]:
        lse = xp.logaddexp(lse, _cast(xp, x, "float32"))
    empty = lse == -_INF  # exp(-inf - -inf) is NaN: such a row takes weight 0 from every set
    out = None
    for o, x in zip(outs, lses):
        w = xp.where(empty, 0.0, xp.exp(_cast(xp, x, "float32") - lse))
        term = _row_weights(w, layout, xp) * _cast(xp, o, "float32")
        out = term if out is None else out + term
    return out, lse


def causal_pieces(len_q: int, len_k: int, start: int, stop: int, causal: bool) -> list:
    """The calls that attend queries 0..len_q-1 to keys start..stop-1 of len_k under bottom-right
    causal masking (query i sees key j iff j <= i + len_k - len_q): ``(row0, row1, causal)`` each,
    meaning rows row0..row1-1 against the chunk with the library's (bottom-right) ``causal``.  Rows
    before the first piece see no key of the chunk.  Exact: for rows row0..row1-1 of a causal
    piece, row1 = stop - (len_k - len_q), so the call's own bottom-right offset (stop - start) -
    (row1 - row0) is the chunk's."""
    if not 0 <= start <= stop <= len_k:
        raise ValueError(f"start, stop: expected 0 <= start <= stop <= len_k = {len_k}, got {start}, {stop}")
    if stop == start or len_q == 0:
        return []
    if not causal:
        return [(0, len_q, False)]
    offset = len_k - len_q
    first = min(max(start - offset, 0), len_q)  # rows before it see no key of the chunk
    full = min(max(stop - offset, 0), len_q)  # rows from here on see every key of the chunk
    pieces = [(first, full, True)] if full > first else []
    return pieces + ([(full, len_q, False)] if len_q > full else [])


def band_piece(q_start: int, q_stop: int, k_start: int, k_stop: int, offset: int, left: int, right: int):
    """The one call that attends queries q_start..q_stop-1 to keys k_start..k_stop-1 (positions in the
    whole sequence) under the band query i sees key j iff -left <= j - i - offset <= right (``offset``:
    the whole call's Lk - Lq; ``left``, ``right`` as ``AttentionOptions.band`` gives them, UNBOUNDED for
    an open side): None when no query sees a key, else ``(row0, row1, key0, key1, window)``, the rows
    and keys counted from q_start and k_start, and the call's own bottom-right ``window_size`` (-1:
    unbounded).  Exact: the keys no row of the range sees are cut, and so are the rows that see no key;
    the band's width is kept and its offset is re-expressed in the call's frame, where the last row
    sees the last key, so both sides are >= 0."""
    for name, value in (("q_start", q_start), ("q_stop", q_stop), ("k_start", k_start), ("k_stop", k_stop)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}: expected an int >= 0, got {value!r}")
    open_left, open_right = left >= UNBOUNDED, right >= UNBOUNDED
    k0 = k_start if open_left else max(k_start, q_start + offset - left)
    k1 = k_stop if open_right else min(k_stop, q_stop + offset + right)
    if k0 >= k1 or q_start >= q_stop:
        return None
    r0 = q_start if open_right else max(q_start, k0 - offset - right)
    r1 = q_stop if open_left else min(q_stop, k1 - offset + left)
    if r0 >= r1:
        return None
    new_left, new_right = left - offset - r1 + k1, right + offset + r1 - k1
    assert (open_left or new_left >= 0) and (open_right or new_right >= 0), (new_left, new_right)
    return (r0 - q_start, r1 - q_start, k0 - k_start, k1 - k_start,
            (-1 if open_left else new_left, -1 if open_right else new_right))


def attention_backward_lse(q, k, v, out, lse, do, *, causal=False, softmax_scale=None, smooth_k=True, smooth_q=False,
                           layout="HND", granularity="fine", deterministic=False, k_mean=None, window_size=(-1, -1),
                           softcap=0.0):
    """dQ, dK, dV of one chunk of the keys against an external output and natural-log LSE (the
    merged ones of attention over all chunks): the chunk's share of the full attention's gradients
    (dQ summed over the chunks, dK and dV the chunk's own).  ``out``: the full attention's output
    rows of q; ``lse``: (B, Hq, Lq) float32, unsmoothed frame, as ``attention(..., return_lse=True)``
    and ``merge_attention`` give it.  ``k_mean``: the μ_K the forward used (``key_mean`` of every
    chunk); None computes this chunk's own, right only for a single chunk.  Options as in
    ``attention_backward_arrays``.  NumPy, torch and CuPy arrays."""
    check_arrays("q, k, v, out, lse, do, k_mean", q, k, v, out, lse, do, k_mean, optional=("k_mean",))
    options = AttentionOptions(causal=causal, softmax_scale=softmax_scale, smooth_k=smooth_k, smooth_q=smooth_q,
                               layout=check_layout(layout), granularity=granularity, deterministic=deterministic,
                               **window_options(window_size), softcap=softcap)
    for name, x in (("q", q), ("k", k), ("v", v), ("out", out), ("do", do)):
        check_rank(x, name, layout_dims(options.layout))
    xp = array_namespace(lse, "lse")
    mean = None
    if options.smooth_k:
        mean = k_mean if k_mean is not None else key_mean([k], options.layout, xp)
    lse2 = lse_to_lse2(lse, q, mean, options.softmax_scale, options.layout, xp)
    if xp.__name__ == "torch":
        lse2 = lse2.contiguous()
    # Through the public function, which also takes JAX arrays; the options as checked here.
    keywords = {name: value for name, value in options._asdict().items() if not name.startswith("window_")}
    return attention_backward_arrays(q, k, v, out, lse2, do, **keywords, k_mean=mean,
                                     window_size=(options.window_left, options.window_right))


__all__ = ["array_namespace", "key_sum", "key_mean", "prefix_key_mean", "key_shift", "lse_to_lse2", "merge_attention",
           "causal_pieces", "band_piece", "attention_backward_lse"]
