"""Soft-capped attention without a causal mask (the windowed kernels with the band open on both sides) beside its
peers in one run: ours with and without the soft cap, FlexAttention (compiled) with a tanh ``score_mod``, and
SDPA-cuDNN without a cap; bf16, no mask; forward and forward+backward ms (CUDA events, median); rounds interleave.

    python tools/experiments/softcap_unmasked.py [BxHqxHkvxNxD ...]   # default 2x16x4x4096x128 1x16x16x8192x128 2x8x8x4096x256
"""
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
from bench_attention import timed  # noqa: E402
from bench_windows import _torch_pair  # noqa: E402

import sagebwd_cp  # noqa: E402

CAP = 30.0


def ours(q, k, v, do, cap):
    kw = dict(softcap=cap, smooth_k=False) if cap else {}

    def fwdbwd():
        _, saved = sagebwd_cp.attention_forward(q, k, v, **kw)
        sagebwd_cp.attention_backward(saved, do)

    return (lambda: sagebwd_cp.attention(q, k, v, **kw)), fwdbwd


def flex(q, k, v, do):
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    mod = lambda score, b, h, i, j: CAP * torch.tanh(score / CAP)  # noqa: E731
    return _torch_pair(lambda q, k, v: compiled(q, k, v, score_mod=mod, enable_gqa=True), q, k, v, do)


def cudnn(q, k, v, do):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def attend(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    return _torch_pair(attend, q, k, v, do)


def main(shapes, rounds=3):
    print(torch.cuda.get_device_name(), torch.__version__)
    for shape in shapes:
        b, hq, hk, n, d = map(int, shape.split("x"))
        g = torch.Generator(device="cuda").manual_seed(0)
        make = lambda h: torch.randn((b, h, n, d), generator=g, device="cuda", dtype=torch.bfloat16)  # noqa: E731
        q, k, v = make(hq), make(hk), make(hk)
        do = torch.randn_like(q)
        runs = {"ours": ours(q, k, v, do, 0.0), "ours softcap": ours(q, k, v, do, CAP), "flex softcap": flex(q, k, v, do),
                "cudnn": cudnn(q, k, v, do)}
        times = {name: ([], []) for name in runs}
        for _ in range(rounds):
            for name, (fwd, fwdbwd) in runs.items():
                times[name][0].append(timed(fwd))
                times[name][1].append(timed(fwdbwd))
        med = {name: (statistics.median(f), statistics.median(fb)) for name, (f, fb) in times.items()}
        cells = "  ".join(f"{name} {f:.3f}/{fb:.3f}" for name, (f, fb) in med.items())
        print(f"{shape}: {cells}  | softcap/ours fwd+bwd {med['ours softcap'][1] / med['ours'][1]:.2f}, "
              f"flex/ours softcap {med['flex softcap'][1] / med['ours softcap'][1]:.2f}, "
              f"ours softcap/cudnn {med['ours softcap'][1] / med['cudnn'][1]:.2f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["2x16x4x4096x128", "1x16x16x8192x128", "2x8x8x4096x256"])
