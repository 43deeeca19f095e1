"""Calibration on the measured card, held-out check, and predictions for the RTX 4090 and 5090.

Reads the calibration run's JSON (calibrate.py) and the SASS counts (sass_counts.json, or counted
now where nvdisasm is present), fits per kernel (ours and FlashAttention-2, forward and backward)
the two stall latencies of ``model.Latency`` on the fit shapes (N = 2K and 8K), a launch cost and a
bandwidth factor for the pre-/post-passes, reports predicted against measured on every shape (the
held-out ones, N = 4K and 16K, marked), checks the model's FlashAttention-2 forward on the RTX 4090
against the published figure (published.json: a check only, never fitted), and predicts both cards'
times with the same parameters.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics

from . import cards as cards_mod
from . import model

FIT_SEQLENS = (2048, 8192)
TOLERANCE = 0.15
SASS_KINDS = [(kind, d, causal) for kind in ("fwd", "bwd") for d in (64, 128) for causal in (False, True)]


def sass_key(kind, d, causal, arch) -> str:
    return f"{kind}.hd{d}.{'causal' if causal else 'full'}.{arch}"


def count_all(archs, shared_limits) -> dict:
    """SASS counts of every mma.sync kernel the model uses, for ``archs`` (compiles and disassembles)."""
    from . import sass

    out = {}
    for arch in archs:
        for kind, d, causal in SASS_KINDS:
            out[sass_key(kind, d, causal, arch)] = sass.profile_kernel(kind, d, causal, arch, shared_limits[arch])
    return out


def shared_limits() -> dict:
    limits = {c.arch: c.shared_per_block for c in cards_mod.CARDS.values()}
    limits.setdefault("sm_89", cards_mod.CARDS["RTX4090"].shared_per_block)
    return limits


def load_counts(path: str | None, archs) -> dict:
    counts = {}
    if path and os.path.exists(path):
        with open(path) as f:
            counts = json.load(f)["kernels"]
    missing = sorted({a for a in archs for kind, d, c in SASS_KINDS if sass_key(kind, d, c, a) not in counts})
    if missing:
        counts.update(count_all(missing, shared_limits()))
    return counts


# ---------------------------------------------------------------------------------------------
# The calibration run's measurements

def _sum_matching(d: dict, pred) -> float:
    return sum(v for k, v in d.items() if pred(k))


def measured(rec: dict) -> dict:
    """{(impl, pass): {"kernel": s, "prepost": s, "total": s}} of one shape's record."""
    out = {}
    for pas, entry in (("fwd", "attention_forward"), ("bwd", "attention_backward")):
        r = rec.get(f"ours_{pas}")
        if r and r.get("steps_ms"):
            steps = r["steps_ms"]
            kern = _sum_matching(steps, lambda k: k.split("#")[0] == entry)
            rest = _sum_matching(steps, lambda k: k.split("#")[0] != entry)
            out["ours", pas] = {"kernel": kern * 1e-3, "prepost": rest * 1e-3, "total": (kern + rest) * 1e-3,
                                "call": r["call_ms"] * 1e-3}
    for pas, main in (("fwd", "flash_fwd"), ("bwd", "flash_bwd_dq_dk_dv")):
        r = rec.get(f"fa2_{pas}")
        if not r:
            continue
        call = r["call_ms"] * 1e-3
        ks = r.get("kernels_us") or {}
        kern = _sum_matching(ks, lambda k: main in k) * 1e-6
        if kern > 0:
            rest = _sum_matching(ks, lambda k: main not in k) * 1e-6
            out["fa2", pas] = {"kernel": kern, "prepost": rest, "total": kern + rest, "call": call}
        else:
            out["fa2", pas] = {"kernel": call, "prepost": 0.0, "total": call, "call": call}
    return out


