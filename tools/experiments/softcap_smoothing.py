"""Soft-capped attention with and without K-smoothing (each row's share added back before tanh): the kernel time of
one forward+backward by kernel name (torch's profiler, mean of 5 calls after 3 warm-up calls), bf16, causal, cap 30.

    python tools/experiments/softcap_smoothing.py [BxHqxHkvxNxD ...]   # default 8x16x16x2048x128 2x16x4x8192x128
"""
import sys

import sagebwd_cp
from kernel_sums import bhnd_inputs, kernel_times

CAP = 30.0


def kernel_times_of(q, k, v, do, smooth_k: bool) -> dict:
    def step():
        _, saved = sagebwd_cp.attention_forward(q, k, v, causal=True, softcap=CAP, smooth_k=smooth_k)
        sagebwd_cp.attention_backward(saved, do)

    return kernel_times(step, 5)


def main(shapes) -> None:
    for text in shapes:
        q, k, v, do, _ = bhnd_inputs(text)
        for smooth in (False, True):
            per = kernel_times_of(q, k, v, do, smooth)
            top = ", ".join(f"{name[:24]} {us:.1f}" for name, us in sorted(per.items(), key=lambda kv: -kv[1]))
            print(f"{text} smooth_k={smooth}: {sum(per.values()):.1f} µs ({top})", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["8x16x16x2048x128", "2x16x4x8192x128"])
