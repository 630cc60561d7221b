"""The low-level Model API: stops, EOS, masks, logprobs, sampling, async/threads/streaming, bad input."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from conftest import random_prompts, reference_greedy


def wait_idle(m, seconds=10.0):
    for _ in range(int(seconds / 0.01)):
        if m.engine.idle():
            return
        threading.Event().wait(0.01)
    raise AssertionError("engine did not become idle")


@pytest.fixture
def m(make_model):
    return make_model()


def ref(llama, tokenizer, prompt, n):
    return reference_greedy(llama, prompt, n, tokenizer.eos_token_id)


def test_completion_fields(m, tokenizer):
    (c,) = m.generate(["Question: what is"], max_tokens=5)
    assert c.prompt_tokens == len(tokenizer.encode("Question: what is"))
    assert c.finish_reason in ("stop", "length") and len(c.token_ids) <= 5
    assert c.text == tokenizer.decode(c.token_ids)
    assert c.cached_tokens == 0


def test_string_and_token_prompts_agree(m, tokenizer):
    text = "The quick brown fox"
    a = m.generate([text], max_tokens=6)[0]
    b = m.generate([tokenizer.encode(text)], max_tokens=6)[0]
    assert a.token_ids == b.token_ids and b.cached_tokens == b.prompt_tokens - 1


def forcing(tokenizer, ids):
    """A mask that makes the model emit exactly `ids`, then anything."""
    def mask(generated):
        if len(generated) >= len(ids):
            return None
        allowed = torch.zeros(len(tokenizer), dtype=torch.bool)
        allowed[ids[len(generated)]] = True
        return allowed
    return mask


def test_stop_string_spanning_token_boundaries_is_cut_and_not_returned(m, tokenizer):
    ids = tokenizer.encode(" the capital of France? Answer: Paris.")
    pieces = [tokenizer.decode([t]) for t in ids]
    assert len(ids) >= 4 and all(len(p) > 1 for p in pieces[1:3])
    full = "".join(pieces)
    stop = full[len(pieces[0]) + 1:len(pieces[0]) + len(pieces[1]) + len(pieces[2]) - 1]  # inside tokens 2..3
    (c,) = m.generate(["Question:"], max_tokens=len(ids), stop=[stop], mask=forcing(tokenizer, ids))
    assert c.finish_reason == "stop"
    assert c.text == full[:full.find(stop)] and stop not in c.text
    assert c.token_ids == ids[:3]  # generation stopped at the token that completed the stop string


def test_eos_ends_a_sequence(m, tokenizer):
    eos = tokenizer.eos_token_id

    def force_eos_third(ids):
        allowed = torch.zeros(len(tokenizer), dtype=torch.bool)
        allowed[eos if len(ids) == 2 else 5] = True
        return allowed

    (c,) = m.generate(["hello"], max_tokens=10, mask=force_eos_third)
    assert c.token_ids == [5, 5] and c.finish_reason == "stop"


def test_mask_restricts_every_token(m, tokenizer):
    allowed_ids = [7, 11, 13]
    allowed = torch.zeros(len(tokenizer), dtype=torch.bool)
    allowed[allowed_ids] = True
    out = m.generate(["hello", "world"], max_tokens=8, mask=lambda ids: allowed, temperature=1.0, seed=1)
    assert all(t in allowed_ids for c in out for t in c.token_ids)


def test_logprobs_of_greedy_tokens_are_the_top_ones(m):
    (c,) = m.generate(["Once upon a time"], max_tokens=5, logprobs=3)
    assert len(c.logprobs) == len(c.token_ids)
    for entry, tok in zip(c.logprobs, c.token_ids):
        assert entry.token_id == tok and len(entry.top) == 3
        assert entry.logprob == pytest.approx(max(entry.top.values())) and entry.logprob <= 0


def test_tiny_top_p_is_greedy(m, llama, tokenizer):
    prompt = random_prompts(seed=42, count=1, vocab=len(tokenizer))[0]
    (c,) = m.generate([prompt], max_tokens=8, temperature=1.0, top_p=1e-6, seed=3)
    assert c.token_ids == ref(llama, tokenizer, prompt, 8)


def test_concurrent_asyncio_tasks_are_batched_together(m, llama, tokenizer):
    prompts = random_prompts(seed=43, count=8, vocab=len(tokenizer))

    async def main():
        return await asyncio.gather(*(m.agenerate([p], max_tokens=8) for p in prompts))

    results = asyncio.run(main())
    assert [r[0].token_ids for r in results] == [ref(llama, tokenizer, p, 8) for p in prompts]
    assert m.stats()["max_batch_requests"] > 1


def test_calls_from_many_threads_share_the_engine(m, llama, tokenizer):
    prompts = random_prompts(seed=44, count=6, vocab=len(tokenizer))
    results = [None] * len(prompts)

    def work(i):
        results[i] = m.generate([prompts[i]], max_tokens=8)[0].token_ids

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [ref(llama, tokenizer, p, 8) for p in prompts]
    m.check_integrity()


def test_stream_yields_tokens_whose_text_adds_up(m, tokenizer):
    async def main():
        return [chunk async for chunk in m.stream("The quick brown", max_tokens=10)]

    chunks = asyncio.run(main())
    final = chunks[-1].completion
    assert final is not None and all(c.completion is None for c in chunks[:-1])
    assert "".join(c.text for c in chunks) == final.text
    assert [c.token_id for c in chunks][:len(final.token_ids)] == final.token_ids


def test_stream_holds_back_text_that_may_start_a_stop_string(m, tokenizer):
    ids = tokenizer.encode(" the capital of France? Answer: Paris.")
    full = tokenizer.decode(ids)
    stop = "France?"

    async def main():
        return [chunk async for chunk in m.stream("Question:", max_tokens=len(ids), stop=stop,
                                                  mask=forcing(tokenizer, ids))]

    chunks = asyncio.run(main())
    assert "".join(c.text for c in chunks) == full[:full.find(stop)]
    assert not any("Fr" in c.text for c in chunks)
    assert chunks[-1].completion.finish_reason == "stop"


def test_leaving_a_stream_early_cancels_the_request(m):
    async def main():
        async for chunk in m.stream("Once upon a time", max_tokens=200):
            break

    asyncio.run(main())
    wait_idle(m)
    s = m.stats()
    assert s["running"] == 0 and s["locked_nodes"] == 0
    m.check_integrity()


def test_cancelling_an_awaiting_task_cancels_its_requests(m):
    async def main():
        task = asyncio.create_task(m.agenerate(["Once upon a time"], max_tokens=300))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    wait_idle(m)
    assert m.stats()["locked_nodes"] == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=4, n=0), "n must be"),
    (dict(max_tokens=4, temperature=-1), "temperature"),
    (dict(max_tokens=4, top_p=0), "top_p"),
    (dict(max_tokens=4, logprobs=100), "logprobs"),
    (dict(max_tokens=600), "context"),
])
def test_bad_parameters_raise_at_submit(m, kwargs, message):
    with pytest.raises(ValueError, match=message):
        m.generate(["hello"], **kwargs)
    assert m.stats()["prompt_tokens"] == 0  # nothing was queued


def test_bad_prompts_raise_clear_errors(m):
    with pytest.raises(ValueError, match="empty"):
        m.generate([[]], max_tokens=2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        m.generate([[1, 2, 10**6]], max_tokens=2)
    with pytest.raises(TypeError, match="prompt 0"):
        m.generate([3.5], max_tokens=2)
    with pytest.raises(ValueError, match="more than the model's context"):
        m.generate([[1] * 510], max_tokens=8)
    with pytest.raises(TypeError, match="unexpected keyword"):
        m.generate(["hi"], max_tokens=2, frequency_penalty_typo=1.0)
    assert m.generate(["hi"], max_tokens=2)[0].token_ids  # the engine keeps serving


def test_stats_report_cache_use(m):
    prompt = list(range(1, 40))
    m.generate([prompt], max_tokens=4)
    m.generate([prompt], max_tokens=4)
    s = m.stats()
    for key in ("prompt_tokens", "cached_tokens", "computed_tokens", "hit_rate", "cache_bytes",
                "cache_budget_bytes", "evictions", "locked_nodes"):
        assert key in s
    assert s["prompt_tokens"] == 78 and s["cached_tokens"] == 38 and s["computed_tokens"] == 40
    assert s["hit_rate"] == pytest.approx(38 / 78)
    assert 0 < s["cache_bytes"] <= s["cache_budget_bytes"] and s["locked_nodes"] == 0


def test_concurrent_first_submissions_start_one_engine_thread(make_model):
    def engine_threads():
        return sum(t.name == "kvql-engine" for t in threading.enumerate())

    for _ in range(10):
        before = engine_threads()
        m = make_model()
        barrier = threading.Barrier(4)

        def work():
            barrier.wait()
            m.generate(["hi"], max_tokens=2)

        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert engine_threads() == before + 1
        closer = threading.Thread(target=m.close)
        closer.start()
        closer.join(timeout=10)
        assert not closer.is_alive(), "close() hung: an engine thread was not woken"


def test_generate_takes_regex_choices_json_schema_and_grammar(m):
    import json
    import re

    (c,) = m.generate(["Number:"], max_tokens=8, regex=r"[0-9]{3}")
    assert re.fullmatch(r"[0-9]{3}", c.text) and c.finish_reason == "stop"
    out = m.generate(["Pick:"], max_tokens=8, choices=["red", "green", "greenish"], n=3, temperature=1.0, seed=2)
    assert all(o.text in ("red", "green", "greenish") for o in out)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"],
              "additionalProperties": False}
    (c,) = m.generate(["JSON:"], max_tokens=40, json_schema=schema)
    assert isinstance(json.loads(c.text)["n"], int)
    (c,) = m.generate(["Lark:"], max_tokens=8, grammar='start: "a" B\nB: /[xy]{2}/')
    assert re.fullmatch("a[xy]{2}", c.text)


def test_constraints_are_exclusive_and_invalid_ones_are_named(m):
    with pytest.raises(ValueError, match="at most one"):
        m.generate(["x"], max_tokens=2, regex="a", choices=["a"])
    with pytest.raises(ValueError, match="invalid regex"):
        m.generate(["x"], max_tokens=2, regex="a(")
    assert m.stats()["prompt_tokens"] == 0