def calibration_card(cal: dict) -> tuple:
    """(card with the measured SM count, clock Hz, mma.sync rates a clock an SM) of the calibration run."""
    dev = cal["device"]
    card = dataclasses.replace(cards_mod.card_for_device(dev["name"]), sms=dev["sms"])
    clocks = [cal.get(k, {}).get("mhz_median") for k in ("clock_after_ceilings", "clock_end", "clock_start")]
    clocks = [c for c in clocks if c]
    clock_mhz = statistics.median(clocks) if clocks else card.boost_ghz * 1e3
    ceil = cal.get("ceilings") or {}
    measured_rates = {"int8_mma_tops": ceil.get("int8_mma_tops"), "fp16_mma_tflops": ceil.get("fp16_mma_tflops"),
                      "clock_mhz": clock_mhz}
    rates = {"i8": card.macs_per_clk("i8", measured_rates), "f16": card.macs_per_clk("f16", measured_rates)}
    return card, clock_mhz * 1e6, rates


def shapes(cal: dict) -> list:
    return [(r["head_dim"], r["causal"], r["seqlen"], r["batch"] * r["heads"]) for r in cal["records"]]


def kernels_for(card: cards_mod.Card, counts: dict, arch: str | None = None) -> dict:
    """{(impl, pass, d, causal): model.Kernel} on ``card`` (ours from the SASS of ``arch``)."""
    arch = arch or card.arch
    out = {}
    for kind, d, causal in SASS_KINDS:
        out["ours", kind, d, causal] = model.ours_kernel(counts[sass_key(kind, d, causal, arch)])
        out["fa2", kind, d, causal] = model.fa2_kernel(kind == "bwd", d, card.arch, causal, card.shared_per_block)
    return out


def predict_bounds(card, kernels, shape, rates, clock_hz) -> dict:
    d, causal, n, bh = shape
    elems = bh * n * d
    out = {}
    for impl in ("ours", "fa2"):
        for pas in ("fwd", "bwd"):
            k = kernels[impl, pas, d, causal]
            out[impl, pas] = model.bounds(card, k, bh, n, causal, rates, clock_hz,
                                          model.kernel_dram_bytes(impl, pas == "bwd", elems))
    return out


@dataclasses.dataclass
class Fit:
    latency: dict  # (impl, pass) -> model.Latency
    fit_rms: dict  # (impl, pass) -> RMS of log(predicted / measured) on the fit shapes
    launch_s: float  # pre-/post-pass: seconds a launch
    bw_factor: float  # and the bytes' time over the DRAM bound

    def prepost(self, card, impl, pas, elems) -> float:
        launches, nbytes = model.prepost(impl, pas == "bwd", elems)
        return launches * self.launch_s + self.bw_factor * nbytes / (card.dram_gbps * 1e9) if launches else 0.0


def fit_latency(pairs, start=(2.0, 8.0), iterations: int = 60) -> tuple:
    """(model.Latency, RMS log error) minimizing sum(log(predicted / measured)^2) over ``pairs`` of
    (model.Bounds, measured seconds): Levenberg-Marquardt on the two stall latencies (kept >= 0),
    with the exact gradient of the list schedule (the stalls of the CTAs on its last slot)."""
    import numpy as np

    p = np.array(start, dtype=float)

    def residuals(q):
        lat = model.Latency(*q)
        res, jac = [], []
        for b, meas in pairs:
            t, g = b.seconds_and_gradient(lat)
            res.append(math.log(t / meas))
            jac.append(g / t)
        return np.array(res), np.array(jac)

    r, J = residuals(p)
    cost, mu = float(r @ r), 1e-3
    for _ in range(iterations):
        A, g = J.T @ J, J.T @ r
        step = np.linalg.solve(A + mu * (np.diag(np.diag(A)) + 1e-12 * np.eye(2)), -g)
        q = np.maximum(p + step, 0.0)
        r2, J2 = residuals(q)
        cost2 = float(r2 @ r2)
        if cost2 <= cost:
            done = np.all(np.abs(q - p) <= 1e-6 * (1 + np.abs(p)))
            p, r, J, cost, mu = q, r2, J2, cost2, max(mu / 3, 1e-9)
            if done:
                break
        else:
            mu *= 4
            if mu > 1e8:
                break
    return model.Latency(float(p[0]), float(p[1])), math.sqrt(cost / max(len(pairs), 1))


