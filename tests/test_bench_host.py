"""benchmarks/bench_host.py runs on a machine without a GPU (its stubs must keep up with the library's
plan keys and device queries), in its own process: it replaces torch and CuPy functions globally."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_host_runs_and_times_every_row():
    pytest.importorskip("torch")
    pytest.importorskip("cupy")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_host.py"), "--number", "2"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.rstrip() and line.split()[-1].replace(".", "").isdigit()]
    assert len(rows) >= 12, out.stdout
    assert any(line.startswith("adapter forward + backward") for line in rows), out.stdout
