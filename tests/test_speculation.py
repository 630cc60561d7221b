"""Speculative decoding without a draft model (kvql.engine.decode.drafts, scheduler, outputs): drafts from the radix
tree, the request's own context and earlier outputs, verified in one forward; outputs equal to decoding one
token per step, with `check_integrity` after every step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import random_prompts, reference_greedy, tiny_model
from kvql.engine.decode.drafts import Drafter, NGrams, continuation
from kvql.engine.decode.grammar import Grammar
from kvql.engine.cache.radix_cache import RadixCache
from kvql.engine.request import SamplingParams
from kvql.engine.scheduler import SPECULATE_MAX_RUNNING


def run(m, jobs, speculate: bool, clear: bool = True):
    """Submit `jobs` [(prompt ids, SamplingParams kw)] with speculation `speculate`, stepping until idle and
    checking integrity after every step; -> (completions per job, steps, stats). `clear`: from an empty cache
    (else a job run again is drafted from the tree at full length, and so ends inside a verify step)."""
    engine = m.engine
    engine.speculate = speculate
    if clear:
        m.clear_cache()
    before = engine.stats()
    groups = [engine.submit(p, SamplingParams(**{"max_tokens": 24, **kw})) for p, kw in jobs]
    steps = 0
    while not engine.idle():
        engine.step()
        steps += 1
        engine.check_integrity()
    after = engine.stats()
    stats = {k: after[k] - before[k] for k in ("drafted_tokens", "accepted_tokens", "generated_tokens")}
    return [g.future.result() if g.future.exception() is None else g.future.exception() for g in groups], steps, stats


def answers(results):
    """Completions per job with what depends on the cache (cached and disk tokens) left out."""
    return [[dataclasses.replace(c, cached_tokens=0, disk_tokens=0) for c in r] if isinstance(r, list) else r
            for r in results]


def looping_prompts(tokenizer, count: int, seed: int = 4) -> list[list[int]]:
    """Prompts whose text repeats itself; the tiny model's greedy outputs fall into loops after them (seed 4:
    one of three repeats a token twenty times), so that drafts from the request's own context exist."""
    prompts = random_prompts(seed=seed, count=count, vocab=len(tokenizer), prefix_lengths=(0, 6), suffix=(5, 9))
    return [p + p[len(p) // 2:] + p for p in prompts]


@pytest.fixture
def engine_model(make_model):
    return make_model(background=False)


def test_greedy_outputs_equal_decoding_one_token_per_step(engine_model, tokenizer):
    jobs = [(p, {"max_tokens": 48}) for p in looping_prompts(tokenizer, 3)]
    on, steps_on, stats = run(engine_model, jobs, True)
    off, steps_off, stats_off = run(engine_model, jobs, False)
    assert on == off
    assert stats["accepted_tokens"] > 0 and stats_off["drafted_tokens"] == 0
    alone = jobs[:1]  # the looping one: decoding it alone takes fewer steps
    assert run(engine_model, alone, True)[1] < run(engine_model, alone, False)[1] == 48
    assert sum(len(c[0].accepted) for c in on) == stats["accepted_tokens"]
    assert sum(c[0].drafted_tokens for c in on) == stats["drafted_tokens"]


def test_greedy_with_speculation_equals_the_uncached_reference(engine_model, llama, tokenizer):
    for p in looping_prompts(tokenizer, 2, seed=5):
        got, _, stats = run(engine_model, [(p, {"max_tokens": 20})], True)
        assert got[0][0].token_ids == reference_greedy(llama, p, 20, tokenizer.eos_token_id)


def test_a_query_run_again_is_drafted_from_the_radix_tree(engine_model, tokenizer):
    prompt = random_prompts(seed=11, count=1, vocab=len(tokenizer), prefix_lengths=(12,), suffix=(6, 7))[0]
    engine = engine_model.engine
    engine.speculate = True
    first = engine_model.generate([prompt], max_tokens=30, ignore_eos=True)[0]
    steps = engine.steps
    again = engine_model.generate([prompt], max_tokens=30, ignore_eos=True)[0]
    assert again.token_ids == first.token_ids
    # after the first token (from the prefill), every draft is accepted whole (each step also samples one more,
    # the last row's): drafts of 3, 5, 7, 8, 8 tokens, 6 forwards instead of 30
    assert len(again.accepted) >= 24 and engine.steps - steps <= 6
    assert again.drafted_tokens == len(again.accepted)


def test_drafts_stop_where_max_tokens_stop_strings_and_stop_fn_stop(engine_model, tokenizer):
    prompts = looping_prompts(tokenizer, 2, seed=7)
    text = engine_model.generate([prompts[0]], max_tokens=24)[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2] or "a"
    jobs = [(prompts[0], {"max_tokens": 7}), (prompts[1], {"stop": (stop,)}),
            (prompts[0], {"stop_fn": lambda ids, text: len(ids) >= 5})]
    on, _, _ = run(engine_model, jobs, True)
    off, _, _ = run(engine_model, jobs, False)
    assert on == off
    assert len(on[0][0].token_ids) == 7 and len(on[2][0].token_ids) == 5


def test_constrained_and_logprob_requests_get_the_same_outputs(engine_model, tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 12}}, "required": ["a"]}
    mask = Grammar.json_schema(tokenizer, schema)
    prompts = looping_prompts(tokenizer, 3, seed=9)
    jobs = [(prompts[0], {"mask": mask.mask_fn(), "max_tokens": 40}), (prompts[1], {"logprobs": 3}),
            (prompts[2], {"repetition_penalty": 1.3, "presence_penalty": 0.5})]
    on, _, stats = run(engine_model, jobs, True)
    jobs[0] = (prompts[0], {"mask": mask.mask_fn(), "max_tokens": 40})  # a fresh matcher
    off, _, _ = run(engine_model, jobs, False)
    assert [c[0].token_ids for c in on] == [c[0].token_ids for c in off]
    for a, b in zip(on[1][0].logprobs, off[1][0].logprobs):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
    assert stats["drafted_tokens"] > 0


