"""sagebwd_cp: trainable INT8 attention (SageBwd).

``attention`` for inference, ``attention_forward`` / ``attention_backward`` for training (the
``attention_varlen*`` functions for packed batches), on any
DLPack array (CuPy, PyTorch, JAX; NumPy arrays run the emulator).  ``import sagebwd_cp.torch`` for
the PyTorch adapter.
"""
from .api import (AttentionSaved, attention, attention_backward, attention_backward_arrays, attention_forward,
                  attention_varlen, attention_varlen_backward_arrays, attention_varlen_forward, k_mean_shape,
                  lse2_shape)
from .arrays import ArrayDesc, describe, set_allocator
from .chunked import (attention_backward_lse, band_piece, causal_pieces, key_mean, lse_to_lse2, merge_attention,
                      prefix_key_mean)
from .guard import AccuracyWarning, score_step, set_accuracy_guard
from .gpu.kernel_cache import KernelCacheWarning
from .gpu.launch_errors import KernelLaunchError
from .options import AttentionOptions

__version__ = "0.1.0"
__all__ = ["attention", "attention_forward", "attention_backward", "attention_backward_arrays", "attention_varlen",
           "attention_varlen_forward", "attention_varlen_backward_arrays", "lse2_shape",
           "k_mean_shape", "attention_backward_lse", "merge_attention", "key_mean", "prefix_key_mean", "lse_to_lse2",
           "causal_pieces", "band_piece", "AttentionOptions", "AttentionSaved", "ArrayDesc", "describe",
           "set_allocator", "score_step", "set_accuracy_guard", "AccuracyWarning", "__version__"]
__all__ += ["KernelCacheWarning", "KernelLaunchError"]
