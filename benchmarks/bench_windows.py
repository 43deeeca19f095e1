"""Sliding-window and soft-capped attention against their peers, side by side in one run (bf16, d = 128,
GQA 4:1).

For each shape, forward and forward+backward in ms (CUDA events, median): this library with the
window; FlexAttention (compiled) with a sliding-window block mask; this library and SDPA-cuDNN on full
causal attention. "band" is the fraction of the causal mask's (query, key) pairs the window keeps; the
target is windowed time <= 1.2 · band · full causal time (ours), the skipped key tiles costing nothing.
``--causal-only`` times this library's plain causal attention alone (to compare two versions of the
library, each run with its own Python). ``--softcap C`` adds causal attention with logit soft-capping
C (ours with K-smoothing, as by default, against FlexAttention with a tanh ``score_mod``).

    python benchmarks/bench_windows.py [--shapes 1x16x4x32768x4096 2x16x4x8192x1024] [--json PATH]
    python benchmarks/bench_windows.py --render PATH.json      # its Markdown table, PATH.md beside it
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention import timed  # noqa: E402

DEFAULT_SHAPES = ("1x16x4x32768x4096", "2x16x4x8192x4096", "2x16x4x8192x1024")


def band_fraction(n: int, window: int) -> float:
    """(query, key) pairs with 0 <= i - j <= window, over those with 0 <= i - j (N queries, N keys)."""
    causal = n * (n + 1) // 2
    w = min(window, n - 1)
    return (causal - (n - w - 1) * (n - w) // 2) / causal


def _inputs(b, hq, hk, n, d):
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    make = lambda h: torch.randn((b, h, n, d), generator=g, device="cuda", dtype=torch.bfloat16)
    q, k, v = make(hq), make(hk), make(hk)
    return q, k, v, torch.randn_like(q)


def _ours(q, k, v, do, window, softcap=0.0):
    import sagebwd_cp

    kw = {"causal": True, "window_size": (window, 0)} if window else {"causal": True}
    if softcap:
        kw.update(softcap=softcap)  # K-smoothing on, as by default
    fwd = lambda: sagebwd_cp.attention(q, k, v, **kw)

    def fwdbwd():
        _, saved = sagebwd_cp.attention_forward(q, k, v, **kw)
        sagebwd_cp.attention_backward(saved, do)

    return fwd, fwdbwd


def _torch_pair(attend, q, k, v, do):
    import torch

    qr, kr, vr = (x.clone().requires_grad_(True) for x in (q, k, v))
    fwd = lambda: attend(q, k, v)

    def fwdbwd():
        torch.autograd.grad(attend(qr, kr, vr), (qr, kr, vr), do)

    return fwd, fwdbwd


def _cudnn(q, k, v, do):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def attend(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    return _torch_pair(attend, q, k, v, do)


def compiled_flex_attention():
    """FlexAttention compiled for one shape's calls: dynamo reset first, so that a run's shapes do not pass its
    recompile limit (past it flex_attention runs uncompiled, ~10x slower)."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()
    return torch.compile(flex_attention, dynamic=False)


def _flex(q, k, v, do, window):
    from torch.nn.attention.flex_attention import create_block_mask

    n = q.shape[2]
    mask = create_block_mask(lambda b, h, i, j: (j <= i) & (i - j <= window), None, None, n, n, device="cuda")
    compiled = compiled_flex_attention()
    return _torch_pair(lambda q, k, v: compiled(q, k, v, block_mask=mask, enable_gqa=True), q, k, v, do)


def _flex_softcap(q, k, v, do, cap):
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    n = q.shape[2]
    mask = create_block_mask(lambda b, h, i, j: j <= i, None, None, n, n, device="cuda")
    compiled = compiled_flex_attention()
    score_mod = lambda score, b, h, i, j: cap * torch.tanh(score / cap)
    return _torch_pair(lambda q, k, v: compiled(q, k, v, score_mod=score_mod, block_mask=mask, enable_gqa=True),
                       q, k, v, do)


COLUMNS = ("ours window", "flex window", "ours causal", "cudnn causal", "ours softcap", "flex softcap")


