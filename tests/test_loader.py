"""Loading models from specs: local directories, the built-in default, and clear errors."""

from __future__ import annotations

import json

import pytest

import kvql
from kvql.backends.loader import ModelLoadError, resolve


def test_local_directory_and_local_prefix_load_the_same_model(tmp_path, llama, tokenizer):
    llama.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    a = kvql.model(str(tmp_path), cache_budget="1MB")
    b = kvql.model(f"local:{tmp_path}", cache_budget="1MB")
    prompt = [[3, 4, 5, 6]]
    assert a.generate(prompt, max_tokens=6)[0].token_ids == b.generate(prompt, max_tokens=6)[0].token_ids
    a.close(), b.close()


def test_unknown_spec_names_what_was_tried():
    with pytest.raises(ModelLoadError) as err:
        resolve("no-such-model-xyz")
    assert "no-such-model-xyz" in str(err.value) and "smollm2-135m" in str(err.value)


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve(str(tmp_path))


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1}))
    with pytest.raises(ModelLoadError, match="'gpt2'.*llama"):
        kvql.model(str(tmp_path))


def test_size_strings_are_parsed():
    from kvql.backends.local import parse_bytes
    assert parse_bytes("512MB") == 512 * 10**6 and parse_bytes("2GiB") == 2 * 2**30 and parse_bytes(1234) == 1234
    with pytest.raises(ValueError, match="size"):
        parse_bytes("lots")
