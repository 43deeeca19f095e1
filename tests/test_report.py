"""The benchmark report on the CPU: rendering from synthetic JSON (tables, ratios, the README headline
block) and a tiny accuracy run through the emulator (``--host``)."""
import json
import math
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

import render_report  # noqa: E402
import report_common  # noqa: E402
import report_speed  # noqa: E402

KEY = dict(dtype="float16", head_dim=128, causal=False, seqlen=16384)
B, H = report_common.sweep_shape(16384, 128)
# TOPS per (pass, impl) at KEY; the ratios below follow from these
TOPS = {("fwd", "sagebwd"): 150.0, ("fwd", "sdpa-flash"): 300.0, ("fwd", "sdpa-cudnn"): 600.0,
        ("fwd", "sageattn"): 400.0,
        ("bwd", "sagebwd[fine]"): 90.0, ("bwd", "sagebwd[paper]"): 120.0, ("bwd", "sdpa-flash"): 300.0,
        ("bwd", "sdpa-cudnn"): 450.0,
        ("fwdbwd", "sagebwd[fine]"): 105.0, ("fwdbwd", "sagebwd[paper]"): 140.0, ("fwdbwd", "sdpa-flash"): 350.0,
        ("fwdbwd", "sdpa-cudnn"): 500.0}


def _record(pass_, impl, tops, **over):
    k = dict(KEY, **over)
    b, h = report_common.sweep_shape(k["seqlen"], k["head_dim"])
    ms = report_common.flops(pass_, b, h, k["seqlen"], k["head_dim"], k["causal"]) / (tops * 1e12) * 1e3
    return report_speed.make_record(impl, pass_, k["dtype"], k["head_dim"], k["causal"], k["seqlen"], b, h, ms)


def speed_data():
    recs = [_record(p, i, t) for (p, i), t in TOPS.items()]
    recs += [_record(p, i, t / 2, seqlen=4096, causal=True) for (p, i), t in TOPS.items()]
    skipped = [dict(impl="sdpa-efficient", **{"pass": "bwd"}, **KEY, reason="RuntimeError: no kernel")]
    return {"kind": "speed", "metadata": {"device": "Test GPU", "date": "2026-01-02T03:04:05+00:00",
                                          "versions": {"sagebwd_cp": "0.1.0"},
                                          "ceilings": {"int8_mma_tops": 1200.0, "fp16_mma_tflops": 600.0}},
            "records": recs, "skipped": skipped}


def accuracy_data():
    shape = dict(dtype="float16", batch=1, heads=4, seqlen=1024, head_dim=64, causal=False)
    recs = [dict(table="sigma", source="gpu", sigma=1, granularity=None, tensor="O", cos=0.99987, rel_l2=0.0159,
                 **shape)]
    for gran, rel in (("fine", 0.0197), ("paper", 0.0480)):
        recs += [dict(table="sigma", source="gpu", sigma=1, granularity=gran, tensor=t, cos=0.9998, rel_l2=rel,
                      **shape) for t in ("dQ", "dK", "dV")]
    recs += [dict(table="intermediates", source="emulator", granularity=None, tensor="P", cos=0.9999, rel_l2=0.012,
                  **shape),
             dict(table="smoothing", source="gpu", smoothing="none", granularity="fine", tensor="dQ", cos=0.99,
                  rel_l2=0.11, **shape)]
    return {"kind": "accuracy", "metadata": {"device": "Test GPU", "sources": {"sigma": "the GPU kernels"}},
            "records": recs}


def memory_data():
    peak = [dict(impl=i, dtype="float16", head_dim=128, causal=False, seqlen=16384, batch=1, heads=16, peak_mib=m,
                 inputs_mib=256.0, cupy_pool_mib=0.0)
            for i, m in (("sagebwd[fine]", 546.0), ("sdpa-flash", 514.0), ("sdpa-cudnn", 387.0))]
    prof = [dict(impl="sagebwd[fine]", **{"pass": "fwdbwd"}, dtype="float16", head_dim=128, causal=False,
                 seqlen=16384, batch=1, heads=16, wall_ms=70.0, kernel_ms=68.0,
                 categories={"quantization": 3.4, "attention": 61.2, "prepost": 2.72, "memset": 0.68},
                 kernels={"attention_backward": 52.0, "attention_forward": 9.2, "quantize_blocks": 3.0}, launches=12)]
    return {"kind": "memory", "metadata": {"device": "Test GPU"}, "peak": peak, "profile": prof, "skipped": []}