def test_a_mask_raising_on_a_drafted_position_fails_its_request_alone(engine_model, tokenizer):
    prompts = looping_prompts(tokenizer, 2, seed=13)

    def bad(ids):
        if len(ids) >= 4:
            raise ValueError("mask broke")
        return None

    on, _, _ = run(engine_model, [(prompts[0], {"mask": bad}), (prompts[1], {})], True)
    off, _, _ = run(engine_model, [(prompts[1], {})], False)
    assert isinstance(on[0], ValueError) and on[1] == off[0]


def test_large_batches_and_sampled_requests_are_not_drafted(engine_model, tokenizer):
    prompts = looping_prompts(tokenizer, SPECULATE_MAX_RUNNING + 4, seed=15)
    _, _, big = run(engine_model, [(p, {"max_tokens": 4}) for p in prompts], True)
    sampled = [(p, {"temperature": 0.8, "seed": 1}) for p in prompts[:2]]
    on, _, drawn = run(engine_model, sampled, True)
    off, _, _ = run(engine_model, sampled, False)
    assert drawn["drafted_tokens"] == 0 and on == off
    assert big["drafted_tokens"] == 0  # all of them run together to the end: never few enough to draft


def test_drafts_never_evict_or_preempt_under_memory_pressure(make_model, tokenizer):
    m = make_model(cache_tokens=160, background=False)
    jobs = [(p, {"max_tokens": 48}) for p in looping_prompts(tokenizer, 3)]
    preemptions = []
    for speculate in (True, False):
        before = m.engine.stats()["preemptions"]
        outputs, _, stats = run(m, jobs, speculate)
        preemptions.append(m.engine.stats()["preemptions"] - before)
        if speculate:
            on, drafted = outputs, stats["drafted_tokens"]
    assert on == outputs and drafted > 0
    assert preemptions[0] == preemptions[1] > 0  # the pool is short either way; drafts add no preemption


