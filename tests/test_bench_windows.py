"""benchmarks/bench_windows.py on the CPU: the band fraction its target reads, and the Markdown table it
renders from a run's records (the committed H200 results included)."""
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import bench_windows  # noqa: E402


def test_band_fraction_counts_the_pairs_a_window_keeps():
    n, w = 50, 7
    kept = sum(1 for i in range(n) for j in range(n) if 0 <= i - j <= w)
    assert abs(bench_windows.band_fraction(n, w) - kept / (n * (n + 1) / 2)) < 1e-12
    assert bench_windows.band_fraction(n, n) == 1.0


def test_the_table_reads_the_targets_ratios():
    rec = {"shape": "1x2x1x1024x128", "band": 0.25,
           "ours window": {"fwd_ms": 1.0, "fwdbwd_ms": 3.0}, "ours causal": {"fwd_ms": 2.0, "fwdbwd_ms": 10.0},
           "flex window": {"fwd_ms": 1.5, "fwdbwd_ms": 4.5}}
    table = bench_windows.markdown({"device": "GPU", "torch": "2", "records": [rec]})
    row = table.splitlines()[-1]
    assert "1.000 / 3.000" in row and "| 1.20 |" in row and "| 1.50 |" in row  # 3 / (0.25·10); 4.5 / 3
    for name in ("windows.json", "softcap_windows.json"):
        path = os.path.join(REPO, "benchmarks", "results", "NVIDIA_H200", name)
        with open(path) as f:
            rendered = bench_windows.markdown(json.load(f))
        with open(path[:-len(".json")] + ".md") as f:
            assert f.read() == rendered  # the committed table is the committed records'
