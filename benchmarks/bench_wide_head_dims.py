"""Head dims above 128 against their peers, side by side in one run (bf16, causal; GQA 4:1 and multi-head shapes
by default): this library's kernels; SDPA with cuDNN and with FlashAttention-2 (each where it takes the head dim;
the reason where not); FlexAttention (compiled) with a causal block mask. Forward and forward+backward in ms (CUDA
events, median).

    python benchmarks/bench_wide_head_dims.py [--shapes 2x16x4x4096x256 2x16x4x4096x192x128] [--peers ours cudnn]
                                              [--json PATH]       # and its Markdown table, PATH.md beside it
    python benchmarks/bench_wide_head_dims.py --render PATH.json  # the Markdown table of a run's records

A shape's optional sixth number is V's head dim (multi-head latent attention's 192/128). ``--window W`` (a causal
sliding window of W keys to the left) and ``--softcap C`` (logit soft-capping, with K-smoothing) time Gemma 2's
layers: ours and FlexAttention (its block mask with the window, a tanh ``score_mod``); SDPA takes neither.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention import timed  # noqa: E402
from bench_windows import _torch_pair, compiled_flex_attention, write_markdown  # noqa: E402

# GQA 4:1 at 4K-8K, and multi-head attention at 2K (the weakest ratios: docs/PERFORMANCE.md).
DEFAULT_SHAPES = ("2x16x4x4096x256", "1x16x4x8192x256", "8x16x16x2048x256", "2x16x4x4096x192", "2x16x4x4096x192x128",
                  "1x16x4x8192x192x128", "8x16x16x2048x192x128")


def _ours(q, k, v, do, window=-1, softcap=0.0):
    import sagebwd_cp

    opts = dict(causal=True, window_size=(window, 0), softcap=softcap)

    def fwdbwd():
        _, saved = sagebwd_cp.attention_forward(q, k, v, **opts)
        sagebwd_cp.attention_backward(saved, do)

    return (lambda: sagebwd_cp.attention(q, k, v, **opts)), fwdbwd


def _sdpa(backend_name):
    def make(q, k, v, do, window=-1, softcap=0.0):
        if window >= 0 or softcap:
            raise ValueError("SDPA takes no sliding window or soft cap")
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)

        def attend(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        return _torch_pair(attend, q, k, v, do)
    return make


def _flex(q, k, v, do, window=-1, softcap=0.0):
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    n = q.shape[2]
    keep = (lambda b, h, i, j: (j <= i) & (i - j <= window)) if window >= 0 else (lambda b, h, i, j: j <= i)
    mask = create_block_mask(keep, None, None, n, n, device="cuda")
    cap = (lambda s, b, h, i, j: softcap * torch.tanh(s / softcap)) if softcap else None
    compiled = compiled_flex_attention()
    return _torch_pair(lambda q, k, v: compiled(q, k, v, score_mod=cap, block_mask=mask, enable_gqa=True), q, k, v, do)


PEERS = {"ours": _ours, "cudnn": _sdpa("CUDNN_ATTENTION"), "fa2": _sdpa("FLASH_ATTENTION"), "flex": _flex}


def shape_inputs(text: str):
    """q, k, v and dO (bf16, (B, H, N, D), seeded) of a shape ``BxHqxHkvxNxD[xDv]``."""
    import torch

    b, hq, hk, n, d, *dv = map(int, text.split("x"))
    dv = dv[0] if dv else d
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn((b, h, n, e), generator=g, device="cuda", dtype=torch.bfloat16)
               for h, e in ((hq, d), (hk, d), (hk, dv)))
    return q, k, v, torch.randn((b, hq, n, dv), generator=g, device="cuda", dtype=torch.bfloat16)


PEER_NAMES = {"ours": "ours", "cudnn": "cuDNN", "fa2": "FlashAttention-2", "flex": "FlexAttention"}


def _shape_text(shape: str) -> str:
    """"2x16x4x4096x192x128" as "2×16/4×4096, 192/128" (B×Hq/Hkv×N, Q·K's head dim / V's)."""
    b, hq, hk, n, *dims = shape.split("x")
    return f"{b}×{hq}/{hk}×{n}, " + "/".join(dims)


def markdown(data: dict) -> str:
    """The records of one run as a Markdown table: ms forward / forward+backward for each peer timed (a peer that
    does not take the shape: n/a), and our forward+backward time over each peer's (below 1: ours is faster)."""
    recs = data["records"]
    peers = [p for p in PEER_NAMES if any(p in r for r in recs)]
    others = [p for p in peers if p != "ours"]
    mask = "causal" + (f", window {data['window']}" if data.get("window", -1) >= 0 else "") + (
        f", soft cap {data['softcap']:g}" if data.get("softcap") else "")
    head = ["B×Hq/Hkv×N, d"] + [PEER_NAMES[p] for p in peers] + [f"our time ÷ {PEER_NAMES[p]}'s" for p in others]
    lines = [f"{data['device']}, torch {data['torch']}: bf16, {mask}; ms forward / forward+backward, one run; the "
             "time ratios are of forward+backward (below 1: ours is faster).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    timed_ok = lambda r, p: p in r and "fwd_ms" in r[p]  # noqa: E731
    for r in recs:
        cells = [_shape_text(r["shape"])]
        cells += [f"{r[p]['fwd_ms']:.3f} / {r[p]['fwdbwd_ms']:.3f}" if timed_ok(r, p) else "n/a" for p in peers]
        cells += [f"{r['ours']['fwdbwd_ms'] / r[p]['fwdbwd_ms']:.2f}" if timed_ok(r, p) and timed_ok(r, "ours") else ""
                  for p in others]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="BxHqxHkvxNxD[xDv]")
    ap.add_argument("--peers", nargs="+", choices=list(PEERS), default=list(PEERS), help="what to time (default: all)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--window", type=int, default=-1, help="a causal sliding window of this many keys (-1: none)")
    ap.add_argument("--softcap", type=float, default=0.0, help="logit soft-capping's c (0: none)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--render", default=None, help="write the Markdown table of a results JSON beside it, and stop")
    args = ap.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            print(write_markdown(args.render, json.load(f), markdown))
        return 0
    import torch

    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  (bf16, causal; ms fwd / fwd+bwd)")
    records = []
    for text in args.shapes:
        q, k, v, do = shape_inputs(text)
        rec = {"shape": text}
        for name in args.peers:
            make = PEERS[name]
            try:
                fwd, fwdbwd = make(q, k, v, do, args.window, args.softcap)
                rec[name] = {"fwd_ms": timed(fwd, args.reps), "fwdbwd_ms": timed(fwdbwd, args.reps)}
            except Exception as exc:  # noqa: BLE001 - a peer that does not take the head dim: its reason
                rec[name] = {"error": str(exc).splitlines()[0][:160]}
        records.append(rec)
        cells = [f"{k} {r['fwd_ms']:.3f}/{r['fwdbwd_ms']:.3f}" if "fwd_ms" in r else f"{k} n/a ({r['error'][:60]})"
                 for k, r in rec.items() if isinstance(r, dict)]
        print(f"{text}: " + "  ".join(cells))
    if args.json:
        data = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "window": args.window,
                "softcap": args.softcap, "records": records}
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
        write_markdown(args.json, data, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
