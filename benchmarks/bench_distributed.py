"""Distributed training with sagebwd_cp, run under torchrun on several GPUs (NCCL), in two parts:

model  bench_model.py's Llama-style decoder trained on one GPU (rank 0 alone), under DDP and under
       FSDP2 (``torch.distributed.fsdp.fully_shard``, every decoder layer and the root), with
       attention by SDPA and by sagebwd_cp: the same global batch and data each way, so the losses
       should agree with the single GPU's; the median step time and the scaling (one GPU's step
       time over the distributed one's: the global batch's speed-up).
ring   ``sagebwd_cp.torch.ring_attention`` at long context (the sequence zig-zag sharded over the
       ranks), forward and forward+backward time, and correctness against single-GPU chunked
       attention (``chunked_attention`` over the same 2·W chunks, on rank 0) and against one SDPA
       call; beside it, torch's ``context_parallel`` over SDPA
       (``torch.distributed.tensor.experimental``) when this torch has it (else the reason is
       reported), in the same run.

    torchrun --nproc-per-node 2 benchmarks/bench_distributed.py [--parts model ring]
        [--contexts 2048 8192] [--head-dim 128] [--steps 20] [--warmup 3]
        [--ring-contexts 32768 65536 131072] [--ring-heads 8] [--ring-head-dim 128] [--iters 5] [--out DIR]

Prints a table and writes distributed.json and distributed.md into benchmarks/results/<device>/
(``--out`` to change).  ``--smoke``: a few seconds on the CPU (gloo, the emulator), tiny shapes, any
world size including 1 (plain ``python``), results into benchmarks/out/smoke unless ``--out``.
"""
from __future__ import annotations

import argparse
import json
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


def _train(d: Dist, mode: str, attn: str, head_dim: int, context: int, steps: int, warmup: int, seed: int) -> dict:
    """Step times and per-step global losses of one run; ``mode`` "single" runs on rank 0 alone."""
    import torch
    import torch.distributed as dist

    import bench_model

    rows = _global_rows(context, d.world)
    model = bench_model.build_model(head_dim, context, attn, seed).to(d.device)
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[d.device.index] if d.cuda else None)
    elif mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    shard = slice(None) if mode == "single" else slice(d.rank * rows // d.world, (d.rank + 1) * rows // d.world)
    data = _batches(context, rows, warmup + steps, seed, d.device)  # every mode: the same global batches
    times, losses = [], []
    for step, (x, y) in enumerate(data):
        x, y = x[shard], y[shard]
        t0 = time.perf_counter()
        loss = bench_model.train_step(model, opt, x, y, d.cuda)
        d.sync()
        if step >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
        loss = loss.detach().double().reshape(1)
        if mode != "single":  # the mean over equal shards: the global batch's loss
            dist.all_reduce(loss)
            loss /= d.world
        losses.append(float(loss))
    del model, opt
    if d.cuda:
        torch.cuda.empty_cache()
    return {"step_ms": statistics.median(times), "losses": losses}


def model_part(d: Dist, args) -> list:
    import torch
    import torch.distributed as dist

    records = []
    for context in args.contexts:
        for attn in ("sdpa", "sagebwd"):
            single = None
            if d.rank == 0:
                single = _train(d, "single", attn, args.head_dim, context, args.steps, args.warmup, args.seed)
            box = [single]
            dist.broadcast_object_list(box, src=0)
            single = box[0]
            d.barrier()
            for mode in ("ddp", "fsdp2"):
                try:
                    res = _train(d, mode, attn, args.head_dim, context, args.steps, args.warmup, args.seed)
                except Exception as exc:  # noqa: BLE001 - an unsupported mode is reported, the rest still runs
                    res = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                rec = {"part": "model", "context": context, "head_dim": args.head_dim, "attn": attn, "mode": mode,
                       "world": d.world, "global_rows": _global_rows(context, d.world),
                       "single_step_ms": single["step_ms"], "single_losses": single["losses"], **res}
                if "losses" in res:
                    diffs = [abs(a - b) for a, b in zip(res["losses"], single["losses"])]
                    rec.update(scaling=single["step_ms"] / res["step_ms"], max_loss_diff=max(diffs),
                               final_loss=res["losses"][-1], single_final_loss=single["losses"][-1])
                records.append(rec)
                d.barrier()
            if d.cuda:
                torch.cuda.empty_cache()
    return records


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
        lines += ["## Model (bench_model.py's decoder), same global batch", "",
                  "scaling: one GPU's step time over the distributed step's (the same global batch; ideal: the "
                  "world size); losses: the global batch's mean, per step.", "",
                  "| context | attn | mode | 1-GPU ms | ms | scaling | final loss | 1-GPU final loss | max loss diff |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in model:
            if "error" in r:
                lines.append(f"| {r['context']} | {r['attn']} | {r['mode']} | {_fmt(r['single_step_ms'])} | "
                             f"failed: {r['error']} | | | | |")
                continue
            lines.append(f"| {r['context']} | {r['attn']} | {r['mode']} | {_fmt(r['single_step_ms'])} | "
                         f"{_fmt(r['step_ms'])} | {_fmt(r['scaling'], '.2f')} | {_fmt(r['final_loss'], '.4f')} | "
                         f"{_fmt(r['single_final_loss'], '.4f')} | {_fmt(r['max_loss_diff'], '.4f')} |")
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
    ap.add_argument("--steps", type=int, default=20, help="model part: timed steps per run")
    ap.add_argument("--warmup", type=int, default=3, help="model part: untimed first steps")
    ap.add_argument("--ring-contexts", type=int, nargs="+", default=[32768, 65536, 131072],
                    help="ring part: total tokens (divisible by 2 x world size)")
    ap.add_argument("--ring-heads", type=int, default=8)
    ap.add_argument("--ring-head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=5, help="ring part: timed calls (median)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results/<device>)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU with gloo (a correctness run)")
    args = ap.parse_args(argv)

    import torch

    import bench_model

    if args.smoke:
        args.contexts, args.head_dim, args.steps, args.warmup = [64], 64, 2, 0
        args.ring_contexts, args.ring_heads, args.ring_head_dim, args.iters = [128], 2, 16, 1
    elif not torch.cuda.is_available():
        print("bench_distributed.py needs CUDA GPUs (or --smoke, on the CPU)", file=sys.stderr)
        return 2
    model_size = (bench_model.HIDDEN, bench_model.LAYERS, bench_model.TOKENS_PER_STEP)
    if args.smoke:  # bench_model's decoder shrunk (the emulator is slow), restored on return
        bench_model.HIDDEN, bench_model.LAYERS, bench_model.TOKENS_PER_STEP = 256, 1, 256
    try:
        return _run(args)
    finally:
        bench_model.HIDDEN, bench_model.LAYERS, bench_model.TOKENS_PER_STEP = model_size


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
        from report_common import device_slug

        meta = {"device": d.name, "world": d.world, "backend": dist.get_backend(), "torch": torch.__version__,
                "smoke": args.smoke, "args": vars(args)}
        out = args.out or (os.path.join(HERE, "out", "smoke") if args.smoke else
                           os.path.join(HERE, "results", device_slug(d.name)))
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "distributed.json"), "w") as f:
            json.dump({**meta, "records": records}, f, indent=1)
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
