"""The wgmma backward pass's time (pre- and post-kernels included) under each causal grid order, forced by patching
backward.backward_grid; bf16; rounds interleave the orders; prints ms a round and heads-first / blocks-first.

    [DET=1] [WINDOW=W] python tools/experiments/grid_orders.py BxHqxHkvxNxD[xDv] ...  # e.g. 8x16x16x2048x128
(DET=1: the deterministic backward; WINDOW=W: a causal sliding window of W keys, window_size=(W, 0); Dv: V's head
dim where it differs, e.g. 8x16x4x1024x192x128)."""
import os
import sys

import torch

import sagebwd_cp.torch as st
from sagebwd_cp.gpu import backward, launch, plan

real = backward.backward_grid


def forced(order):
    def grid(prob, block_keys, deterministic, wgmma, sms, passes=1, **kw):
        g, o = real(prob, block_keys, deterministic, wgmma, sms, passes, **kw)
        return launch.attention_grid(prob.len_k, block_keys, prob.heads_kv, prob.batch, order, "k", passes), order
    return grid


def run(shape, reps=20, rounds=5):
    b, hq, hk, n, d = shape[:5]
    dv = shape[5] if len(shape) > 5 else d
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, n, hq, d, generator=g, device="cuda").bfloat16()
    k = torch.randn(b, n, hk, d, generator=g, device="cuda").bfloat16()
    v = torch.randn(b, n, hk, dv, generator=g, device="cuda").bfloat16()
    do = torch.randn(b, n, hq, dv, generator=g, device="cuda").bfloat16()
    window = int(os.environ.get("WINDOW", "-1"))
    res = {}
    for r in range(rounds):
        for name, order in (("blocks", launch.BLOCKS_FIRST), ("heads", launch.HEADS_FIRST),
                            ("heads_batch", launch.HEADS_BATCH_FIRST)):
            backward.backward_grid = forced(order)
            plan.clear_plans()
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            out = st.flash_attn_func(*leaves, causal=True, deterministic=os.environ.get("DET") == "1",
                                     window_size=(window, 0))
            out.backward(do, retain_graph=True)
            torch.cuda.synchronize()
            ts = []
            for _ in range(reps):
                for x in leaves:
                    x.grad = None
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                out.backward(do, retain_graph=True)
                e.record()
                torch.cuda.synchronize()
                ts.append(s.elapsed_time(e))
            ts.sort()
            res.setdefault(name, []).append(ts[len(ts) // 2])
    backward.backward_grid = real
    ratio = [h / bl for h, bl in zip(res["heads"], res["blocks"])]
    print(shape, {k: " ".join(f"{x:.3f}" for x in v) for k, v in res.items()},
          "heads/blocks", " ".join(f"{x:.3f}" for x in ratio), flush=True)


for spec in sys.argv[1:]:
    run(tuple(int(x) for x in spec.split("x")))
