"""benchmarks/bench_long_run.py on the CPU (the emulator): a few steps of a tiny model, its records
and its checks."""
import json
import os
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_long_run  # noqa: E402


def test_a_short_run_on_the_emulator_records_every_window_and_passes(tmp_path, capsys, monkeypatch):
    # A kernel cache of its own: the run checks that its cache stops growing, and the session's cache is shared with
    # the other test workers, which compile into it meanwhile.
    monkeypatch.setenv("SAGEBWD_CP_CACHE_DIR", str(tmp_path / "kernel-cache"))
    out = tmp_path / "run.json"
    rc = bench_long_run.main(["--device", "cpu", "--steps", "3", "--every", "1", "--hidden", "32", "--layers", "1",
                              "--head-dim", "8", "--contexts", "32", "--tokens-per-step", "32",
                              "--corpus-bytes", "100000", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    result = json.loads(out.read_text())
    assert [r["step"] for r in result["records"]] == [1, 2, 3]
    for r in result["records"]:
        assert r["nonfinite_losses"] == 0 and 0 < r["loss_mean"] < 10
        assert r["cache_files"] >= 0 and r["host_rss_bytes"] > 0 and r["plans"] >= 0
    assert all(ok for ok, _ in result["checks"].values())
    assert "ok   finite" in text and "FAIL" not in text


def test_the_checks_catch_non_finite_losses_growing_memory_and_caches():
    rec = lambda step, **kw: {"step": step, "nonfinite_losses": 0, "allocated_bytes": 1 << 30, "peak_bytes": 2 << 30,
                              "cache_files": 10, "cache_bytes": 1000, "compiled_kernels": 5, "loaded_functions": 5,
                              "plans": 2, "host_rss_bytes": 1 << 30, **kw}
    good = [rec(1, allocated_bytes=1 << 20), rec(2), rec(3, peak_bytes=(2 << 30) + (8 << 20))]
    assert all(ok for ok, _ in bench_long_run.checks(good).values())
    bad = bench_long_run.checks([rec(1), rec(2), rec(3, nonfinite_losses=1, allocated_bytes=(1 << 30) + (64 << 20),
                                                   cache_files=11, plans=3)])
    failed = {name for name, (ok, _) in bad.items() if not ok}
    assert failed == {"finite", "flat_allocated_memory", "bounded_cache_files", "bounded_plans"}
