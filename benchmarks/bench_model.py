"""Training step time of a Llama-style decoder from ``transformers``, with PyTorch's SDPA and with
sagebwd_cp attention, in one run: where a user feels the attention kernels.

The model: ``LlamaForCausalLM`` (RoPE, RMSNorm, SwiGLU), hidden 1024, 8 layers, GQA 4:1, head dim 128
(8 query heads), 64 (16) or 256 (4 query heads, one key/value head: Gemma's head dim), a byte vocabulary (256); bfloat16 autocast over float32 weights, AdamW.
The corpus is the Python standard library's source read byte by byte (no download), 16K tokens a
step (batch = 16384 / context). Both runs start from the same weights and see the same batches.

sagebwd_cp enters through ``sagebwd_cp.torch.register_transformers`` (``attn_implementation="sagebwd"``).
For each context and head dim it reports the median step time of each implementation and their
ratio, the share of the step spent in attention kernels (from the profiler's CUDA kernel times;
for SDPA the kernel names show which backend torch picked), and the mean loss of the last steps.

With ``--drift`` a third run trains with SDPA held off cuDNN (FlashAttention, else memory-efficient,
else the math backend, whichever takes the shapes): two exact attentions that differ only in
rounding, so their loss gap over the same steps is the drift any change of rounding causes, the
scale for ours against SDPA's.

    python benchmarks/bench_model.py [--contexts 2048 8192 32768] [--head-dims 128 64] [--steps 30]
        [--warmup 5] [--drift] [--json out.json]

``--json`` appends the run (its commit, arguments, device and records) to the file's ``runs``. A
record (one a head dim and context) keeps summaries, not every step, under each implementation's
name: the median step time and its percentiles, the profiled step's kernel times, the mean loss of
the last 10 and of the last ``LOSS_TAIL`` steps, the per-step loss difference from SDPA's run over
those steps (mean and s.d.), and the loss curve as the means of equal windows of steps.

Needs a CUDA GPU, PyTorch and transformers (``pip install transformers``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys

HIDDEN, LAYERS, TOKENS_PER_STEP, GQA = 1024, 8, 16384, 4
# CUDA kernels that belong to attention: ours (the pre-pass, the attention kernels, the row kernels)
# and SDPA's backends (FlashAttention, cuDNN, memory-efficient).
OUR_KERNELS = re.compile(r"attention_forward|attention_backward|quantize_tensors|token_sum|row_stats|dq_convert|"
                         r"natural_lse|pack_rows|smooth_q_bias")
SDPA_KERNELS = re.compile(r"flash|fmha|cudnn|sdpa|attention|cutlassF|cutlassB", re.IGNORECASE)
# What a record keeps of the losses: the mean of the last LOSS_TAIL steps (and the per-step difference
# from SDPA's over them), and the curve as the means of windows of steps, about CURVE_POINTS of them.
LOSS_TAIL, CURVE_POINTS = 100, 60
# Fields of train()'s result that a record keeps as they are, prefixed with the implementation's name.
KEPT = ("step_ms", "attention_share", "attention_kernels", "kernel_ms", "attention_ms", "attention_kernel_ms",
        "other_kernel_ms")


def build_model(head_dim: int, context: int, attn: str, seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import sagebwd_cp.torch as sage

    sage.register_transformers("sagebwd")
    heads = HIDDEN // head_dim
    config = LlamaConfig(vocab_size=256, hidden_size=HIDDEN, intermediate_size=2816, num_hidden_layers=LAYERS,
                         num_attention_heads=heads, num_key_value_heads=heads // GQA, head_dim=head_dim,
                         max_position_embeddings=context, tie_word_embeddings=False, attn_implementation=attn)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def batches(context: int, steps: int, seed: int, device):
    """``steps`` (inputs, labels) pairs of byte tokens from the standard library's source."""
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    from train_tiny import read_stdlib_bytes

    data = torch.frombuffer(bytearray(read_stdlib_bytes(64 << 20)), dtype=torch.uint8).long()
    batch = max(1, TOKENS_PER_STEP // context)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - context - 1, (batch,), generator=g)
        rows = torch.stack([data[s:s + context + 1] for s in starts.tolist()]).to(device)
        yield rows[:, :-1], rows[:, 1:]


def train_step(model, opt, x, y, cuda: bool = True):
    """One training step (bfloat16 autocast on CUDA, next-token cross entropy, AdamW); returns the loss
    tensor, not synchronized."""
    import contextlib

    import torch
    import torch.nn.functional as F

    with torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext():
        logits = model(input_ids=x).logits
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


# Implementations: name -> transformers attn_implementation (and, for "sdpa_other", the SDPA backends it may use).
IMPLS = {"sdpa": "sdpa", "sagebwd": "sagebwd", "sdpa_other": "sdpa"}


def _backends(impl: str):
    """A context that holds SDPA off cuDNN for "sdpa_other" (its first backend that takes the shapes)."""
    import contextlib

    if impl != "sdpa_other":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def train(head_dim: int, context: int, impl: str, steps: int, warmup: int, seed: int) -> dict:
    """Median step time (ms), attention's share of the kernel time, the attention kernels' names and
    the losses of one implementation."""
    with _backends(impl):
        return _train(head_dim, context, IMPLS[impl], steps, warmup, seed)


def _train(head_dim: int, context: int, attn: str, steps: int, warmup: int, seed: int) -> dict:
    import torch

    device = torch.device("cuda")
    model = build_model(head_dim, context, attn, seed).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    times, losses, profile = [], [], None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for step, (x, y) in enumerate(batches(context, warmup + steps + 1, seed, device)):
        last = step == warmup + steps  # one more step, under the profiler
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) if last else None
        if prof is not None:
            prof.__enter__()
        start.record()
        loss = train_step(model, opt, x, y)
        end.record()
        if prof is not None:
            torch.cuda.synchronize()
            prof.__exit__(None, None, None)
            profile = prof
            break
        torch.cuda.synchronize()
        losses.append(loss.item())
        if step >= warmup:
            times.append(start.elapsed_time(end))
    pattern = OUR_KERNELS if attn == "sagebwd" else SDPA_KERNELS
    kernel_us, attention_us, names, others = 0.0, 0.0, {}, {}
    for event in profile.key_averages():
        us = event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
        if us <= 0:
            continue
        kernel_us += us
        into = names if pattern.search(event.key) else others
        into[event.key] = into.get(event.key, 0.0) + us
        attention_us += us if into is names else 0.0
    del model, opt
    torch.cuda.empty_cache()
    top = lambda d, n: {k[:120]: round(d[k] / 1e3, 4) for k in sorted(d, key=d.get, reverse=True)[:n]}
    return {"step_ms": statistics.median(times), "step_times_ms": times,
            "attention_share": attention_us / kernel_us if kernel_us else None,
            "attention_kernels": sorted(names, key=names.get, reverse=True)[:4], "losses": losses,
            # the profiled step: all kernels' time, attention's, and the largest kernels of each kind (ms)
            "kernel_ms": kernel_us / 1e3, "attention_ms": attention_us / 1e3,
            "attention_kernel_ms": top(names, 8), "other_kernel_ms": top(others, 12)}


