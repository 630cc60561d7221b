"""Integration: the embedded Gemma 3 270M (sliding windows of 512 tokens on 5 of every 6 layers, one KV head of
256 dims), kvql vs plain transformers `generate` (fp32, greedy) on prompts of 600-1,500 tokens: past the
window, cold, warm and through the server (its app, in this process)."""

from __future__ import annotations

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

import kvql
from conftest import serving
from kvql.backends.loader import resolve
from kvql.server.app import create_app

pytestmark = pytest.mark.gemma3

COLORS = ["red", "blue", "green", "yellow", "black", "white", "orange"]
DOCUMENT = "".join(f"Record {i}: the {COLORS[i % 7]} box on shelf {i % 13} holds {(i * 37) % 101} stones.\n"
                   for i in range(90))
QUESTIONS = ["How many stones does the box of record 3 hold?", "Which shelf holds record 40?",
             "What color is the box of record 77?"]


@pytest.fixture(scope="module")
def gemma():
    m = kvql.model("gemma3-270m", dtype="float32", cache_budget="512MB")  # as `plain` below
    yield m
    m.close()


@pytest.fixture(scope="module")
def plain():
    """A second copy of the model, loaded by transformers alone (nothing of kvql on its path)."""
    return AutoModelForCausalLM.from_pretrained(resolve("gemma3-270m"), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(gemma):
    """Token ids of 3 prompts of ~600, ~1,000 and ~1,500 tokens; the longer ones share the shorter's start."""
    ids = gemma.tokenizer.encode(DOCUMENT)
    cuts = [600, 1000, 1500]
    assert len(ids) > cuts[-1]
    return [ids[:n] + gemma.tokenizer.encode(f"\nQuestion: {q}\nAnswer:", add_special_tokens=False)
            for n, q in zip(cuts, QUESTIONS)]


@pytest.fixture(scope="module")
def reference(plain, prompts):
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = plain.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                                 pad_token_id=0)[0, len(p):].tolist()
            eos = plain.generation_config.eos_token_id
            eos = set(eos if isinstance(eos, list) else [eos])
            out.append(gen[:next((i for i, t in enumerate(gen) if t in eos), len(gen))])
    return out


def test_it_loads_with_its_windows_and_its_full_context(gemma):
    layers = gemma.engine.runner.geometry.layers
    assert [x.window for x in layers] == [None if i % 6 == 5 else 512 for i in range(18)]
    assert gemma.context_length == 32768


def test_greedy_past_the_window_equals_transformers_cold_and_warm(gemma, prompts, reference):
    gemma.clear_cache()
    cold = gemma.generate(prompts, max_tokens=10)
    assert [c.token_ids for c in cold] == reference
    assert sum(c.cached_tokens for c in cold) > 0  # the shared start was computed once
    warm = gemma.generate(prompts, max_tokens=10)
    assert [c.token_ids for c in warm] == reference
    assert all(c.cached_tokens == c.prompt_tokens - 1 for c in warm)
    gemma.check_integrity()


def test_through_the_server_equals_transformers(gemma, prompts, reference):
    """The server's app in this process, over the module's model (a `kvql serve` process would load the model
    a second time, ~25 s; the command itself: test_server_process.py). Last here: shutting the app down
    closes the model."""
    gemma.clear_cache()
    with serving(create_app(gemma)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        for p, want in zip(prompts, reference):
            r = client.completions.create(model=gemma.name, prompt=p, max_tokens=10, temperature=0,
                                          extra_body={"return_token_ids": True})
            assert r.choices[0].model_extra.get("token_ids") == want
