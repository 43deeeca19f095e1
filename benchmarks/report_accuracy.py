"""Accuracy in the settings of SB26 Tables 1 and 2, against exact FP64 attention and gradients.

1. σ sweep (Table 1): q, k ~ N(0, σ²), v and dO ~ N(0, 1), fp16, non-causal; CosSim and Rel-L2 of
   O, dQ, dK, dV for each backward granularity, at (d=64, N=1024) and (d=128, N=4096), B=1, H=4.
   On the GPU the inputs are drawn exactly as tests/test_gpu_backward.py::test_sigma_sweep_against_paper
   draws them (torch CUDA generator, seeds 2026 and 2027), so the d=64 numbers are that test's.
2. Intermediate tensors (Table 2): δ, P, dS, the 8-bit P̂ and dŜ, O, dQ, dK, dV on inputs whose K has
   a strong per-channel bias.  The kernels do not expose δ, P or dS, so this table always comes from
   the NumPy emulator (sagebwd_cp.host.emulator), which quantizes exactly as the kernels do.
3. Smoothing ablation on the same inputs: none / K (default) / Q+K, measured with the kernels; and with
   logit soft-capping (cap SOFTCAP, granularity "fine"): none / K, against exact soft-capped attention.

Writes <results-dir>/<device>/accuracy.json.  ``--host`` runs everything through the emulator on
the CPU (the public API does that for NumPy arrays), labelled "host-emulator", with small default
shapes; it then writes only where ``--out`` says.

    python benchmarks/report_accuracy.py [--quick]
    python benchmarks/report_accuracy.py --host --out /tmp/accuracy.json [--configs 64:128 --sigmas 1 3]
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import report_common  # noqa: E402

SIGMAS = (1, 3, 5, 8, 10)
GRANULARITIES = ("fine", "paper")
SIGMA_SEED = 2026  # tests/test_gpu_backward.py: q, k, v from this seed, dO from the next
BIAS_SEED = 7
BIAS_STRENGTH = 5.0
SMOOTHING = {"none": dict(smooth_k=False, smooth_q=False), "K": dict(smooth_k=True, smooth_q=False),
             "Q+K": dict(smooth_k=True, smooth_q=True)}
SOFTCAP = 30.0  # the soft-capped ablation's cap (Gemma 2's 50 barely bends these inputs' scores at d=64)
SOFTCAP_SMOOTHING = ("none", "K")  # soft-capping takes no Q-smoothing
GPU_DEFAULTS = dict(configs=[(64, 1024), (128, 4096)], heads=4, bias=(64, 1024))
HOST_DEFAULTS = dict(configs=[(64, 256)], heads=2, bias=(64, 256))


def cos_sim(x, ref) -> float:
    x, ref = np.asarray(x, np.float64).ravel(), np.asarray(ref, np.float64).ravel()
    den = np.linalg.norm(x) * np.linalg.norm(ref)
    return float(x @ ref / den) if den > 0 else float("nan")


def rel_l2(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    n = np.linalg.norm(ref)
    return float(np.linalg.norm(x - ref) / n) if n > 0 else float("nan")


def metrics(x, ref) -> dict:
    return {"cos": cos_sim(x, ref), "rel_l2": rel_l2(x, ref)}


class Backend:
    """Where the attention runs: the GPU kernels (torch CUDA tensors) or the emulator (NumPy)."""

    def __init__(self, host: bool):
        self.host = host
        if host:
            self.name = "host-emulator"
        else:
            self.name = report_common.cuda_device_name()

    def sigma_base(self, b, h, n, d, seed):
        """float32 (q, k, v, dO) in HND with std 1: on the GPU drawn like the GPU tests draw them."""
        if self.host:
            rng = np.random.default_rng(seed)
            q, k, v = (rng.standard_normal((b, n, h, d), dtype=np.float32).transpose(0, 2, 1, 3) for _ in range(3))
            do = np.random.default_rng(seed + 1).standard_normal((b, h, n, d), dtype=np.float32)
            return q, k, v, do
        import torch

        g = torch.Generator(device="cuda").manual_seed(seed)
        q, k, v = (torch.randn((b, n, h, d), generator=g, device="cuda", dtype=torch.float32).transpose(1, 2)
                   for _ in range(3))
        g = torch.Generator(device="cuda").manual_seed(seed + 1)
        do = torch.randn((b, h, n, d), generator=g, device="cuda", dtype=torch.float32)
        return q, k, v, do

    def half(self, x):
        """fp16 copy in this backend's framework."""
        if self.host:
            return np.ascontiguousarray(np.asarray(x, np.float32).astype(np.float16))
        import torch

        if isinstance(x, np.ndarray):
            x = torch.from_numpy(np.ascontiguousarray(x)).cuda()
        return x.to(torch.float16)

    def numpy64(self, x) -> np.ndarray:
        if isinstance(x, np.ndarray):
            return x.astype(np.float64)
        return x.detach().double().cpu().numpy()

    def exact(self, q, k, v, do, causal=False, softcap=0.0):
        """FP64 (o, dq, dk, dv) of the 16-bit inputs, as NumPy arrays (with ``softcap``, of scores c·tanh(s/c))."""
        if self.host:
            from sagebwd_cp.host import reference

            q, k, v, do = (self.numpy64(x) for x in (q, k, v, do))
            o, _ = reference.attention_reference(q, k, v, causal=causal, softcap=softcap)
            return (o,) + tuple(reference.attention_reference_backward(q, k, v, do, causal=causal, softcap=softcap))
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        leaves = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
        if softcap:  # SDPA takes no cap: the same float64 math written out
            s = leaves[0] @ leaves[1].transpose(-1, -2) / math.sqrt(q.shape[-1])
            o = torch.softmax(softcap * torch.tanh(s / softcap), dim=-1) @ leaves[2]
        else:
            with sdpa_kernel(SDPBackend.MATH):  # the only backend that computes in float64
                o = F.scaled_dot_product_attention(*leaves, is_causal=causal)
        grads = torch.autograd.grad(o, leaves, do.double())
        return tuple(self.numpy64(x) for x in (o, *grads))

    def run(self, q, k, v, do, granularities, **options):
        """Our O (one forward) and dQ, dK, dV per granularity, as float64 NumPy arrays."""
        import sagebwd_cp

        out, saved = sagebwd_cp.attention_forward(q, k, v, causal=False, **options)
        res = {(None, "O"): self.numpy64(out)}
        for gran in granularities:
            grads = sagebwd_cp.attention_backward(saved, do, granularity=gran)
            for name, g in zip(("dQ", "dK", "dV"), grads):
                res[gran, name] = self.numpy64(g)
        return res


