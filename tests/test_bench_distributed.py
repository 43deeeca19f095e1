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


def test_smoke_model_part_in_a_world_of_one(tmp_path, monkeypatch):
    """The model part: one record a (round, attention, mode), FSDP at a size of its own with its own
    one-GPU baseline, the same losses as one GPU, per-step times and their spread, and the summary."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_PORT", str(30500 + os.getpid() % 1000))
    assert bench_distributed.main(["--smoke", "--parts", "model", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "distributed.json").read_text())
    rows = data["records"]
    assert [(r["attn"], r["mode"]) for r in rows] == [("sdpa", "ddp"), ("sagebwd", "ddp"), ("sdpa", "fsdp2"),
                                                       ("sagebwd", "fsdp2")]
    assert {(r["hidden"], r["layers"]) for r in rows if r["mode"] == "ddp"} == {(256, 1)}
    assert {(r["hidden"], r["layers"]) for r in rows if r["mode"] == "fsdp2"} == {(256, 2)}
    for r in rows:
        assert "error" not in r, r.get("error")
        assert len(r["step_times_ms"]) == 2 and r["p10_ms"] <= r["step_ms"] <= r["p90_ms"]
        assert r["max_loss_diff"] < 1e-6  # a world of one: the same steps as one GPU
    summary = data["summary"]
    assert len(summary) == 2 and all("ours_over_sdpa" in row for row in summary)
    text = (tmp_path / "distributed.md").read_text()
    assert "ours/sdpa distributed" in text and "| 64 | 256x2 |" in text


def test_summary_pools_rounds_and_reports_the_spread():
    rec = lambda rnd, attn, times, single: {
        "part": "model", "round": rnd, "context": 2048, "hidden": 1024, "layers": 8, "mode": "ddp", "attn": attn,
        "params": 90e6, "world": 2, "step_times_ms": times, "step_ms": bench_distributed.step_stats(times)["step_ms"],
        "single_step_times_ms": single, "single_step_ms": bench_distributed.step_stats(single)["step_ms"],
        "max_loss_diff": 0.001}
    records = [rec(0, "sdpa", [100, 101, 102], [190, 190, 190]), rec(0, "sagebwd", [110, 111, 112], [200, 200, 200]),
               rec(1, "sdpa", [104, 105, 300], [194, 194, 194]), rec(1, "sagebwd", [114, 115, 116], [204, 204, 204])]
    (row,) = bench_distributed.summarize(records)
    assert row["sdpa"]["round_medians"] == [101, 105] and row["sdpa"]["step_ms"] == 103
    assert row["sagebwd"]["step_ms"] == 113 and row["ours_over_sdpa"] == pytest.approx(113 / 103)
    assert row["ours_over_sdpa_single"] == pytest.approx(202 / 192)
    assert row["sdpa"]["scaling"] == pytest.approx(192 / 103)
    stats = bench_distributed.step_stats([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])
    assert (stats["p10_ms"], stats["step_ms"], stats["p90_ms"]) == (2, 6, 10) and stats["spread"] == pytest.approx(8 / 6)
    text = bench_distributed.markdown({"device": "x", "world": 2, "backend": "nccl", "torch": "t", "smoke": False},
                                      records)
    assert "| 2048 | 1024x8 (90M) | ddp | sdpa | 192.0 (190.0 / 194.0) | 103.0 |" in text
