"""benchmarks/bench_model.py's transformers attention function, on the CPU emulator: a Llama model
built with it matches the SDPA one, and a mask it cannot honour is an error."""
import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_model  # noqa: E402


def _llama(attn):
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

    AttentionInterface.register("sagebwd", bench_model.sagebwd_attention)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=64,
                         attn_implementation=attn)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def test_llama_with_sagebwd_attention_matches_sdpa_on_the_emulator():
    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    results = {}
    for attn in ("sdpa", "sagebwd"):
        model = _llama(attn)
        logits = model(input_ids=x).logits
        logits.float().square().mean().backward()
        results[attn] = logits.detach(), model.model.layers[0].self_attn.q_proj.weight.grad
    (ref, g_ref), (out, g) = results["sdpa"], results["sagebwd"]
    assert ((out - ref).norm() / ref.norm()).item() < 0.03
    assert ((g - g_ref).norm() / g_ref.norm()).item() < 0.05


def test_a_mask_or_dropout_is_refused():
    q = torch.zeros(1, 2, 8, 64)
    k = v = torch.zeros(1, 1, 8, 64)
    with pytest.raises(ValueError, match="attention_mask"):
        bench_model.sagebwd_attention(None, q, k, v, torch.ones(1, 1, 8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="dropout"):
        bench_model.sagebwd_attention(None, q, k, v, None, dropout=0.1)


def test_batches_are_next_token_pairs():
    x, y = next(bench_model.batches(2048, 1, 0, "cpu"))
    assert x.shape == y.shape == (bench_model.TOKENS_PER_STEP // 2048, 2048)
    assert bool((x[:, 1:] == y[:, :-1]).all())
