"""sagebwd_cp.torch.register_transformers on the CPU emulator: a tiny Llama (and a Mistral, Qwen2 and
Gemma 3 with sliding windows, and a GPT-OSS with sliding windows and attention sinks) with
attn_implementation="sagebwd" against "sdpa" or "eager" (logits and gradients) on plain, padded and
packed batches, sinks beside padding and packing included; a Gemma 2 with logit soft-capping; a DeepSeek-V3
with multi-head latent attention (V's head dim other than Q·K's); and every
batch it cannot express (custom masks) refused with a clear error."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import sagebwd_cp.torch as sage  # noqa: E402


def _model(attn, family="llama", **extra):
    import transformers

    sage.register_transformers()
    config_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                             "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
                             "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[family]
    config = config_cls(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
                        attn_implementation=attn, **extra)
    torch.manual_seed(0)
    return model_cls(config)


def _tokens(batch=2, n=96):
    return torch.randint(0, 256, (batch, n), generator=torch.Generator().manual_seed(1))


def _rel(x, ref):
    return ((x - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("mask", [False, True])
def test_logits_and_gradients_match_sdpa(mask):
    """No mask, or an all-ones padding mask (nothing padded): causal attention, as SDPA computes it."""
    x = _tokens()
    kwargs = {"attention_mask": torch.ones_like(x)} if mask else {}
    res = {}
    for attn in ("sdpa", "sagebwd"):
        model = _model(attn)
        logits = model(input_ids=x, **kwargs).logits
        logits.float().square().mean().backward()
        res[attn] = logits.detach(), model.model.layers[0].self_attn.k_proj.weight.grad
    (ref, g_ref), (out, g) = res["sdpa"], res["sagebwd"]
    assert _rel(out, ref) < 0.03 and _rel(g, g_ref) < 0.06
    wrong = _model("sagebwd")(input_ids=x.flip(1)).logits.detach()  # the check can tell models apart
    assert _rel(wrong, ref) > 0.1


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_padded_batch_matches_sdpa_on_its_tokens(side):
    """A 2-D padding mask: the valid tokens go through the variable-length path (logits and gradients
    as SDPA's on every valid position; padded positions are not compared)."""
    x = _tokens()
    mask = torch.ones_like(x)
    pad = slice(0, 10) if side == "left" else slice(70, None)
    mask[0, pad] = 0
    res = {}
    for attn in ("sdpa", "sagebwd"):
        model = _model(attn)
        logits = model(input_ids=x, attention_mask=mask).logits * mask[..., None]
        logits.float().square().mean().backward()
        res[attn] = logits.detach(), model.model.layers[0].self_attn.k_proj.weight.grad
    (ref, g_ref), (out, g) = res["sdpa"], res["sagebwd"]
    assert _rel(out, ref) < 0.03 and _rel(g, g_ref) < 0.06
    unpadded = _model("sagebwd")(input_ids=x[1:]).logits.detach()  # row 1 has no padding: as alone
    assert _rel(out[1], unpadded[0]) < 1e-6


@pytest.mark.parametrize("how", ["position_ids", "collator"])
def test_packed_sequences_match_sdpa(how):
    """Two sequences in one row, marked by restarting position_ids (or the cu_seq_lens keywords of
    DataCollatorWithFlattening): each attends only to itself, as SDPA's packed mask has it."""
    x = _tokens(batch=1)
    position_ids = torch.cat([torch.arange(40), torch.arange(56)]).unsqueeze(0)
    extra = {}
    if how == "collator":
        cu = torch.tensor([0, 40, 96], dtype=torch.int32)
        extra = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=56, max_length_k=56)
    res = {}
    for attn in ("sdpa", "sagebwd"):
        model = _model(attn)
        kw = extra if attn == "sagebwd" else {}
        logits = model(input_ids=x, position_ids=position_ids, use_cache=False, **kw).logits
        logits.float().square().mean().backward()
        res[attn] = logits.detach(), model.model.layers[0].self_attn.k_proj.weight.grad
    (ref, g_ref), (out, g) = res["sdpa"], res["sagebwd"]
    assert _rel(out, ref) < 0.03 and _rel(g, g_ref) < 0.06
    alone = _model("sagebwd")(input_ids=x[:, 40:], use_cache=False).logits.detach()  # the second sequence alone
    assert _rel(out[:, 40:], alone) < 1e-6


