"""PyTorch adapter for sagebwd_cp: ``import sagebwd_cp.torch``.

- ``attention(q, k, v, causal=..., layout="HND" | "NHD", ...)``: differentiable SageBwd attention;
- ``scaled_dot_product_attention(...)``: drop-in for ``torch.nn.functional.scaled_dot_product_attention``;
- ``flash_attn_func(...)``: drop-in for FlashAttention's ``flash_attn_func`` (NHD);
- ``SageAttention``: the same as an ``nn.Module``;
- ``SageAttentionFunction``: the ``torch.autograd.Function`` of eager calls, every option an argument;
- ``register_transformers(name="sagebwd")``: ``attn_implementation="sagebwd"`` for ``transformers`` models;
- the operators ``torch.ops.sagebwd_cp.attention``, ``.attention_forward`` and
  ``.attention_backward`` (``torch.library.custom_op``, with fake implementations and autograd),
  which ``torch.compile`` traces with no graph break.

CUDA tensors run the INT8 kernels on torch's current stream, with outputs from torch's caching
allocator; CPU tensors run the NumPy emulator of the same algorithm.
"""
try:
    import torch  # noqa: F401
except ImportError as exc:  # name the extra rather than leave a bare "No module named 'torch'"
    raise ModuleNotFoundError(f"sagebwd_cp.torch needs PyTorch, which is not importable ({exc}); "
                              "install it with: pip install \"sagebwd_cp[torch]\"", name="torch") from exc

from ._ops import attention_backward_op, attention_forward_op, attention_op  # noqa: E402
from .functional import SageAttentionFunction, attention, flash_attn_func, scaled_dot_product_attention  # noqa: E402
from .modules import SageAttention  # noqa: E402
from .transformers import register_transformers  # noqa: E402
from sagebwd_cp.guard import AccuracyWarning, score_step, set_accuracy_guard  # noqa: E402

__all__ = ["attention", "scaled_dot_product_attention", "flash_attn_func", "SageAttention", "SageAttentionFunction",
           "attention_op", "attention_forward_op", "attention_backward_op", "register_transformers", "score_step",
           "set_accuracy_guard", "AccuracyWarning"]