def test_bf16_greedy_is_the_same_drafted_or_not(tokenizer, make_model):
    hf = tiny_model(tokenizer, "llama", 1, hidden_size=128, intermediate_size=256, initializer_range=0.05).to(torch.bfloat16)
    m = make_model(hf, background=False)
    jobs = [(p, {"max_tokens": 20}) for p in looping_prompts(tokenizer, 3, seed=19)]
    on, _, stats = run(m, jobs, True)
    off, _, _ = run(m, jobs, False)
    assert on == off and stats["drafted_tokens"] > 0


# -- the draft sources ---------------------------------------------------------------------------------------
def test_ngrams_draft_what_followed_the_latest_longest_match():
    index = NGrams()
    seq = [1, 2, 3, 4, 9, 9, 2, 3, 4, 5, 6, 7]
    index.add(seq)
    assert index.lookup([0, 2, 3, 4], 3) == [5, 6, 7]  # the latest occurrence of (2, 3, 4)
    assert index.lookup([8, 9, 9], 2) == [2, 3]
    assert index.lookup([5, 3], 4) == []  # (3,) alone is too short a match
    seq.extend([8, 1])
    index.add(seq, start=12)
    assert index.lookup([6, 7], 2) == [8, 1]


def test_the_tree_drafts_the_continuation_of_the_same_context():
    tree = RadixCache(lambda slots: None)
    tree.insert([1, 2, 3, 4, 5, 6], torch.arange(6))
    tree.insert([1, 2, 3, 7, 8], torch.arange(6, 11))  # the most recent branch after (1, 2, 3)
    _, node = tree.match_prefix([1, 2])
    assert continuation(node, [3], 3) == [7, 8]
    assert continuation(node, [3, 4], 5) == [5, 6]
    assert continuation(node, [9], 3) == []
    assert continuation(tree.root, [1, 2, 3, 4, 5, 6], 3) == []


def test_remembered_outputs_draft_only_within_their_cache_partition():
    class Req:
        def __init__(self, tokens, salt):
            self.tokens, self.salt, self.draft, self.tree_len = tokens, salt, None, 0
            self.node = None

    tree = RadixCache(lambda slots: None)
    drafter = Drafter()
    drafter.remember("tenant-a", [50, 51], [60, 61, 62, 63, 64])
    a, b = Req([70, 61, 62], "tenant-a"), Req([70, 61, 62], "tenant-b")
    a.node, b.node = tree._root("tenant-a"), tree._root("tenant-b")
    assert drafter.propose(a, 8) == [63, 64]
    assert drafter.propose(b, 8) == []
    drafter.reset()
    a = Req([70, 61, 62], "tenant-a")
    a.node = tree._root("tenant-a")
    assert drafter.propose(a, 8) == []


def test_a_trace_shows_the_drafted_and_accepted_tokens_of_each_hole(make_model, tmp_path):
    import kvql

    m = make_model()
    query = '"Story: once upon a time [A]" where len(TOKENS(A)) < 24'
    first = kvql.run_sync(query, model=m)
    again = kvql.run_sync(query, model=m)  # the same context: drafted from the tree, accepted
    hole = again.trace.holes[0]
    assert again.prompt == first.prompt and hole.drafted >= hole.accepted >= 15
    again.trace.save(tmp_path / "t.html")
    assert f"{hole.accepted} of {hole.drafted} drafted tokens accepted" in (tmp_path / "t.html").read_text()
    # and per token: the accepted ones marked, in the trace's tokens and on its page
    assert again.trace.summary()["drafted"] == hole.accepted == (tmp_path / "t.html").read_text().count(" drafted\"")
    assert all(t.hole == "A" for t in again.trace.tokens if t.drafted) and first.trace.summary()["drafted"] == 0
    m.engine.speculate = False
    plain = kvql.run_sync(query, model=m)
    assert plain.prompt == first.prompt and plain.trace.holes[0].drafted == 0


