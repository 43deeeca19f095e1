"""Attention sinks around the kernels: the kernel time of one forward+backward by kernel name (torch's profiler, mean
of 10 calls after 3 warm-up calls), the sinks joined where the LSE is formed and δ read from the backward's row
statistics (this version), against the elementwise join and the sinks' gradient formed from O and dO (sinks.py's
join_sinks and sinks_grad around a forward and backward without sinks, as the earlier versions ran them); bf16,
causal.

    python tools/experiments/sink_passes.py [BxHqxHkvxNxD ...]   # default 8x16x16x2048x128 2x64x8x4096x64
"""
import sys

import torch

import sagebwd_cp
from kernel_sums import bhnd_inputs, kernel_times
from sagebwd_cp.sinks import join_sinks, sinks_grad


def main(shapes) -> None:
    for text in shapes:
        q, k, v, do, g = bhnd_inputs(text)
        sinks = torch.randn(q.shape[1], device="cuda", generator=g)

        def fused():
            _, saved = sagebwd_cp.attention_forward(q, k, v, causal=True, sinks=sinks)
            sagebwd_cp.attention_backward(saved, do)

        def elementwise():
            out, lse, saved = sagebwd_cp.attention_forward(q, k, v, causal=True, return_lse=True)
            out, lse, lse2 = join_sinks(out, lse, saved.lse2.obj, sinks, "HND")
            sagebwd_cp.attention_backward_arrays(q, k, v, out, lse2, do, causal=True, k_mean=saved.k_mean.obj)
            sinks_grad(out, lse, do, sinks, "HND")

        for name, step in (("fused", fused), ("elementwise", elementwise)):
            per = kernel_times(step, 10)
            top = ", ".join(f"{k[:22]} {us:.1f}" for k, us in sorted(per.items(), key=lambda kv: -kv[1])[:6])
            print(f"{text} {name}: {sum(per.values()):.1f} µs ({top})", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["8x16x16x2048x128", "2x64x8x4096x64"])