def _percentile(xs: list, p: float) -> float:
    """The ``p`` quantile (0-1) of sorted ``xs``, interpolated linearly."""
    i = (len(xs) - 1) * p
    lo, hi = int(i), min(int(i) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)


def step_stats(times: list) -> dict:
    """Minimum, 10th and 90th percentiles, maximum and mean of the step times (ms); the median is the
    record's ``step_ms``."""
    xs = sorted(times)
    return {"min": xs[0], "p10": _percentile(xs, 0.1), "p90": _percentile(xs, 0.9), "max": xs[-1],
            "mean": statistics.mean(xs)}


def loss_curve(losses: list, points: int = CURVE_POINTS) -> dict:
    """The curve as the means of consecutive windows of ``every`` steps (the last window may be shorter)."""
    every = max(1, math.ceil(len(losses) / points))
    return {"every": every, "mean": [statistics.mean(losses[i:i + every]) for i in range(0, len(losses), every)]}


def record(head_dim: int, context: int, steps: int, res: dict) -> dict:
    """One record of ``main``'s JSON from ``{impl: train()'s result}``: per implementation the kept
    fields, the step times' percentiles (where ``step_times_ms`` is given) and the loss summaries and
    curve (module docstring)."""
    tail = min(LOSS_TAIL, *(len(v["losses"]) for v in res.values()))
    rec = {"head_dim": head_dim, "context": context, "steps": steps, "loss_tail_steps": tail}
    for k, v in res.items():
        out = {f: v[f] for f in KEPT if f in v}
        if v.get("step_times_ms"):
            out["step_ms_stats"] = step_stats(v["step_times_ms"])
        out["loss"] = statistics.mean(v["losses"][-min(10, steps):])
        out["loss_tail"] = statistics.mean(v["losses"][-tail:])
        if k != "sdpa" and "sdpa" in res:
            diff = [a - b for a, b in zip(v["losses"][-tail:], res["sdpa"]["losses"][-tail:])]
            out["loss_diff_tail"] = {"mean": statistics.mean(diff),
                                     "sd": statistics.stdev(diff) if len(diff) > 1 else 0.0}
        out["loss_curve"] = loss_curve(v["losses"])
        rec[k] = out
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[128, 64], choices=[64, 128, 256])
    ap.add_argument("--steps", type=int, default=30, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--drift", action="store_true",
                    help="also train with SDPA off cuDNN (the scale of rounding drift)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        ap.error(f"--steps: expected at least 1 (and --warmup at least 0), got {args.steps} and {args.warmup}")

    import torch

    if not torch.cuda.is_available():
        print("bench_model.py needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name()
    tail = min(10, args.steps)
    rows, records = [], []
    for d in args.head_dims:
        for context in args.contexts:
            impls = ("sdpa", "sagebwd") + (("sdpa_other",) if args.drift else ())
            res = {impl: train(d, context, impl, args.steps, args.warmup, args.seed) for impl in impls}
            sdpa, ours = res["sdpa"], res["sagebwd"]
            loss = {k: statistics.mean(v["losses"][-tail:]) for k, v in res.items()}
            records.append(record(d, context, args.steps, res))
            share = lambda r: "-" if r["attention_share"] is None else f"{100 * r['attention_share']:.0f}%"
            rows.append(f"{d:>3} {context:>6} {sdpa['step_ms']:9.1f} {ours['step_ms']:9.1f} "
                        f"{ours['step_ms'] / sdpa['step_ms']:7.3f} {share(sdpa):>6} {share(ours):>6} "
                        f"{sdpa['attention_ms']:7.2f} {ours['attention_ms']:7.2f} {sdpa['kernel_ms']:7.1f} "
                        f"{ours['kernel_ms']:7.1f} "
                        f"{loss['sdpa']:8.4f} {loss['sagebwd']:8.4f}"
                        + (f" {loss['sdpa_other']:8.4f}" if args.drift else "")
                        + f"  {', '.join(sdpa['attention_kernels'][:2])}")
    if args.json:
        from report_common import git_commit, write_json

        runs = []
        if os.path.exists(args.json):
            with open(args.json) as f:
                runs = json.load(f).get("runs", [])
        runs.append({"commit": git_commit(), "args": " ".join(sys.argv[1:] if argv is None else argv),
                     "device": device, "torch": torch.__version__, "records": records})
        write_json(args.json, {"runs": runs})
    print(f"\n{device}: Llama-style decoder, hidden {HIDDEN}, {LAYERS} layers, GQA {GQA}:1, {TOKENS_PER_STEP} tokens "
          f"a step, bfloat16 autocast, AdamW; median of {args.steps} steps after {args.warmup}; loss: mean of the "
          f"last {tail}")
    print("  d    ctx   sdpa ms   ours ms  ours/sdpa  attn% sdpa/ours  attn ms sdpa/ours  kernel ms sdpa/ours  "
          "loss sdpa  ours" + ("  sdpa(other backend)" if args.drift else "") + "  SDPA's attention kernels")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