def test_a_custom_mask_is_refused():
    x = _tokens()
    mask = torch.ones(2, 1, 96, 96, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="sagebwd_cp attention"):
        _model("sagebwd")(input_ids=x, attention_mask=mask)


_WINDOWED = {"mistral": dict(sliding_window=24),
             "qwen2": dict(use_sliding_window=True, sliding_window=24, max_window_layers=1)}


@pytest.mark.parametrize("family", sorted(_WINDOWED))
@pytest.mark.parametrize("batch", ["plain", "padded", "packed"])
def test_sliding_window_layers_match_sdpa(family, batch):
    """Sliding-window layers (Mistral's every layer, Qwen2's above max_window_layers): the layer's window
    as the kernels' band, against SDPA's sliding-window mask, on plain, padded and packed batches."""
    x = _tokens(batch=1 if batch == "packed" else 2)
    kwargs, keep = {}, torch.ones_like(x)[..., None]
    if batch == "padded":
        mask = torch.ones_like(x)
        mask[0, :10] = 0
        kwargs["attention_mask"], keep = mask, mask[..., None]
    if batch == "packed":
        kwargs["position_ids"] = torch.cat([torch.arange(40), torch.arange(56)]).unsqueeze(0)
    res = {}
    for attn in ("sdpa", "sagebwd"):
        model = _model(attn, family=family, **_WINDOWED[family])
        logits = model(input_ids=x, use_cache=False, **kwargs).logits * keep
        logits.float().square().mean().backward()
        res[attn] = logits.detach(), model.model.layers[1].self_attn.k_proj.weight.grad
    (ref, g_ref), (out, g) = res["sdpa"], res["sagebwd"]
    assert _rel(out, ref) < 0.03 and _rel(g, g_ref) < 0.06
    # The window changes the answer: the same model without it is far off.
    unwindowed = _model("sagebwd", family="llama")(input_ids=x, use_cache=False, **kwargs).logits.detach() * keep
    assert _rel(unwindowed, ref) > 0.1


def _tiny(config_cls, model_cls, attn, **extra):
    sage.register_transformers()
    config = config_cls(vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, attn_implementation=attn,
                        **extra)
    torch.manual_seed(0)
    return model_cls(config)


def _gpt_oss(attn):
    import transformers

    model = _tiny(transformers.GptOssConfig, transformers.GptOssForCausalLM, attn, intermediate_size=64,
                  sliding_window=24, num_local_experts=2, num_experts_per_tok=2)  # (no routing to flip)
    with torch.no_grad():  # sinks of either sign and some size (they start at zero)
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 2, generator=torch.Generator().manual_seed(3))
    return model


def _gemma3(attn):
    import transformers

    return _tiny(transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, attn, intermediate_size=256,
                 sliding_window=24, layer_types=["sliding_attention", "full_attention"])


@pytest.mark.parametrize("family,reference", [("gpt_oss", "eager"), ("gemma3", "sdpa")])
def test_gpt_oss_and_gemma3_match_the_reference(family, reference):
    """GPT-OSS: alternating sliding-window and full layers, each with per-head attention sinks (their
    gradient checked too); Gemma 3: alternating sliding-window and full layers."""
    make = {"gpt_oss": _gpt_oss, "gemma3": _gemma3}[family]
    x = _tokens()
    res = {}
    for attn in (reference, "sagebwd"):
        model = make(attn)
        logits = model(input_ids=x, use_cache=False).logits
        logits.float().square().mean().backward()
        attn_layer = model.model.layers[0].self_attn
        res[attn] = (logits.detach(), attn_layer.k_proj.weight.grad) + (
            (attn_layer.sinks.grad,) if family == "gpt_oss" else ())
    (ref, *g_ref), (out, *g) = res[reference], res["sagebwd"]
    assert _rel(out, ref) < 0.03
    for a, b in zip(g, g_ref):
        assert _rel(a, b) < 0.06


