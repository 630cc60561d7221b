"""Every decoder-only family a tiny random config builds runs on the engine through one code path, exact:
greedy tokens equal `transformers.generate` (eager attention, a fresh copy of the model) cold, warm and
staggered, on both attention paths a CPU takes, with prompts past the window for windowed families; bf16
batched equals alone. Refused families say why (tests/families.py builds the models)."""

from __future__ import annotations

import pytest

import families as F


@pytest.fixture(params=["paged-kernel", "gather-sdpa"])
def attention_path(request, monkeypatch):
    monkeypatch.setenv("KVQL_PAGED_ATTENTION", "1" if request.param == "paged-kernel" else "0")
    return request.param


@pytest.mark.parametrize("family", sorted(F.FAMILIES))
def test_greedy_equals_transformers_cold_warm_and_staggered(family, tokenizer, attention_path):
    r = F.check_exact(family, tokenizer)
    assert r["cold"] == r["reference"]
    assert r["warm"] == r["reference"] and all(r["warm_cached"])
    assert r["staggered"] == r["reference"] and r["mixed_steps"] > 0
    if any(layer.window for layer in r["geometry"].layers):  # the prompts run past the window
        assert max(map(len, r["prompts"])) > F.WINDOW + 8


@pytest.mark.parametrize("family", sorted(F.FAMILIES))
def test_bf16_batched_equals_alone(family, tokenizer):
    assert F.check_bf16_invariant(family, tokenizer) == []


@pytest.mark.parametrize("family", sorted(F.REFUSED))
def test_a_family_the_engine_cannot_run_is_refused_with_its_reason(family, tokenizer):
    assert F.REFUSED[family][2] in F.check_refused(family, tokenizer)


def test_geometry_is_read_from_the_model_not_from_llama_named_fields(tokenizer):
    """GPT-2 names heads `n_head` and has no `num_key_value_heads`; Gemma 2 soft-caps and windows one layer."""
    import kvql

    gpt2 = F.build(*F.FAMILIES["gpt2"], len(tokenizer), tokenizer.eos_token_id)
    gemma2 = F.build(*F.FAMILIES["gemma2"], len(tokenizer), tokenizer.eos_token_id)
    for hf, want in [(gpt2, [(4, 4, 16, None, None)] * 2),
                     (gemma2, [(4, 2, 16, F.WINDOW, 5.0), (4, 2, 16, None, 5.0)])]:
        m = kvql.Model(hf, tokenizer, cache_budget=1 << 20)
        got = [(x.heads, x.kv_heads, x.head_dim, x.window, x.softcap) for x in m.engine.runner.geometry.layers]
        m.close()
        assert got == want


def test_the_context_is_the_models_own_not_the_window(tokenizer):
    import kvql

    hf = F.build(*F.FAMILIES["mistral"], len(tokenizer), tokenizer.eos_token_id)
    m = kvql.Model(hf, tokenizer, cache_budget=1 << 20)
    m.close()
    assert m.context_length == 512 and hf.config.sliding_window == F.WINDOW


def test_a_model_whose_cached_logits_differ_is_refused(tokenizer, monkeypatch):
    """The load-time check compares logits over KV read back from the pool with the plain forward: an engine
    that ignored a layer's window (here: made to) would be caught there, before any request."""
    import kvql
    from kvql.engine.model import admission, lean_model
    from kvql.engine.model.kernels import paged_attention

    attend = paged_attention.attend
    monkeypatch.setattr(paged_attention, "attend", lambda q, k, v, o, s, scale, window=None, softcap=None,
                        sinks=None: attend(q, k, v, o, s, scale, None, softcap, sinks))
    monkeypatch.setattr(lean_model, "build", lambda hf: None)  # its bound calls would not go through `attend`
    hf = F.build(*F.FAMILIES["mistral"], len(tokenizer), tokenizer.eos_token_id)
    with pytest.raises(admission.UnsupportedModel, match="differ from the model's own forward"):
        kvql.Model(hf, tokenizer, cache_budget=1 << 20)


def test_a_layer_type_the_engine_does_not_compute_is_refused_by_name():
    """A config naming a layer kind kvql's attention does not know is refused before its weights load, never
    admitted and computed as full attention (what happened to Llama 4's chunked layers)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from kvql.engine.model.admission import UnsupportedModel, check_config

    fields = {**F.COMMON, **F.FAMILIES["gemma3"][1], "layer_types": ["sliding_attention", "indexed_attention"]}
    with pytest.raises(UnsupportedModel, match="indexed_attention"):
        check_config(CONFIG_MAPPING["gemma3_text"](**fields))
    check_config(CONFIG_MAPPING["gemma3_text"](**{**F.COMMON, **F.FAMILIES["gemma3"][1]}))  # its own kinds pass


def test_the_numerical_check_refuses_a_variant_the_config_check_missed(tokenizer, monkeypatch):
    """Chunked attention with the config's refusal switched off: the check at load runs its tokens past the
    longest chunk the config declares, through a cached prefix and one-token steps, and refuses the model,
    naming the first token whose logits differ (the chunk's end): a variant it does not compute is never
    admitted."""
    import kvql
    from kvql.engine.model import admission

    monkeypatch.setattr(admission, "check_config", lambda config: None)
    hf = F.build("llama4_text", {**F.MOE, "attention_chunk_size": 32}, len(tokenizer), tokenizer.eos_token_id)
    with pytest.raises(admission.UnsupportedModel, match="from token 32 of 40 on"):
        kvql.Model(hf, tokenizer, cache_budget=1 << 20)
