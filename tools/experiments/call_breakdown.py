"""Where a forward+backward call's time goes, ours beside cuDNN's (GPU; bf16, causal; shapes BxHqxHkvxNxD[xDv] as in
benchmarks/bench_wide_head_dims.py, whose peers it times):

- each kernel's GPU time in one call of ours (torch's profiler through tools/probe_sdpa_kernels.py's
  ``kernel_times``): the attention kernels against the passes around them (quantize, row_stats, dq_convert, and at
  a V head dim of its own the zero-padding copies);
- the forward and the forward+backward of ours and of cuDNN timed two ways: a synchronize after every call (the
  benchmarks' ``timed``: the host's work before the first launch shows) and 20 calls queued between two events (the
  host running ahead, as in training).

    python tools/experiments/call_breakdown.py [2x16x4x4096x192x128 8x16x16x2048x128 ...]
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "benchmarks"))
sys.path.insert(0, os.path.join(HERE, ".."))
from bench_attention import timed  # noqa: E402
from bench_wide_head_dims import PEERS, shape_inputs  # noqa: E402
from probe_sdpa_kernels import kernel_times, print_kernel_times  # noqa: E402


def queued(fn, calls: int = 20, reps: int = 7) -> float:
    """Median ms a call with ``calls`` calls queued back to back between two events (``timed`` of the batch)."""
    def batch():
        for _ in range(calls):
            fn()

    return timed(batch, reps=reps, warmup=1) / calls


def main(shapes) -> None:
    for shape in shapes:
        q, k, v, do = shape_inputs(shape)
        _, ours_fwdbwd = PEERS["ours"](q, k, v, do)
        print_kernel_times(f"{shape} ours, one fwd+bwd", kernel_times(ours_fwdbwd, 10))
        for peer in ("ours", "cudnn"):
            fwd, fwdbwd = PEERS[peer](q, k, v, do)
            print(f"{shape} {peer}: ms synced / queued: forward {timed(fwd):.3f} / {queued(fwd):.3f}, "
                  f"fwd+bwd {timed(fwdbwd):.3f} / {queued(fwdbwd):.3f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["2x16x4x4096x192x128", "8x16x16x2048x128"])
