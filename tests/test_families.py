"""Every decoder-only family a tiny random config builds runs on the engine through one code path, exact:
greedy tokens equal `transformers.generate` (eager attention, a fresh copy of the model) cold, warm and
staggered, on both attention paths a CPU takes (the ragged path's families) or on the model's own forward (the
others), with prompts past the window for windowed families; bf16 batched equals alone (tests/families.py builds
the models)."""

from __future__ import annotations

import pytest

import families as F


# the ragged path's families on both of its CPU attention paths; the model's own forward has no attention of kvql's
CASES = [(family, path) for family in sorted(F.FAMILIES) for path in ("paged-kernel", "gather-sdpa")
         if path == "paged-kernel" or family not in F.OWN]


@pytest.mark.parametrize("family,path", CASES)
def test_greedy_equals_transformers_cold_warm_and_staggered(family, path, tokenizer, monkeypatch):
    monkeypatch.setenv("KVQL_PAGED_ATTENTION", "1" if path == "paged-kernel" else "0")
    r = F.check_exact(family, tokenizer)
    assert (r["geometry"].own is not None) == (family in F.OWN)  # the path admission chose
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


def test_a_ragged_path_whose_cached_logits_differ_gives_way_to_the_models_own_forward(tokenizer, monkeypatch):
    """The load-time check compares logits over KV read back from the pool with the plain forward: an engine
    whose ragged attention ignored a layer's window (here: made to) is caught there, before any request, and the
    model runs on its own forward instead, exact."""
    from kvql.engine.model import lean_model
    from kvql.engine.model.kernels import paged_attention

    attend = paged_attention.attend
    monkeypatch.setattr(paged_attention, "attend", lambda q, k, v, o, s, scale, window=None, softcap=None,
                        sinks=None, chunk=None, alibi=None: attend(q, k, v, o, s, scale, None, softcap, sinks, chunk,
                                                                   alibi))
    monkeypatch.setattr(lean_model, "build", lambda hf: None)  # its bound calls would not go through `attend`
    own, got, want = F.fallback("mistral", tokenizer, long=True)
    assert "the ragged path's check failed" in own and "differ from the model's own forward" in own
    assert got == want


def test_a_hybrid_whose_batched_states_differ_gives_way_to_its_own_forward(tokenizer, monkeypatch):
    """A hybrid on the ragged path runs its recurrent mixers per request, one-token steps of several requests with
    their states stacked: the load check runs those steps beside a twin of its sequence, so stacking made wrong
    (here: each state scaled) is caught before any request, and the model runs on its own forward, exact."""
    from kvql.engine.model import recurrent_mixers

    stack = recurrent_mixers._stack_layers

    def scaled(layers):
        out = stack(layers)
        out.conv_states = {k: None if v is None else v * 1.5 for k, v in out.conv_states.items()}
        return out

    monkeypatch.setattr(recurrent_mixers, "_stack_layers", scaled)
    # (Qwen3.5's, LFM2's and the Mamba2 mixers' states are kvql's kernels', unstacked: tests/test_recurrent_step.py)
    own, got, want = F.fallback("jamba", tokenizer)
    assert "the ragged path's check failed" in own and got == want


def test_mla_whose_absorbed_form_differs_gives_way_to_its_own_forward_on_the_same_pool(tokenizer, monkeypatch):
    """MLA in its absorbed form (latent_attention.py) caches its latent and rotary key part as one key; made wrong
    (here: the output's up-projection scaled), the load check catches it and the model runs on its own forward,
    which caches the two apart: the same pool memory seen so, exact, with the cache serving repeats."""
    import kvql
    from kvql.engine.model import latent_attention

    expand = latent_attention.expand_output
    monkeypatch.setattr(latent_attention, "expand_output", lambda module, out: expand(module, out) * 1.01)
    name = "deepseek_v3"
    hf = F.build(*F.FAMILIES[name], len(tokenizer), tokenizer.eos_token_id)
    m = kvql.Model(hf, tokenizer, cache_budget=1 << 20)
    try:
        assert "the ragged path's check failed" in m.engine.runner.geometry.own
        pool = m.engine.runner.pool
        assert pool.k.data_ptr() == pool.v.data_ptr() - pool.k.shape[-1] * pool.k.element_size()
        ps = F.prompts(len(tokenizer), seed=2)
        want = F.reference(name, F.FAMILIES[name][1], tokenizer, ps, 8)
        assert [c.token_ids for c in m.generate(ps, max_tokens=8)] == want
        warm = m.generate(ps, max_tokens=8)
        assert [c.token_ids for c in warm] == want and all(c.cached_tokens for c in warm)
        m.check_integrity()
    finally:
        m.close()