def test_speculate_is_an_option_of_local_models_only(tokenizer, llama):
    import kvql

    m = kvql.Model(llama, tokenizer, cache_budget="4MB", speculate=False)
    try:
        assert m.engine.speculate is False
    finally:
        m.close()
    with pytest.raises(TypeError, match="speculate= is for local models"):
        kvql.model("http://127.0.0.1:9/v1", speculate=False)


def test_speculative_sampling_keeps_the_distribution():
    """A draft proposing one token: kept with probability p(draft), else a draw from the rest; the tokens drawn
    follow p (20,000 seeded draws per case, each frequency within 0.015 of its probability; 5 sigma ~ 0.012)."""
    from types import SimpleNamespace

    from kvql.engine.decode.sampler import sample

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    for params in (SamplingParams(max_tokens=1, temperature=1.0), SamplingParams(max_tokens=1, temperature=0.7, top_k=4),
                   SamplingParams(max_tokens=1, temperature=1.3, top_p=0.9)):
        want = _distribution(logits, params)
        for draft in (0, 3, 5):  # likely, unlikely, filtered out (top-k / top-p) or nearly impossible
            req = SimpleNamespace(params=params, generator=torch.Generator().manual_seed(draft), output_ids=[],
                                  prompt_ids=[], next_allowed=None)
            counts = torch.bincount(torch.tensor([sample(logits, req, draft)[0] for _ in range(20_000)]), minlength=6)
            assert (counts / 20_000 - want).abs().max() < 0.015, (params, draft, counts / 20_000, want)


