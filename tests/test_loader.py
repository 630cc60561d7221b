"""Loading models from specs: local directories, the built-in default, and clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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


def test_an_encoder_decoder_model_is_refused_before_its_weights_load(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5", "num_layers": 1}))
    with pytest.raises(ModelLoadError, match="'t5' is an encoder-decoder model"):
        kvql.model(str(tmp_path))


def test_a_recurrent_model_directory_loads_and_runs_exactly(tmp_path, tokenizer):
    """A Mamba directory (recurrent layers only: its own forward, its state carried and snapshotted) loads and
    answers as transformers' generate does."""
    import families

    hf = families.build("mamba", {"state_size": 4}, len(tokenizer), tokenizer.eos_token_id)
    hf.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    prompt = families.prompts(len(tokenizer), seed=1, count=1)[0]
    want = families.reference("mamba", {"state_size": 4}, tokenizer, [prompt], 6)
    m = kvql.model(str(tmp_path), dtype="float32", cache_budget="8MB")
    try:
        assert m.generate([prompt], max_tokens=6)[0].token_ids == want[0]
    finally:
        m.close()


def test_an_encoder_decoder_directory_is_refused_from_its_config(tmp_path):
    from transformers import T5Config

    T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8, vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=f"model '{tmp_path}': 't5' is an encoder-decoder model"):
        kvql.model(str(tmp_path))


def test_size_strings_are_parsed():
    from kvql.backends.local import parse_bytes
    assert parse_bytes("512MB") == 512 * 10**6 and parse_bytes("2GiB") == 2 * 2**30 and parse_bytes(1234) == 1234
    with pytest.raises(ValueError, match="size"):
        parse_bytes("lots")


# --- Hugging Face Hub ids, first-load note, devices ------------------------------------------------------

HUB_CODE = """
import sys, kvql
for spec in sys.argv[1:]:
    try:
        m = kvql.model(spec, cache_budget="1MB")
    except kvql.ModelLoadError as e:
        print("ERROR", e)
    else:
        print("LOADED", m.generate([[3, 4, 5, 6]], max_tokens=6)[0].token_ids)
        m.close()
"""


def run_hub(*specs: str, hub_cache, offline: bool = True) -> list[str]:
    """Each spec loaded in turn by one fresh process (the Hub's settings are read at import): a line each."""
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache)}
    env.pop("HF_HUB_OFFLINE", None)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    out = subprocess.run([sys.executable, "-c", HUB_CODE, *specs], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    lines = [x for x in out.stdout.splitlines() if x.startswith(("LOADED", "ERROR"))]
    assert len(lines) == len(specs), out.stdout
    return lines


def test_a_hub_id_missing_offline_says_it_is_not_in_the_cache_and_how_to_get_it(tmp_path):
    [line] = run_hub("kvql-test-org/no-such-model", hub_cache=tmp_path / "hub")
    assert line.startswith("ERROR model 'kvql-test-org/no-such-model' is no local directory and not in the local "
                           "Hugging Face cache")
    assert str(tmp_path / "hub") in line and "HF_HUB_OFFLINE is set" in line
    assert "hf download kvql-test-org/no-such-model" in line and "local model directory" in line


def test_hub_ids_load_from_the_local_hugging_face_cache(tmp_path, llama, tokenizer):
    """A model in the HF cache layout (models--ORG--NAME/snapshots/REV, refs/main) loads by its id, also
    written local:ORG/NAME, without network; the same weights as its directory."""
    repo = tmp_path / "hub" / "models--kvql-test-org--tiny"
    revision = "0123456789abcdef0123456789abcdef01234567"
    llama.save_pretrained(repo / "snapshots" / revision)
    tokenizer.save_pretrained(repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    direct, by_id = run_hub(str(repo / "snapshots" / revision), "kvql-test-org/tiny", hub_cache=tmp_path / "hub")
    assert direct.startswith("LOADED") and by_id == direct
    assert run_hub("local:kvql-test-org/tiny", hub_cache=tmp_path / "hub", offline=False) == [direct]  # no network


def test_a_spec_that_is_no_hub_id_says_what_was_tried():
    with pytest.raises(ModelLoadError, match="Hugging Face Hub ids"):
        resolve("./missing/dir/x")


def test_first_load_note_says_what_the_embedded_model_conversion_writes_and_where(tmp_path, monkeypatch):
    from kvql.backends.loader import first_load_note

    monkeypatch.setenv("KVQL_CACHE_DIR", str(tmp_path))
    note = first_load_note("smollm2-135m")
    assert "GGUF" in note and "0.5 GB" in note and str(tmp_path / "smollm2-135m") in note
    assert "KVQL_CACHE_DIR" in note
    (tmp_path / "smollm2-135m").mkdir()
    (tmp_path / "smollm2-135m" / "config.json").write_text("{}")
    assert first_load_note("smollm2-135m") is None  # converted already: nothing to say
    assert first_load_note(str(tmp_path)) is None


def test_a_device_this_torch_cannot_use_is_refused_before_loading(tmp_path, llama, tokenizer):
    import torch

    llama.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    bad = "cuda:99" if torch.cuda.is_available() else "cuda"
    with pytest.raises(ModelLoadError, match=f"device '{bad}'") as err:
        kvql.model(str(tmp_path), device=bad)
    assert "\n" not in str(err.value)
    with pytest.raises(ModelLoadError, match="unknown device 'gpu'"):
        kvql.model(str(tmp_path), device="gpu")