def test_a_model_that_keeps_state_outside_its_cache_is_refused(tokenizer):
    """A deliberately unsupported variant (its logits depend on how often it ran: state no cache holds) fails
    the check on both paths and is refused, naming both, never admitted."""
    import kvql
    from kvql.engine.model import admission

    hf = F.build(*F.FAMILIES["llama"], len(tokenizer), tokenizer.eos_token_id)
    calls = []

    def drift(module, args, output):
        calls.append(1)
        return output + len(calls)

    hf.lm_head.register_forward_hook(drift)
    with pytest.raises(admission.UnsupportedModel) as e:
        kvql.Model(hf, tokenizer, cache_budget=1 << 20)
    assert str(e.value).count("differ from the model's own forward") == 2
    assert "on the ragged path" in str(e.value) and "on its own forward" in str(e.value)


def test_attention_the_ragged_path_does_not_compute_is_named_from_the_config():
    """A config naming a layer kind the ragged path's attention does not know, or recurrent layers, sends the
    model to its own forward before its weights load (`own_reason`), never computed as full attention (what
    happened to Llama 4's chunked layers before the ragged path computed them); an encoder-decoder model is
    refused outright."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from kvql.engine.model.admission import UnsupportedModel, check_config, own_reason

    fields = {**F.COMMON, **F.FAMILIES["gemma3"][1], "layer_types": ["sliding_attention", "indexed_attention"]}
    assert "indexed_attention" in own_reason(CONFIG_MAPPING["gemma3_text"](**fields))
    assert own_reason(CONFIG_MAPPING["gemma3_text"](**{**F.COMMON, **F.FAMILIES["gemma3"][1]})) is None
    llama4 = CONFIG_MAPPING["llama4_text"](**{**F.COMMON, **F.FAMILIES["llama4"][1]})
    assert llama4.layer_types == ["chunked_attention", "full_attention"] and own_reason(llama4) is None
    assert "recurrent" in own_reason(CONFIG_MAPPING["lfm2"](**{**F.COMMON, **F.FAMILIES["lfm2"][1]}))
    with pytest.raises(UnsupportedModel, match="encoder-decoder"):
        check_config(CONFIG_MAPPING["t5"]())


def test_the_numerical_check_catches_a_variant_the_config_check_missed(tokenizer, monkeypatch):
    """Chunked attention with the config's reading of chunks switched off: the check at load runs its tokens past
    the longest chunk the config declares, through a cached prefix and one-token steps, and finds the first
    token whose logits differ on the ragged path (the chunk's end); the model then runs on its own forward,
    exact."""
    import kvql
    from kvql.engine.model import admission

    layer = admission._layer
    monkeypatch.setattr(admission, "_layer", lambda name, i, k, v, call, chunk: layer(name, i, k, v, call, None))
    overrides = {**F.MOE, "attention_chunk_size": 32, "attn_temperature_tuning": False}
    hf = F.build("llama4_text", overrides, len(tokenizer), tokenizer.eos_token_id)
    m = kvql.Model(hf, tokenizer, cache_budget=1 << 20)
    try:
        assert "from token 32 of 40 on" in m.engine.runner.geometry.own
        ps = [p * 3 for p in F.prompts(len(tokenizer), seed=4, count=3, long=True)]  # past the chunk of 32
        want = F.reference("llama4_text", overrides, tokenizer, ps, 6)
        assert [c.token_ids for c in m.generate(ps, max_tokens=6)] == want
    finally:
        m.close()


def test_chunks_are_read_per_layer_and_a_layer_asking_the_caches_length_runs_on_its_own_forward(tokenizer):
    """Llama 4: its RoPE layer's chunk comes from the config's `layer_types` (its NoPE layer attends in full);
    with the NoPE layer's attention temperature on, that layer scales its queries by the cache's length, which
    a batch of requests does not have, so the probe sends the model to its own forward, naming it."""
    import kvql

    for family, want in [("llama4", None), ("llama4_tuned", "ask the cache for the length of their past")]:
        m = kvql.Model(F.build(*F.FAMILIES[family], len(tokenizer), tokenizer.eos_token_id), tokenizer,
                       cache_budget=1 << 20)
        geometry = m.engine.runner.geometry
        m.close()
        if want is None:
            assert geometry.own is None and [x.chunk for x in geometry.layers] == [F.WINDOW, None]
        else:
            assert want in geometry.own and "[1]" in geometry.own