def _scored(res: dict, exact: tuple, **fields) -> list:
    ref = dict(zip(("O", "dQ", "dK", "dV"), exact))
    out = []
    for (gran, name), x in res.items():
        rec = dict(fields, granularity=gran, tensor=name, **metrics(x, ref[name]))
        if not (np.isfinite(x).all()):
            rec["non_finite"] = int(np.size(x) - np.isfinite(x).sum())
        out.append(rec)
    return out


def sigma_sweep(be: Backend, configs, heads, sigmas, granularities) -> list:
    from tqdm import tqdm

    records = []
    # A bar with the time left, on a terminal: the emulator's sweep takes minutes.
    bar = tqdm(total=len(configs) * len(sigmas), unit="input", desc="σ sweep", file=sys.stderr, disable=None)
    for d, n in configs:
        shape = dict(dtype="float16", batch=1, heads=heads, seqlen=n, head_dim=d, causal=False)
        base = be.sigma_base(1, heads, n, d, SIGMA_SEED)
        for sigma in sigmas:
            q, k = (be.half(x * sigma) for x in base[:2])
            v, do = be.half(base[2]), be.half(base[3])
            res = be.run(q, k, v, do, granularities)
            recs = _scored(res, be.exact(q, k, v, do), table="sigma", source=_source(be), sigma=sigma, **shape)
            records += recs
            report_common.log(f"  σ sweep d={d} N={n} σ={sigma}: " + _summary(recs))
            bar.update()
    bar.close()
    return records


def _summary(recs) -> str:
    """Rel-L2 per tensor (and granularity) of scored records, for the progress log."""
    return "  ".join(f"{r['tensor']}{'' if r['granularity'] is None else '/' + r['granularity']} {r['rel_l2']:.4f}"
                     for r in recs)


def _source(be: Backend) -> str:
    return "emulator" if be.host else "gpu"


# ---------------------------------------------------------------------------------------------- bias inputs

def bias_inputs(heads: int, n: int, d: int):
    """float32 NumPy (q, k, v, dO) holding fp16 values, HND, B=1: q, v, dO ~ N(0, 1) and
    k = N(0, 1) + 5·c with c ~ N(0, 1) per (head, channel), the same for every token."""
    rng = np.random.default_rng(BIAS_SEED)
    q, k, v, do = (rng.standard_normal((1, heads, n, d), dtype=np.float32) for _ in range(4))
    k = k + np.float32(BIAS_STRENGTH) * rng.standard_normal((1, heads, 1, d), dtype=np.float32)
    return tuple(x.astype(np.float16).astype(np.float32) for x in (q, k, v, do))


