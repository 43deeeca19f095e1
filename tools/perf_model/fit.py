"""Calibration on the measured card, held-out check, and predictions for the RTX 4090 and 5090.

Reads the calibration run's JSON (calibrate.py) and the SASS counts (sass_counts.json, or counted
now where nvdisasm is present), fits per kernel (ours and FlashAttention-2, forward and backward)
one latency factor on the fit shapes (N = 2K and 8K), a launch cost and a bandwidth factor for the
pre-/post-passes, reports predicted against measured on every shape (the held-out ones, N = 4K and
16K, marked), and predicts both cards' times with the same factors.
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
    factors: dict  # (impl, pass) -> latency factor (max bound)
    serial_factors: dict  # (impl, pass) -> latency factor (serial bound)
    launch_s: float  # pre-/post-pass: seconds a launch
    bw_factor: float  # and the bytes' time over the DRAM bound

    def prepost(self, card, impl, pas, elems) -> float:
        launches, nbytes = model.prepost(impl, pas == "bwd", elems)
        return launches * self.launch_s + self.bw_factor * nbytes / (card.dram_gbps * 1e9) if launches else 0.0


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
    factors, serial = {}, {}
    for impl in ("ours", "fa2"):
        for pas in ("fwd", "bwd"):
            sel = [r for r in rows if r["fit"] and r["impl"] == impl and r["pass"] == pas]
            if sel:
                factors[impl, pas] = math.exp(statistics.mean(
                    math.log(r["measured"]["kernel"] / r["bounds"].seconds()) for r in sel))
                serial[impl, pas] = math.exp(statistics.mean(
                    math.log(r["measured"]["kernel"] / r["bounds"].seconds(serial=True)) for r in sel))
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
    f = Fit(factors, serial, launch_s, bw_factor)
    for r in rows:
        key = r["impl"], r["pass"]
        d, causal, n, bh = r["shape"]
        r["pred_kernel"] = factors[key] * r["bounds"].seconds()
        r["pred_kernel_serial"] = serial[key] * r["bounds"].seconds(serial=True)
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
            kern = f.factors[impl, pas] * bb.seconds()
            row[impl, pas] = kern + f.prepost(card, impl, pas, bh * n * d)
            row[impl, pas, "kernel"] = kern
            row[impl, pas, "serial"] = f.serial_factors[impl, pas] * bb.seconds(serial=True) + f.prepost(
                card, impl, pas, bh * n * d)
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


def report(cal: dict, counts: dict, cal_path: str) -> tuple:
    """(markdown, JSON-able summary) of the calibration and the predictions."""
    f, rows, (card, clock_hz, rates) = fit(cal, counts)
    dev = cal["device"]
    lines = [f"# mma.sync performance model: calibration on {dev['name']} and predictions", "",
             "Generated by `python -m tools.perf_model fit --calibration "
             f"{cal_path}` from the calibration run `{cal.get('command', '?')}` "
             f"({cal.get('started', '?')}, commit {dev.get('commit') or '?'}, `SAGEBWD_WGMMA=0`). The model: "
             "`tools/perf_model/` and docs/PERFORMANCE.md, \"Predicted, not measured\".", "",
             f"Calibration card: {dev['name']}, {dev['sms']} SMs, SM clock under load {clock_hz / 1e6:.0f} MHz "
             f"(measured), mma.sync ceilings INT8 {cal['ceilings']['int8_mma_tops']:.0f} TOPS and fp16 "
             f"{cal['ceilings']['fp16_mma_tflops']:.0f} TFLOPS (measured; {rates['i8']:.0f} and {rates['f16']:.0f} "
             "multiply-adds a clock an SM).", "",
             "## Fitted factors (on N = 2K and 8K)", "",
             "| kernel | latency factor (max bound) | latency factor (serial bound) |", "|---|---|---|"]
    for (impl, pas), lf in sorted(f.factors.items()):
        lines.append(f"| {impl} {pas} | {lf:.3f} | {f.serial_factors[impl, pas]:.3f} |")
    lines += ["", f"Pre-/post-passes: {1e6 * f.launch_s:.2f} µs a launch + {f.bw_factor:.2f} x (bytes / DRAM bandwidth).",
              "", "## Predicted against measured, per shape", "",
              "B·N = 16K tokens, hidden 2048 (heads = 2048 / d), fp16. Kernel: the attention kernel alone; "
              "pass: with its pre- and post-kernels (GPU time of the launches). Error = predicted / measured - 1. "
              "Rows with N = 4K and 16K are held out of the fit.", "",
              "| d | mask | N | impl | pass | held out | binding | measured kernel ms | predicted | error | "
              "measured pass ms | predicted | error |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["impl"], r["pass"], r["shape"][0], r["shape"][1], r["shape"][2])):
        m = r["measured"]
        lines.append(f"| {_shape_label(r['shape'])} | {r['impl']} | {r['pass']} | {'' if r['fit'] else 'yes'} | "
                     f"{r['bounds'].binding} | {1e3 * m['kernel']:.3f} | {1e3 * r['pred_kernel']:.3f} | "
                     f"{_pct(r['err_kernel'])} | {1e3 * m['total']:.3f} | {1e3 * r['pred_total']:.3f} | "
                     f"{_pct(r['err_total'])} |")
    held = [r for r in rows if not r["fit"]]
    errs = {}
    for impl in ("ours", "fa2"):
        for pas in ("fwd", "bwd"):
            sel = [abs(r["err_kernel"]) for r in held if r["impl"] == impl and r["pass"] == pas]
            if sel:
                errs[impl, pas] = {"median": statistics.median(sel), "max": max(sel), "n": len(sel),
                                   "within": sum(e <= TOLERANCE for e in sel)}
    ours_shapes = {}
    for r in held:
        if r["impl"] == "ours":
            ours_shapes.setdefault(r["shape"], []).append(abs(r["err_kernel"]) <= TOLERANCE)
    both_ok = sum(1 for v in ours_shapes.values() if len(v) == 2 and all(v))
    lines += ["", "## Held-out error (kernel time)", "", "| kernel | shapes | median abs. error | max | within 15% |",
              "|---|---|---|---|---|"]
    for (impl, pas), e in sorted(errs.items()):
        lines.append(f"| {impl} {pas} | {e['n']} | {100 * e['median']:.1f}% | {100 * e['max']:.1f}% | {e['within']} |")
    lines += ["", f"Held-out shapes where our forward and backward kernels are both within 15%: {both_ok} of "
              f"{len(ours_shapes)} (the issue asks for at least 8).", ""]

    # predictions
    summary_pred = {}
    grid = sorted({(d, c, n, bh) for d, c, n, bh in shapes(cal)}, key=lambda s: (s[0], s[1], s[2]))
    lines += ["## Predicted, not measured: RTX 4090 and RTX 5090", "",
              "Times from the model with the factors above; ours ÷ FA2 as a speedup (above 1: ours faster). "
              "The H100's held-out error of each kernel (median / max) is the model's measured error; on "
              "another card it can be larger. FA2's side is modelled from its algorithm, not its SASS.", ""]
    targets = [("RTX4090", None), ("RTX5090", None), ("RTX5090", "sm_89")]
    for key, arch in targets:
        card_p = cards_mod.CARDS[key]
        preds = predict(card_p, f, counts, grid, arch)
        label = f"{card_p.name} ({arch or card_p.arch} SASS)"
        summary_pred[f"{key}.{arch or card_p.arch}"] = [
            {"shape": p["shape"], **{f"{i}_{s}_ms": 1e3 * p[i, s] for i in ("ours", "fa2") for s in ("fwd", "bwd")},
             "binding": {f"{i}_{s}": p["bounds"][i, s].binding for i in ("ours", "fa2") for s in ("fwd", "bwd")}}
            for p in preds]
        lines += [f"### {label}", "", "| d | mask | N | ours fwd ms | FA2 fwd ms | fwd speedup | ours bwd ms | "
                  "FA2 bwd ms | bwd speedup | fwd+bwd speedup | FA2 fwd TOPS | binding (ours fwd / bwd) | "
                  "speedup, serial bound |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for p in preds:
            of, ob, ff, fb = p["ours", "fwd"], p["ours", "bwd"], p["fa2", "fwd"], p["fa2", "bwd"]
            sf, sb = p["ours", "fwd", "serial"] + p["ours", "bwd", "serial"], p["fa2", "fwd", "serial"] + p["fa2", "bwd", "serial"]
            lines.append(f"| {_shape_label(p['shape'])} | {1e3 * of:.3f} | {1e3 * ff:.3f} | {ff / of:.2f} | "
                         f"{1e3 * ob:.3f} | {1e3 * fb:.3f} | {fb / ob:.2f} | {(ff + fb) / (of + ob):.2f} | "
                         f"{tops(p['shape'], 'fwd', ff):.0f} | {p['bounds']['ours', 'fwd'].binding} / "
                         f"{p['bounds']['ours', 'bwd'].binding} | {sb / sf:.2f} |")
        lines.append("")
    lines += ["Model error on the calibration card (held out, kernel time, median / max): " +
              "; ".join(f"{i} {s} {100 * e['median']:.0f}% / {100 * e['max']:.0f}%" for (i, s), e in sorted(errs.items())),
              ""]
    # what bounds: resource shares at 16K, full, per card
    lines += ["## What bounds each kernel (N = 16K, non-causal): each resource's clocks over the largest", "",
              "| card | kernel | d | issue | tensor | fma | alu | xu | lsu | shared | occupancy |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
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
                top = max(bb.cycles.values())
                lines.append(f"| {name} | {impl} {pas} | {shape[0]} | " +
                             " | ".join(f"{bb.cycles[r] / top:.2f}" for r in model.RESOURCES) + f" | {bb.occupancy} |")
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
               "factors": {f"{i}_{s}": v for (i, s), v in f.factors.items()},
               "serial_factors": {f"{i}_{s}": v for (i, s), v in f.serial_factors.items()},
               "prepost": {"launch_s": f.launch_s, "bw_factor": f.bw_factor},
               "held_out_error": {f"{i}_{s}": e for (i, s), e in errs.items()},
               "held_out_shapes_within_15pct_fwd_and_bwd": both_ok,
               "rows": [{"shape": r["shape"], "impl": r["impl"], "pass": r["pass"], "fit": r["fit"],
                         "measured": r["measured"], "pred_kernel": r["pred_kernel"], "pred_total": r["pred_total"],
                         "err_kernel": r["err_kernel"], "err_total": r["err_total"], "binding": r["bounds"].binding,
                         "bound_cycles": r["bounds"].cycles, "occupancy": r["bounds"].occupancy} for r in rows],
               "predictions": summary_pred}
    return "\n".join(lines), summary
