"""benchmarks/bench_model.py on the CPU: its batches are next-token pairs of the byte corpus, and its
model builds with sagebwd_cp attention (register_transformers) and trains a step on the emulator."""
import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_model  # noqa: E402


def test_batches_are_next_token_pairs():
    x, y = next(bench_model.batches(2048, 1, 0, "cpu"))
    assert x.shape == y.shape == (bench_model.TOKENS_PER_STEP // 2048, 2048)
    assert bool((x[:, 1:] == y[:, :-1]).all())


def test_the_model_uses_sagebwd_attention(monkeypatch):
    monkeypatch.setattr(bench_model, "HIDDEN", 256)
    monkeypatch.setattr(bench_model, "LAYERS", 1)
    model = bench_model.build_model(64, 64, "sagebwd", seed=0)
    assert model.config._attn_implementation == "sagebwd" and model.config.num_key_value_heads == 1
    tokens = torch.randint(0, 256, (1, 64))
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    assert torch.isfinite(loss) and model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_a_record_keeps_summaries_not_every_step():
    steps, n = 300, 305
    sdpa = {"step_ms": 50.0, "step_times_ms": [50.0 + (i % 7) for i in range(steps)], "kernel_ms": 40.0,
            "losses": [5.0 - i / 100 for i in range(n)]}
    ours = {**sdpa, "step_ms": 52.0, "losses": [x + 0.01 * (-1) ** i for i, x in enumerate(sdpa["losses"])]}
    rec = bench_model.record(128, 2048, steps, {"sdpa": sdpa, "sagebwd": ours})
    assert (rec["head_dim"], rec["context"], rec["steps"], rec["loss_tail_steps"]) == (128, 2048, steps, 100)
    s, o = rec["sdpa"], rec["sagebwd"]
    assert s["step_ms"] == 50.0 and s["kernel_ms"] == 40.0 and "losses" not in s and "step_times_ms" not in s
    assert s["step_ms_stats"]["min"] == 50.0 and s["step_ms_stats"]["max"] == 56.0
    assert s["loss"] == pytest.approx(sum(sdpa["losses"][-10:]) / 10)
    assert s["loss_tail"] == pytest.approx(sum(sdpa["losses"][-100:]) / 100)
    assert "loss_diff_tail" not in s and o["loss_diff_tail"]["mean"] == pytest.approx(0.0, abs=1e-12)
    assert o["loss_diff_tail"]["sd"] == pytest.approx(0.01, rel=0.01)
    curve = s["loss_curve"]
    assert curve["every"] == 6 and len(curve["mean"]) == 51
    assert curve["mean"][0] == pytest.approx(sum(sdpa["losses"][:6]) / 6)
    assert "step_ms_stats" not in bench_model.record(64, 32768, 30, {"sdpa": {"step_ms": 1.0, "losses": [1.0]}})["sdpa"]
