"""Render a results/<device>/ folder: speed.md, accuracy.md, memory.md and the speed charts from the
JSON files the measuring scripts wrote, and two blocks of README.md: the headline (between
``<!-- headline:start -->`` and ``<!-- headline:end -->``) from that folder, and the verdict by GPU
(between ``<!-- verdict:start -->`` and ``<!-- verdict:end -->``) from every folder beside it.  Runs
anywhere: it needs neither a GPU nor torch, and without matplotlib it skips the charts with a message.

    python benchmarks/render_report.py [benchmarks/results/NVIDIA_H200] [--no-readme] [--no-charts]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import report_common  # noqa: E402

README = os.path.join(report_common.ROOT, "README.md")
START, END = "<!-- headline:start -->", "<!-- headline:end -->"
VERDICT_START, VERDICT_END = "<!-- verdict:start -->", "<!-- verdict:end -->"

IMPL_ORDER = ("sagebwd", "sagebwd[fine]", "sagebwd[paper]", "sageattn", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient")
SHORT = {"sagebwd": "ours", "sagebwd[fine]": "ours fine", "sagebwd[paper]": "ours paper", "sageattn": "sageattn",
         "sdpa-flash": "FA2", "sdpa-cudnn": "cuDNN", "sdpa-efficient": "mem-eff"}
LONG = {"sagebwd": "SageBwd (ours)", "sagebwd[fine]": "SageBwd fine (ours)", "sagebwd[paper]": "SageBwd paper (ours)",
        "sageattn": "SageAttention 1.0.6 (Triton)", "sdpa-flash": "FlashAttention2 (SDPA)",
        "sdpa-cudnn": "cuDNN (SDPA)", "sdpa-efficient": "memory-efficient (SDPA)"}
COLORS = {"sagebwd": "#d62728", "sagebwd[fine]": "#d62728", "sagebwd[paper]": "#ff9896", "sageattn": "#9467bd",
          "sdpa-flash": "#1f77b4", "sdpa-cudnn": "#2ca02c", "sdpa-efficient": "#7f7f7f"}
RATIO_PEERS = ("sdpa-flash", "sdpa-cudnn", "sageattn")
PASS_TITLE = {"fwd": "forward", "bwd": "backward", "fwdbwd": "forward+backward"}
HEADLINE = {"seqlen": 16384, "head_dim": 128, "causal": False, "dtype": "float16"}


def is_ours(impl: str) -> bool:
    return impl.startswith("sagebwd")


def mode_of(impl: str) -> str:
    """"fine" of "sagebwd[fine]"; the impl itself when it has no mode."""
    return impl[impl.index("[") + 1:-1] if impl.endswith("]") and "[" in impl else impl


# Our forward kernel without its quantization pre-pass (report_speed.KERNEL_ONLY): not an impl of its
# own (no bars, ratios or headline), but two columns of the forward tables.
KERNEL_ONLY = "sagebwd[kernel]"


def _order(impls) -> list:
    impls = set(impls) - {KERNEL_ONLY}
    return sorted(impls, key=lambda i: (IMPL_ORDER.index(i) if i in IMPL_ORDER else len(IMPL_ORDER), i))


def _dtypes(names) -> list:
    """float16 before bfloat16 (the paper's and the headline's dtype first)."""
    return sorted(set(names), key=lambda n: (n != "float16", n))


def seqlen_label(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def load(path: str):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def check_speed_records(data: dict) -> None:
    """Raise ValueError if a speed record lacks a required key."""
    for i, rec in enumerate(data.get("records", [])):
        missing = [k for k in report_common.SPEED_RECORD_KEYS if k not in rec]
        if missing:
            raise ValueError(f"speed record {i} lacks {missing}: {rec}")


def _meta_line(meta: dict) -> str:
    v = meta.get("versions", {})
    parts = [f"{meta.get('device', '?')}", f"measured {meta.get('date', '?')}"]
    if meta.get("commit"):
        parts.append(f"commit {meta['commit']}")
    parts += [f"{name} {v[name]}" for name in ("sagebwd_cp", "torch", "cupy", "sageattention") if v.get(name)]
    return ", ".join(parts) + "."


def _fmt(x, spec=".0f") -> str:
    return "–" if x is None else format(x, spec)


# ---------------------------------------------------------------------------------------------- speed

def speed_index(data: dict) -> dict:
    """{(pass, dtype, head_dim, causal, seqlen, impl): tflops}"""
    return {(r["pass"], r["dtype"], r["head_dim"], r["causal"], r["seqlen"], r["impl"]): r["tflops"]
            for r in data.get("records", [])}


CEILING_NAMES = (("int8_mma_tops", "INT8 mma.sync", "TOPS"), ("fp16_mma_tflops", "16-bit mma.sync", "TFLOPS"),
                 ("int8_wgmma_tops", "INT8 wgmma", "TOPS"), ("fp16_wgmma_tflops", "16-bit wgmma", "TFLOPS"))


def speed_markdown(data: dict, charts=()) -> str:
    check_speed_records(data)
    meta = data.get("metadata", {})
    ceil = meta.get("ceilings", {})
    # The "% of limit" columns use the wgmma ceilings where the run measured them (Hopper), else mma.sync's.
    wgmma = "int8_wgmma_tops" in ceil
    i8 = ceil.get("int8_wgmma_tops") if wgmma else ceil.get("int8_mma_tops")
    f16 = ceil.get("fp16_wgmma_tflops") if wgmma else ceil.get("fp16_mma_tflops")
    idx = speed_index(data)
    recs = data.get("records", [])
    out = [f"# Attention speed, {meta.get('device', '?')}", "", _meta_line(meta), "",
           "16K tokens per batch (batch = max(1, 16384 / N)), hidden 2048 (heads = 2048 / head dim), HND layout. "
           "TOPS = FLOPs / time with the forward at 4·B·H·N²·d (half when causal), the backward 2.5x and "
           "forward+backward 3.5x that. Our backward includes its quantization and pre/postprocessing; "
           "\"fine\" and \"paper\" are its two scale granularities. Ratios are ours / peer, measured side by side."]
    if i8 and f16:
        kind = "wgmma (operands from shared memory)" if wgmma else "mma.sync"
        listed = ", ".join(f"{name} {ceil[key]:.0f} {unit}" for key, name, unit in CEILING_NAMES if key in ceil)
        out.append(f"Ceilings measured in the same run: {listed}; \"% INT8\" is ours against the INT8 {kind} "
                   f"one, \"FA2 % 16-bit\" FlashAttention2 against the 16-bit {kind} one"
                   + ("." if wgmma else " (cuDNN uses Hopper's wgmma and can pass the mma.sync ceiling)."))
    for pass_ in PASS_TITLE:
        for dtype in _dtypes(r["dtype"] for r in recs if r["pass"] == pass_):
            group = [r for r in recs if r["pass"] == pass_ and r["dtype"] == dtype]
            impls = _order(r["impl"] for r in group)
            ours = [i for i in impls if is_ours(i)]
            peers = [p for p in RATIO_PEERS if p in impls]
            head = ["d", "causal", "N"] + [SHORT.get(i, i) for i in impls] + [f"×{SHORT[p]}" for p in peers]
            head += ["% INT8"] if i8 and ours else []
            head += ["FA2 % 16-bit"] if f16 and "sdpa-flash" in impls else []
            kernel_only = "sagebwd" in impls and any(r["impl"] == KERNEL_ONLY for r in group)
            head += ["ours, kernel only", "pre-pass %"] if kernel_only else []
            out += ["", f"## {PASS_TITLE[pass_]}, {dtype} (TOPS)", ""]
            if kernel_only:
                out.append("\"Kernel only\" times the attention kernel on K and V quantized beforehand (the "
                           "kernel quantizes Q itself); \"pre-pass %\" is the share of our forward's time "
                           "spent before it (K's token sums, K and V's quantization, host work).")
                out.append("")
            if len(ours) > 1:
                out.append(f"Ratio and % columns list {' / '.join(SHORT[o] for o in ours)}.")
                out.append("")
            out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            for d, causal, n in sorted({(r["head_dim"], r["causal"], r["seqlen"]) for r in group}):
                t = {i: idx.get((pass_, dtype, d, causal, n, i)) for i in impls}
                row = [str(d), "yes" if causal else "no", seqlen_label(n)] + [_fmt(t[i]) for i in impls]
                for p in peers:
                    row.append(" / ".join("–" if t[o] is None or not t[p] else f"{t[o] / t[p]:.2f}" for o in ours))
                if i8 and ours:
                    row.append(" / ".join("–" if t[o] is None else f"{100 * t[o] / i8:.1f}" for o in ours))
                if f16 and "sdpa-flash" in impls:
                    row.append(_fmt(None if t["sdpa-flash"] is None else 100 * t["sdpa-flash"] / f16, ".1f"))
                if kernel_only:
                    k = idx.get((pass_, dtype, d, causal, n, KERNEL_ONLY))
                    row += [_fmt(k), _fmt(None if k is None or t["sagebwd"] is None else 100 * (1 - t["sagebwd"] / k), ".1f")]
                out.append("| " + " | ".join(row) + " |")
            chart = chart_name(pass_, dtype)
            if chart in charts:
                out += ["", f"![{PASS_TITLE[pass_]}, {dtype}]({chart})"]
    skipped = data.get("skipped", [])
    if skipped:
        out += ["", "## Skipped", ""]
        groups = {}
        for s in skipped:
            groups.setdefault((s["impl"], s["pass"], s["reason"]), []).append(s)
        for (impl, pass_, reason), items in sorted(groups.items()):
            where = ", ".join(sorted({f"{s['dtype']} d={s['head_dim']} {'c' if s['causal'] else 'nc'} "
                                      f"N={seqlen_label(s['seqlen'])}" for s in items}))
            out.append(f"- {impl} {pass_}: {reason} ({where})")
    return "\n".join(out) + "\n"


def chart_name(pass_: str, dtype: str) -> str:
    return f"speed_{pass_}_{dtype}.png"


def speed_charts(data: dict, outdir: str) -> list:
    """One PNG per (pass, dtype): a panel per (head dim, causal), bars per impl grouped by N."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no charts", file=sys.stderr)
        return []
    recs = data.get("records", [])
    device = data.get("metadata", {}).get("device", "")
    idx = speed_index(data)
    written = []
    for pass_ in PASS_TITLE:
        for dtype in _dtypes(r["dtype"] for r in recs if r["pass"] == pass_):
            group = [r for r in recs if r["pass"] == pass_ and r["dtype"] == dtype]
            impls = _order(r["impl"] for r in group)
            dims = sorted({r["head_dim"] for r in group})
            causals = sorted({r["causal"] for r in group})
            seqlens = sorted({r["seqlen"] for r in group})
            fig, axes = plt.subplots(len(dims), len(causals), figsize=(6.4 * len(causals), 3.4 * len(dims)),
                                     squeeze=False)
            width = 0.84 / len(impls)
            for a, d in enumerate(dims):
                for c, causal in enumerate(causals):
                    ax = axes[a][c]
                    top = 0.0
                    for j, impl in enumerate(impls):
                        pts = [(x, idx[pass_, dtype, d, causal, n, impl]) for x, n in enumerate(seqlens)
                               if (pass_, dtype, d, causal, n, impl) in idx]
                        if not pts:
                            continue
                        xs = [x + (j - (len(impls) - 1) / 2) * width for x, _ in pts]
                        ys = [y for _, y in pts]
                        top = max(top, max(ys))
                        bars = ax.bar(xs, ys, width, label=LONG.get(impl, impl), color=COLORS.get(impl),
                                      edgecolor="black", linewidth=0.3)
                        ax.bar_label(bars, fmt="%.0f", fontsize=5.5, rotation=90, padding=1.5)
                    ax.set_xticks(range(len(seqlens)), [seqlen_label(n) for n in seqlens])
                    ax.set_ylim(0, top * 1.22 if top else 1)
                    ax.set_xlabel("sequence length")
                    ax.set_ylabel("TOPS")
                    ax.set_title(f"head dim {d}, {'causal' if causal else 'non-causal'}", fontsize=10)
                    ax.grid(axis="y", alpha=0.3)
                    ax.set_axisbelow(True)
            handles, labels = [], []
            for ax in axes.flat:
                for h, lab in zip(*ax.get_legend_handles_labels()):
                    if lab not in labels:
                        handles.append(h)
                        labels.append(lab)
            # Title and legend in a band above the panels, sized in inches so any grid looks the same.
            height = fig.get_figheight()
            band = (0.75 + 0.2 * ((len(labels) - 1) // 5)) / height
            fig.tight_layout(rect=(0, 0, 1, 1 - band))
            fig.suptitle(f"{device}: {PASS_TITLE[pass_]}, {dtype}", y=1 - 0.08 / height, va="top")
            fig.legend(handles, labels, loc="upper center", ncol=min(5, len(labels)), fontsize=8, frameon=False,
                       bbox_to_anchor=(0.5, 1 - 0.38 / height))
            path = os.path.join(outdir, chart_name(pass_, dtype))
            fig.savefig(path, dpi=130, bbox_inches="tight")
            plt.close(fig)
            written.append(path)
    return written


# ---------------------------------------------------------------------------------------------- accuracy

TENSOR_LABEL = {"delta": "δ", "P": "P", "P_hat": "P̂ (as dV reads it)", "dS": "dS",
                "dS_hat_q": "dŜ (as dQ reads it)", "dS_hat_k": "dŜ (as dK reads it)",
                "O": "O", "dQ": "dQ", "dK": "dK", "dV": "dV"}
GRADS = ("O", "dQ", "dK", "dV")


def _cell(rec) -> str:
    return "–" if rec is None else f"{rec['cos']:.5f} / {rec['rel_l2']:.4f}"


def _shape_key(r) -> tuple:
    return (r["head_dim"], r["seqlen"], r["batch"], r["heads"], r["dtype"], r["causal"])


def _shape_text(key) -> str:
    d, n, b, h, dtype, causal = key
    return f"B={b}, H={h}, N={n}, d={d}, {dtype}, {'causal' if causal else 'non-causal'}"


def _granularities(recs) -> list:
    return [g for g in ("fine", "paper") if any(r.get("granularity") == g for r in recs)]


def sigma_rows(recs, key, gran) -> dict:
    """{sigma: {tensor: record}} of one σ-sweep shape and granularity (O has no granularity)."""
    rows = {}
    for r in recs:
        if r["table"] == "sigma" and _shape_key(r) == key and r.get("granularity") in (gran, None):
            rows.setdefault(r["sigma"], {})[r["tensor"]] = r
    return rows


def accuracy_markdown(data: dict) -> str:
    meta = data.get("metadata", {})
    recs = data.get("records", [])
    src = meta.get("sources", {})
    out = [f"# Accuracy, {meta.get('device', '?')}", "", _meta_line(meta), "",
           "CosSim / Rel-L2 against exact FP64 attention and gradients of the same 16-bit inputs"
           + (f" ({src['reference']})" if src.get("reference") else "") + ". Rel-L2 = ‖x − x_ref‖ / ‖x_ref‖."]
    sig = [r for r in recs if r["table"] == "sigma"]
    if sig:
        out += ["", "## σ sweep (SB26 Table 1 setting)", "",
                f"q, k ~ N(0, σ²), v and dO ~ N(0, 1); computed by {src.get('sigma', '?')}. The last column is our "
                "Rel-L2 over the published one (below 1: more accurate than SB26)."]
        for key in sorted({_shape_key(r) for r in sig}):
            for gran in _granularities([r for r in sig if _shape_key(r) == key]):
                rows = sigma_rows(sig, key, gran)
                out += ["", f"### {_shape_text(key)}, granularity \"{gran}\"", "",
                        "| σ | O | dQ | dK | dV | Rel-L2 ÷ SB26 (O / dQ / dK / dV) |", "|---|---|---|---|---|---|"]
                for sigma in sorted(rows):
                    pub = report_common.SB26_TABLE1.get(sigma)
                    ratios = " / ".join("–" if pub is None or t not in rows[sigma] else
                                        f"{rows[sigma][t]['rel_l2'] / pub[t][1]:.2f}" for t in GRADS)
                    out.append(f"| {sigma:g} | " + " | ".join(_cell(rows[sigma].get(t)) for t in GRADS)
                               + f" | {ratios} |")
        out += ["", "### SB26 Table 1 (published)", "", "| σ | O | dQ | dK | dV |", "|---|---|---|---|---|"]
        for sigma, row in sorted(report_common.SB26_TABLE1.items()):
            out.append(f"| {sigma} | " + " | ".join(f"{row[t][0]:.4f} / {row[t][1]:.4f}" for t in GRADS) + " |")
    inter = [r for r in recs if r["table"] == "intermediates"]
    if inter:
        grans = _granularities(inter)
        bias = meta.get("inputs", {}).get("bias", {})
        out += ["", "## Intermediate tensors (SB26 Table 2 setting)", "",
                f"From the NumPy emulator of the kernels' quantization (the kernels do not expose δ, P, dS), "
                f"{_shape_text(_shape_key(inter[0]))}, on inputs with a strong K channel bias: "
                f"{bias.get('description', '')}. P̂ and dŜ are the dequantized 8-bit values the INT8 products "
                "read. SB26's numbers come from one layer of a real model, not these inputs: a guide to the "
                "ordering of the errors, not a target.", "",
                "| tensor | " + " | ".join(f"{g}" for g in grans) + " | SB26 Table 2 |",
                "|" + "---|" * (len(grans) + 2)]
        for tensor in TENSOR_LABEL:
            cells = []
            for g in grans:
                hit = [r for r in inter if r["tensor"] == tensor and r.get("granularity") in (g, None)]
                cells.append(_cell(hit[0]) if hit else "–")
            if all(c == "–" for c in cells):
                continue
            pub = report_common.SB26_TABLE2.get(tensor)
            out.append(f"| {TENSOR_LABEL[tensor]} | " + " | ".join(cells) + " | "
                       + ("–" if pub is None else f"{pub[0]:.4f} / {pub[1]:.4f}") + " |")
    smooth = [r for r in recs if r["table"] == "smoothing" and not r.get("softcap")]
    capped = [r for r in recs if r["table"] == "smoothing" and r.get("softcap")]
    if smooth:
        out += ["", "## Smoothing ablation", "",
                f"The strong-K-bias inputs above ({_shape_text(_shape_key(smooth[0]))}), computed by "
                f"{src.get('smoothing', '?')}: no smoothing (smooth_k=False), K-smoothing (the default) and "
                "Q+K-smoothing (smooth_q=True).", "",
                "| smoothing | granularity | O | dQ | dK | dV |", "|---|---|---|---|---|---|"]
        for variant in [v for v in ("none", "K", "Q+K") if any(r["smoothing"] == v for r in smooth)]:
            for g in _granularities(smooth):
                cells = []
                for t in GRADS:
                    hit = [r for r in smooth if r["smoothing"] == variant and r["tensor"] == t
                           and r.get("granularity") in (g, None)]
                    cells.append(_cell(hit[0]) if hit else "–")
                out.append(f"| {variant} | {g} | " + " | ".join(cells) + " |")
    if capped:
        cap = capped[0]["softcap"]
        out += ["", f"With logit soft-capping (softcap={cap:g}, granularity \"fine\"; the exact reference caps its "
                    "scores too): no smoothing and K-smoothing, whose share of each score is added back before tanh.",
                "", "| smoothing | O | dQ | dK | dV |", "|---|---|---|---|---|"]
        for variant in [v for v in ("none", "K") if any(r["smoothing"] == v for r in capped)]:
            cells = []
            for t in GRADS:
                hit = [r for r in capped if r["smoothing"] == variant and r["tensor"] == t]
                cells.append(_cell(hit[0]) if hit else "–")
            out.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------- memory

CATEGORIES = ("quantization", "attention", "prepost", "memset", "other")
CATEGORY_TITLE = {"quantization": "quantization", "attention": "attention kernels", "prepost": "pre/post",
                  "memset": "memset", "other": "other"}


def memory_markdown(data: dict) -> str:
    meta = data.get("metadata", {})
    out = [f"# Memory and time shares, {meta.get('device', '?')}", "", _meta_line(meta)]
    peak = data.get("peak", [])
    if peak:
        impls = _order(r["impl"] for r in peak)
        ours = [i for i in impls if is_ours(i)]
        peers = [p for p in ("sdpa-flash", "sdpa-cudnn") if p in impls]
        out += ["", "## Peak memory of one forward+backward (MiB)", "",
                "torch.cuda.max_memory_allocated() after reset_peak_memory_stats(), minus what was allocated "
                "before the call (q, k, v, dO: the \"inputs\" column). Our workspaces come from torch's caching "
                "allocator for torch inputs; \"CuPy pool\" checks that CuPy's own pool stayed unused.", "",
                "| d | N | B×H | dtype | causal | inputs | " + " | ".join(SHORT.get(i, i) for i in impls)
                + "".join(f" | {SHORT[o]} ÷ {SHORT[p]}" for o in ours for p in peers) + " | CuPy pool |",
                "|" + "---|" * (7 + len(impls) + len(ours) * len(peers))]
        keys = sorted({(r["head_dim"], r["seqlen"], r["batch"], r["heads"], r["dtype"], r["causal"]) for r in peak})
        for d, n, b, h, dtype, causal in keys:
            rows = {r["impl"]: r for r in peak if (r["head_dim"], r["seqlen"], r["batch"], r["heads"], r["dtype"],
                                                   r["causal"]) == (d, n, b, h, dtype, causal)}
            any_row = next(iter(rows.values()))
            cells = [str(d), seqlen_label(n), f"{b}×{h}", dtype, "yes" if causal else "no",
                     f"{any_row['inputs_mib']:.0f}"]
            cells += [_fmt(rows[i]["peak_mib"] if i in rows else None) for i in impls]
            for o in ours:
                for p in peers:
                    cells.append("–" if o not in rows or p not in rows else
                                 f"{rows[o]['peak_mib'] / rows[p]['peak_mib']:.2f}")
            pools = [r.get("cupy_pool_mib") for r in rows.values() if is_ours(r["impl"])]
            cells.append(_fmt(max(pools) if pools and None not in pools else None, ".0f"))
            out.append("| " + " | ".join(cells) + " |")
    prof = data.get("profile", [])
    if prof:
        cats = meta.get("kernel_categories", {})
        names = "; ".join(f"{CATEGORY_TITLE[c]}: {', '.join(cats[c])}" for c in CATEGORIES if cats.get(c))
        out += ["", "## Where our time goes (torch.profiler, GPU kernel time per call)", "",
                (names + "; " if names else "") + "memset: zeroed workspaces; other: any other GPU work. Shares are "
                "of the summed kernel time; \"outside kernels\" is wall time (CUDA events, no profiler) minus "
                "that sum: launch gaps and host work the GPU waits on.", "",
                "| call | d | N | causal | wall ms | kernels ms | " + " | ".join(CATEGORY_TITLE[c] for c in CATEGORIES)
                + " | outside kernels ms | largest kernels (ms) |",
                "|" + "---|" * (8 + len(CATEGORIES))]
        order = list(PASS_TITLE)
        for r in sorted(prof, key=lambda r: (order.index(r["pass"]) if r["pass"] in order else len(order), r["impl"],
                                             r["head_dim"], r["seqlen"], r["causal"])):
            total = r["kernel_ms"] or 1.0
            shares = [f"{100 * r['categories'].get(c, 0.0) / total:.1f}%" for c in CATEGORIES]
            top = sorted(r["kernels"].items(), key=lambda kv: -kv[1])[:4]
            out.append(f"| {r['impl']} {r['pass']} | {r['head_dim']} | {seqlen_label(r['seqlen'])} | "
                       f"{'yes' if r['causal'] else 'no'} | {r['wall_ms']:.2f} | {r['kernel_ms']:.2f} | "
                       + " | ".join(shares) + f" | {r['wall_ms'] - r['kernel_ms']:.2f} | "
                       + ", ".join(f"{k} {v:.2f}" for k, v in top) + " |")
    skipped = data.get("skipped", [])
    if skipped:
        out += ["", "Skipped: " + "; ".join(f"{s['impl']} d={s['head_dim']}: {s['reason']}" for s in skipped)]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------- headline

def _pick_headline_shape(records):
    """(head_dim, causal, dtype, seqlen) for the headline: HEADLINE where measured, else the nearest
    shape (larger head dim, non-causal, fp16, N = 16K or the longest)."""
    shapes = {(r["head_dim"], r.get("causal", False), r["dtype"], r["seqlen"]) for r in records}
    if not shapes:
        return None
    h = HEADLINE

    def rank(shape):
        d, causal, dtype, n = shape
        return (d != h["head_dim"], -d, causal != h["causal"], dtype != h["dtype"], n != h["seqlen"], -n)

    return min(shapes, key=rank)


def headline(speed, accuracy, memory, results_link: str) -> str:
    """The README block: a few numbers from the JSON files, their terms, and links to the full tables."""
    lines, terms = [], []
    device = next((x["metadata"].get("device") for x in (speed, accuracy, memory) if x), "?")
    if speed:
        shape = _pick_headline_shape(speed.get("records", []))
        if shape is not None:
            d, causal, dtype, n = shape
            idx = speed_index(speed)
            date = speed["metadata"].get("date", "?")[:10]
            lines += [f"Measured on {device} ({date}), N = {seqlen_label(n)} tokens, head dim {d}, "
                      f"{'causal' if causal else 'non-causal'}, {dtype}. The peer is cuDNN's attention through "
                      "PyTorch's `scaled_dot_product_attention` (what PyTorch runs by default on Hopper):", "",
                      "| pass | ours (TOPS) | cuDNN (TOPS) | ours ÷ cuDNN | ours ÷ FA2 |", "|---|---|---|---|---|"]
            for pass_ in PASS_TITLE:
                ours = [i for i in _order(r["impl"] for r in speed["records"] if r["pass"] == pass_) if is_ours(i)]
                vals = {i: idx.get((pass_, dtype, d, causal, n, i)) for i in ours}
                ours = [i for i in ours if vals[i] is not None]
                if not ours:
                    continue
                label = PASS_TITLE[pass_] + (f" ({' / '.join(mode_of(i) for i in ours)})" if len(ours) > 1 else "")

                def ratio(peer):
                    p = idx.get((pass_, dtype, d, causal, n, peer))
                    return " / ".join(f"{vals[i] / p:.2f}" for i in ours) if p else "–"

                cudnn = idx.get((pass_, dtype, d, causal, n, "sdpa-cudnn"))
                lines.append(f"| {label} | {' / '.join(f'{vals[i]:.0f}' for i in ours)} | "
                             f"{_fmt(cudnn)} | {ratio('sdpa-cudnn')} | {ratio('sdpa-flash')} |")
            lines.append("")
            terms.append("TOPS: tera-operations per second, counting 4·B·H·N²·d for a forward (half of it when "
                         "causal), 2.5× that for a backward and 3.5× for both; ours ÷ cuDNN above 1 is faster than "
                         "cuDNN; FA2: FlashAttention-2 through the same PyTorch call; fine / paper: the backward's "
                         "quantization scales (per query and per key, or one per 64×64 tile as published).")
    if accuracy:
        sig = [r for r in accuracy.get("records", []) if r["table"] == "sigma"]
        keys = sorted({_shape_key(r) for r in sig})
        if keys:
            key = keys[0]
            gran = "fine" if "fine" in _granularities(sig) else (_granularities(sig) or [None])[0]
            row = sigma_rows(sig, key, gran).get(1)
            if row:
                pub = report_common.SB26_TABLE1[1]
                lines.append(f"Accuracy at σ = 1 ({_shape_text(key)}, granularity \"{gran}\"), Rel-L2 against FP64: "
                             + ", ".join(f"{t} {row[t]['rel_l2']:.4f}" for t in GRADS if t in row)
                             + " (SB26 Table 1: " + ", ".join(f"{pub[t][1]:.4f}" for t in GRADS) + ").")
                lines.append("")
                terms.append("Rel-L2: ‖x − x_ref‖₂ / ‖x_ref‖₂ against attention computed in float64; σ: the standard "
                             "deviation of the Gaussian q and k (v and dO have 1); SB26: the SageBwd paper "
                             "(\"SageBwd: A Trainable Low-bit Attention\", arXiv 2603.02170), whose Table 1 gives "
                             "these errors for its kernels in the same setting.")
    if memory:
        peak = memory.get("peak", [])
        shape = _pick_headline_shape(peak)
        rows = {r["impl"]: r["peak_mib"] for r in peak
                if shape and (r["head_dim"], r["causal"], r["dtype"], r["seqlen"]) == shape}
        ours = [i for i in _order(rows) if is_ours(i)]
        if ours:
            peers = ", ".join(f"{SHORT[p]} {rows[p]:.0f}" for p in ("sdpa-flash", "sdpa-cudnn") if p in rows)
            lines.append(f"Peak memory of one forward+backward at N = {seqlen_label(shape[3])}, head dim "
                         f"{shape[0]}: ours {rows[ours[0]]:.0f} MiB" + (f" ({peers})" if peers else "") + ".")
            lines.append("")
    if not lines:
        return "No benchmark results rendered yet (benchmarks/README.md says how)."
    if terms:
        lines += ["Terms: " + " ".join(terms), ""]
    names = [("speed", speed), ("accuracy", accuracy), ("memory", memory)]
    lines.append("Full tables and charts: " + ", ".join(f"[{name}]({results_link}/{name}.md)"
                                                        for name, x in names if x) + ".")
    return "\n".join(lines)


def update_readme(path: str, block: str, start_marker: str = START, end_marker: str = END,
                  required: bool = True) -> None:
    """Replace what lies between the markers, and nothing else; without the markers, raise ValueError
    if ``required``, else leave the file alone."""
    with open(path) as f:
        text = f.read()
    start, end = text.find(start_marker), text.find(end_marker)
    if start < 0 or end < 0 or end < start:
        if not required:
            return
        raise ValueError(f"{path}: no {start_marker} ... {end_marker} block")
    new = text[:start + len(start_marker)] + "\n" + block.strip("\n") + "\n" + text[end:]
    if new != text:
        with open(path, "w") as f:
            f.write(new)


# ---------------------------------------------------------------------------------------------- verdict

def _times(x: float) -> str:
    """A speed ratio in words: "slower", "faster" or "on par" (within 3%)."""
    return "slower" if x < 0.97 else "faster" if x > 1.03 else "on par"


def _span(xs, spec=".2f") -> str:
    lo, hi = format(min(xs), spec), format(max(xs), spec)
    return lo if lo == hi else f"{lo}-{hi}"


def _speed_cell(ratios: list) -> str:
    med = statistics.median(ratios)
    word = f"**{_times(med)}**" if med < 0.97 else _times(med)
    return f"{word}: {med:.2f}x ({_span(ratios)})"


def _model_cell(model: dict) -> str:
    """Our step time over SDPA's per context: the newest commit's records of each (head dim, context);
    shapes measured only at an older commit are marked so."""
    runs = model.get("runs", [])
    if not runs:
        return "not measured"
    newest = runs[-1].get("commit")
    latest = {}  # (head_dim, context) -> (commit, [our step / SDPA's])
    for run in runs:
        for r in run["records"]:
            key = (r["head_dim"], r["context"])
            ratio = r["sagebwd"]["step_ms"] / r["sdpa"]["step_ms"]
            if key in latest and latest[key][0] == run.get("commit"):
                latest[key][1].append(ratio)
            else:
                latest[key] = (run.get("commit"), [ratio])
    by_context = {}
    for (_, context), (commit, ratios) in sorted(latest.items(), key=lambda kv: kv[0][1]):
        old, xs = by_context.setdefault(context, (False, []))
        by_context[context] = (old or commit != newest, xs + ratios)
    groups = []  # consecutive contexts alike in being measured at the newest commit or not
    for context, (old, xs) in by_context.items():
        if groups and groups[-1][0] == old:
            groups[-1][1].append(context)
            groups[-1][2].extend(xs)
        else:
            groups.append((old, [context], list(xs)))
    parts = []
    for old, contexts, xs in groups:
        where = "-".join(dict.fromkeys((seqlen_label(contexts[0]), seqlen_label(contexts[-1]))))
        pct = [100 * (x - 1) for x in xs]
        if min(pct) > 0:
            text = f"{_span(pct, '.0f')}% **slower**"
        elif max(pct) < 0:
            text = f"{_span([-p for p in pct], '.0f')}% faster"
        else:
            text = f"{_span(xs, '.3f')}x the step time"
        parts.append(f"{text} at {where} context" + (" (an earlier version)" if old else ""))
    return "; ".join(parts)


def verdict(folders: list, readme_dir: str) -> str:
    """The README's verdict by GPU: for each results folder with a speed.json, forward+backward
    against PyTorch's default attention (cuDNN on Hopper) and FlashAttention-2 over every measured
    shape (median and range of ours / peer), and the model step from model.json where there is one."""
    rows, shapes = [], set()
    for folder in folders:
        speed = load(os.path.join(folder, "speed.json"))
        if not speed:
            continue
        idx = speed_index(speed)
        recs = [r for r in speed.get("records", []) if r["pass"] == "fwdbwd"]
        ours = [i for i in _order(r["impl"] for r in recs) if is_ours(i)]
        if not ours:
            continue
        ours = "sagebwd" if "sagebwd" in ours else "sagebwd[fine]" if "sagebwd[fine]" in ours else ours[0]
        ratio = {}
        for r in recs:
            if r["impl"] == ours:
                for peer in ("sdpa-cudnn", "sdpa-flash"):
                    p = idx.get((r["pass"], r["dtype"], r["head_dim"], r["causal"], r["seqlen"], peer))
                    if p:
                        ratio.setdefault(peer, []).append(r["tflops"] / p)
                shapes.add((r["head_dim"], r["seqlen"], r["causal"], r["dtype"]))
        model = load(os.path.join(folder, "model.json"))
        link = os.path.relpath(os.path.abspath(os.path.join(folder, "speed.md")), readme_dir).replace(os.sep, "/")
        meta = speed.get("metadata", {})
        cc = meta.get("compute_capability", "")
        cells = [_speed_cell(ratio[p]) if p in ratio else "–" for p in ("sdpa-cudnn", "sdpa-flash")]
        cells.append(_model_cell(model) if model else "not measured")
        rows.append(f"| [{meta.get('device', '?')}]({link})" + (f" (sm_{cc.replace('.', '')})" if cc else "")
                    + " | " + " | ".join(cells) + " |")
    if not rows:
        return "No speed results rendered yet (benchmarks/README.md says how)."
    dims = " and ".join(str(d) for d in sorted({s[0] for s in shapes}))
    ns = sorted({s[1] for s in shapes})
    dtypes = " and ".join(_dtypes(s[3] for s in shapes))
    causal = {True: "causal", False: "non-causal"}
    causal = "causal and not" if len({s[2] for s in shapes}) > 1 else causal[next(iter(shapes))[2]]
    return "\n".join([
        "| GPU | forward+backward ÷ PyTorch's default (cuDNN) | ÷ FlashAttention-2 | "
        "training step ÷ PyTorch's default |",
        "|---|---|---|---|", *rows,
        "| A100, A10, RTX 30xx/40xx, L4, L40 (sm_80-sm_89) | not measured | not measured | not measured |",
        "| B200 (sm_100), RTX 50xx (sm_120): built (mma.sync kernels) | not measured | not measured | not measured |",
        "",
        f"Speed ratios: ours ÷ peer, above 1 is faster; the median, and in brackets the range, over head dims "
        f"{dims}, {seqlen_label(ns[0])}-{seqlen_label(ns[-1])} tokens, {causal}, {dtypes}, each measured side by "
        "side in one run. "
        "Training step: a `transformers` Llama-style decoder (hidden 1024, 8 layers, GQA 4:1, bfloat16 autocast, "
        "16K tokens a step, `benchmarks/bench_model.py`), our step time against the same model's with SDPA. "
        "On sm_80-sm_89, sm_100 and sm_120 the kernels are compiled (without register spills) and their "
        "algorithm is tested on the CPU emulator, but no such card has been measured."])


# ---------------------------------------------------------------------------------------------- all

def result_folders(root: str = report_common.DEFAULT_RESULTS) -> list:
    """The results/<device> folders under ``root`` that hold a speed.json, in name order."""
    return sorted(os.path.dirname(p) for p in glob.glob(os.path.join(root, "*", "speed.json")))


def render_wide_accuracy(results_dir: str) -> str | None:
    """accuracy_wide_head_dims.md, the SB26 table at head dims 192 and 256, from the JSON beside it (report.py
    --wide-head-dims writes both); its path, or None where there is no such JSON."""
    data = load(os.path.join(results_dir, "accuracy_wide_head_dims.json"))
    if not data:
        return None
    path = os.path.join(results_dir, "accuracy_wide_head_dims.md")
    with open(path, "w") as f:
        f.write(accuracy_markdown(data))
    return path


def render(results_dir: str, readme: str | None = README, charts: bool = True) -> list:
    """Write the Markdown files (and charts) of one results/<device> folder; update ``readme``'s
    headline block unless it is None.  Returns the paths written."""
    speed, accuracy, memory = (load(os.path.join(results_dir, f"{n}.json")) for n in ("speed", "accuracy", "memory"))
    if not (speed or accuracy or memory):
        raise FileNotFoundError(f"{results_dir}: no speed.json, accuracy.json or memory.json")
    written = []

    def write(name, text):
        path = os.path.join(results_dir, name)
        with open(path, "w") as f:
            f.write(text)
        written.append(path)

    if speed:
        pngs = speed_charts(speed, results_dir) if charts else []
        written += pngs
        write("speed.md", speed_markdown(speed, charts=[os.path.basename(p) for p in pngs]))
    if accuracy:
        write("accuracy.md", accuracy_markdown(accuracy))
    wide_accuracy = render_wide_accuracy(results_dir)
    if wide_accuracy:
        written.append(wide_accuracy)
    if memory:
        write("memory.md", memory_markdown(memory))
    if readme is not None:
        link = os.path.relpath(os.path.abspath(results_dir), os.path.dirname(os.path.abspath(readme)))
        update_readme(readme, headline(speed, accuracy, memory, link.replace(os.sep, "/")))
        update_readme(readme, verdict(result_folders(os.path.dirname(os.path.abspath(results_dir))),
                                      os.path.dirname(os.path.abspath(readme))),
                      VERDICT_START, VERDICT_END, required=False)
        written.append(readme)
    for p in written:
        print(f"wrote {p}", file=sys.stderr)
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="?", help="a results/<device> folder (default: the only one with JSON files)")
    ap.add_argument("--readme", default=README, help="the README whose headline block to update")
    ap.add_argument("--no-readme", action="store_true")
    ap.add_argument("--no-charts", action="store_true")
    args = ap.parse_args(argv)
    target = args.results
    if target is None:
        found = sorted({os.path.dirname(p) for n in ("speed", "accuracy", "memory")
                        for p in glob.glob(os.path.join(report_common.DEFAULT_RESULTS, "*", f"{n}.json"))})
        if len(found) != 1:
            ap.error(f"name a results folder; found {found or 'none'}")
        target = found[0]
    render(target, readme=None if args.no_readme else args.readme, charts=not args.no_charts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
