"""Distributed training with sagebwd_cp, run under torchrun on several GPUs (NCCL), in two parts:

model  bench_model.py's Llama-style decoder trained on one GPU (rank 0 alone), under DDP and under
       FSDP2 (``torch.distributed.fsdp.fully_shard``, every decoder layer and the root), with
       attention by SDPA and by sagebwd_cp: the same global batch and data each way, so the losses
       should agree with the single GPU's; the step time and the scaling (one GPU's step time over
       the distributed one's: the global batch's speed-up).

       Step times: a step's time is the slowest rank's (each rank's time after a synchronize, the
       maximum over ranks); each run has ``--warmup`` untimed steps (10: compiles, cuDNN/NCCL
       set-up, the allocator's first growth) and ``--steps`` timed ones (50); the table gives the
       median, the 10th-90th percentile band and (p90 - p10) / median, the per-step spread.  The
       whole part runs ``--rounds`` times (2), SDPA and sagebwd_cp alternating within each round, and
       the summary pools every round's steps, listing each round's median beside it: two runs that
       disagree show it there rather than in two files.

       FSDP is sized apart (``--fsdp-hidden`` 2048, ``--fsdp-layers`` 16: 0.45B parameters, with
       its own single-GPU baseline at that size).  At bench_model's size (hidden 1024, 8 layers,
       0.09B parameters) a step is too short to hide FSDP's per-layer all-gathers and
       reduce-scatters (three transfers of the parameters a step against DDP's one all-reduce of
       the gradients) and its parameters fit one GPU many times over: FSDP measured slower than one
       GPU there (scaling 0.73-0.95 on 2x H100 and 2x H200) for either attention, which says
       nothing about attention.  ``--fsdp-hidden 0`` runs FSDP at bench_model's size anyway.
ring   ``sagebwd_cp.torch.ring_attention`` at long context (the sequence zig-zag sharded over the
       ranks), forward and forward+backward time, and correctness against single-GPU chunked
       attention (``chunked_attention`` over the same 2·W chunks, on rank 0) and against one SDPA
       call; beside it, torch's ``context_parallel`` over SDPA
       (``torch.distributed.tensor.experimental``) when this torch has it (else the reason is
       reported), in the same run.

    torchrun --nproc-per-node 2 benchmarks/bench_distributed.py [--parts model ring]
        [--contexts 2048 8192] [--head-dim 128] [--steps 50] [--warmup 10] [--rounds 2]
        [--modes ddp fsdp2] [--fsdp-hidden 2048] [--fsdp-layers 16]
        [--ring-contexts 32768 65536 131072] [--ring-heads 8] [--ring-head-dim 128] [--iters 5] [--out DIR]

Prints a table and writes distributed.json and distributed.md into benchmarks/results/<device>/
(``--out`` to change).  ``--smoke``: a few seconds on the CPU (gloo, the emulator), tiny shapes, any
world size including 1 (plain ``python``), results into benchmarks/out/smoke unless ``--out``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


# ------------------------------------------------------------------------------ process group

class Dist:
    """The process group of this run: rank, world size, device, and timing on that device."""

    def __init__(self, smoke: bool):
        import torch
        import torch.distributed as dist

        self.cuda = torch.cuda.is_available() and not smoke
        if "RANK" not in os.environ:  # plain python: a world of one
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))
        if not dist.is_initialized():
            dist.init_process_group("nccl" if self.cuda else "gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if self.cuda:
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
            self.name = torch.cuda.get_device_name(local)
        else:
            self.device = torch.device("cpu")
            self.name = "cpu"

    def sync(self):
        import torch

        if self.cuda:
            torch.cuda.synchronize()

    def barrier(self):
        import torch.distributed as dist

        self.sync()
        dist.barrier()

    def timed(self, fn) -> float:
        """Milliseconds of ``fn()`` on every rank (the slowest rank's time: a barrier before and after)."""
        import torch
        import torch.distributed as dist

        self.barrier()
        t0 = time.perf_counter()
        fn()
        self.sync()
        ms = torch.tensor([(time.perf_counter() - t0) * 1e3], dtype=torch.float64, device=self.device)
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)
        return float(ms)


def rel_l2(x, ref) -> float:
    x, ref = x.detach().double(), ref.detach().double()
    return float((x - ref).norm() / ref.norm())


