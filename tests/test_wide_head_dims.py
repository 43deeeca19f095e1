"""Head dims above 128 (to 256) on the CPU: the emulator's numerics against exact attention (unquantized:
exact; quantized: the algorithm's error, as at d=128), the options their kernels do not take refused by name,
and a transformers Gemma-style model with head dim 256 against SDPA; the GPU kernels are checked in
tests/test_gpu_wide_head_dims.py."""
import numpy as np
import pytest

import sagebwd_cp
from sagebwd_cp.host import emulator, reference


def _inputs(seed, lq=150, lk=200, hq=4, hk=2, d=256):
    rng = np.random.default_rng(seed)
    q, k, v, do = (rng.standard_normal((1, h, n, d)) for h, n in ((hq, lq), (hk, lk), (hk, lk), (hq, lq)))
    return q, k, v, do


def _rel(x, ref):
    return float(np.linalg.norm(np.asarray(x, np.float64) - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("d", [136, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_the_emulator_at_wide_head_dims(d, causal):
    q, k, v, do = _inputs(d, d=d)
    o_ref, _ = reference.attention_reference(q, k, v, causal=causal)
    g_ref = reference.attention_reference_backward(q, k, v, do, causal=causal)
    o, _, saved = emulator.emulate_forward(q, k, v, causal=causal, quantize=False, dtype="float32")
    assert _rel(o, o_ref) < 1e-5  # float32 arithmetic, no quantization: exact attention
    for g, r in zip(emulator.emulate_backward(saved, do, quantize=False), g_ref):
        assert _rel(g, r) < 1e-5
    q16, k16, v16, do16 = (x.astype(np.float16) for x in (q, k, v, do))
    out, saved = sagebwd_cp.attention_forward(q16, k16, v16, causal=causal)
    grads = sagebwd_cp.attention_backward(saved, do16)
    assert _rel(out, o_ref) < 0.03
    for g, r in zip(grads, g_ref):
        assert _rel(g, r) < 0.06


def test_the_options_wide_kernels_do_not_take_are_refused_by_name():
    q, k, v, do = (x.astype(np.float16) for x in _inputs(1, lq=64, lk=64))
    with pytest.raises(ValueError, match=r"head dims above 128 \(got 256\) take no smooth_q=True"):
        sagebwd_cp.attention(q, k, v, smooth_q=True)
    _, saved = sagebwd_cp.attention_forward(q, k, v)
    # The deterministic order is taken (on the GPU by sm_90's kernels: specs.backward_kernel), soft-capped under
    # the band test (a sliding window, or no causal mask) too.
    for g, h in zip(sagebwd_cp.attention_backward(saved, do, deterministic=True), sagebwd_cp.attention_backward(saved, do)):
        np.testing.assert_array_equal(g, h)
    for mask in (dict(causal=True, window_size=(16, 0)), dict(causal=False)):
        _, capped = sagebwd_cp.attention_forward(q, k, v, softcap=5.0, **mask)
        for g, h in zip(sagebwd_cp.attention_backward(capped, do, deterministic=True),
                        sagebwd_cp.attention_backward(capped, do)):
            np.testing.assert_array_equal(g, h)
    with pytest.raises(ValueError, match=r"take no granularity='paper'"):
        sagebwd_cp.attention_backward(saved, do, granularity="paper")
    with pytest.raises(ValueError, match=r"head_dim: expected a multiple of 8 between 8 and 256, got 264"):
        sagebwd_cp.attention(*(np.zeros((1, 1, 8, 264), np.float16) for _ in range(3)))


def test_a_gemma_model_with_head_dim_256_matches_sdpa():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import sagebwd_cp.torch as sage

    sage.register_transformers()
    res = {}
    x = torch.randint(0, 256, (2, 80), generator=torch.Generator().manual_seed(1))
    for attn in ("sdpa", "sagebwd"):
        config = transformers.Gemma3TextConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                                               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                               head_dim=256, max_position_embeddings=128, sliding_window=24,
                                               layer_types=["sliding_attention", "full_attention"],
                                               attn_implementation=attn)
        torch.manual_seed(0)
        model = transformers.Gemma3ForCausalLM(config)
        logits = model(input_ids=x, use_cache=False).logits
        logits.float().square().mean().backward()
        res[attn] = logits.detach(), model.model.layers[0].self_attn.k_proj.weight.grad
    (ref, g_ref), (out, g) = res["sdpa"], res["sagebwd"]
    assert ((out - ref).norm() / ref.norm()).item() < 0.03
    assert ((g - g_ref).norm() / g_ref.norm()).item() < 0.06
