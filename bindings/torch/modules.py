"""``SageAttention``: the attention call as an ``nn.Module`` (no parameters)."""
from __future__ import annotations

from torch import Tensor, nn

from sagebwd_cp.options import AttentionOptions, window_options

from .functional import attention


class SageAttention(nn.Module):
    """``SageAttention(causal=False, layout="HND", softmax_scale=None, **options)(q, k, v)``.

    The options are those of ``sagebwd_cp.torch.attention``: ``smooth_k``, ``smooth_q``,
    ``granularity``, ``deterministic``, ``window_size`` and ``softcap``; they are checked here, at construction.
    """

    def __init__(self, causal: bool = False, layout: str = "HND", softmax_scale: float | None = None, *,
                 smooth_k: bool = True, smooth_q: bool = False, granularity: str = "fine",
                 deterministic: bool = False, window_size=(-1, -1), softcap: float = 0.0):
        super().__init__()
        self.options = AttentionOptions(causal=causal, softmax_scale=softmax_scale, smooth_k=smooth_k,
                                        smooth_q=smooth_q, layout=layout, granularity=granularity,
                                        deterministic=deterministic, **window_options(window_size), softcap=softcap)
        for name, value in self.options._asdict().items():
            setattr(self, name, value)
        self.window_size = (self.options.window_left, self.options.window_right)

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        o = self.options
        return attention(q, k, v, causal=o.causal, softmax_scale=o.softmax_scale, layout=o.layout, smooth_k=o.smooth_k,
                         smooth_q=o.smooth_q, granularity=o.granularity, deterministic=o.deterministic,
                         window_size=self.window_size, softcap=o.softcap)

    def extra_repr(self) -> str:
        scale = "default" if self.softmax_scale is None else f"{self.softmax_scale:g}"
        return (f"causal={self.causal}, layout={self.layout!r}, softmax_scale={scale}, smooth_k={self.smooth_k}, "
                f"smooth_q={self.smooth_q}, granularity={self.granularity!r}, deterministic={self.deterministic}"
                + (f", window_size={self.window_size}" if self.options.windowed else "")
                + (f", softcap={self.options.softcap:g}" if self.options.softcap else ""))
