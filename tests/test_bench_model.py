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
