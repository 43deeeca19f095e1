"""PyTorch adapter for sagebwd_cp: ``import sagebwd_cp.torch``.

- ``attention(q, k, v, causal=..., layout="HND" | "NHD", ...)``: differentiable SageBwd attention;
- ``scaled_dot_product_attention(...)``: drop-in for ``torch.nn.functional.scaled_dot_product_attention``;
- ``flash_attn_func(...)``: drop-in for FlashAttention's ``flash_attn_func`` (NHD);
- ``flash_attn_varlen_func(...)``: drop-in for FlashAttention's ``flash_attn_varlen_func`` (packed batches);
- ``SageAttention``: the same as an ``nn.Module``;
- ``SageAttentionFunction``: the ``torch.autograd.Function`` of eager calls, every option an argument;
- ``register_transformers(name="sagebwd")``: ``attn_implementation="sagebwd"`` for ``transformers`` models;
- ``chunked_attention(q, ks, vs, ...)``: differentiable attention over a list of K/V chunks, merged by
  LSE, with its pieces ``attention_lse``, ``attention_backward_lse``, ``merge_attention``, ``key_mean``;
- ``ring_attention(q, k, v, ...)``: context-parallel attention over a ``torch.distributed`` group
  (K/V passed around the ring), with ``zigzag_shard`` / ``zigzag_unshard`` for causal load balance;
- the operators ``torch.ops.sagebwd_cp.attention``, ``.attention_forward``, ``.attention_backward``,
  ``.attention_lse``, ``.varlen_forward`` and ``.varlen_backward`` (``torch.library.custom_op``, with
  fake implementations and autograd),
  which ``torch.compile`` traces with no graph break.

CUDA tensors run the INT8 kernels on torch's current stream, with outputs from torch's caching
allocator; CPU tensors run the NumPy emulator of the same algorithm.
"""
try:
    import torch  # noqa: F401
except ImportError as exc:  # name the extra rather than leave a bare "No module named 'torch'"
    raise ModuleNotFoundError(f"sagebwd_cp.torch needs PyTorch, which is not importable ({exc}); "
                              "install it with: pip install \"sagebwd_cp[torch]\"", name="torch") from exc

from ._ops import attention_backward_op, attention_forward_op, attention_lse_op, attention_op  # noqa: E402
from .functional import SageAttentionFunction, attention, flash_attn_func, scaled_dot_product_attention  # noqa: E402
from .modules import SageAttention  # noqa: E402
from .transformers import register_transformers  # noqa: E402
from .chunked import attention_backward_lse, attention_lse, chunked_attention, key_mean, merge_attention  # noqa: E402
from .ring import ring_attention, zigzag_shard, zigzag_unshard  # noqa: E402
from .varlen import flash_attn_varlen_func  # noqa: E402
from sagebwd_cp.guard import AccuracyWarning, score_step, set_accuracy_guard  # noqa: E402

__all__ = ["attention", "scaled_dot_product_attention", "flash_attn_func", "flash_attn_varlen_func", "SageAttention",
           "SageAttentionFunction", "attention_op", "attention_forward_op", "attention_backward_op", "attention_lse_op",
           "register_transformers", "chunked_attention", "attention_lse", "attention_backward_lse", "merge_attention",
           "key_mean", "ring_attention", "zigzag_shard", "zigzag_unshard", "score_step", "set_accuracy_guard",
           "AccuracyWarning"]