def exact_intermediates(q, k, v, do) -> dict:
    """FP64 δ, P, dS, O, dQ, dK, dV of non-causal attention (softmax scale 1/√d)."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    c = 1.0 / math.sqrt(q.shape[-1])
    s = c * q @ np.swapaxes(k, -1, -2)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    p = e / e.sum(axis=-1, keepdims=True)
    o = p @ v
    delta = np.sum(do * o, axis=-1)
    ds = p * (do @ np.swapaxes(v, -1, -2) - delta[..., None])
    return {"delta": delta, "P": p, "dS": ds, "O": o, "dQ": c * ds @ k, "dK": c * np.swapaxes(ds, -1, -2) @ q,
            "dV": np.swapaxes(p, -1, -2) @ do}


def _tiles(x: np.ndarray) -> np.ndarray:
    """(B, H, Lq, Lk) -> (B, H, Lq/64, 64, Lk/64, 64): the backward's 64x64 tiles."""
    from sagebwd_cp.numerics import BLOCK_KV, BLOCK_Q

    b, h, lq, lk = x.shape
    return x.reshape(b, h, lq // BLOCK_Q, BLOCK_Q, lk // BLOCK_KV, BLOCK_KV)


def _dequantized(x: np.ndarray, axis, unsigned=False) -> np.ndarray:
    """The values an INT8 product reads for ``x``, scales reduced over ``axis`` of its tiles."""
    from sagebwd_cp.numerics import INT8_MAX, P_LEVELS, quantize_tile

    t = _tiles(x)
    vals, scale = quantize_tile(t, axis, P_LEVELS if unsigned else INT8_MAX)
    return (vals.astype(np.float32) * scale).reshape(x.shape)


def emulated_intermediates(q, k, v, do, granularities) -> dict:
    """{(granularity or None, tensor): array} from the emulator, with default smoothing (K only).

    δ and P are rebuilt as the emulated backward computes them: δ from the stored 16-bit O, P from
    the INT8 logits (Q̂K̂ᵀ·s_K[key])·s_Q[query] and the forward's base-2 LSE; then the 8-bit P̂ (read by
    dV), and the dS that dQ and dK read: dS quantized with each granularity's scales (Ŷ per query,
    Ẑ per key, or per tile; numerics.py)."""
    from sagebwd_cp.host import emulator
    from sagebwd_cp.numerics import BLOCK_KV, BLOCK_Q

    n = q.shape[2]
    if n % BLOCK_Q or n % BLOCK_KV or q.shape[1] != k.shape[1]:
        raise ValueError("intermediates: N must be a multiple of 64 and heads equal")
    o, _, state = emulator.emulate_forward(q, k, v, causal=False, dtype="float16")
    qi = state["inputs"]
    s_rows = qi["q_scale"][:, :, :n, None]  # per token
    s_cols = qi["k_scale"][:, :, None, :n]
    prod = (qi["q_int8"][:, :, :n].astype(np.float64) @ np.swapaxes(qi["k_int8"][:, :, :n], -1, -2)
            .astype(np.float64)).astype(np.float32)
    s2 = ((prod * s_cols).astype(np.float32) * s_rows).astype(np.float32)
    p = np.exp2(s2 - state["lse2"][:, :, :n, None]).astype(np.float32)
    delta = np.sum(do * o, axis=-1, dtype=np.float32)
    dp = (do @ np.swapaxes(v, -1, -2)).astype(np.float32)
    ds = (p * (dp - delta[..., None])).astype(np.float32)
    res = {(None, "delta"): delta, (None, "P"): p, (None, "dS"): ds, (None, "O"): o}
    for gran in granularities:
        if gran == "fine":  # P per key (unsigned, 255 levels); dS per query for dQ, per key for dK
            res[gran, "P_hat"] = _dequantized(p, 3, unsigned=True)
            res[gran, "dS_hat_q"] = _dequantized(ds, 5)
            res[gran, "dS_hat_k"] = _dequantized(ds, 3)
        else:  # one scale per 64x64 tile for each
            res[gran, "P_hat"] = _dequantized(p, (3, 5))
            res[gran, "dS_hat_q"] = _dequantized(ds, (3, 5))
            res[gran, "dS_hat_k"] = _dequantized(ds, (3, 5))
        dq, dk, dv = emulator.emulate_backward(state, do, granularity=gran)
        res[gran, "dQ"], res[gran, "dK"], res[gran, "dV"] = dq, dk, dv
    return res


def intermediates_table(heads, n, d, granularities) -> list:
    q, k, v, do = bias_inputs(heads, n, d)
    exact = exact_intermediates(q, k, v, do)
    shape = dict(dtype="float16", batch=1, heads=heads, seqlen=n, head_dim=d, causal=False)
    records = []
    for (gran, tensor), x in emulated_intermediates(q, k, v, do, granularities).items():
        ref = exact[{"P_hat": "P", "dS_hat_q": "dS", "dS_hat_k": "dS"}.get(tensor, tensor)]
        records.append(dict(table="intermediates", source="emulator", granularity=gran, tensor=tensor,
                            **shape, **metrics(x, ref)))
    report_common.log("  intermediates (emulator): " + "  ".join(
        f"{r['tensor']}{'' if r['granularity'] is None else '/' + r['granularity']} {r['rel_l2']:.4f}"
        for r in records))
    return records


def smoothing_table(be: Backend, heads, n, d, granularities) -> list:
    q, k, v, do = (be.half(x) for x in bias_inputs(heads, n, d))
    exact = be.exact(q, k, v, do)
    shape = dict(dtype="float16", batch=1, heads=heads, seqlen=n, head_dim=d, causal=False)
    records = []
    for variant, options in SMOOTHING.items():
        recs = _scored(be.run(q, k, v, do, granularities, **options), exact, table="smoothing",
                       source=_source(be), smoothing=variant, **shape)
        records += recs
        report_common.log(f"  smoothing {variant:<4}: " + _summary(recs))
    # Soft-capped (granularity "fine"): K-smoothing adds each score's share back before tanh (docs/ALGORITHM.md).
    exact = be.exact(q, k, v, do, softcap=SOFTCAP)
    for variant in SOFTCAP_SMOOTHING:
        recs = _scored(be.run(q, k, v, do, ["fine"], softcap=SOFTCAP, **SMOOTHING[variant]), exact,
                       table="smoothing", source=_source(be), smoothing=variant, softcap=SOFTCAP, **shape)
        records += recs
        report_common.log(f"  smoothing {variant:<4} cap {SOFTCAP:g}: " + _summary(recs))
    return records


# ---------------------------------------------------------------------------------------------- main

def _shape_arg(text: str) -> tuple:
    d, n = text.split(":")
    return int(d), int(n)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", action="store_true", help="run the NumPy emulator on the CPU (no GPU needed)")
    ap.add_argument("--out", default=None, help="JSON path (required with --host)")
    ap.add_argument("--results-dir", default=report_common.DEFAULT_RESULTS)
    ap.add_argument("--configs", type=_shape_arg, nargs="+", default=None, metavar="D:N",
                    help="σ-sweep shapes as head_dim:seqlen (default 64:1024 128:4096; --host 64:256)")
    ap.add_argument("--sigmas", type=float, nargs="+", default=list(SIGMAS))
    ap.add_argument("--heads", type=int, default=None, help="default 4 (--host: 2)")
    ap.add_argument("--bias-shape", type=_shape_arg, default=None, metavar="D:N",
                    help="shape of the K-bias inputs (default 64:1024; --host 64:256)")
    ap.add_argument("--granularities", nargs="+", choices=GRANULARITIES, default=list(GRANULARITIES))
    ap.add_argument("--quick", action="store_true", help="σ = 1 and 5, the first shape only")
    args = ap.parse_args(argv)
    if args.host and not args.out:
        ap.error("--host needs --out: emulator numbers do not go into results/")
    defaults = HOST_DEFAULTS if args.host else GPU_DEFAULTS
    configs = args.configs or defaults["configs"]
    heads = args.heads or defaults["heads"]
    bias_d, bias_n = args.bias_shape or defaults["bias"]
    sigmas = [int(s) if float(s).is_integer() else s for s in args.sigmas]
    if args.quick:
        configs, sigmas = configs[:1], [s for s in sigmas if s in (1, 5)] or sigmas[:1]

    start = time.time()
    be = Backend(args.host)
    report_common.log(f"accuracy on {be.name}")
    records = sigma_sweep(be, configs, heads, sigmas, args.granularities)
    records += intermediates_table(heads, bias_n, bias_d, args.granularities)
    records += smoothing_table(be, heads, bias_n, bias_d, args.granularities)
    kernels = "the NumPy emulator (host)" if args.host else "the GPU kernels"
    meta = report_common.metadata(
        be.name, seconds=round(time.time() - start, 1),
        sources={"sigma": kernels, "intermediates": "the NumPy emulator", "smoothing": kernels,
                 "reference": "float64 NumPy (sagebwd_cp.host.reference)" if args.host
                 else "float64 torch autograd on the GPU (SDPA math backend)"},
        inputs={"sigma": {"description": "q, k ~ N(0, σ²); v, dO ~ N(0, 1); fp16; seeds "
                                         f"{SIGMA_SEED} (q, k, v) and {SIGMA_SEED + 1} (dO)"},
                "bias": {"description": f"q, v, dO ~ N(0, 1), k = N(0, 1) + {BIAS_STRENGTH:g}·c "
                                        "with c ~ N(0, 1) per (head, channel); fp16",
                         "strength": BIAS_STRENGTH, "seed": BIAS_SEED}})
    data = {"kind": "accuracy", "metadata": meta, "records": records}
    out = args.out or os.path.join(report_common.device_dir(args.results_dir, be.name), "accuracy.json")
    report_common.write_json(out, data)

    import render_report

    print(render_report.accuracy_markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
