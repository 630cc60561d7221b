"""A GGUF file is a model, read directly (kvql/backends/gguf_model.py, issue 53): the same weights, config and
tokenizer transformers' own GGUF loading gives, without its dequantizing pass or its progress bars; the tokenizer
converted once per file's metadata; with weights="gguf" the linear layers take the file's blocks, never dequantized,
and a layer left dequantized is read from the file afterwards, exact against the model's own forward."""

from __future__ import annotations

import torch

import kvql
from kvql.backends import loader
from kvql.engine.model import quantized

PROMPTS = ["The capital of France is", "def fib(n):\n    return", "Hello <b>world</b> 😀"]


def test_a_gguf_file_loads_as_transformers_loads_it(tmp_path, monkeypatch, capfd):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = loader.builtin_gguf("smollm2-135m", tmp_path)
    monkeypatch.setenv("KVQL_CACHE_DIR", str(tmp_path / "cache"))
    capfd.readouterr()
    model, tokenizer = loader.load_hf(str(path), dtype=torch.float32)
    said = capfd.readouterr().err
    assert "de-quantizing" not in said and "Loading weights" not in said, said
    assert len(list((tmp_path / "cache" / "gguf-tokenizers").iterdir())) == 1  # converted once, kept
    again = loader.load_tokenizer(str(path))  # the kept copy

    want = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    want_tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    got_state, want_state = model.state_dict(), want.state_dict()
    assert got_state.keys() == want_state.keys()
    assert all(torch.equal(got_state[k], want_state[k]) for k in want_state)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied as the file has it
    unmarked = {k: v for k, v in want.config.to_dict().items() if k != "quantization_config"}  # transformers' marker
    assert model.config.to_dict() == unmarked
    chat = [{"role": "user", "content": "Hi"}]
    for tok in (tokenizer, again):
        assert [tok(p).input_ids for p in PROMPTS] == [want_tokenizer(p).input_ids for p in PROMPTS]
        assert tok.apply_chat_template(chat, tokenize=False) == want_tokenizer.apply_chat_template(chat, tokenize=False)
        assert (tok.eos_token, tok.bos_token) == (want_tokenizer.eos_token, want_tokenizer.bos_token)


def test_a_layer_left_dequantized_is_read_from_the_file(tmp_path, monkeypatch):
    """weights="gguf" leaves every layer whose blocks qgemm runs unread; one refused (and its stacked siblings)
    is dequantized from the file afterwards: no weight stays unread, and greedy output equals the model's own
    forward."""
    refuse = "model.layers.0.self_attn.k_proj"
    taken = quantized._GGUF.layer
    monkeypatch.setattr(quantized._GGUF, "layer", lambda self, name, linear: "refused here" if name == refuse
                        else taken(self, name, linear))
    path = loader.builtin_gguf("smollm2-135m", tmp_path)
    m = kvql.model(str(path), dtype="float32", weights="gguf", cache_budget="64MB")
    try:
        assert "207 Q4_1" in m.quantization and "1 left dequantized (refused here" in m.quantization
        assert "2 left dequantized (a layer stacked with it" in m.quantization, m.quantization
        assert not [n for n, p in m.hf_model.named_parameters() if p.is_meta]
        k_proj = m.hf_model.model.layers[0].self_attn.k_proj
        assert isinstance(k_proj, torch.nn.Linear) and k_proj.weight.abs().sum() > 0
        ids = m.tokenizer(PROMPTS[0], return_tensors="pt").input_ids
        with torch.inference_mode():
            want = m.hf_model.generate(ids, max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(ids))
        assert m.generate([PROMPTS[0]], max_tokens=8, ignore_eos=True)[0].token_ids == want[0, ids.shape[1]:].tolist()
    finally:
        m.close()


