"""sagebwd_cp as an attention implementation of Hugging Face ``transformers``.

``register_transformers()`` registers an attention function and its mask function under a name
(default ``"sagebwd"``), so that ``attn_implementation="sagebwd"`` works for Llama-, Qwen- and
Mistral-style models, sliding-window layers included, as FlashAttention's integration does:

- a batch without padding: causal attention by the kernels' own rule (no mask is built), with the
  layer's ``sliding_window`` as the kernels' window (``window_size=(sliding_window - 1, ...)``, the
  keys transformers' sliding-window mask keeps);
- a padded batch (a 2-D ``attention_mask`` with zeros, left or right padding): the valid tokens are
  gathered into a packed batch, attended by the variable-length kernels, and scattered back (padded
  positions give 0);
- packed sequences in one row (``position_ids`` restarting, or the ``cu_seq_lens_q/k`` and
  ``max_length_q/k`` keywords of ``DataCollatorWithFlattening``): the variable-length kernels
  directly;
- GPT-OSS's attention sinks (``s_aux``), in all three kinds of batch;
- Gemma 2's logit soft-capping (``softcap``), with K-smoothing (each score's share added back before tanh);
- the deterministic dQ order where FlashAttention's integration takes it: the ``deterministic`` keyword, else
  ``FLASH_ATTENTION_DETERMINISTIC=1`` in the environment;
- anything else (a cache with an offset, padding beside a cache, any custom mask): a ``ValueError``
  that says so, never a silent wrong answer.

The mask function returns None for plain causal or packed-by-position batches, the 2-D padding mask
for a padded one, and otherwise the mask transformers' SDPA integration would build, which the
attention function then refuses. Padded batches read the mask's lengths on the host (one
synchronization, as FlashAttention's integration does).
"""
from __future__ import annotations

import os

import torch

from ._checks import check_tensors
from ._ops import check_ranks
from .functional import attention
from .varlen import flash_attn_varlen_func

__all__ = ["register_transformers", "attention_forward"]


def _refuse(what: str) -> ValueError:
    return ValueError(f"sagebwd_cp attention (transformers): {what} is not supported; "
                      "use attn_implementation=\"sdpa\" for this model")


def _packed_offsets(kwargs: dict, position_ids, batch: int):
    """(cu_q, cu_k, max_q, max_k) of a packed row from the collator's keywords or restarting
    position_ids, or None."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        if cu_q is None or cu_k is None or kwargs.get("max_length_q") is None or kwargs.get("max_length_k") is None:
            raise _refuse("packed sequences without all of cu_seq_lens_q/k and max_length_q/k")
        return cu_q.to(torch.int32), cu_k.to(torch.int32), int(kwargs["max_length_q"]), int(kwargs["max_length_k"])
    if position_ids is None or batch != 1:
        return None
    from transformers.modeling_flash_attention_utils import _is_packed_sequence, prepare_fa_kwargs_from_position_ids

    if not _is_packed_sequence(position_ids, batch):
        return None
    (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(position_ids)
    return cu_q, cu_k, int(max_q), int(max_k)


def _unpadded_attention(q, k, v, mask, causal: bool, scaling, window_size=(-1, -1), extra=None, sinks=None):
    """Attention over a padded batch (q, k, v (B, N, H, D), mask (B, N), nonzero where valid): the
    valid tokens packed, attended per sequence, scattered back; padded positions are 0."""
    b, n = mask.shape
    valid = mask.bool()
    index = valid.reshape(-1).nonzero().squeeze(1)  # the one host synchronization
    cu = torch.nn.functional.pad(valid.sum(1, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0))
    take = lambda x: x.reshape(b * n, *x.shape[2:]).index_select(0, index)
    # n bounds every sequence's length (max_seqlen need not be exact): no second read of the lengths.
    out = flash_attn_varlen_func(take(q), take(k), take(v), cu, cu, n, n, causal=causal, softmax_scale=scaling,
                                 window_size=window_size, sinks=sinks, **(extra or {}))
    full = out.new_zeros((b * n, *out.shape[1:])).index_copy(0, index, out)
    return full.reshape(b, n, *out.shape[1:])


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      sliding_window=None, softcap=None, is_causal=None, **kwargs):
    """transformers' attention interface: query and key (B, Hq or Hkv, N, D), value (B, Hkv, N, Dv) with Hq a
    multiple of Hkv; returns ((B, N, Hq, Dv), None)."""
    check_tensors("query, key, value, attention_mask", query, key, value, attention_mask, optional=("attention_mask",))
    check_ranks("HND", query=query, key=key, value=value)
    if dropout:
        raise _refuse(f"attention dropout ({dropout})")
    # MLA (DeepSeek-V3: 192 for Q·K, 128 for V) runs: V keeps its own head dim (value_head_dim.py).
    if max(query.shape[-1], value.shape[-1]) > 256:
        raise _refuse(f"head dim {max(query.shape[-1], value.shape[-1])} (the kernels take up to 256)")
    # Gemma 2's logit soft-capping (K-smoothing's share of each score added back before tanh: numerics.py).
    extra = {"softcap": float(softcap)} if softcap else {}
    # The deterministic dQ order as transformers' FlashAttention integration reads it.
    deterministic = kwargs.get("deterministic")
    extra["deterministic"] = (bool(deterministic) if deterministic is not None
                              else os.getenv("FLASH_ATTENTION_DETERMINISTIC", "0") == "1")
    sinks = kwargs.get("s_aux")  # GPT-OSS's attention sinks, one logit per query head
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    # transformers' sliding-window mask keeps key j for query i iff i - sliding_window < j (and j <= i, causal).
    window = (-1, -1) if sliding_window is None else (int(sliding_window) - 1, int(sliding_window) - 1)
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # (B, N, H, D)
    if attention_mask is not None:
        if attention_mask.ndim != 2 or q.shape[1] != k.shape[1] or attention_mask.shape[1] != k.shape[1]:
            raise _refuse(f"attention_mask of shape {tuple(attention_mask.shape)} for {q.shape[1]} queries and "
                          f"{k.shape[1]} keys (a cache offset or a custom mask)")
        return _unpadded_attention(q, k, v, attention_mask, causal, scaling, window, extra, sinks), None
    packed = _packed_offsets(kwargs, kwargs.get("position_ids"), q.shape[0])
    if packed is not None:
        if q.shape[0] != 1:
            raise _refuse(f"packed sequences in a batch of {q.shape[0]} rows (one row expected)")
        out = flash_attn_varlen_func(q[0], k[0], v[0], *packed, causal=causal, softmax_scale=scaling,
                                     window_size=window, sinks=sinks, **extra)
        return out[None], None
    out = attention(q, k, v, causal=causal, layout="NHD", softmax_scale=scaling, window_size=window, sinks=sinks,
                    **extra)
    return out, None


def _plain_causal_or_sdpa_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                               attention_mask=None, local_size=None, **kwargs):
    """None for causal attention that the attention function computes by itself (no padding, or
    packed sequences it reads from position_ids; a sliding window of ``local_size`` keys, which the
    layer passes to the attention function as its ``sliding_window``), the 2-D padding mask of a padded
    batch, else the mask SDPA would get, which the attention function refuses."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    causal_rule = _causal_or_packed(mask_function, causal_mask_function, local_size)
    no_offset = not _nonzero(q_offset) and not _nonzero(kv_offset) and q_length == kv_length
    if causal_rule and no_offset:
        if _nothing_padded(attention_mask):
            return None
        if attention_mask.ndim == 2 and attention_mask.shape[1] == kv_length and _unpacked(mask_function):
            return attention_mask
    kwargs.pop("allow_is_causal_skip", None)  # a skipped mask would read as plain causal here
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function or causal_mask_function,
                     attention_mask=attention_mask, local_size=local_size, allow_is_causal_skip=False, **kwargs)


