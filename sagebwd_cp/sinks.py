"""Attention sinks: one logit per query head that joins every row's softmax normalizer and attends to
nothing (GPT-OSS's learned ``sinks``), computed exactly around the kernels.

With a row's scores s_j, LSE λ = log Σ_j exp(s_j) and the head's sink logit σ, the sink attention is
o' = Σ_j exp(s_j - λ')·v_j with λ' = log(exp(λ) + exp(σ)): the kernels' output scaled by
w = exp(λ - λ'), and a row that sees no key (λ = -∞) gives 0. Its backward is the kernels' backward
run with o' and λ' (their base-2 LSE moved by the same amount, λ' - λ): P'_ij = exp(s_ij - λ'),
dS = P'(dP - δ') with δ' = rowsum(dO ∘ o'); and dσ = -Σ_rows exp(σ - λ')·δ'. The arithmetic is
elementwise float32 in the caller's framework (NumPy, torch or CuPy; ``arrays.array_namespace``).
"""
from __future__ import annotations

from .arrays import array_namespace, as_dtype, check_arrays
from .numerics import LOG2E


def check_sinks(sinks, heads_q: int, q) -> None:
    """``sinks``: a floating array of shape (heads_q,) in q's framework (and on its device)."""
    check_arrays("q, sinks", q, sinks)
    if tuple(sinks.shape) != (heads_q,):
        raise ValueError(f"sinks: expected one logit per query head, shape ({heads_q},), got {tuple(sinks.shape)}")
    if "float" not in str(sinks.dtype):
        raise TypeError(f"sinks: expected a floating dtype, got {sinks.dtype}")
    xp = array_namespace(q, "q")
    if xp.__name__ == "cupy" and str(q.dtype) == "uint16":
        raise TypeError("sinks: CuPy holds bfloat16 as uint16, which the sinks' arithmetic cannot read; pass torch "
                        "tensors (or float16)")
    if xp.__name__ == "torch" and sinks.device != q.device:
        raise ValueError(f"sinks: expected a tensor on {q.device}, got one on {sinks.device}")


def _rows(x, layout: str, xp):
    """(B, Hq, L) row values broadcast against an output in ``layout``."""
    return (x if layout == "HND" else xp.moveaxis(x, 1, 2))[..., None]


def sink_logits(sinks):
    """The sinks as the kernels read them (kernels/lse.cu natural_lse): a contiguous float32 array in their own
    framework (a copy only where they are not one already)."""
    xp = array_namespace(sinks, "sinks")
    x = as_dtype(xp, sinks, "float32")
    return x.contiguous() if xp.__name__ == "torch" else xp.ascontiguousarray(x)


def _times_rows(out, w, xp):
    """out·w rounded once to out's dtype: the float32 product of the 16-bit values (type promotion), stored straight
    into a 16-bit result where the namespace writes into a given array (torch, NumPy, CuPy: one pass over O, no
    float32 copy of it); JAX casts the float32 product."""
    if xp.__name__.startswith("jax"):
        return as_dtype(xp, out * w, out.dtype)
    result = xp.empty_like(out)
    xp.multiply(out, w, out=result)
    return result


def join_sinks(out, lse, lse2, sinks, layout: str):
    """(o', λ', base-2 λ'') of the sink attention from the kernels' output ``out`` (``layout``), its
    natural-log LSE ``lse`` (B, Hq, L) and, if not None, its base-2 LSE ``lse2`` (the backward's:
    moved by (λ' - λ)·log₂e; +∞ stays +∞)."""
    xp = array_namespace(out, "out")
    f32 = lambda x: as_dtype(xp, x, "float32")
    lse = f32(lse)
    new_lse = xp.logaddexp(lse, f32(sinks)[None, :, None])
    weight = xp.exp(lse - new_lse)  # 0 where lse = -inf
    new_out = _times_rows(out, _rows(weight, layout, xp), xp)
    new_lse2 = None if lse2 is None else f32(lse2) + (new_lse - lse) * LOG2E
    return new_out, new_lse, new_lse2


def sinks_grad(out, lse, dout, sinks, layout: str, delta=None):
    """dσ (Hq,) in sinks' dtype: -Σ over batch and rows of exp(σ - λ')·δ, δ = rowsum(dO ∘ o'), from the sink
    attention's output ``out`` and natural-log LSE ``lse``; ``delta``: δ (B, Hq, L) float32 where the backward's
    row statistics hold it (api.run_backward), else formed here."""
    xp = array_namespace(out, "out")
    f32 = lambda x: as_dtype(xp, x, "float32")
    if delta is None:
        delta = (f32(dout) * out).sum(axis=-1)  # (B, Hq, L) or (B, L, Hq); out promotes to float32
        if layout != "HND":
            delta = xp.moveaxis(delta, 1, 2)
    p_sink = xp.exp(f32(sinks)[None, :, None] - f32(lse))
    return as_dtype(xp, -(p_sink * delta).sum(axis=(0, 2)), sinks.dtype)