def _distribution(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution `sample` draws from without a draft (temperature, top-k, top-p), computed directly."""
    probs = torch.softmax(logits / p.temperature, -1)
    order = probs.argsort(descending=True)
    keep = torch.zeros(6, dtype=torch.bool)
    mass = 0.0
    for rank, i in enumerate(order.tolist()):
        if (p.top_k and rank >= p.top_k) or (p.top_p < 1 and mass >= p.top_p):
            break
        keep[i], mass = True, mass + float(probs[i])
    probs = torch.where(keep, probs, 0.0)
    return probs / probs.sum()


def test_unseeded_sampled_requests_are_drafted_and_seeded_ones_are_not(engine_model, tokenizer):
    # unseeded draws differ run to run: a temperature this low keeps the looping output (and its accepted
    # drafts) all but certain, while the requests still sample (speculative sampling's path)
    prompts = looping_prompts(tokenizer, 3)
    jobs = [(p, {"max_tokens": 48, "temperature": 0.05}) for p in prompts]
    outputs, _, stats = run(engine_model, jobs, True)
    assert stats["accepted_tokens"] > 0 and all(len(c[0].token_ids) > 0 for c in outputs)
    _, _, seeded = run(engine_model, [(p, {**kw, "seed": 5}) for p, kw in jobs], True)
    assert seeded["drafted_tokens"] == 0


# -- several samples, preemption and the HTTP server with drafts -----------------------------------------------------
GREEDY_OPTIONS = {"greedy": {}, "logprobs": {"logprobs": 2}, "penalties": {
    "repetition_penalty": 1.1, "presence_penalty": 0.1, "frequency_penalty": 0.05}, "ignore_eos": {"ignore_eos": True}}


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("option", GREEDY_OPTIONS)
def test_n_greedy_samples_equal_speculation_off(engine_model, tokenizer, option, n):
    """Samples end inside a verify step (a stop, max_tokens): each of the group's samples is exact."""
    prompts = looping_prompts(tokenizer, 2)
    text = engine_model.generate([prompts[0]], max_tokens=24)[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2] or "a"
    jobs = [(prompts[0], {"max_tokens": 40, "n": n, **GREEDY_OPTIONS[option]}),
            (prompts[1], {"max_tokens": 40, "n": n, "stop": (stop,), **GREEDY_OPTIONS[option]}),
            (prompts[0], {"max_tokens": 9, "n": n, **GREEDY_OPTIONS[option]})]
    drafted = 0
    for job in jobs:  # one group at a time: n samples are few enough to draft (SPECULATE_MAX_RUNNING)
        off, _, _ = run(engine_model, [job], False)
        on, _, stats = run(engine_model, [job], True)
        again, _, _ = run(engine_model, [job], True, clear=False)  # drafted from the tree: ends in a verify step
        assert isinstance(on[0], list) and len(on[0]) == n, on
        assert on == off and answers(again) == answers(off)
        assert all(s.token_ids == on[0][0].token_ids for s in on[0])  # greedy samples agree
        drafted += stats["drafted_tokens"]
    assert drafted > 0


@pytest.mark.parametrize("kw", [{"temperature": 0.05}, {"temperature": 0.05, "top_k": 5, "top_p": 0.9},
                                {"temperature": 0.7, "top_k": 8, "seed": 3}], ids=["unseeded", "filtered", "seeded"])
def test_n_sampled_samples_finish_with_drafts_and_seeded_ones_equal_speculation_off(engine_model, tokenizer, kw):
    jobs = [(p, {"max_tokens": 40, "n": 2, **kw}) for p in looping_prompts(tokenizer, 2)]
    on, _, stats = run(engine_model, jobs, True)
    again, _, _ = run(engine_model, jobs, True, clear=False)  # drafted from the tree: ends in a verify step
    assert all(isinstance(c, list) and len(c) == 2 for c in on + again), (on, again)
    assert all(0 < len(s.token_ids) <= 40 and s.finish_reason in ("stop", "length") for c in on + again for s in c)
    if "seed" in kw:  # same seed, same samples: never drafted
        assert stats["drafted_tokens"] == 0 and on == run(engine_model, jobs, False)[0]
    else:
        assert stats["accepted_tokens"] > 0


@pytest.mark.parametrize("n", [1, 2])
def test_preemption_with_drafts_equals_speculation_off(make_model, tokenizer, n):
    """A pool short enough to preempt, prompts that draft: outputs as without drafts, integrity after every step."""
    m = make_model(cache_tokens=200, background=False, max_batch_tokens=16)
    jobs = [(p, {"max_tokens": 48, "n": n}) for p in looping_prompts(tokenizer, 4)]
    preemptions = []
    runs = []
    for speculate, clear in ((False, True), (True, True), (True, False)):
        before = m.engine.stats()["preemptions"]
        outputs, _, stats = run(m, jobs, speculate, clear)
        preemptions.append(m.engine.stats()["preemptions"] - before)
        runs.append((outputs, stats["drafted_tokens"]))
    (off, _), (on, drafted), (again, _) = runs
    assert all(isinstance(c, list) and len(c) == n for c in on + again), (on, again)
    assert on == off and answers(again) == answers(off) and drafted > 0 and min(preemptions) > 0


def test_generate_and_stream_n_samples_with_drafts(tokenizer, make_model):
    """The Python API, background engine thread: `generate` and `stream` of n = 2 greedy samples with drafts."""
    import asyncio

    m = make_model()
    prompt = looping_prompts(tokenizer, 1)[0]
    m.engine.speculate = True
    on = m.generate([prompt], max_tokens=30, n=2)  # the samples of each prompt in turn
    drafted = m.stats()["drafted_tokens"]

    async def streamed():
        texts = {}
        async for chunk in m.stream(prompt, max_tokens=30, n=2):
            texts[chunk.sample] = texts.get(chunk.sample, "") + chunk.text
        return texts

    texts = asyncio.run(streamed())
    m.engine.speculate = False
    m.clear_cache()
    off = m.generate([prompt], max_tokens=30, n=2)
    assert drafted > 0 and [c.token_ids for c in on] == [c.token_ids for c in off]
    assert texts == {0: off[0].text, 1: off[1].text}


def test_http_n_samples_with_drafts_plain_and_streamed(served, tokenizer):
    """`n` = 2 and `best_of` = 2 over HTTP, greedy, on a prompt that drafts: 200 and the texts of speculation off."""
    import json

    import httpx

    url, model = served
    prompt = looping_prompts(tokenizer, 1, seed=5)[0]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0, "n": 2}

    def texts(**extra):
        r = httpx.post(url + "/v1/completions", json={**body, **extra}, timeout=120)
        assert r.status_code == 200, r.text
        return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]

    def streamed():
        got = ["", ""]
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    for c in event["choices"]:
                        got[c["index"]] += c["text"]
        return got

    try:
        model.engine.speculate = True
        before = model.stats()["drafted_tokens"]
        on = [texts(), texts(best_of=2), streamed()]
        drafted = model.stats()["drafted_tokens"] - before
        model.engine.speculate = False
        model.clear_cache()
        off = texts()
    finally:
        model.engine.speculate = True
    assert drafted > 0 and on == [off, off, off] and off[0] == off[1]


