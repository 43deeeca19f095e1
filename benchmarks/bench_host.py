"""Host cost per call of the pure-Python parts, on a machine without a GPU.

Every call into the GPU (stream query, device query, kernel launch, module load) is replaced
by a stub, and device allocations go through the library's own allocation code to CPU
``torch.empty`` calls of the same shapes; CPU tensors are described as CUDA ones.  What is left is what the library itself spends in Python: finding the
launch plan, allocating, packing the pointers, and the adapter's bookkeeping.  On a GPU, add the
driver's own time per launch (a few µs each) and the real allocator.

    python benchmarks/bench_host.py                 # B=1, H=1, N=64, D=64, float16, causal
"""
from __future__ import annotations

import argparse
import timeit

import torch

import sagebwd_cp
from sagebwd_cp import arrays
from sagebwd_cp.gpu import compiler, device, launch, plan, tensor_map
from sagebwd_cp.api import run_backward, run_forward
from sagebwd_cp.options import AttentionOptions


def mock_the_gpu():
    import cupy
    from cupy.cuda import driver, runtime

    real_from_torch = arrays._from_torch

    def cuda_desc(x, name):  # CPU tensors pass for CUDA ones
        d = real_from_torch(x, name)
        d.device_type = "cuda"
        return d

    arrays._from_torch = cuda_desc
    arrays._TORCH_DEVICES[0] = torch.device("cpu")  # "CUDA device 0" allocations: torch.empty on the CPU
    plan.stream_reader = lambda framework: (lambda device_id: 0)
    compiler.get_function_pointer = lambda spec, entry, device_id, shared=0: 0x1000 + len(entry)
    device._device_limits[0] = 232448  # an H200's opt-in shared memory per block
    device._device_archs[0] = "sm_90"
    device._device_sms[0] = 132  # an H100's or H200's multiprocessors
    runtime.getDevice = lambda: 0
    driver.ctxGetCurrent = lambda: 1
    driver.launchKernel = lambda f, gx, gy, gz, bx, by, bz, shared, stream, params, extra: None
    # The backward's tensor maps (sm_90): the driver's encoder is not there; its calls are not timed.
    tensor_map._encoder = lambda layout: (lambda out, address: None)
    # The adapter branches on q.is_cuda: let CPU tensors take the CUDA branch.
    torch.Tensor.is_cuda = property(lambda self: True)
    return cupy


def best_us(fn, number: int, repeat: int = 7) -> float:
    fn()
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=1)
    p.add_argument("--seqlen", type=int, default=64)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--number", type=int, default=2000)
    args = p.parse_args(argv)
    mock_the_gpu()
    import sagebwd_cp.torch as st

    shape = (args.batch, args.heads, args.seqlen, args.head_dim)
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(shape, generator=g).half() for _ in range(4))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    out, _, (lse2, k_mean) = run_forward(q, k, v, AttentionOptions(causal=True), training=True)
    # as sagebwd_cp.attention(causal=True): api.run_forward's options (inference, no LSE, no μ_K given, dense, no sinks)
    options = ("forward", AttentionOptions(causal=True), False, False, False, None, False)

    def lookup():
        return plan.cached_plan((options, tuple(arrays.signature(x)[1] for x in (q, k, v))))

    sagebwd_cp.attention(q, k, v, causal=True)
    fwd = lookup()
    ptrs = [x.data_ptr() for x in (q, k, v)]
    table = ptrs + [0x10000] * len(fwd.outputs) + [0x20000]

    def pack_pointers():
        for step in fwd.steps:
            words = step.args.words
            for word, source, offset in step.slots:
                words[word] = table[source] + offset

    def grad_step():
        st.attention(qg, kg, vg, causal=True).backward(do)
        for x in (qg, kg, vg):
            x.grad = None

    rows = [
        ("signatures of q, k, v + plan lookup", lookup),
        (f"pack the pointers of one forward ({sum(len(s.slots) for s in fwd.steps)} slots, "
         f"{len(fwd.steps)} launches)", pack_pointers),
        ("plan.run: forward (allocations, launches)", lambda: fwd.run(ptrs)),
        ("sagebwd_cp.attention (inference)", lambda: sagebwd_cp.attention(q, k, v, causal=True)),
        ("sagebwd_cp.attention_forward (training, saved state)",
         lambda: sagebwd_cp.attention_forward(q, k, v, causal=True)),
        ("run_forward (training, as the adapter calls it)",
         lambda: run_forward(q, k, v, AttentionOptions(causal=True), training=True)),
        ("sagebwd_cp.attention_backward_arrays",
         lambda: sagebwd_cp.attention_backward_arrays(q, k, v, out, lse2, do, causal=True, k_mean=k_mean)),
        ("run_backward (as the adapter calls it)",
         lambda: run_backward(q, k, v, out, lse2, do, AttentionOptions(causal=True), k_mean=k_mean)),
        ("adapter inference (sagebwd_cp.torch.attention)", lambda: st.attention(q, k, v, causal=True)),
        ("adapter training forward (autograd.Function)", lambda: st.attention(qg, kg, vg, causal=True)),
        ("custom op attention_forward (torch.library, with autograd)",
         lambda: torch.ops.sagebwd_cp.attention_forward(qg, kg, vg, *AttentionOptions(causal=True))),
        ("adapter forward + backward", grad_step),
    ]
    print(f"shape (B, H, N, D) = {shape}, float16, causal; GPU calls stubbed; µs per call (best of 7)")
    for name, fn in rows:
        print(f"{name:62s} {best_us(fn, args.number):8.2f}")


if __name__ == "__main__":
    main()
