"""One attention step on the GPU, for a profiler to attach to (ncu, nsys, compute-sanitizer).

Runs ``--warmup`` untimed steps then ``--steps`` more; pick the kernel with the profiler's own
filters, e.g.

    ncu --kernel-name attention_backward --launch-skip 2 --launch-count 1 --set full \
        python tools/profile_step.py --head-dim 128 --seqlen 4096 --pass bwd

A GQA model's shapes: ``--hidden 1024 --gqa 4 --dtype bfloat16 --causal`` (bench_model.py's).
``--impl cudnn`` runs SDPA on cuDNN's kernels instead, the peer's side of the same profile.
"""
from __future__ import annotations

import argparse

import torch

import sagebwd_cp


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=16384, help="tokens per batch (batch = tokens // seqlen)")
    p.add_argument("--hidden", type=int, default=2048, help="heads = hidden // head_dim")
    p.add_argument("--gqa", type=int, default=1, help="query heads per key/value head")
    p.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--granularity", choices=("fine", "paper"), default="fine")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--pass", dest="which", choices=("fwd", "bwd"), default="bwd")
    p.add_argument("--impl", choices=("ours", "cudnn"), default="ours")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=1)
    a = p.parse_args(argv)
    b, h = max(1, a.tokens // a.seqlen), a.hidden // a.head_dim
    dtype = getattr(torch, a.dtype)
    if h % a.gqa:
        p.error(f"--gqa: expected a divisor of the {h} query heads, got {a.gqa}")
    q, k, v, do = (torch.randn((b, heads, a.seqlen, a.head_dim), device="cuda", dtype=dtype)
                   for heads in (h, h // a.gqa, h // a.gqa, h))
    if a.impl == "cudnn":
        _sdpa_steps(a, q, k, v, do)
        return
    for _ in range(a.warmup + a.steps):
        if a.which == "fwd":
            sagebwd_cp.attention(q, k, v, causal=a.causal)
        else:
            out, saved = sagebwd_cp.attention_forward(q, k, v, causal=a.causal)
            sagebwd_cp.attention_backward(saved, do, granularity=a.granularity, deterministic=a.deterministic)
    torch.cuda.synchronize()


def _sdpa_steps(a, q, k, v, do):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (t.requires_grad_(a.which == "bwd") for t in (q, k, v))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        for _ in range(a.warmup + a.steps):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=a.causal, enable_gqa=a.gqa > 1)
            if a.which == "bwd":
                torch.autograd.grad(out, (q, k, v), do)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
