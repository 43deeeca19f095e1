"""ncu's view of the attention kernels beside cuDNN's, one launch each, as a markdown table.

For every kernel variant (our kernels under environment settings, or SDPA on cuDNN), pass, head
dim and sequence length it runs ncu on ``profile_step.py`` and reads back: time, issue slots busy,
cycles with no eligible warp, warps active and eligible a scheduler, instructions executed,
registers, grid and block, and the busiest tensor pipe (whatever tensor-pipe counters this ncu
knows for the chip).

    python tools/ncu_table.py --variants default: ws:SAGEBWD_BACKWARD_WS=1 cudnn \\
        --passes bwd --head-dims 64 128 --seqlens 2048 16384 --json out.json

With ``--base DIR`` (another version's ``kernels/`` and ``ptx/``, and its ``sagebwd_cp/`` if there, as for
``tools/ab_kernels.py``) each of our variants is profiled with those sources too, labelled ``LABEL@base``: the old,
new and cuDNN lines of a kernel change from one command.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
try:  # (run as a script from tools/, or imported as tools.ncu_table)
    from ab_kernels import swapped_sources
except ImportError:
    from tools.ab_kernels import swapped_sources
BASE_METRICS = {
    "time_us": "gpu__time_duration.sum",  # read back in µs
    "issue_busy_pct": "sm__inst_issued.avg.pct_of_peak_sustained_active",
    "issue_active_pct": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "warps_active": "smsp__warps_active.avg.per_cycle_active",
    "warps_eligible": "smsp__warps_eligible.avg.per_cycle_active",
    "instructions": "smsp__inst_executed.sum",
    "registers": "launch__registers_per_thread",
    "grid": "launch__grid_size",
    "block": "launch__block_size",
}
KERNELS = {("ours", "fwd"): "regex:^attention_forward$", ("ours", "bwd"): "regex:^attention_backward$",
           ("cudnn", "fwd"): "regex:fprop", ("cudnn", "bwd"): "regex:bprop"}


def tensor_pipe_metrics(ncu: str) -> list:
    """The tensor-pipe cycle counters this ncu lists for the device's chip, as % of peak."""
    out = subprocess.run([ncu, "--query-metrics"], capture_output=True, text=True).stdout
    names = sorted(set(re.findall(r"^(sm__pipe_tensor\w*cycles_active)\b", out, re.M)))
    return [n + ".avg.pct_of_peak_sustained_active" for n in names]


def profile(ncu, metrics, impl, env, which, d, n, args) -> dict:
    cmd = [ncu, "--csv", "--metrics", ",".join(metrics), "--kernel-name", KERNELS[(impl, which)],
           "--launch-skip", "2", "--launch-count", "1",
           sys.executable, os.path.join(HERE, "profile_step.py"), "--impl", impl, "--pass", which,
           "--head-dim", str(d), "--seqlen", str(n), "--tokens", str(args.tokens), "--hidden", str(args.hidden),
           "--gqa", str(args.gqa), "--dtype", args.dtype] + (["--causal"] if args.causal else []) \
        + (["--deterministic"] if args.deterministic and impl == "ours" else [])
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env})
    rows = [line for line in r.stdout.splitlines() if line.startswith('"')]
    if r.returncode or not rows:
        raise RuntimeError(f"ncu failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    values, name = {}, ""
    for row in csv.DictReader(io.StringIO("\n".join(rows))):
        name = row.get("Kernel Name", name)
        value = row["Metric Value"].replace(",", "")
        scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}.get(row.get("Metric Unit", ""))
        values[row["Metric Name"]] = str(_num(value) * scale) if scale else value
    return {"kernel": name, **values}


def _num(s):
    try:
        return float(s)
    except (TypeError, ValueError):
        return float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", nargs="+", default=["default:", "cudnn"],
                    help="'cudnn', or LABEL:NAME=VALUE,... for our kernels under those settings")
    ap.add_argument("--passes", nargs="+", choices=("fwd", "bwd"), default=("fwd", "bwd"))
    ap.add_argument("--head-dims", type=int, nargs="+", default=(64, 128))
    ap.add_argument("--seqlens", type=int, nargs="+", default=(2048, 16384))
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--gqa", type=int, default=1)
    ap.add_argument("--dtype", choices=("float16", "bfloat16"), default="bfloat16")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--deterministic", action="store_true", help="our backward's deterministic dQ order")
    ap.add_argument("--ncu", default="ncu")
    ap.add_argument("--json", help="also write the raw values here")
    ap.add_argument("--base", help="also profile our variants with this folder's kernel sources (ab_kernels.py's)")
    args = ap.parse_args()
    tensor = tensor_pipe_metrics(args.ncu)
    metrics = list(BASE_METRICS.values()) + tensor
    results = []
    print(f"{args.dtype}, {'causal' if args.causal else 'non-causal'}{', deterministic' if args.deterministic else ''}, {args.tokens} tokens, hidden {args.hidden}, "
          f"GQA {args.gqa}:1; tensor pipes: {', '.join(m.split('.')[0] for m in tensor) or 'none listed'}")
    print("| pass | d | N | variant | time µs | issue busy % | no eligible % | warps active / eligible "
          "| instructions (M) | registers | grid × block | tensor pipe % |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")

    def table(variants, suffix=""):
        for which in args.passes:
            for d in args.head_dims:
                for n in args.seqlens:
                    for variant in variants:
                        row(which, d, n, variant, suffix)

    def row(which, d, n, variant, suffix):
        label, _, settings = variant.partition(":")
        impl = "cudnn" if label == "cudnn" else "ours"
        label += suffix
        env = dict(s.split("=") for s in filter(None, settings.split(",")))
        v = profile(args.ncu, metrics, impl, env, which, d, n, args)
        results.append({"pass": which, "d": d, "N": n, "variant": label, **v})
        busiest = max((_num(v.get(m)) for m in tensor), default=float("nan"))
        print(f"| {which} | {d} | {n} | {label} | {_num(v[BASE_METRICS['time_us']]):.1f} "
              f"| {_num(v[BASE_METRICS['issue_busy_pct']]):.1f} "
              f"| {100 - _num(v[BASE_METRICS['issue_active_pct']]):.1f} "
              f"| {_num(v[BASE_METRICS['warps_active']]):.2f} / {_num(v[BASE_METRICS['warps_eligible']]):.2f} "
              f"| {_num(v[BASE_METRICS['instructions']]) / 1e6:.1f} "
              f"| {v[BASE_METRICS['registers']]} | {v[BASE_METRICS['grid']]} × {v[BASE_METRICS['block']]} "
              f"| {busiest:.1f} |", flush=True)

    table(args.variants)
    if args.base:
        ours = [v for v in args.variants if v.partition(":")[0] != "cudnn"]
        with swapped_sources(args.base):
            table(ours, "@base")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
