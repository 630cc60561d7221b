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
