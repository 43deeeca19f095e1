"""benchmarks/bench_distributed.py's smoke mode in a world of one on the CPU (gloo, the emulator): the
ring part runs, checks ring attention against chunked attention and writes its JSON and markdown."""
import json
import os
import sys

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_distributed  # noqa: E402


def test_smoke_ring_part_in_a_world_of_one(tmp_path, monkeypatch):
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_PORT", str(29500 + os.getpid() % 1000))
    assert bench_distributed.main(["--smoke", "--parts", "ring", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "distributed.json").read_text())
    assert data["world"] == 1 and data["backend"] == "gloo" and data["smoke"]
    rows = data["records"]
    assert [r["causal"] for r in rows] == [True, False]
    for r in rows:
        assert r["ring_fwd_bwd_ms"] > 0
        # a world of one: one call against 2 chunks merged, both the quantized attention
        for name in ("out", "dq", "dk", "dv"):
            assert r[f"{name}_vs_chunked"] < 1e-2 and r[f"{name}_vs_sdpa"] < 5e-2
        assert r["cp_sdpa_fwd_bwd_ms"] is not None or r["cp_sdpa_note"]
    text = (tmp_path / "distributed.md").read_text()
    assert "Ring attention" in text and "| 128 | True |" in text