def markdown(data: dict) -> str:
    """The records of one run as a Markdown table: ms forward / forward+backward per implementation, and
    the ratios the targets read (ours against band · our causal; FlexAttention's time over ours)."""
    recs = data["records"]
    cols = [c for c in COLUMNS if any(c in r for r in recs)]
    head = ["B×Hq×Hkv×N×window", "band"] + cols + ["ours ÷ (band·causal)", "flex ÷ ours, window", "flex ÷ ours, softcap"]
    lines = [f"{data['device']}, torch {data['torch']}: bf16, head dim 128, causal; ms forward / forward+backward, "
             "one run.", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ratio = lambda r, a, b: (f"{r[a]['fwdbwd_ms'] / r[b]['fwdbwd_ms']:.2f}" if a in r and b in r else "")
    for r in recs:
        cells = [r["shape"], f"{r['band']:.3f}"]
        cells += [f"{r[c]['fwd_ms']:.3f} / {r[c]['fwdbwd_ms']:.3f}" if c in r else "" for c in cols]
        target = (f"{r['ours window']['fwdbwd_ms'] / (r['band'] * r['ours causal']['fwdbwd_ms']):.2f}"
                  if "ours window" in r and "ours causal" in r else "")
        cells += [target, ratio(r, "flex window", "ours window"), ratio(r, "flex softcap", "ours softcap")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_markdown(json_path: str, data: dict, render) -> str:
    """``render(data)``, the Markdown table of a run's records, written beside its JSON (PATH.md); returned."""
    table = render(data)
    with open(os.path.splitext(json_path)[0] + ".md", "w") as f:
        f.write(table)
    return table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="BxHqxHkvxNxWINDOW, d = 128")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--causal-only", action="store_true")
    ap.add_argument("--softcap", type=float, default=0.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--render", default=None, help="write the Markdown table of a results JSON beside it, and stop")
    args = ap.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            print(write_markdown(args.render, json.load(f), markdown))
        return 0
    import torch

    records = []
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    for text in args.shapes:
        b, hq, hk, n, window = map(int, text.split("x"))
        q, k, v, do = _inputs(b, hq, hk, n, 128)
        runs = {"ours causal": _ours(q, k, v, do, None)}
        if not args.causal_only:
            runs = {"ours window": _ours(q, k, v, do, window), **runs, "cudnn causal": _cudnn(q, k, v, do)}
            try:
                runs["flex window"] = _flex(q, k, v, do, window)
                if args.softcap:
                    runs["ours softcap"] = _ours(q, k, v, do, None, args.softcap)
                    runs["flex softcap"] = _flex_softcap(q, k, v, do, args.softcap)
            except Exception as exc:  # noqa: BLE001 - a torch without FlexAttention: the row is left out
                print(f"  flex unavailable: {str(exc)[:100]}", file=sys.stderr)
        rec = {"shape": text, "band": band_fraction(n, window)}
        for name, (fwd, fwdbwd) in runs.items():
            rec[name] = {"fwd_ms": timed(fwd, args.reps), "fwdbwd_ms": timed(fwdbwd, args.reps)}
        records.append(rec)
        cells = "  ".join(f"{name} {r['fwd_ms']:.3f}/{r['fwdbwd_ms']:.3f}" for name, r in rec.items()
                          if isinstance(r, dict))
        print(f"{text} band {rec['band']:.3f}: {cells}  (fwd/fwd+bwd ms)")
        if "ours window" in rec:
            ours, full = rec["ours window"]["fwdbwd_ms"], rec["ours causal"]["fwdbwd_ms"]
            line = f"  window/(band·causal) {ours / (rec['band'] * full):.2f}"
            if "flex window" in rec:
                line += (f"  flex/ours fwd {rec['flex window']['fwd_ms'] / rec['ours window']['fwd_ms']:.2f} "
                         f"fwd+bwd {rec['flex window']['fwdbwd_ms'] / ours:.2f}")
            print(line)
        if "flex softcap" in rec:
            print(f"  softcap: flex/ours fwd {rec['flex softcap']['fwd_ms'] / rec['ours softcap']['fwd_ms']:.2f} "
                  f"fwd+bwd {rec['flex softcap']['fwdbwd_ms'] / rec['ours softcap']['fwdbwd_ms']:.2f}; ours softcap/causal "
                  f"fwd+bwd {rec['ours softcap']['fwdbwd_ms'] / rec['ours causal']['fwdbwd_ms']:.2f}")
    if args.json:
        data = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "records": records}
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
        write_markdown(args.json, data, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
