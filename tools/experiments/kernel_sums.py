"""What the experiments that report kernel sums share (softcap_smoothing.py, sink_passes.py): a shape's inputs, and
tools/probe_sdpa_kernels.py's ``kernel_times`` (the GPU time of a step by kernel name, torch's profiler)."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from probe_sdpa_kernels import kernel_times  # noqa: E402,F401


def bhnd_inputs(text: str) -> tuple:
    """q, k, v, dO (bf16, (B, H, N, D), seeded) of a shape ``BxHqxHkvxNxD``, and the generator that drew them."""
    b, hq, hk, n, d = map(int, text.split("x"))
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, hq, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(b, hk, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    do = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v, do, g