def write_results(tmp_path, parts=("speed", "accuracy", "memory")):
    target = tmp_path / "results" / report_common.device_slug("Test GPU")
    target.mkdir(parents=True)
    for name, make in (("speed", speed_data), ("accuracy", accuracy_data), ("memory", memory_data)):
        if name in parts:
            (target / f"{name}.json").write_text(json.dumps(make()))
    return target


def _row(md: str, start: str) -> str:
    rows = [line for line in md.splitlines() if line.startswith(start)]
    assert len(rows) == 1, (start, rows)
    return rows[0]


def test_speed_records_have_the_required_keys_and_tops():
    rec = report_speed.make_record("sagebwd", "fwd", "float16", 128, False, 16384, 1, 16, 10.0)
    assert set(report_common.SPEED_RECORD_KEYS) <= set(rec)
    assert rec["tflops"] == pytest.approx(4 * 16 * 16384**2 * 128 / 10e-3 / 1e12)
    causal_bwd = report_speed.make_record("x", "bwd", "float16", 64, True, 4096, 4, 32, 1.0)
    assert causal_bwd["tflops"] == pytest.approx(2.5 * 4 * 4 * 32 * 4096**2 * 64 / 2 / 1e-3 / 1e12)
    render_report.check_speed_records(speed_data())
    bad = speed_data()
    del bad["records"][0]["tflops"]
    with pytest.raises(ValueError, match="tflops"):
        render_report.check_speed_records(bad)


def test_sweep_shapes_and_device_folder():
    assert report_common.sweep_shape(1024, 64) == (16, 32)
    assert report_common.sweep_shape(32768, 128) == (1, 16)
    assert report_common.device_slug("NVIDIA H200") == "NVIDIA_H200"
    calls = []
    fn = report_speed.alternate(calls.append)
    for _ in range(4):
        fn()
    assert calls == [0, 1, 0, 1]


def test_speed_tables_hold_the_right_ratios():
    md = render_report.speed_markdown(speed_data())
    fwd = md.split("## forward, float16")[1].split("##")[0]
    row = _row(fwd, "| 128 | no | 16K |")
    # ours 150, FA2 300, cuDNN 600, sageattn 400; 150 / 1200 INT8 = 12.5%; FA2 300 / 600 = 50%
    assert row == "| 128 | no | 16K | 150 | 400 | 300 | 600 | 0.50 | 0.25 | 0.38 | 12.5 | 50.0 |"
    bwd = md.split("## backward, float16")[1].split("##")[0]
    row = _row(bwd, "| 128 | no | 16K |")
    assert "| 90 | 120 | 300 | 450 | 0.30 / 0.40 | 0.20 / 0.27 | 7.5 / 10.0 | 50.0 |" in row
    fb = md.split("## forward+backward, float16")[1].split("##")[0]
    assert "0.30 / 0.40 | 0.21 / 0.28" in _row(fb, "| 128 | no | 16K |")
    assert "| 128 | yes | 4K |" in fb
    assert "sdpa-efficient bwd: RuntimeError: no kernel" in md


def test_percent_columns_use_the_wgmma_ceilings_where_measured():
    data = speed_data()
    data["metadata"]["ceilings"].update(int8_wgmma_tops=1500.0, fp16_wgmma_tflops=750.0)
    md = render_report.speed_markdown(data)
    assert "INT8 mma.sync 1200 TOPS" in md and "INT8 wgmma 1500 TOPS" in md and "16-bit wgmma 750 TFLOPS" in md
    fwd = md.split("## forward, float16")[1].split("##")[0]
    # ours 150 / 1500 = 10.0%; FA2 300 / 750 = 40.0%
    assert _row(fwd, "| 128 | no | 16K |").endswith("| 10.0 | 40.0 |")