def fit(cal: dict, counts: dict) -> tuple:
    """(Fit, rows): rows hold per shape and (impl, pass) the bounds, the measurement and the predictions."""
    import numpy as np

    card, clock_hz, rates = calibration_card(cal)
    kernels = kernels_for(card, counts)
    rows = []
    for rec, shape in zip(cal["records"], shapes(cal)):
        meas = measured(rec)
        b = predict_bounds(card, kernels, shape, rates, clock_hz)
        for key, m in meas.items():
            rows.append({"shape": shape, "impl": key[0], "pass": key[1], "measured": m, "bounds": b[key],
                         "fit": shape[2] in FIT_SEQLENS})
    latency, rms = {}, {}
    for impl in ("ours", "fa2"):
        for pas in ("fwd", "bwd"):
            sel = [(r["bounds"], r["measured"]["kernel"]) for r in rows
                   if r["fit"] and r["impl"] == impl and r["pass"] == pas]
            if sel:
                latency[impl, pas], rms[impl, pas] = fit_latency(sel)
    # pre-/post-passes: measured = launches * a + (bytes / bandwidth) * b, least squares on the fit shapes
    a_rows, y = [], []
    for r in rows:
        if r["fit"] and r["measured"]["prepost"] > 0:
            d, causal, n, bh = r["shape"]
            launches, nbytes = model.prepost(r["impl"], r["pass"] == "bwd", bh * n * d)
            if launches:
                a_rows.append([launches, nbytes / (card.dram_gbps * 1e9)])
                y.append(r["measured"]["prepost"])
    launch_s, bw_factor = 0.0, 1.0
    if len(y) >= 2:
        sol = np.linalg.lstsq(np.array(a_rows), np.array(y), rcond=None)[0]
        launch_s, bw_factor = float(sol[0]), float(sol[1])
        if launch_s < 0 or bw_factor <= 0:
            launch_s = 0.0
            bw_factor = float(np.dot(np.array(a_rows)[:, 1], y) / np.dot(np.array(a_rows)[:, 1], np.array(a_rows)[:, 1]))
    f = Fit(latency, rms, launch_s, bw_factor)
    for r in rows:
        key = r["impl"], r["pass"]
        d, causal, n, bh = r["shape"]
        r["pred_kernel"] = r["bounds"].seconds(latency[key])
        r["binding"] = r["bounds"].binding(latency[key])
        r["pred_prepost"] = f.prepost(card, r["impl"], r["pass"], bh * n * d)
        r["pred_total"] = r["pred_kernel"] + r["pred_prepost"]
        r["err_kernel"] = r["pred_kernel"] / r["measured"]["kernel"] - 1
        r["err_total"] = r["pred_total"] / r["measured"]["total"] - 1
    return f, rows, (card, clock_hz, rates)


def predict(card: cards_mod.Card, f: Fit, counts: dict, shape_list, arch: str | None = None) -> list:
    rates = {"i8": card.macs_per_clk("i8"), "f16": card.macs_per_clk("f16")}
    kernels = kernels_for(card, counts, arch)
    out = []
    for shape in shape_list:
        d, causal, n, bh = shape
        b = predict_bounds(card, kernels, shape, rates, card.boost_ghz * 1e9)
        row = {"shape": shape, "bounds": b}
        for (impl, pas), bb in b.items():
            lat = f.latency[impl, pas]
            kern = bb.seconds(lat)
            row[impl, pas] = kern + f.prepost(card, impl, pas, bh * n * d)
            row[impl, pas, "kernel"] = kern
            row[impl, pas, "binding"] = bb.binding(lat)
        out.append(row)
    return out


# ---------------------------------------------------------------------------------------------
# ncu's instruction counts against the SASS counts