@pytest.mark.parametrize("batch", ["padded", "packed"])
def test_gpt_oss_sinks_in_padded_and_packed_batches_match_eager(batch):
    """Sinks beside padding (left) or packing (restarting position_ids): the variable-length path with
    sinks, logits and gradients (the sinks' included) as eager's on every valid position; eager's
    packed reference is each sequence run alone."""
    def run(model, x, **kwargs):
        keep = kwargs["attention_mask"][..., None] if "attention_mask" in kwargs else 1
        logits = model(input_ids=x, use_cache=False, **kwargs).logits * keep
        logits.float().square().sum().backward()
        return logits.detach()

    def grads(model):
        layer = model.model.layers[0].self_attn
        return layer.k_proj.weight.grad, layer.sinks.grad

    if batch == "padded":
        x = _tokens()
        mask = torch.ones_like(x)
        mask[0, :10] = 0
        ref_model, model = _gpt_oss("eager"), _gpt_oss("sagebwd")
        ref, out = run(ref_model, x, attention_mask=mask), run(model, x, attention_mask=mask)
    else:
        x = _tokens(batch=1)
        ref_model, model = _gpt_oss("eager"), _gpt_oss("sagebwd")
        ref = torch.cat([run(ref_model, x[:, :40]), run(ref_model, x[:, 40:])], 1)  # grads add up over both
        out = run(model, x, position_ids=torch.cat([torch.arange(40), torch.arange(56)]).unsqueeze(0))
    assert _rel(out, ref) < 0.03
    for a, b in zip(grads(model), grads(ref_model)):
        assert _rel(a, b) < 0.06


def _gemma2(attn):
    import transformers

    model = _tiny(transformers.Gemma2Config, transformers.Gemma2ForCausalLM, attn, intermediate_size=256,
                  sliding_window=24, attn_logit_softcapping=5.0, query_pre_attn_scalar=32)
    with torch.no_grad():  # scores of a few units, which a cap of 5 bends (at initialization they are ~0.01)
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    return model


def test_gemma2_soft_capping_matches_eager():
    """Gemma 2: logit soft-capping in every layer (a small cap, 5.0, that changes the answer), sliding
    windows in alternate layers; K-smoothing on, each score's share added back before tanh."""
    x = _tokens()
    res = {}
    for attn in ("eager", "sagebwd"):
        model = _gemma2(attn)
        logits = model(input_ids=x, use_cache=False).logits
        logits.float().square().mean().backward()
        res[attn] = logits.detach(), model.model.layers[0].self_attn.k_proj.weight.grad
    (ref, g_ref), (out, g) = res["eager"], res["sagebwd"]
    assert _rel(out, ref) < 0.03 and _rel(g, g_ref) < 0.06
    uncapped = _gemma2("eager")
    for layer in uncapped.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    assert _rel(uncapped(input_ids=x, use_cache=False).logits.detach(), ref) > 0.01


def _deepseek_v3(attn):
    import transformers

    # Multi-head latent attention: Q·K head dim 48 (32 without rotary + 16 rotary), V head dim 32; dense MLPs.
    sage.register_transformers()
    config = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=256, moe_intermediate_size=64, first_k_dense_replace=2,
        n_routed_experts=2, n_shared_experts=1, num_experts_per_tok=1, n_group=1, topk_group=1, kv_lora_rank=32,
        q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, head_dim=16,
        attn_implementation=attn)
    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM(config)


def test_a_deepseek_v3_model_with_latent_attention_matches_sdpa():
    """DeepSeek-V3's multi-head latent attention: a V head dim (32) other than the Q·K one (48), on plain and
    padded batches; logits and gradients as SDPA's."""
    x = _tokens()
    mask = torch.ones_like(x)
    mask[0, :10] = 0
    for kwargs in ({}, {"attention_mask": mask}):
        keep = kwargs["attention_mask"][..., None] if kwargs else 1
        res = {}
        for attn in ("sdpa", "sagebwd"):
            model = _deepseek_v3(attn)
            logits = model(input_ids=x, use_cache=False, **kwargs).logits * keep
            logits.float().square().mean().backward()
            attn_layer = model.model.layers[0].self_attn
            res[attn] = logits.detach(), attn_layer.kv_b_proj.weight.grad, attn_layer.q_b_proj.weight.grad
        (ref, *g_ref), (out, *g) = res["sdpa"], res["sagebwd"]
        assert _rel(out, ref) < 0.03
        for a, b in zip(g, g_ref):
            assert _rel(a, b) < 0.06


def test_what_is_not_supported_names_itself():
    from types import SimpleNamespace

    from sagebwd_cp.torch.transformers import attention_forward

    layer = SimpleNamespace(is_causal=True)
    q = torch.randn(1, 2, 16, 320)
    with pytest.raises(ValueError, match=r"head dim 320 \(the kernels take up to 256\)"):
        attention_forward(layer, q, q, q, None)


