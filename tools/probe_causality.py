"""What causal attention guarantees under quantization, measured on the NumPy emulator (CPU; bit-matched
to the kernels): how much the outputs of a causal row move when later tokens change, and what the
three choices of μ_K cost in accuracy. The numbers quoted in docs/ALGORITHM.md ("Causality") come
from this script.

Table 1 (outputs): q, k, v ~ N(0, 1) (fp16, B=1, H=2, causal); every key and value after position p
replaced by fresh random values. Over rows 0..p, whose exact outputs are unchanged: Rel-L2 and max |ΔO|
of the quantized output, the ratio of ΔO's norm to the quantized output's own error against exact
attention on those rows, and the first row that changed. For μ_K = the whole sequence's token mean
(the default), none (smooth_k=False) and the first 64 keys' mean (``prefix_key_mean``), at forward key
tiles of 64 and 128 keys (mma.sync and sm_90's wgmma forward).

Table 2 (gradients): the same inputs, dO nonzero only on rows 0..p: the largest |dQ|, |dK|, |dV| at
positions after p (exactly 0 is the claim); and with dO on every row, how much dQ of rows 0..p moves
when the later keys and values change (Rel-L2).

Table 3 (decoding): row t of a causal prefill over N tokens against one query t over the keys 0..t, as
token-by-token decoding with a KV cache computes it.

Table 4 (accuracy): Rel-L2 of O, dQ, dK, dV against exact float64 attention (causal, N=1024) for
each μ_K, on unit inputs, on keys with a strong channel bias (k = N(0,1) + 5·c, c ~ N(0,1) per head and
channel: accuracy.md's smoothing ablation) and on the same with an outlier first key (token 0's key
+ 8·N(0,1): an attention sink).

    python tools/probe_causality.py            # all four tables (a few minutes on one core)
    python tools/probe_causality.py --quick    # fewer seeds and shapes
"""
from __future__ import annotations

import argparse

import numpy as np

try:  # the emulator and the reference, wherever the package keeps them
    from sagebwd_cp.host import emulator, reference
except ImportError:
    from sagebwd_cp.host import emulator, reference
from sagebwd_cp import prefix_key_mean

MEANS = ("sequence", "none", "prefix64")