def test_forward_tables_show_the_kernel_without_its_pre_pass(tmp_path):
    """The kernel-only record adds two columns to the forward tables (its TOPS and the pre-pass share
    of our forward's time) and is no impl of its own: no ratios, bars or headline."""
    data = speed_data()
    data["records"].append(_record("fwd", report_speed.KERNEL_ONLY, 200.0))
    md = render_report.speed_markdown(data)
    fwd = md.split("## forward, float16")[1].split("##")[0]
    assert "| ours, kernel only | pre-pass % |" in fwd
    # ours 150 TOPS with the pre-pass, 200 without: the pre-pass is 1 - 150/200 = 25% of the time
    assert _row(fwd, "| 128 | no | 16K |") == "| 128 | no | 16K | 150 | 400 | 300 | 600 | 0.50 | 0.25 | 0.38 | 12.5 | 50.0 | 200 | 25.0 |"
    assert _row(fwd, "| 128 | yes | 4K |").endswith("| – | – |")
    assert "kernel only" not in md.split("## backward")[1]
    assert "kernel" not in render_report.headline(data, None, None, "speed.md")


def test_accuracy_and_memory_tables():
    acc = render_report.accuracy_markdown(accuracy_data())
    fine = acc.split('granularity "fine"')[1].split("###")[0]
    # O 0.0159 / 0.0160, dQ 0.0197 / 0.0184, dK 0.0197 / 0.0220, dV 0.0197 / 0.0159
    assert "| 1 | 0.99987 / 0.0159 | 0.99980 / 0.0197 |" in fine
    assert "0.99 / 1.07 / 0.90 / 1.24 |" in fine
    assert "| 10 | 0.9933 / 0.1161 |" in acc  # the published table
    assert "| none | fine | – | 0.99000 / 0.1100 |" in acc
    mem = render_report.memory_markdown(memory_data())
    assert "| 128 | 16K | 1×16 | float16 | no | 256 | 546 | 514 | 387 | 1.06 | 1.41 | 0 |" in mem
    assert "| 70.00 | 68.00 | 5.0% | 90.0% | 4.0% | 1.0% | 0.0% | 2.00 |" in mem


README_TEXT = """# Title

Some text that must stay.
<!-- headline:start -->
old headline
<!-- headline:end -->
Text after, also kept.
"""


