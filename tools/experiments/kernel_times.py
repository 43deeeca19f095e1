"""Each kernel's GPU time in one causal bf16 forward+backward of ours (torch's profiler), one line a kernel:
``<shape> <kernel> <µs>``, for shapes ``BxHqxHkvxNxD[xDv]`` as in benchmarks/bench_wide_head_dims.py. The per-kernel
bench of ``tools/ab_kernels.py --bench kernels``.

    python tools/experiments/kernel_times.py 8x16x16x2048x128 2x16x4x4096x256
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "benchmarks"))
sys.path.insert(0, os.path.join(HERE, ".."))
from bench_wide_head_dims import PEERS, shape_inputs  # noqa: E402
from probe_sdpa_kernels import kernel_times  # noqa: E402


def main(shapes, reps: int = 10) -> None:
    for shape in shapes:
        q, k, v, do = shape_inputs(shape)
        _, fwdbwd = PEERS["ours"](q, k, v, do)
        for name, us in sorted(kernel_times(fwdbwd, reps).items(), key=lambda kv: -kv[1]):
            print(f"{shape} {name.split('(')[0].replace(' ', '_')} {us:.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