def _moe_file(path, smollm2):
    """A 2-layer Qwen3-MoE GGUF file written here from a random model (SmolLM2's vocabulary): attention in Q4_1,
    experts' gate and up in Q5_0 (3-D tensors), down in Q8_0, the rest float32."""
    import gguf
    import gguf.quants
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    source = gguf.GGUFReader(str(smollm2))
    config = Qwen3MoeConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=768, max_position_embeddings=512,
                            tie_word_embeddings=False, initializer_range=0.2)  # moe size: transformers' default
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    for key, value in {"context_length": 512, "embedding_length": 64, "block_count": 2, "feed_forward_length": 128,
                       "attention.head_count": 4, "attention.head_count_kv": 2, "attention.key_length": 16,
                       "attention.value_length": 16, "expert_count": 4, "expert_used_count": 2,
                       "expert_feed_forward_length": 768}.items():
        w.add_uint32(f"qwen3moe.{key}", value)
    w.add_float32("qwen3moe.rope.freq_base", config.rope_parameters["rope_theta"])
    w.add_float32("qwen3moe.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    fields = source.fields
    w.add_token_list([bytes(fields["tokenizer.ggml.tokens"].parts[i]).decode() for i in fields["tokenizer.ggml.tokens"].data])
    w.add_token_types([int(fields["tokenizer.ggml.token_type"].parts[i][0]) for i in fields["tokenizer.ggml.token_type"].data])
    w.add_token_merges([bytes(fields["tokenizer.ggml.merges"].parts[i]).decode() for i in fields["tokenizer.ggml.merges"].data])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def put(name, tensor, kind=T.F32):
        values = tensor.detach().float().numpy()
        if kind == T.F32:
            w.add_tensor(name, values)
        else:
            w.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)

    put("token_embd.weight", model.model.embed_tokens.weight)
    put("output_norm.weight", model.model.norm.weight)
    put("output.weight", model.lm_head.weight, T.Q8_0)
    for i, layer in enumerate(model.model.layers):
        a, mlp, b = layer.self_attn, layer.mlp, f"blk.{i}."
        for gname, module in (("attn_q", a.q_proj), ("attn_k", a.k_proj), ("attn_v", a.v_proj), ("attn_output", a.o_proj)):
            put(b + gname + ".weight", module.weight, T.Q4_1)
        put(b + "attn_q_norm.weight", a.q_norm.weight)
        put(b + "attn_k_norm.weight", a.k_norm.weight)
        put(b + "attn_norm.weight", layer.input_layernorm.weight)
        put(b + "ffn_norm.weight", layer.post_attention_layernorm.weight)
        put(b + "ffn_gate_inp.weight", mlp.gate.weight)
        gate, up = mlp.experts.gate_up_proj.chunk(2, dim=1)
        put(b + "ffn_gate_exps.weight", gate, T.Q5_0)
        put(b + "ffn_up_exps.weight", up, T.Q5_0)
        put(b + "ffn_down_exps.weight", mlp.experts.down_proj, T.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_moe_file_runs_its_experts_on_their_blocks(tmp_path, monkeypatch):
    """A Qwen3-MoE GGUF file: read directly it is the model transformers' own GGUF loading gives; with
    weights="gguf" its 3-D experts run on their Q5_0 / Q8_0 blocks (5-bit and 8-bit, never dequantized), exact
    against the quantized model's own forward, cold and warm."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("KVQL_CACHE_DIR", str(tmp_path / "cache"))
    path = _moe_file(tmp_path / "moe.gguf", loader.builtin_gguf("smollm2-135m", tmp_path))
    model, _ = loader.load_hf(str(path), dtype=torch.float32)
    want = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="moe.gguf", dtype=torch.float32).state_dict()
    got = model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)

    m = kvql.model(str(path), dtype="float32", weights="gguf", cache_budget="64MB")
    try:
        assert "8 Q4_1, 2 Q5_0/Q8_0 experts, 1 Q8_0" in m.quantization and "left" not in m.quantization, m.quantization
        assert not [n for n, p in m.hf_model.named_parameters() if p.is_meta or p.dim() == 3]
        ids = m.tokenizer(PROMPTS[0], return_tensors="pt").input_ids
        with torch.inference_mode():
            out = m.hf_model.generate(ids, max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(ids))
        for _ in range(2):
            assert m.generate([PROMPTS[0]], max_tokens=8, ignore_eos=True)[0].token_ids == out[0, ids.shape[1]:].tolist()
    finally:
        m.close()


def test_a_built_in_file_joined_for_its_blocks_leaves_its_conversion_room(tmp_path, monkeypatch):
    """weights="gguf" on Gemma 3 joins its chunk packages' file in a directory of its own: the converted model's
    directory stays free for the conversion's atomic rename (a file there made a later plain load fail)."""
    monkeypatch.setenv("KVQL_CACHE_DIR", str(tmp_path))
    joined = loader.gguf_file("gemma3-270m")
    assert joined.is_file() and joined.parent == tmp_path / "gemma3-270m-gguf"
    assert not (tmp_path / "gemma3-270m").exists()
    assert loader.gguf_file("gemma3-270m") == joined  # joined once
