"""No request list, big prompt or whole-vocabulary bias lets one client hold up the others (issue 51, item 3).

The caps are 400s that say what to do; text to tokenize and biases to read past a small size are prepared off
the event loop (asserted by the thread they ran on, not by a clock); a whole-vocabulary `logit_bias` answers as
the same bias computed by hand; a text no context could hold is refused before it is tokenized. Slow
constraints: test_slow_constraints.py."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

import kvql
from conftest import serving
from kvql.engine.request_builder import INLINE_CHARS, INLINE_PROMPTS, RequestBuilder
from kvql.backends.options import GenerateOptions
from kvql.server.app import create_app
from kvql.server.served import MAX_PROMPTS, MAX_SAMPLES


@pytest.fixture(scope="module")
def served(tokenizer, llama):
    model = kvql.Model(llama, tokenizer, name="tiny", cache_budget=4 << 20)
    with serving(create_app(model)) as url:
        yield url, model


def test_a_prompt_list_cannot_pass_the_caps_on_prompts_and_samples(served):
    url, _ = served
    r = httpx.post(url + "/v1/completions", json={"prompt": ["Hi"] * (MAX_PROMPTS + 1), "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and str(MAX_PROMPTS) in r.text
    r = httpx.post(url + "/v1/completions", json={"prompt": ["Hi"] * 2000, "n": 64, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    prompts = MAX_SAMPLES // 64 + 1  # with n at its own cap of 64
    r = httpx.post(url + "/v1/completions", json={"prompt": ["Hi"] * prompts, "n": 64, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n" and f"{64 * prompts} samples" in r.text
    r = httpx.post(url + "/v1/completions", json={"prompt": ["Hi", "Ho"], "n": 2, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 4


@pytest.mark.parametrize("kind", ["text", "prompts", "bias"])
def test_much_to_read_is_prepared_off_the_event_loop(tokenizer, llama, monkeypatch, kind):
    """Tokenizing a megabyte takes ~0.5 s: on the event loop it would stall every other client (and /health)."""
    m = kvql.Model(llama, tokenizer, cache_budget=4 << 20)
    threads, reads = [], []  # where each request was built, and where its options were read (a bias: ~20 ms)
    real, real_read = RequestBuilder.build, GenerateOptions.read.__func__
    monkeypatch.setattr(RequestBuilder, "build", lambda self, *a, **kw: threads.append(
        threading.current_thread()) or real(self, *a, **kw))
    monkeypatch.setattr(GenerateOptions, "read", classmethod(lambda cls, *a, **kw: reads.append(
        threading.current_thread()) or real_read(cls, *a, **kw)))
    prompts, options = ["hello"], {}
    if kind == "text":  # (longer than the tiny model's context: refused, after it was tokenized)
        prompts = ["hello " * (INLINE_CHARS // 6 + 1)]
    elif kind == "prompts":
        prompts = ["hi"] * (INLINE_PROMPTS + 1)
    else:
        options["logit_bias"] = {str(t): 1.0 for t in range(INLINE_PROMPTS + 1)}

    async def run():
        try:
            await m.agenerate(prompts, max_tokens=1, **options)
        except ValueError as e:
            assert kind == "text" and "context" in str(e)
        return threading.current_thread()

    try:
        loop_thread = asyncio.run(run())
        assert threads and threads[0] is not loop_thread and reads and reads[0] is not loop_thread
        threads.clear(), reads.clear()
        asyncio.run(m.agenerate(["hello"], max_tokens=1))  # a small request: prepared in place (no hop)
        assert threads == [threading.main_thread()] and reads == [threading.main_thread()]
    finally:
        m.close()


def test_a_text_longer_than_the_context_can_hold_is_refused_unread(tokenizer, llama, monkeypatch):
    """Eight 1 MB prompts took ~3 s of both cores to tokenize before their 400: a text longer than the context
    at the vocabulary's longest token is refused before it is read; one within that bound is read and checked."""
    m = kvql.Model(llama, tokenizer, cache_budget=4 << 20)
    bound = 2 * m.context_length * max(map(len, tokenizer.get_vocab()))
    read = []
    real = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, *a, **kw: read.append(len(text)) or real(text, *a, **kw))
    with pytest.raises(ValueError, match=f"prompt 1 has {bound + 1} characters.*not tokenized"):
        m.generate(["hello", "x" * (bound + 1)], max_tokens=1)
    assert read == [5]
    read.clear()
    with pytest.raises(ValueError, match="tokens \\+ max_tokens"):
        m.generate("x" * bound, max_tokens=1)
    assert read == [bound]


def test_a_whole_vocabulary_bias_answers_as_the_bias_added_by_hand(served, tokenizer, llama):
    import torch

    url, model = served
    ids = tokenizer.encode("Once upon a time")
    g = torch.Generator().manual_seed(5)
    values = (torch.rand(len(tokenizer), generator=g) * 20 - 10).tolist()
    bias = {str(t): round(v, 3) for t, v in enumerate(values)}
    got = httpx.post(url + "/v1/completions", json={"prompt": ids, "max_tokens": 6, "temperature": 0,
                                                     "logit_bias": bias, "ignore_eos": True,
                                                     "return_token_ids": True}, timeout=120).json()
    added = torch.tensor([bias[str(t)] for t in range(len(tokenizer))])
    seq = list(ids)
    with torch.inference_mode():
        for _ in range(6):
            row = llama(input_ids=torch.tensor([seq])).logits[0, -1].float()
            row = row.clone()
            row[:added.numel()] += added
            seq.append(int(row.argmax()))
    assert got["choices"][0]["token_ids"] == seq[len(ids):]
