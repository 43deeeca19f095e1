"""sagebwd_cp as an attention implementation of Hugging Face ``transformers``.

``register_transformers()`` registers an attention function and its mask function under a name
(default ``"sagebwd"``), so that ``attn_implementation="sagebwd"`` works for Llama-, Qwen- and
Mistral-style models:

- a batch without padding: causal attention by the kernels' own rule (no mask is built);
- a batch the kernels cannot express yet: a padded batch (a 2-D ``attention_mask`` with zeros),
  packed sequences (``position_ids`` restarting, ``cu_seq_lens_*``), sliding windows, soft-capping,
  a cache with an offset, or any custom mask: a ``ValueError`` that says so, never a silent wrong
  answer. (Variable-length batches need the packed-sequence path, which the library does not have
  yet: pass unpadded batches, or use ``attn_implementation="sdpa"`` for them.)

The mask function returns None exactly when the batch is plain causal attention (no padding mask,
or one of all ones read on the host in eager mode; no cache offset; the default causal rule);
otherwise it builds the mask transformers' SDPA integration would, which the attention function
then refuses.
"""
from __future__ import annotations

__all__ = ["register_transformers", "attention_forward"]


def _refuse(what: str) -> ValueError:
    return ValueError(f"sagebwd_cp attention (transformers): {what} is not supported; pass batches without "
                      "padding or packing, or use attn_implementation=\"sdpa\" for this model")


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      sliding_window=None, softcap=None, is_causal=None, **kwargs):
    """transformers' attention interface: query (B, Hq, N, D), key and value (B, Hkv, N, D) with Hq a
    multiple of Hkv; returns ((B, N, Hq, D), None)."""
    from .functional import attention

    if attention_mask is not None:
        raise _refuse(f"an attention mask of shape {tuple(attention_mask.shape)} (a padded or packed batch, "
                      "a cache offset or a custom mask)")
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
        raise _refuse("packed sequences (cu_seq_lens_q / cu_seq_lens_k)")
    if dropout:
        raise _refuse(f"attention dropout ({dropout})")
    if sliding_window is not None:
        raise _refuse(f"a sliding window ({sliding_window})")
    if softcap is not None:
        raise _refuse(f"logit soft-capping ({softcap})")
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    out = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), causal=bool(causal),
                    layout="NHD", softmax_scale=scaling)
    return out, None


def _plain_causal_or_sdpa_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                               attention_mask=None, local_size=None, **kwargs):
    """None for plain causal attention over the whole batch (no padding mask, no offset, the default
    causal rule), else the mask SDPA would get: the attention function refuses any mask."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    plain = (_nothing_padded(attention_mask) and local_size is None and mask_function in (None, causal_mask_function)
             and not _nonzero(q_offset) and not _nonzero(kv_offset) and q_length == kv_length)
    if plain:
        return None
    kwargs.pop("allow_is_causal_skip", None)  # a skipped mask would read as plain causal here
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function or causal_mask_function,
                     attention_mask=attention_mask, local_size=local_size, allow_is_causal_skip=False, **kwargs)


def _nothing_padded(attention_mask) -> bool:
    """True for no 2-D padding mask or one of all ones (read on the host: while tracing, where that
    cannot be done, a mask counts as padding)."""
    import torch

    if attention_mask is None:
        return True
    if torch.compiler.is_compiling() or attention_mask.ndim != 2:
        return False
    return bool(attention_mask.all())


def _nonzero(offset) -> bool:
    import torch

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
