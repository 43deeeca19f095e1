"""The GPU time of a step by kernel name: torch's profiler over ``calls`` calls after ``warmup`` calls, µs a call.
Shared by the experiments that report kernel sums (softcap_smoothing.py, sink_passes.py)."""
import collections

import torch
from torch.profiler import ProfilerActivity, profile


def kernel_times(step, calls: int = 10, warmup: int = 3) -> dict:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    per = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name] += e.device_time_total / calls
    return per