def _rel(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    n = np.linalg.norm(ref)
    return float(np.linalg.norm(x - ref) / (n if n > 0 else 1.0))


def _rand(rng, shape, dtype="float16"):
    return rng.standard_normal(shape).astype(np.float32).astype(dtype).astype(np.float32)


def _options(mean, k):
    """emulate_forward's keyword arguments for a μ_K choice."""
    if mean == "sequence":
        return {"smooth_k": True}
    if mean == "none":
        return {"smooth_k": False}
    if mean.startswith("prefix"):
        return {"smooth_k": True, "k_mean": prefix_key_mean(k, tokens=int(mean[len("prefix"):]))}
    raise ValueError(mean)


def _forward(q, k, v, mean, key_tile=64):
    return emulator.emulate_forward(q, k, v, causal=True, key_tile=key_tile, **_options(mean, k))


def _changed_after(k, v, p, seed):
    """k, v with every token after position p replaced by fresh N(0, 1) values."""
    rng = np.random.default_rng(10_000 + seed)
    k2, v2 = k.copy(), v.copy()
    k2[:, :, p + 1:] = _rand(rng, k2[:, :, p + 1:].shape)
    v2[:, :, p + 1:] = _rand(rng, v2[:, :, p + 1:].shape)
    return k2, v2


def output_table(shapes, seeds):
    print("| N | d | p | key tile | μ_K | Rel-L2 ΔO (rows ≤ p) | max abs ΔO | ΔO / error vs exact | first changed row |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n, d, p in shapes:
        for key_tile in (64, 128):
            for mean in MEANS:
                rels, maxes, ratios, firsts = [], [], [], []
                for seed in seeds:
                    rng = np.random.default_rng(seed)
                    q, k, v = (_rand(rng, (1, 2, n, d)) for _ in range(3))
                    k2, v2 = _changed_after(k, v, p, seed)
                    o1 = _forward(q, k, v, mean, key_tile)[0][:, :, :p + 1]
                    o2 = _forward(q, k2, v2, mean, key_tile)[0][:, :, :p + 1]
                    exact = reference.attention_reference(q, k, v, causal=True)[0][:, :, :p + 1]
                    rels.append(_rel(o2, o1))
                    maxes.append(float(np.abs(o2 - o1).max()))
                    ratios.append(np.linalg.norm(o2 - o1) / np.linalg.norm(o1 - exact))
                    diff = np.nonzero((o1 != o2).any(axis=(0, 1, 3)))[0]
                    firsts.append(int(diff[0]) if diff.size else None)
                first = "none" if all(f is None for f in firsts) else min(f for f in firsts if f is not None)
                print(f"| {n} | {d} | {p} | {key_tile} | {mean} | {min(rels):.2e}-{max(rels):.2e} | "
                      f"{max(maxes):.3g} | {max(ratios):.2f} | {first} |")


def gradient_table(shapes, seeds):
    print("| N | d | p | μ_K | max abs dQ, dK, dV after p (loss on rows ≤ p) | Rel-L2 of dQ rows ≤ p when later k, v change "
          "| first changed dQ row |")
    print("|---|---|---|---|---|---|---|")
    for n, d, p in shapes:
        for mean in MEANS:
            worst, moved, firsts = 0.0, [], []
            for seed in seeds:
                rng = np.random.default_rng(seed)
                q, k, v, do = (_rand(rng, (1, 2, n, d)) for _ in range(4))
                do_early = do.copy()
                do_early[:, :, p + 1:] = 0
                _, _, saved = _forward(q, k, v, mean)
                dq, dk, dv = emulator.emulate_backward(saved, do_early)
                worst = max(worst, *(float(np.abs(g[:, :, p + 1:]).max()) for g in (dq, dk, dv)))
                dq_full = emulator.emulate_backward(saved, do)[0]
                k2, v2 = _changed_after(k, v, p, seed)
                dq2 = emulator.emulate_backward(_forward(q, k2, v2, mean)[2], do)[0]
                moved.append(_rel(dq2[:, :, :p + 1], dq_full[:, :, :p + 1]))
                firsts.append(int(np.nonzero((dq2[:, :, :p + 1] != dq_full[:, :, :p + 1]).any(axis=(0, 1, 3)))[0][0]))
            print(f"| {n} | {d} | {p} | {mean} | {worst:g} | {min(moved):.2e}-{max(moved):.2e} | {min(firsts)} |")


def decode_table(n, d, steps, seeds):
    """Token-by-token decoding against prefill: row t of one causal call over all n tokens against a call
    with the single query t over the keys 0..t (what a KV cache gives), each call with its own μ_K choice
    computed from its own keys (the prefix mean is the same in both once t ≥ 63)."""
    print("| N | d | key tile | μ_K | " + " | ".join(f"t = {t}" for t in steps) + " |")
    print("|---|---|---|---|" + "---|" * len(steps))
    for key_tile in (64, 128):
        for mean in MEANS:
            cells = []
            for t in steps:
                rels = []
                for seed in seeds:
                    rng = np.random.default_rng(seed)
                    q, k, v = (_rand(rng, (1, 2, n, d)) for _ in range(3))
                    prefill = _forward(q, k, v, mean, key_tile)[0][:, :, t]
                    decode = _forward(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], mean, key_tile)[0][:, :, 0]
                    rels.append(_rel(decode, prefill))
                cells.append("identical" if max(rels) == 0 else f"{max(rels):.1e}")
            print(f"| {n} | {d} | {key_tile} | {mean} | " + " | ".join(cells) + " |")


def _inputs(kind, rng, n, d):
    q, k, v, do = (_rand(rng, (1, 2, n, d)) for _ in range(4))
    if kind in ("bias", "bias+sink"):
        c = rng.standard_normal((1, 2, 1, d)).astype(np.float32)
        k = (k + 5 * c).astype(np.float16).astype(np.float32)
    if kind == "bias+sink":
        k[:, :, 0] = (k[:, :, 0] + 8 * rng.standard_normal((1, 2, d))).astype(np.float16).astype(np.float32)
    return q, k, v, do


def accuracy_table(dims, seeds, n=1024, means=MEANS + ("prefix1",)):
    print("| inputs | d | μ_K | O | dQ | dK | dV |")
    print("|---|---|---|---|---|---|---|")
    for kind in ("unit", "bias", "bias+sink"):
        for d in dims:
            errs = {m: [] for m in means}
            for seed in seeds:
                rng = np.random.default_rng(100 + seed)
                q, k, v, do = _inputs(kind, rng, n, d)
                ref = (reference.attention_reference(q, k, v, causal=True)[0],
                       *reference.attention_reference_backward(q, k, v, do, causal=True))
                for mean in means:
                    o, _, saved = _forward(q, k, v, mean)
                    got = (o, *emulator.emulate_backward(saved, do))
                    errs[mean].append([_rel(x, r) for x, r in zip(got, ref)])
            for mean in means:
                e = np.mean(errs[mean], axis=0)
                print(f"| {kind} | {d} | {mean} | " + " | ".join(f"{x:.4f}" for x in e) + " |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one seed, fewer shapes")
    args = ap.parse_args()
    seeds = [0] if args.quick else [0, 1, 2]
    shapes = [(512, 64, 200), (512, 128, 200)] + ([] if args.quick else [(2048, 64, 1000), (2048, 128, 1000)])
    print("## Outputs of rows 0..p when every key and value after p changes\n")
    output_table(shapes, seeds)
    print("\n## Gradients\n")
    gradient_table(shapes[:2], seeds)
    print("\n## Decoding against prefill: Rel-L2 of row t (largest over the seeds)\n")
    decode_table(512, 64, (40, 63, 100, 127, 200, 255, 511), seeds)
    print("\n## Accuracy against exact attention (causal, N=1024, mean of the seeds)\n")
    accuracy_table((64, 128), seeds)


if __name__ == "__main__":
    main()