def ncu_rows(path: str) -> list:
    """Rows of ncu's raw CSV (``--csv --page raw``): dicts of column -> text, in launch order."""
    import csv

    with open(path) as f:
        lines = [line for line in f if line.startswith('"')]
    if len(lines) < 3:
        return []
    rows = list(csv.reader(lines))
    header = rows[0]
    return [dict(zip(header, r)) for r in rows[2:] if len(r) == len(header)]


def _num(text) -> float | None:
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return None


def ncu_check(cal: dict, cal_dir: str, counts: dict, card) -> list:
    """Per profiled call of our kernels: ncu's warp instructions of the attention kernel against the
    model's (SASS counts times the grid's units), and the issue activity ncu saw."""
    info = cal.get("ncu_base") or {}
    path = os.path.join(cal_dir, info.get("file") or "ncu_base.csv")
    calls = info.get("calls")
    if not calls or not os.path.exists(path):
        return []
    current, per_call = None, {}
    for r in ncu_rows(path):
        name = r.get("Kernel Name", "")
        if "perfmodel_marker" in name:
            grid = r.get("launch__grid_size") or r.get("Grid Size", "")
            current = int(_num(grid.strip("()").split(",")[0]) or 0) - 1
            continue
        if current is not None and 0 <= current < len(calls):
            per_call.setdefault(current, []).append(r)
    out = []
    for i, (d, causal, n, what) in enumerate(calls):
        impl, pas = what.split("_")
        entry = {"ours": {"fwd": "attention_forward", "bwd": "attention_backward"},
                 "fa2": {"fwd": "flash_fwd", "bwd": "flash_bwd_dq_dk_dv"}}[impl][pas]
        rows = [r for r in per_call.get(i, []) if entry in r.get("Kernel Name", "")]
        if not rows:
            continue
        r = rows[0]
        inst = _num(r.get("smsp__inst_executed.sum"))
        bh = (16384 // n) * (2048 // d)
        if impl == "ours":
            k = model.ours_kernel(counts[sass_key(pas, d, causal, card.arch)])
        else:
            k = model.fa2_kernel(pas == "bwd", d, card.arch, causal, card.shared_per_block)
        units = model.cta_units(k, n, causal)
        pred = bh * k.warps * sum(a * k.interior["issue"] + e * k.edge["issue"] + k.per_cta.get("issue", 0)
                                  for a, e in units)
        out.append({"shape": (d, causal, n, bh), "impl": impl, "pass": pas, "ncu_inst": inst, "model_inst": pred,
                    "issue_active_pct": _num(r.get("smsp__issue_active.avg.pct_of_peak_sustained_active")),
                    "ncu_ms": (_num(r.get("gpu__time_duration.sum")) or 0) * 1e-6,
                    "clock_hz": _num(r.get("sm__cycles_elapsed.avg.per_second"))})
    return out


# ---------------------------------------------------------------------------------------------
# Report

def tops(shape, pas, seconds) -> float:
    d, causal, n, bh = shape
    flops = 4 * bh * n * n * d / (2 if causal else 1) * {"fwd": 1, "bwd": 2.5, "fwdbwd": 3.5}[pas]
    return flops / seconds / 1e12


def _shape_label(shape) -> str:
    d, causal, n, bh = shape
    return f"{d} | {'causal' if causal else 'full'} | {n // 1024}K"


def _pct(x) -> str:
    return f"{100 * x:+.1f}%"


PUBLISHED = os.path.join("benchmarks", "results", "perf_model", "published.json")
KERNELS = [("ours", "fwd"), ("ours", "bwd"), ("fa2", "fwd"), ("fa2", "bwd")]


def load_published(path: str | None = PUBLISHED) -> dict:
    if path and os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return {}


def published_check(f: Fit, counts: dict, grid, published: dict) -> dict | None:
    """The model's FlashAttention-2 forward on the published figure's card and head dim (non-causal
    shapes of the calibration grid) against the published range. A check: nothing is fitted on it."""
    pub = published.get("fa2_fwd_rtx4090")
    if not pub:
        return None
    card = cards_mod.CARDS[pub["card"]]
    sel = [s for s in grid if s[0] == pub["head_dim"] and not s[1]]
    if not sel:
        return None
    preds = predict(card, f, counts, sel)
    pts = [{"shape": p["shape"], "tops": tops(p["shape"], "fwd", p["fa2", "fwd", "kernel"]),
            "binding": p["fa2", "fwd", "binding"]} for p in preds]
    lo, hi = min(x["tops"] for x in pts), max(x["tops"] for x in pts)
    return {"published": pub, "card": card.name, "points": pts, "pred_low": lo, "pred_high": hi,
            "inside": pub["tops_low"] * (1 - 1e-9) <= lo and hi <= pub["tops_high"] * (1 + 1e-9),
            "ratio_to_mid": (lo + hi) / (pub["tops_low"] + pub["tops_high"])}


def _held_errors(rows) -> dict:
    held = [r for r in rows if not r["fit"]]
    errs = {}
    for impl, pas in KERNELS:
        sel = [abs(r["err_kernel"]) for r in held if r["impl"] == impl and r["pass"] == pas]
        if sel:
            errs[impl, pas] = {"median": statistics.median(sel), "max": max(sel), "n": len(sel),
                               "within": sum(e <= TOLERANCE for e in sel)}
    both = {}
    for impl in ("ours", "fa2"):
        per_shape = {}
        for r in held:
            if r["impl"] == impl:
                per_shape.setdefault(r["shape"], []).append(abs(r["err_kernel"]) <= TOLERANCE)
        both[impl] = (sum(1 for v in per_shape.values() if len(v) == 2 and all(v)), len(per_shape))
    return errs, both


def report(cal: dict, counts: dict, cal_path: str, published_path: str | None = PUBLISHED) -> tuple:
    """(markdown, JSON-able summary) of the calibration and the predictions."""
    f, rows, (card, clock_hz, rates) = fit(cal, counts)
    dev = cal["device"]
    errs, both = _held_errors(rows)
    grid = sorted({(d, c, n, bh) for d, c, n, bh in shapes(cal)}, key=lambda s: (s[0], s[1], s[2]))
    check = published_check(f, counts, grid, load_published(published_path))
    err_line = "; ".join(f"{i} {s} {e['within']}/{e['n']} within 15% (median {100 * e['median']:.1f}%, max "
                         f"{100 * e['max']:.1f}%)" for (i, s), e in sorted(errs.items()))
    lines = [f"# mma.sync performance model: calibration on {dev['name']} and predictions", "",
             "Generated by `python -m tools.perf_model fit --calibration "
             f"{cal_path}` from the calibration run `{cal.get('command', '?')}` "
             f"({cal.get('started', '?')}, commit {dev.get('commit') or '?'}, `SAGEBWD_WGMMA=0`). The model: "
             "`tools/perf_model/` and docs/PERFORMANCE.md, \"Predicted, not measured\".", "",
             "**Measured**: every time in the per-shape table's \"measured\" columns, the clock and the mma.sync "
             f"ceilings, and ncu's counts, all on the {dev['name']}. **Predicted**: everything else, and every "
             f"RTX 4090 and RTX 5090 figure (no such card ran these kernels). The model's error where it can be "
             f"measured (the {dev['name']}'s held-out shapes, kernel time): {err_line}.", "",
             f"Calibration card: {dev['name']}, {dev['sms']} SMs, SM clock under load {clock_hz / 1e6:.0f} MHz "
             f"(measured), mma.sync ceilings INT8 {cal['ceilings']['int8_mma_tops']:.0f} TOPS and fp16 "
             f"{cal['ceilings']['fp16_mma_tflops']:.0f} TFLOPS (measured; {rates['i8']:.0f} and {rates['f16']:.0f} "
             "multiply-adds a clock an SM).", "",
             "## The model and its fitted parameters (on N = 2K and 8K)", "",
             "A CTA lasts max(occupancy x its largest throughput bound (issue, tensor, FP32, ALU, MUFU, LSU, "
             "shared memory), one warp's latency chain); the chain is W x I + c_other x I_other + c_tensor x "
             "I_tensor clocks, with W the warps a scheduler and I the warp's instructions (I_tensor its mma.sync). "
             "CTAs are list-scheduled on the SMs' slots; the kernel takes max(that makespan, its DRAM bytes / "
             "bandwidth). No factor multiplies a throughput bound: the tensor pipe runs at the card's rate. "
             "Two parameters a kernel, least squares on log time over the 8 fit shapes (N = 2K, 8K); N = 4K "
             "and 16K are held out.", "",
             "| kernel | c_other (clocks an instruction) | c_tensor (clocks an mma) | W, d = 64 / 128 | "
             "fit RMS error |", "|---|---|---|---|---|"]
    kernels = kernels_for(card, counts)
    for impl, pas in KERNELS:
        if (impl, pas) not in f.latency:
            continue
        lat = f.latency[impl, pas]
        ws = []
        for d in (64, 128):
            k = kernels[impl, pas, d, False]
            ws.append(f"{model.occupancy(card, k) * k.warps / card.issue_per_sm:g}")
        lines.append(f"| {impl} {pas} | {lat.other:.2f} | {lat.tensor:.2f} | {' / '.join(ws)} | "
                     f"{100 * f.fit_rms[impl, pas]:.1f}% |")
    lines += ["", f"Pre-/post-passes: {1e6 * f.launch_s:.2f} µs a launch + {f.bw_factor:.2f} x (bytes / DRAM bandwidth).",
              "", "## Predicted against measured, per shape", "",
              "B·N = 16K tokens, hidden 2048 (heads = 2048 / d), fp16. Kernel: the attention kernel alone; "
              "pass: with its pre- and post-kernels (GPU time of the launches). Error = predicted / measured - 1. "
              "Rows with N = 4K and 16K are held out of the fit. Binding: what the model says bounds the kernel "
              "(\"latency\": the warps' chains).", "",
              "| d | mask | N | impl | pass | held out | binding | measured kernel ms | predicted | error | "
              "measured pass ms | predicted | error |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["impl"], r["pass"], r["shape"][0], r["shape"][1], r["shape"][2])):
        m = r["measured"]
        lines.append(f"| {_shape_label(r['shape'])} | {r['impl']} | {r['pass']} | {'' if r['fit'] else 'yes'} | "
                     f"{r['binding']} | {1e3 * m['kernel']:.3f} | {1e3 * r['pred_kernel']:.3f} | "
                     f"{_pct(r['err_kernel'])} | {1e3 * m['total']:.3f} | {1e3 * r['pred_total']:.3f} | "
                     f"{_pct(r['err_total'])} |")
    lines += ["", "## Held-out error (kernel time)", "", "| kernel | shapes | median abs. error | max | within 15% |",
              "|---|---|---|---|---|"]
    for (impl, pas), e in sorted(errs.items()):
        lines.append(f"| {impl} {pas} | {e['n']} | {100 * e['median']:.1f}% | {100 * e['max']:.1f}% | {e['within']} |")
    lines += ["", f"Held-out shapes where the forward and backward kernels are both within 15%: ours {both['ours'][0]} "
              f"of {both['ours'][1]}, FA2 {both['fa2'][0]} of {both['fa2'][1]} (the issue asks for at least 8).", ""]

    # the published-figure check
    if check:
        pub = check["published"]
        if check["inside"]:
            verdict = "inside the published range"
        elif check["pred_high"] > pub["tops_high"]:
            verdict = f"above its top by up to {100 * (check['pred_high'] / pub['tops_high'] - 1):.1f}%"
        else:
            verdict = f"below its bottom by up to {100 * (1 - check['pred_low'] / pub['tops_low']):.1f}%"
        lines += ["## Check against a published figure (not fitted on)", "",
                  f"{pub['source']}: about {pub['tops_low']}-{pub['tops_high']} TOPS at {pub['seqlens']}. The model's "
                  f"FA2 forward on the {check['card']} (head dim {pub['head_dim']}, non-causal, spec boost clock): "
                  f"{check['pred_low']:.1f}-{check['pred_high']:.1f} TOPS, {verdict}; predicted over the published "
                  f"range's middle: {check['ratio_to_mid']:.2f}. By N: " +
                  ", ".join(f"{p['shape'][2] // 1024}K {p['tops']:.0f} ({p['binding']})" for p in check["points"]) +
                  ". The model takes the tensor pipe at its full rate: where it binds, the prediction is the card's "
                  "peak times the schedule's fill, at the spec clock (cards run above it under load, and lose some "
                  "of the peak to the rest of the loop, which the model does not charge there).", ""]

    # predictions
    summary_pred = {}
    lines += ["## Predicted, not measured: RTX 4090 and RTX 5090", "",
              "Times from the model with the parameters above, at each card's spec boost clock; ours ÷ FA2 as a "
              "speedup (above 1: ours faster). Nothing here ran on these cards. The model's measured error is "
              f"the {dev['name']}'s held-out error ({err_line}); on another card it can be larger. FA2's side is "
              "modelled from its algorithm, not its SASS.", ""]
    targets = [("RTX4090", None), ("RTX5090", None), ("RTX5090", "sm_89")]
    for key, arch in targets:
        card_p = cards_mod.CARDS[key]
        preds = predict(card_p, f, counts, grid, arch)
        label = f"{card_p.name} ({arch or card_p.arch} SASS)"
        summary_pred[f"{key}.{arch or card_p.arch}"] = [
            {"shape": p["shape"], **{f"{i}_{s}_ms": 1e3 * p[i, s] for i, s in KERNELS},
             **{f"{i}_{s}_kernel_ms": 1e3 * p[i, s, "kernel"] for i, s in KERNELS},
             "binding": {f"{i}_{s}": p[i, s, "binding"] for i, s in KERNELS}}
            for p in preds]
        lines += [f"### {label}", "", "| d | mask | N | ours fwd ms | FA2 fwd ms | fwd speedup | ours bwd ms | "
                  "FA2 bwd ms | bwd speedup | fwd+bwd speedup | kernels alone, fwd / bwd | FA2 fwd TOPS | "
                  "binding: ours fwd / bwd, FA2 fwd / bwd |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for p in preds:
            of, ob, ff, fb = p["ours", "fwd"], p["ours", "bwd"], p["fa2", "fwd"], p["fa2", "bwd"]
            kf = p["fa2", "fwd", "kernel"] / p["ours", "fwd", "kernel"]
            kb = p["fa2", "bwd", "kernel"] / p["ours", "bwd", "kernel"]
            lines.append(f"| {_shape_label(p['shape'])} | {1e3 * of:.3f} | {1e3 * ff:.3f} | {ff / of:.2f} | "
                         f"{1e3 * ob:.3f} | {1e3 * fb:.3f} | {fb / ob:.2f} | {(ff + fb) / (of + ob):.2f} | "
                         f"{kf:.2f} / {kb:.2f} | {tops(p['shape'], 'fwd', p['fa2', 'fwd', 'kernel']):.0f} | "
                         f"{p['ours', 'fwd', 'binding']} / {p['ours', 'bwd', 'binding']}, "
                         f"{p['fa2', 'fwd', 'binding']} / {p['fa2', 'bwd', 'binding']} |")
        lines.append("")
    # what bounds: resource shares at 16K, full, per card
    cols = model.RESOURCES + ("latency",)
    lines += ["## What bounds each kernel (N = 16K, non-causal): each term's clocks over the largest", "",
              "Throughput resources and the warps' latency chain (\"latency\", which includes the issue slots), "
              "per SM over the launch; W: warps a scheduler.", "",
              "| card | kernel | d | " + " | ".join(cols) + " | occupancy | W |",
              "|---|---|---|" + "---|" * (len(cols) + 2)]
    big = [s for s in grid if s[2] == max(g[2] for g in grid) and not s[1]]
    for key, arch in [(None, None)] + targets[:2]:
        if key is None:
            card_p, rates_p, clk, name = card, rates, clock_hz, dev["name"]
        else:
            card_p = cards_mod.CARDS[key]
            rates_p = {"i8": card_p.macs_per_clk("i8"), "f16": card_p.macs_per_clk("f16")}
            clk, name = card_p.boost_ghz * 1e9, card_p.name
        ks = kernels_for(card_p, counts, arch)
        for shape in big:
            b = predict_bounds(card_p, ks, shape, rates_p, clk)
            for (impl, pas), bb in sorted(b.items()):
                sh = bb.shares(f.latency[impl, pas])
                top = max(sh.values())
                w = bb.occupancy * ks[impl, pas, shape[0], shape[1]].warps / card_p.issue_per_sm
                lines.append(f"| {name} | {impl} {pas} | {shape[0]} | " +
                             " | ".join(f"{sh[r] / top:.2f}" for r in cols) + f" | {bb.occupancy} | {w:g} |")
    lines.append("")
    try:
        checks = ncu_check(cal, os.path.dirname(os.path.abspath(cal_path)), counts, card)
    except Exception as exc:  # noqa: BLE001 (a check: its absence must not stop the report)
        checks, lines = [], lines + [f"ncu check skipped: {exc!r}", ""]
    if checks:
        lines += ["## ncu check: warp instructions of the attention kernels (N = 4K)", "",
                  "ncu's `smsp__inst_executed.sum` against the model's count (ours: SASS paths times the grid's "
                  "units; FA2: our estimate), and ncu's issue activity.", "",
                  "| d | mask | N | kernel | ncu instructions | model | model / ncu | issue active |",
                  "|---|---|---|---|---|---|---|---|"]
        for c in checks:
            ratio = c["model_inst"] / c["ncu_inst"] if c["ncu_inst"] else float("nan")
            lines.append(f"| {_shape_label(c['shape'])} | {c['impl']} {c['pass']} | {c['ncu_inst'] or 0:.4g} | "
                         f"{c['model_inst']:.4g} | {ratio:.3f} | {c['issue_active_pct'] or 0:.0f}% |")
        lines.append("")
    summary = {"device": dev, "ncu_check": checks, "calibration": cal_path, "clock_hz": clock_hz, "rates_macs_per_clk_sm": rates,
               "model": "CTA = max(occupancy x max throughput bound, W x I + c_other x I_other + c_tensor x I_tensor)",
               "latency": {f"{i}_{s}": {"c_other": v.other, "c_tensor": v.tensor} for (i, s), v in f.latency.items()},
               "fit_rms_log_error": {f"{i}_{s}": v for (i, s), v in f.fit_rms.items()},
               "prepost": {"launch_s": f.launch_s, "bw_factor": f.bw_factor},
               "held_out_error": {f"{i}_{s}": e for (i, s), e in errs.items()},
               "held_out_shapes_within_15pct_fwd_and_bwd": both["ours"][0],
               "held_out_shapes_within_15pct_fwd_and_bwd_fa2": both["fa2"][0],
               "published_check": check,
               "rows": [{"shape": r["shape"], "impl": r["impl"], "pass": r["pass"], "fit": r["fit"],
                         "measured": r["measured"], "pred_kernel": r["pred_kernel"], "pred_total": r["pred_total"],
                         "err_kernel": r["err_kernel"], "err_total": r["err_total"], "binding": r["binding"],
                         "bound_cycles": r["bounds"].shares(f.latency[r["impl"], r["pass"]]),
                         "occupancy": r["bounds"].occupancy} for r in rows],
               "predictions": summary_pred}
    return "\n".join(lines), summary