@pytest.mark.parametrize("keyword,env,expected", [(None, None, False), (None, "1", True), (True, None, True),
                                                  (False, "1", False)])
def test_the_deterministic_order_is_read_as_flash_attentions_integration_reads_it(monkeypatch, keyword, env, expected):
    """transformers' FlashAttention integration takes ``deterministic`` from its keyword, else from
    FLASH_ATTENTION_DETERMINISTIC=1: every kind of batch passes it on to the kernels' calls."""
    from types import SimpleNamespace

    import sagebwd_cp.torch.transformers as integration

    seen = []
    monkeypatch.setattr(integration, "attention", lambda *a, **kw: seen.append(kw["deterministic"]) or a[0])
    monkeypatch.setattr(integration, "flash_attn_varlen_func", lambda *a, **kw: seen.append(kw["deterministic"]) or a[0])
    if env is None:
        monkeypatch.delenv("FLASH_ATTENTION_DETERMINISTIC", raising=False)
    else:
        monkeypatch.setenv("FLASH_ATTENTION_DETERMINISTIC", env)
    layer, q = SimpleNamespace(is_causal=True), torch.randn(1, 2, 16, 32)
    kw = {} if keyword is None else {"deterministic": keyword}
    integration.attention_forward(layer, q, q, q, None, **kw)  # plain
    integration.attention_forward(layer, q, q, q, torch.ones(1, 16, dtype=torch.long).tril(1)[:1], **kw)  # padded
    integration.attention_forward(layer, q, q, q, None, cu_seq_lens_q=torch.tensor([0, 16]),
                                  cu_seq_lens_k=torch.tensor([0, 16]), max_length_q=16, max_length_k=16, **kw)  # packed
    assert seen == [expected] * 3


def test_the_name_must_be_a_string():
    with pytest.raises(TypeError, match="name"):
        sage.register_transformers(name=3)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", ["plain", "padded", "packed"])
def test_on_the_gpu_logits_and_gradients_match_sdpa(batch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    x = _tokens(batch=1 if batch == "packed" else 2).cuda()
    kwargs = {}
    if batch == "padded":
        mask = torch.ones_like(x)
        mask[0, :10] = 0
        kwargs["attention_mask"] = mask
    if batch == "packed":
        kwargs["position_ids"] = torch.cat([torch.arange(40), torch.arange(56)]).unsqueeze(0).cuda()
    keep = kwargs.get("attention_mask", torch.ones_like(x))[..., None]
    res = {}
    for attn in ("sdpa", "sagebwd"):
        model = _model(attn).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=x, use_cache=False, **kwargs).logits * keep
        logits.float().square().mean().backward()
        res[attn] = logits.detach().float(), model.model.layers[0].self_attn.k_proj.weight.grad
    (ref, g_ref), (out, g) = res["sdpa"], res["sagebwd"]
    assert _rel(out, ref) < 0.03 and _rel(g, g_ref) < 0.08


def test_only_the_causal_rule_and_its_packed_forms_pass_the_mask_function():
    from transformers.masking_utils import and_masks, causal_mask_function, or_masks

    from sagebwd_cp.torch.transformers import _causal_or_packed

    def other(b, h, q, kv):
        return q >= 0

    assert _causal_or_packed(None, causal_mask_function) and _causal_or_packed(causal_mask_function, causal_mask_function)
    for custom in (other, and_masks(causal_mask_function, other), or_masks(causal_mask_function, other)):
        assert not _causal_or_packed(custom, causal_mask_function)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["gpt_oss", "gemma2"])
def test_on_the_gpu_gpt_oss_and_gemma2_match_eager(family):
    """GPT-OSS (sliding windows, attention sinks: their gradient too) and Gemma 2 (soft-capping) in bf16
    autocast on the GPU, against "eager"."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    make = {"gpt_oss": _gpt_oss, "gemma2": _gemma2}[family]
    x = _tokens().cuda()
    res = {}
    for attn in ("eager", "sagebwd"):
        model = make(attn).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=x, use_cache=False).logits
        logits.float().square().mean().backward()
        layer = model.model.layers[0].self_attn
        res[attn] = (logits.detach().float(), layer.k_proj.weight.grad) + (
            (layer.sinks.grad,) if family == "gpt_oss" else ())
    for a, b in zip(res["sagebwd"], res["eager"]):
        assert _rel(a, b) < 0.06