@pytest.mark.parametrize("decoder", ["argmax", "beam(n=2)", "sample(n=2, temperature=0.7)"])
def test_query_decoders_with_several_samples_equal_speculation_off(make_model, decoder):
    """A query run again is drafted from the tree (its holes end inside verify steps); seeded, so the sampled
    decoder's runs compare too."""
    import kvql

    m = make_model()
    query = f'{decoder}\n"Story: once upon a time [A] and so [B]" where len(TOKENS(A)) < 20 and len(TOKENS(B)) < 12'

    def values(speculate):
        m.engine.speculate = speculate
        m.clear_cache()
        before = m.stats()["drafted_tokens"]
        got = [kvql.run_sync(query, model=m, seed=3) for _ in range(2)]
        runs = [[r.prompt for r in g] if isinstance(g, list) else [g.prompt] for g in got]
        return runs, m.stats()["drafted_tokens"] - before

    (on, drafted), (off, _) = values(True), values(False)
    assert on == off and on[0] == on[1]
    assert (drafted > 0) == (decoder == "argmax")  # beam asks one token per request; seeded samples are not drafted


@pytest.mark.parametrize("name", ["qwen3_5", "lfm2", "jamba"])
def test_hybrids_rewind_their_states_past_rejected_drafts(tokenizer, name):
    """A model with recurrent layers on the ragged path keeps its state after each drafted token and goes back to
    the one after the last accepted token: with drafts of two right tokens and a wrong one at every step (stepped
    by kvql's steps or the model's own; batched and alone), greedy outputs equal transformers' generate."""
    import families as F
    import kvql

    hf = F.build(*F.FAMILIES[name], len(tokenizer), tokenizer.eos_token_id)
    m = kvql.Model(hf, tokenizer, cache_budget=8 << 20, background=False)
    try:
        assert m.engine.runner.mixers is not None and m.engine.speculate
        prompts = looping_prompts(tokenizer, 3)
        want = dict(zip(map(tuple, prompts), F.reference(*F.FAMILIES[name], tokenizer, prompts, 24)))

        def propose(req, limit):  # the next two tokens of the reference, then one it does not have
            from kvql.engine.decode.drafts import Draft

            req.draft = req.draft or Draft()
            n, ref = len(req.output_ids), want[tuple(req.prompt_ids)]
            return (ref[n:n + 2] + [(ref[n + 2] + 1) % len(tokenizer)])[:limit] if n + 2 < len(ref) else []

        m.engine.scheduler.drafter.propose = propose
        for jobs in ([(p, {}) for p in prompts], [(prompts[1], {})]):
            got, _, stats = run(m, jobs, True)
            assert [c[0].token_ids for c in got] == [want[tuple(p)] for p, _ in jobs]
            assert stats["accepted_tokens"] > 0 and stats["drafted_tokens"] > stats["accepted_tokens"]
    finally:
        m.close()