# ------------------------------------------------------------------------------ part 1: the model

def _global_rows(context: int, world: int) -> int:
    """Sequences per global batch: bench_model's tokens a step, at least one per rank, a multiple of W."""
    import bench_model

    rows = max(bench_model.TOKENS_PER_STEP // context, world)
    return -(-rows // world) * world


_BATCHES = {}


def _batches(context: int, rows: int, steps: int, seed: int, device) -> list:
    """bench_model's batches of ``rows`` sequences (read once per shape: the corpus takes seconds)."""
    import bench_model

    key = (context, rows, steps, seed, str(device))
    if key not in _BATCHES:
        saved = bench_model.TOKENS_PER_STEP
        bench_model.TOKENS_PER_STEP = rows * context
        try:
            _BATCHES[key] = list(bench_model.batches(context, steps, seed, device))
        finally:
            bench_model.TOKENS_PER_STEP = saved
    return _BATCHES[key]


def step_stats(times: list) -> dict:
    """Median, 10th and 90th percentiles, min, max and (p90 - p10) / median of step times (ms)."""
    xs = sorted(times)

    def pct(p):
        i = (len(xs) - 1) * p
        lo, hi = int(i), min(int(i) + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)

    med = statistics.median(xs)
    return {"step_ms": med, "p10_ms": pct(0.1), "p90_ms": pct(0.9), "min_ms": xs[0], "max_ms": xs[-1],
            "spread": (pct(0.9) - pct(0.1)) / med if med else None}


class model_size:
    """bench_model's decoder at ``hidden`` and ``layers`` inside the block (0: as it is)."""

    def __init__(self, hidden: int, layers: int):
        self.size = (hidden, layers)

    def __enter__(self):
        import bench_model

        self.saved = (bench_model.HIDDEN, bench_model.LAYERS)
        bench_model.HIDDEN = self.size[0] or self.saved[0]
        bench_model.LAYERS = self.size[1] or self.saved[1]
        return (bench_model.HIDDEN, bench_model.LAYERS)

    def __exit__(self, *exc):
        import bench_model

        bench_model.HIDDEN, bench_model.LAYERS = self.saved
        return False


def _train(d: Dist, mode: str, attn: str, head_dim: int, context: int, steps: int, warmup: int, seed: int) -> dict:
    """Step times (the slowest rank's) and per-step global losses of one run; ``mode`` "single" runs on
    rank 0 alone."""
    import torch
    import torch.distributed as dist

    import bench_model

    rows = _global_rows(context, d.world)
    model = bench_model.build_model(head_dim, context, attn, seed).to(d.device)
    params = sum(p.numel() for p in model.parameters())
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[d.device.index] if d.cuda else None)
    elif mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # The run's device type named (without a mesh FSDP2 takes the GPU when there is one, also for --smoke).
        mesh = init_device_mesh(d.device.type, (d.world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    shard = slice(None) if mode == "single" else slice(d.rank * rows // d.world, (d.rank + 1) * rows // d.world)
    data = _batches(context, rows, warmup + steps, seed, d.device)  # every mode: the same global batches
    times, losses = [], []
    for step, (x, y) in enumerate(data):
        x, y = x[shard], y[shard]
        t0 = time.perf_counter()
        loss = bench_model.train_step(model, opt, x, y, d.cuda)
        d.sync()
        ms = torch.tensor([(time.perf_counter() - t0) * 1e3], dtype=torch.float64, device=d.device)
        loss = loss.detach().double().reshape(1)
        if mode != "single":  # the mean over equal shards: the global batch's loss; the slowest rank's time
            dist.all_reduce(loss)
            loss /= d.world
            dist.all_reduce(ms, op=dist.ReduceOp.MAX)
        if step >= warmup:
            times.append(float(ms))
        losses.append(float(loss))
    del model, opt
    if d.cuda:
        torch.cuda.empty_cache()
    return {**step_stats(times), "step_times_ms": times, "losses": losses, "params": params}


def _single(d: Dist, attn: str, args, context: int) -> dict:
    """The one-GPU run on rank 0, its result on every rank."""
    import torch.distributed as dist

    single = _train(d, "single", attn, args.head_dim, context, args.steps, args.warmup, args.seed) \
        if d.rank == 0 else None
    box = [single]
    dist.broadcast_object_list(box, src=0)
    d.barrier()
    return box[0]


def model_part(d: Dist, args) -> list:
    """One record a (round, context, attention, mode): SDPA and sagebwd_cp alternate within a round."""
    import torch

    records = []
    sizes = {mode: (args.fsdp_hidden, args.fsdp_layers) if mode == "fsdp2" else (0, 0) for mode in args.modes}
    for rnd in range(args.rounds):
        for context in args.contexts:
            for size in dict.fromkeys(sizes.values()):  # the modes of one model size share its baseline
                for attn in ("sdpa", "sagebwd"):
                    with model_size(*size) as (hidden, layers):
                        single = _single(d, attn, args, context)
                        for mode in [m for m in args.modes if sizes[m] == size]:
                            try:
                                res = _train(d, mode, attn, args.head_dim, context, args.steps, args.warmup,
                                             args.seed)
                            except Exception as exc:  # noqa: BLE001 - an unsupported mode is reported
                                res = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                            rec = {"part": "model", "round": rnd, "context": context, "head_dim": args.head_dim,
                                   "attn": attn, "mode": mode, "world": d.world, "hidden": hidden, "layers": layers,
                                   "params": single["params"], "global_rows": _global_rows(context, d.world),
                                   **{f"single_{k}": v for k, v in single.items() if k != "params"}, **res}
                            if "losses" in res:
                                diffs = [abs(a - b) for a, b in zip(res["losses"], single["losses"])]
                                rec.update(scaling=single["step_ms"] / res["step_ms"], max_loss_diff=max(diffs),
                                           final_loss=res["losses"][-1], single_final_loss=single["losses"][-1])
                            records.append(rec)
                            d.barrier()
                    if d.cuda:
                        torch.cuda.empty_cache()
    return records


def summarize(records: list) -> list:
    """Per (context, model size, mode): each attention's step times pooled over the rounds (median and
    band), each round's median, the one-GPU baseline pooled the same way, the scaling, and sagebwd_cp's
    step over SDPA's, distributed and alone."""
    groups = {}
    for r in records:
        if r["part"] == "model" and "step_times_ms" in r:
            groups.setdefault((r["context"], r["hidden"], r["layers"], r["mode"]), {}).setdefault(r["attn"], []).append(r)
    rows = []
    for (context, hidden, layers, mode), by_attn in groups.items():
        row = {"context": context, "hidden": hidden, "layers": layers, "mode": mode,
               "params": next(iter(by_attn.values()))[0]["params"]}
        for attn, recs in by_attn.items():
            pooled = step_stats([t for r in recs for t in r["step_times_ms"]])
            single = step_stats([t for r in recs for t in r["single_step_times_ms"]])
            row[attn] = {**pooled, "round_medians": [r["step_ms"] for r in recs],
                         "single_step_ms": single["step_ms"], "single_spread": single["spread"],
                         "single_round_medians": [r["single_step_ms"] for r in recs],
                         "scaling": single["step_ms"] / pooled["step_ms"],
                         "max_loss_diff": max(r["max_loss_diff"] for r in recs)}
        if "sdpa" in row and "sagebwd" in row:
            row["ours_over_sdpa"] = row["sagebwd"]["step_ms"] / row["sdpa"]["step_ms"]
            row["ours_over_sdpa_single"] = row["sagebwd"]["single_step_ms"] / row["sdpa"]["single_step_ms"]
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------ part 2: ring attention

def _context_parallel_available():
    """(context_parallel, init_device_mesh) or the reason they cannot be used."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
    except Exception as exc:  # noqa: BLE001
        return None, f"torch.distributed.tensor.experimental.context_parallel unavailable: {exc}"
    return (context_parallel, init_device_mesh), None


def _time_context_parallel(d: Dist, q, k, v, do, causal: bool, iters: int):
    """(forward ms, forward+backward ms) of SDPA under torch's context_parallel, or the reason not."""
    import torch
    import torch.nn.functional as F

    if not d.cuda:  # torch registers no sharding strategy for SDPA's CPU kernels: it fails after seconds of tracing
        return None, "context_parallel over SDPA runs on CUDA tensors only; not timed on the CPU"
    found, why = _context_parallel_available()
    if found is None:
        return None, why
    context_parallel, init_device_mesh = found
    options = None
    try:  # its load balancing (on by default) refuses is_causal=False: a private switch turns it off
        from torch.distributed.tensor.experimental import _attention

        options = _attention._cp_options
        balance = options.enable_load_balance
        options.enable_load_balance = causal
    except Exception:  # noqa: BLE001 - another torch: run with its defaults
        options = None
    try:
        mesh = init_device_mesh(d.device.type, (d.world,))
        bufs = [x.detach().clone() for x in (q, k, v, do)]
        with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers=set(bufs)):
            ql, kl, vl = (x.detach().requires_grad_() for x in bufs[:3])

            def fwd():
                with torch.no_grad():
                    F.scaled_dot_product_attention(ql, kl, vl, is_causal=causal)

            def fwd_bwd():
                F.scaled_dot_product_attention(ql, kl, vl, is_causal=causal).backward(bufs[3])

            fwd_bwd()  # warm-up
            f = statistics.median(d.timed(fwd) for _ in range(iters))
            fb = statistics.median(d.timed(fwd_bwd) for _ in range(iters))
        return (f, fb), None
    except Exception as exc:  # noqa: BLE001 - reported in the table, the other columns still stand
        return None, f"context_parallel over SDPA failed: {type(exc).__name__}: {exc}"[:300]
    finally:
        if options is not None:
            options.enable_load_balance = balance


def ring_part(d: Dist, args) -> list:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import sagebwd_cp.torch as st

    records = []
    dtype = torch.bfloat16
    for n in args.ring_contexts:
        for causal in (True, False):
            if n % (2 * d.world):
                raise SystemExit(f"--ring-contexts: {n} is not divisible by 2·world size = {2 * d.world}")
            g = torch.Generator(device=d.device).manual_seed(args.seed)
            shape = (1, args.ring_heads, n, args.ring_head_dim)
            q, k, v, do = (torch.randn(shape, generator=g, device=d.device, dtype=torch.float32).to(dtype)
                           for _ in range(4))
            shard = lambda x: st.zigzag_shard(x, d.rank, d.world, 2).contiguous()  # noqa: E731
            ql, kl, vl = (shard(x).requires_grad_() for x in (q, k, v))
            dol = shard(do)

            def fwd():
                with torch.no_grad():
                    st.ring_attention(ql, kl, vl, causal=causal)

            def fwd_bwd():
                out = st.ring_attention(ql, kl, vl, causal=causal)
                torch.autograd.grad(out, (ql, kl, vl), dol)

            fwd_bwd()  # warm-up: kernels compiled and loaded, plans built
            ring_f = statistics.median(d.timed(fwd) for _ in range(args.iters))
            ring_fb = statistics.median(d.timed(fwd_bwd) for _ in range(args.iters))
            # Correctness: every rank's rows gathered on rank 0 against single-GPU chunked attention.
            out = st.ring_attention(ql, kl, vl, causal=causal)
            grads = torch.autograd.grad(out, (ql, kl, vl), dol)
            gathered = []
            for x in (out.detach(), *grads):
                parts = [torch.empty_like(x) for _ in range(d.world)]
                dist.all_gather(parts, x.contiguous())
                gathered.append(st.zigzag_unshard(parts, 2))
            errors = {}
            if d.rank == 0:
                full = [x.detach().requires_grad_() for x in (q, k, v)]
                chunks = lambda x: list(x.chunk(2 * d.world, 2))  # noqa: E731
                ref = st.chunked_attention(full[0], chunks(full[1]), chunks(full[2]), causal=causal)
                ref_grads = torch.autograd.grad(ref, full, do)
                sdpa = F.scaled_dot_product_attention(*full, is_causal=causal)
                sdpa_grads = torch.autograd.grad(sdpa, full, do)
                for name, got, want, exact in zip(("out", "dq", "dk", "dv"), gathered, (ref, *ref_grads),
                                                  (sdpa, *sdpa_grads)):
                    errors[f"{name}_vs_chunked"] = rel_l2(got, want)
                    errors[f"{name}_vs_sdpa"] = rel_l2(got, exact)
                del full, ref, ref_grads, sdpa, sdpa_grads
            box = [errors]
            dist.broadcast_object_list(box, src=0)
            cp, why = _time_context_parallel(d, q, k, v, do, causal, args.iters)
            records.append({"part": "ring", "context": n, "causal": causal, "heads": args.ring_heads,
                            "head_dim": args.ring_head_dim, "dtype": "bfloat16", "world": d.world,
                            "ring_fwd_ms": ring_f, "ring_fwd_bwd_ms": ring_fb,
                            "cp_sdpa_fwd_ms": cp[0] if cp else None, "cp_sdpa_fwd_bwd_ms": cp[1] if cp else None,
                            "cp_sdpa_note": why, **box[0]})
            del q, k, v, do, ql, kl, vl, dol, out, grads, gathered
            if d.cuda:
                torch.cuda.empty_cache()
            d.barrier()
    return records


# ------------------------------------------------------------------------------ report

def _fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def markdown(meta: dict, records: list) -> str:
    lines = [f"# Distributed: {meta['device']} x {meta['world']} ({meta['backend']})", "",
             f"torch {meta['torch']}; {'smoke run (tiny shapes, CPU)' if meta['smoke'] else 'bfloat16'}", ""]
    model = [r for r in records if r["part"] == "model"]
    if model:
        rounds = len({r["round"] for r in model})
        lines += ["## Model (bench_model.py's decoder), same global batch", "",
                  "ms: the median step (the slowest rank's time each step), pooled over "
                  f"{rounds} round(s) of {model[0]['world']} ranks; p10-p90: the band of the steps; spread: "
                  "(p90 - p10) / median; rounds: each round's median. scaling: one GPU's median step over the "
                  "distributed one's (the same global batch; ideal: the world size). ours/sdpa: sagebwd_cp's "
                  "median step over SDPA's, distributed and on one GPU.", "",
                  "| context | model | mode | attn | 1-GPU ms (rounds) | ms | p10-p90 | spread | rounds | "
                  "scaling | max loss diff |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        summary = summarize(records)
        rounds_text = lambda xs: " / ".join(_fmt(x) for x in xs)  # noqa: E731
        for row in summary:
            size = f"{row['hidden']}x{row['layers']} ({row['params'] / 1e6:.0f}M)"
            for attn in ("sdpa", "sagebwd"):
                if attn not in row:
                    continue
                a = row[attn]
                lines.append(f"| {row['context']} | {size} | {row['mode']} | {attn} | {_fmt(a['single_step_ms'])} "
                             f"({rounds_text(a['single_round_medians'])}) | {_fmt(a['step_ms'])} | "
                             f"{_fmt(a['p10_ms'])}-{_fmt(a['p90_ms'])} | {_fmt(a['spread'], '.1%')} | "
                             f"{rounds_text(a['round_medians'])} | {_fmt(a['scaling'], '.2f')} | "
                             f"{_fmt(a['max_loss_diff'], '.4f')} |")
        lines += ["", "| context | model | mode | ours/sdpa distributed | ours/sdpa one GPU |", "|---|---|---|---|---|"]
        for row in summary:
            if "ours_over_sdpa" in row:
                lines.append(f"| {row['context']} | {row['hidden']}x{row['layers']} | {row['mode']} | "
                             f"{_fmt(row['ours_over_sdpa'], '.3f')} | {_fmt(row['ours_over_sdpa_single'], '.3f')} |")
        failed = [r for r in model if "error" in r]
        lines += [""] + [f"Failed: round {r['round']}, {r['context']}, {r['attn']}, {r['mode']}: {r['error']}"
                         for r in failed]
        lines.append("")
    ring = [r for r in records if r["part"] == "ring"]
    if ring:
        lines += ["## Ring attention (zig-zag shards) vs context_parallel over SDPA", "",
                  "| tokens | causal | ring fwd ms | ring fwd+bwd ms | CP-SDPA fwd ms | CP-SDPA fwd+bwd ms | "
                  "out / dq / dk / dv rel-L2 vs 1-GPU chunked | vs 1-GPU SDPA |", "|---|---|---|---|---|---|---|---|"]
        for r in ring:
            errs = lambda ref: " / ".join(_fmt(r.get(f"{n}_vs_{ref}"), ".2e") for n in ("out", "dq", "dk", "dv"))  # noqa
            lines.append(f"| {r['context']} | {r['causal']} | {_fmt(r['ring_fwd_ms'])} | {_fmt(r['ring_fwd_bwd_ms'])} | "
                         f"{_fmt(r['cp_sdpa_fwd_ms'])} | {_fmt(r['cp_sdpa_fwd_bwd_ms'])} | {errs('chunked')} | "
                         f"{errs('sdpa')} |")
        notes = sorted({r["cp_sdpa_note"] for r in ring if r["cp_sdpa_note"]})
        lines += [""] + [f"Note: {n}" for n in notes]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=["model", "ring"], choices=["model", "ring"])
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192], help="model part: context lengths")
    ap.add_argument("--head-dim", type=int, default=128, choices=[64, 128], help="model part")
    ap.add_argument("--steps", type=int, default=50, help="model part: timed steps per run")
    ap.add_argument("--warmup", type=int, default=10, help="model part: untimed first steps of each run")
    ap.add_argument("--rounds", type=int, default=2, help="model part: times the whole part runs (pooled)")
    ap.add_argument("--modes", nargs="+", default=["ddp", "fsdp2"], choices=["ddp", "fsdp2"], help="model part")
    ap.add_argument("--fsdp-hidden", type=int, default=2048,
                    help="model part: the decoder's hidden size under FSDP2 (0: bench_model's)")
    ap.add_argument("--fsdp-layers", type=int, default=16,
                    help="model part: the decoder's layers under FSDP2 (0: bench_model's)")
    ap.add_argument("--ring-contexts", type=int, nargs="+", default=[32768, 65536, 131072],
                    help="ring part: total tokens (divisible by 2 x world size)")
    ap.add_argument("--ring-heads", type=int, default=8)
    ap.add_argument("--ring-head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=5, help="ring part: timed calls (median)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results/<device>)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU with gloo (a correctness run)")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        ap.error(f"--steps, --rounds: at least 1, --warmup: at least 0; got {args.steps}, {args.rounds}, {args.warmup}")

    import torch

    import bench_model

    if args.smoke:
        args.contexts, args.head_dim, args.steps, args.warmup, args.rounds = [64], 64, 2, 0, 1
        args.fsdp_hidden, args.fsdp_layers = 256, 2  # a size of its own, as on GPUs
        args.ring_contexts, args.ring_heads, args.ring_head_dim, args.iters = [128], 2, 16, 1
    elif not torch.cuda.is_available():
        print("bench_distributed.py needs CUDA GPUs (or --smoke, on the CPU)", file=sys.stderr)
        return 2
    model_size = (bench_model.HIDDEN, bench_model.LAYERS, bench_model.TOKENS_PER_STEP)
    threads = torch.get_num_threads()
    if args.smoke:  # bench_model's decoder shrunk (the emulator is slow), restored on return
        bench_model.HIDDEN, bench_model.LAYERS, bench_model.TOKENS_PER_STEP = 256, 1, 256
        torch.set_num_threads(1)  # W ranks on one CPU: a thread each (torch's many threads a rank oversubscribe it)
    try:
        return _run(args)
    finally:
        bench_model.HIDDEN, bench_model.LAYERS, bench_model.TOKENS_PER_STEP = model_size
        torch.set_num_threads(threads)


def _run(args) -> int:
    import torch
    import torch.distributed as dist

    d = Dist(args.smoke)
    records = []
    if "model" in args.parts:
        records += model_part(d, args)
    if "ring" in args.parts:
        if args.smoke:
            args.ring_contexts = [64 * 2 * d.world]  # two 64-token chunks a rank
        records += ring_part(d, args)
    if d.rank == 0:
        from report_common import device_slug, json_text

        meta = {"device": d.name, "world": d.world, "backend": dist.get_backend(), "torch": torch.__version__,
                "smoke": args.smoke, "args": vars(args)}
        out = args.out or (os.path.join(HERE, "out", "smoke") if args.smoke else
                           os.path.join(HERE, "results", device_slug(d.name)))
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "distributed.json"), "w") as f:
            f.write(json_text({**meta, "summary": summarize(records), "records": records}) + "\n")
        text = markdown(meta, records)
        with open(os.path.join(out, "distributed.md"), "w") as f:
            f.write(text)
        print(text)
        print(f"wrote {out}/distributed.json and distributed.md")
    d.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