def _causal_or_packed(mask_function, causal_mask_function, window=None) -> bool:
    """The default causal rule, alone or as transformers restricts it to packed sequences found in
    restarting position_ids (which the attention function reads itself): intersected with a
    same-sequence mask (``and_masks``, transformers 5.17) or applied to positions remapped per sequence
    (``remap_positions_for_packed_sequence``, later versions); with ``window``, also intersected with
    transformers' sliding-window overlay of that many keys (``sliding_window_causal_mask_function``),
    which the attention function applies from its ``sliding_window``. Any other mask function is not."""
    if mask_function in (None, causal_mask_function):
        return True
    name = getattr(mask_function, "__qualname__", "")
    cells = [c.cell_contents for c in getattr(mask_function, "__closure__", None) or ()]
    if name == "and_masks.<locals>.and_mask":  # and_masks(causal or remapped causal, overlays)
        parts = next((c for c in cells if isinstance(c, tuple)), ())
        packed = "packed_sequence_mask_function.<locals>.inner_mask"
        return bool(parts) and all(getattr(p, "__qualname__", "") == packed or _window_overlay(p, window) or
                                   _causal_or_packed(p, causal_mask_function, window) for p in parts)
    if name == "remap_positions_for_packed_sequence.<locals>.inner_mask":
        inner = next((c for c in cells if callable(c)), None)
        return any(c is causal_mask_function for c in cells) or (
            inner is not None and _causal_or_packed(inner, causal_mask_function, window))
    return False


def _unpacked(mask_function) -> bool:
    """Whether a mask function that _causal_or_packed accepted leaves packed sequences out (so that a 2-D
    padding mask says all that is left): plain causal, or causal with a sliding-window overlay."""
    def parts(f):
        if getattr(f, "__qualname__", "") != "and_masks.<locals>.and_mask":
            return [f]
        cells = [c.cell_contents for c in f.__closure__ or ()]
        return [p for t in cells if isinstance(t, tuple) for q in t for p in parts(q)]
    from transformers.masking_utils import causal_mask_function

    return mask_function is None or all(
        p is causal_mask_function or getattr(p, "__qualname__", "") == "sliding_window_overlay.<locals>.inner_mask"
        for p in parts(mask_function))


def _window_overlay(mask_function, window) -> bool:
    """Whether ``mask_function`` is transformers' sliding-window overlay of ``window`` keys."""
    if window is None or getattr(mask_function, "__qualname__", "") != "sliding_window_overlay.<locals>.inner_mask":
        return False
    return [c.cell_contents for c in mask_function.__closure__ or ()] == [window]


def _nothing_padded(attention_mask) -> bool:
    """True for no 2-D padding mask or one of all ones (read on the host: while tracing, where that
    cannot be done, a mask counts as padding)."""
    if attention_mask is None:
        return True
    if torch.compiler.is_compiling() or attention_mask.ndim != 2:
        return False
    return bool(attention_mask.all())


def _nonzero(offset) -> bool:
    return bool(offset.ne(0).any()) if isinstance(offset, torch.Tensor) else bool(offset)


def register_transformers(name: str = "sagebwd") -> str:
    """Register the attention and mask functions under ``name`` (then ``attn_implementation=name``
    in ``from_pretrained`` or a model config selects them); returns ``name``."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name: expected a non-empty str, got {name!r}")
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as exc:
        raise ImportError(f'register_transformers needs transformers: pip install "sagebwd_cp[transformers]" '
                          f"({exc})") from None
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, _plain_causal_or_sdpa_mask)
    return name