def test_readme_headline_is_replaced_between_markers_only(tmp_path):
    target = write_results(tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text(README_TEXT)
    render_report.render(str(target), readme=str(readme), charts=False)
    text = readme.read_text()
    head, rest = text.split(render_report.START)
    block, tail = rest.split(render_report.END)
    assert head == README_TEXT.split(render_report.START)[0]
    assert tail == README_TEXT.split(render_report.END)[1]
    assert "old headline" not in block
    # ours, cuDNN's TOPS, ours ÷ cuDNN, ours ÷ FA2 (ours 150, FA2 300, cuDNN 600 forward; 450 cuDNN backward)
    assert "| pass | ours (TOPS) | cuDNN (TOPS) | ours ÷ cuDNN | ours ÷ FA2 |" in block
    assert "| forward | 150 | 600 | 0.25 | 0.50 |" in block
    assert "| backward (fine / paper) | 90 / 120 | 450 | 0.20 / 0.27 | 0.30 / 0.40 |" in block
    assert "scaled_dot_product_attention" in block  # the peer, named
    terms = block.split("Terms: ")[1]
    for term in ("TOPS:", "Rel-L2:", "σ:", "SB26: the SageBwd paper", "arXiv 2603.02170", "FA2:", "fine / paper:"):
        assert term in terms
    assert "dQ 0.0197" in block and "0.0184" in block  # ours and SB26 at σ = 1
    assert "ours 546 MiB (FA2 514, cuDNN 387)" in block
    assert "(results/Test_GPU/speed.md)" in block
    for name in ("speed.md", "accuracy.md", "memory.md"):
        assert (target / name).exists()
    render_report.render(str(target), readme=str(readme), charts=False)
    assert readme.read_text() == text  # idempotent

    readme.write_text("no markers here\n")
    with pytest.raises(ValueError, match="headline"):
        render_report.render(str(target), readme=str(readme), charts=False)
    assert readme.read_text() == "no markers here\n"


def test_verdict_by_gpu_from_speed_and_model_results(tmp_path):
    """The README's verdict: forward+backward against cuDNN and FA2 (median and range over the shapes),
    and the model step by context, the newest commit's records of each shape, older ones marked."""
    target = write_results(tmp_path, parts=("speed",))
    rec = lambda d, n, sdpa, ours: {"head_dim": d, "context": n, "sdpa": {"step_ms": sdpa},  # noqa: E731
                                    "sagebwd": {"step_ms": ours}}
    runs = [{"commit": "a", "records": [rec(128, 32768, 100.0, 112.0), rec(128, 2048, 100.0, 150.0)]},
            {"commit": "b", "records": [rec(128, 2048, 100.0, 103.0), rec(64, 2048, 100.0, 106.0)]},
            {"commit": "b", "records": [rec(128, 2048, 100.0, 104.0)]}]
    (target / "model.json").write_text(json.dumps({"runs": runs}))
    text = render_report.verdict(render_report.result_folders(str(tmp_path / "results")), str(tmp_path))
    row = _row(text, "| [Test GPU](results/Test_GPU/speed.md) |")
    # fwd+bwd: ours (fine) 105 against cuDNN 500 and FA2 350 TOPS, at both shapes
    assert "| **slower**: 0.21x (0.21) | **slower**: 0.30x (0.30) |" in row
    assert row.endswith("| 3-6% **slower** at 2K context; 12% **slower** at 32K context (an earlier version) |")
    assert "| A100, A10, RTX 30xx/40xx, L4, L40 (sm_80-sm_89) | not measured |" in text
    assert "| B200 (sm_100), RTX 50xx (sm_120): built (mma.sync kernels) | not measured |" in text
    assert "head dims 128, 4K-16K tokens, causal and not, float16" in text

    readme = tmp_path / "README.md"
    readme.write_text("top\n" + render_report.VERDICT_START + "\nold\n" + render_report.VERDICT_END + "\n" + README_TEXT)
    render_report.render(str(target), readme=str(readme), charts=False)
    assert readme.read_text().startswith("top\n" + render_report.VERDICT_START + "\n" + text + "\n")


def test_headline_with_only_some_results(tmp_path):
    target = write_results(tmp_path, parts=("accuracy",))
    readme = tmp_path / "README.md"
    readme.write_text(README_TEXT)
    render_report.render(str(target), readme=str(readme), charts=False)
    block = readme.read_text().split(render_report.START)[1].split(render_report.END)[0]
    assert "TOPS" not in block and "dQ 0.0197" in block and "[accuracy]" in block and "[speed]" not in block


def test_charts(tmp_path):
    pytest.importorskip("matplotlib")
    target = write_results(tmp_path, parts=("speed",))
    written = render_report.render(str(target), readme=None)
    pngs = sorted(os.path.basename(p) for p in written if p.endswith(".png"))
    assert pngs == ["speed_bwd_float16.png", "speed_fwd_float16.png", "speed_fwdbwd_float16.png"]
    assert all((target / p).stat().st_size > 1000 for p in pngs)
    assert "![forward, float16](speed_fwd_float16.png)" in (target / "speed.md").read_text()


def test_host_accuracy_run_on_the_emulator(tmp_path):
    import report_accuracy

    out = tmp_path / "acc.json"
    rc = report_accuracy.main(["--host", "--out", str(out), "--configs", "64:64", "--sigmas", "1", "3",
                               "--heads", "1", "--bias-shape", "64:64"])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["metadata"]["device"] == "host-emulator"
    recs = data["records"]
    for r in recs:
        assert math.isfinite(r["cos"]) and math.isfinite(r["rel_l2"]), r
        assert 0 < r["cos"] <= 1 + 1e-12, r
        assert "non_finite" not in r
    sig = {(r["sigma"], r["granularity"], r["tensor"]) for r in recs if r["table"] == "sigma"}
    assert sig == {(s, None, "O") for s in (1, 3)} | {(s, g, t) for s in (1, 3) for g in ("fine", "paper")
                                                      for t in ("dQ", "dK", "dV")}
    assert {r["tensor"] for r in recs if r["table"] == "intermediates"} >= {"delta", "P", "dS", "O", "dQ", "dK", "dV"}
    assert {r["smoothing"] for r in recs if r["table"] == "smoothing"} == {"none", "K", "Q+K"}
    # the soft-capped ablation: none and K, fine; K-smoothing's share added back, O follows the reference closer
    capped = {(r["smoothing"], r["tensor"]): r["rel_l2"] for r in recs if r["table"] == "smoothing" and r.get("softcap")}
    assert set(capped) == {(v, t) for v in ("none", "K") for t in ("O", "dQ", "dK", "dV")}
    assert capped["K", "O"] < capped["none", "O"]
    text = render_report.accuracy_markdown(data)
    assert "host-emulator" in text and "With logit soft-capping (softcap=30" in text


def test_host_accuracy_needs_out():
    import report_accuracy

    with pytest.raises(SystemExit):
        report_accuracy.main(["--host"])


def test_ab_kernels_reads_our_rows_and_restores_the_sources_when_a_run_fails(tmp_path, monkeypatch):
    """tools/ab_kernels.py: our rows of bench_attention's table by (d, causal, N, pass, impl),
    and the checkout's kernel sources back in place even when the base version's run fails."""
    sys.path.insert(0, os.path.join(os.path.dirname(BENCH), "tools"))
    import ab_kernels

    table = ("  d c      N pass   impl                               ms    TOPS  xFA2 xcuDNN  %int8  peak(fwd+bwd)\n"
             "128 n  16384 fwd    sdpa-flash                      6.102   360.4  1.00  0.58  28.9%\n"
             "128 n  16384 fwd    sagebwd attend-only             6.147   357.7  0.99  0.57  28.7%\n"
             " 64 c  16384 fwdbwd sagebwd[fine]                  21.308   180.6  0.65  0.43  14.5%      494MiB\n")
    root, base = tmp_path / "root", tmp_path / "base"
    for top in (root, base):
        for d in ab_kernels.SOURCE_DIRS:
            (top / d).mkdir(parents=True)
            (top / d / "k.cu").write_text(f"{top.name} {d}")
    runs = []

    class Result:
        def __init__(self, ok):
            self.returncode, self.stdout, self.stderr = (0 if ok else 1), table, ""

    def fake_run(cmd, **kw):
        runs.append((root / "kernels" / "k.cu").read_text())
        return Result(ok=len(runs) == 1)  # the base version's run fails

    monkeypatch.setattr(ab_kernels, "ROOT", str(root))
    monkeypatch.setattr(ab_kernels.subprocess, "run", fake_run)
    assert ab_kernels._bench([]) == {("128", "n", "16384", "fwd", "sagebwd attend-only"): 357.7,
                                     ("64", "c", "16384", "fwdbwd", "sagebwd[fine]"): 180.6}
    runs.clear()
    with pytest.raises(SystemExit, match="bench_attention.py failed"):
        ab_kernels.main(["--base", str(base), "--passes", "fwd"])
    assert runs == ["root kernels", "base kernels"]
    assert (root / "kernels" / "k.cu").read_text() == "root kernels"
    assert (root / "ptx" / "k.cu").read_text() == "root ptx"


def _ab_kernels_printing(monkeypatch, out):
    """tools/ab_kernels.py with its benchmark's subprocess faked to print ``out``; the commands it ran go in the list
    returned beside the module."""
    sys.path.insert(0, os.path.join(os.path.dirname(BENCH), "tools"))
    import ab_kernels

    seen = []

    class Result:
        returncode, stdout, stderr = 0, out, ""

    def fake_run(cmd, **kw):
        seen.append(cmd)
        return Result()

    monkeypatch.setattr(ab_kernels.subprocess, "run", fake_run)
    return ab_kernels, seen


def test_ab_kernels_reads_the_wide_head_dims_lines_as_calls_a_second(monkeypatch):
    """tools/ab_kernels.py --bench wide_head_dims: bench_wide_head_dims.py run for our kernels alone, its
    "<shape>: ours <fwd ms>/<fwd+bwd ms>" lines read as calls a second (1000 / ms), so that this / base stays
    above 1 where this is faster."""
    ab_kernels, seen = _ab_kernels_printing(monkeypatch, "device: Test GPU  torch 2.11  (bf16, causal; ms fwd / fwd+bwd)\n"
                                                         "2x16x4x4096x256: ours 0.500/2.000\n"
                                                         "2x16x4x4096x192x128: ours 0.250/4.000\n")
    rows = ab_kernels._bench(["--shapes", "2x16x4x4096x256", "--window", "4096"], script="wide_head_dims")
    assert rows == {("2x16x4x4096x256", "-", "-", "fwd", "ours"): 2000.0,
                    ("2x16x4x4096x256", "-", "-", "fwdbwd", "ours"): 500.0,
                    ("2x16x4x4096x192x128", "-", "-", "fwd", "ours"): 4000.0,
                    ("2x16x4x4096x192x128", "-", "-", "fwdbwd", "ours"): 250.0}
    assert seen[0][1].endswith("bench_wide_head_dims.py") and seen[0][-2:] == ["--peers", "ours"]
    assert "--window" in seen[0]


def test_ab_kernels_reads_each_kernels_time_as_calls_a_second(monkeypatch):
    """tools/ab_kernels.py --bench kernels: tools/experiments/kernel_times.py's "<shape> <kernel> <µs>" lines read as
    1000 / µs by (shape, kernel), so that this / base stays above 1 where this kernel is faster."""
    ab_kernels, seen = _ab_kernels_printing(
        monkeypatch, "8x16x16x2048x128 quantize_tensors 100.00\n8x16x16x2048x128 attention_backward 2000.00\nnoise\n")
    rows = ab_kernels._bench(["8x16x16x2048x128"], script="kernels")
    assert rows == {("8x16x16x2048x128", "-", "-", "quantize_tensors", "ours"): 10.0,
                    ("8x16x16x2048x128", "-", "-", "attention_backward", "ours"): 0.5}
    assert seen[0][1].endswith(os.path.join("experiments", "kernel_times.py")) and seen[0][2:] == ["8x16x16x2048x128"]


def test_json_text_writes_a_record_a_line_and_loads_back_the_same():
    data = {"metadata": {"device": "Test GPU", "versions": {"torch": "2.4", "cupy": None}, 1024: {"reps": 3}},
            "records": [dict(impl="sagebwd", seqlen=n, ms=1.0 / 3, tflops=float(n), curve=list(range(50)),
                             note="x" * 40) for n in (1024, 2048)],
            "empty": [], "curve": [0.5] * 100, "deep": {"a": ["y" * 70], "b": ["z" * 70]}}
    text = report_common.json_text(data)
    assert json.loads(text) == json.loads(json.dumps(data))
    lines = text.splitlines()
    assert sum('"impl": "sagebwd"' in line for line in lines) == 2  # each record on one line of its own
    assert ' "curve": [0.5, ' in text  # a list of scalars: one line at any length
    assert '  "a": ["yyy' in text and '  "b": ["zzz' in text  # too long for a line, and not a record: opened
    assert len(lines) == 13


def test_committed_results_are_compact():
    """Results keep summaries and sampled curves, one record a line: no file of per-step data."""
    import glob

    for path in glob.glob(os.path.join(BENCH, "results", "*", "*.json")):
        with open(path) as f:
            text = f.read()
        assert text.count("\n") <= 1000, f"{path}: {text.count(chr(10))} lines"
        if path.endswith("model.json"):
            for run in json.loads(text)["runs"]:
                for rec in run["records"]:
                    assert "sdpa" in rec and "sagebwd" in rec and not any(k.endswith("_losses") for k in rec)
                    assert all(len(rec[i]["loss_curve"]["mean"]) <= 61 for i in ("sdpa", "sagebwd"))
