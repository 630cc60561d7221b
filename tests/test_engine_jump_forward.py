"""Jump-forward decoding: tokens a constraint forces are appended at once and computed as one chunk.

Every test runs the same requests with `engine.jump_forward` on and off and asserts the same
completions (token ids, text, finish reason, logprobs), fewer steps when something was forced, the
forced-token counts, and `check_integrity` after every step."""

from __future__ import annotations

import json
import math

import pytest

from conftest import random_prompts
from kvql.engine.decode.grammar import Grammar
from kvql.engine.request import SamplingParams, State

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"}}}
CHOICES = ["the quick brown fox jumps over the lazy dog", "the quick brown fox sleeps under a tree",
           "a little robot counts tokens"]
LARK = 'start: "Question: " WORD "? Answer: " WORD "."\nWORD: /[a-z]{1,5}/'
FIXED = 'start: "kvql serves every shared prefix from a radix tree of cached keys and values."'


def constraints(tokenizer):
    return {"json": Grammar.json_schema(tokenizer, SCHEMA), "choices": Grammar.choices(tokenizer, CHOICES),
            "lark": Grammar.lark(tokenizer, LARK), "fixed": Grammar.lark(tokenizer, FIXED)}


def prompts(tokenizer, seed, count):
    return random_prompts(seed=seed, count=count, vocab=len(tokenizer), prefix_lengths=(0, 9), suffix=(4, 10))


def run(m, jobs, jump: bool):
    """Submit `jobs` [(prompt, grammar or mask factory, params kw)] with jump-forward `jump`, step until
    idle checking integrity after every step; -> (groups, steps, stats)."""
    m.engine.jump_forward = jump
    m.clear_cache()
    before = m.stats()
    groups = []
    for prompt, constraint, kw in jobs:
        mask = constraint.mask_fn() if isinstance(constraint, Grammar) else constraint()
        params = SamplingParams(**{"max_tokens": 64, "mask": mask, **kw})
        groups.append(m.engine.submit(prompt, params))
    for _ in range(2000):
        m.engine.step()
        m.check_integrity()
        if m.engine.idle():
            break
    assert m.engine.idle()
    after = m.stats()
    assert after["locked_nodes"] == 0
    return groups, after["steps"] - before["steps"], {k: after[k] - before[k] for k in ("forced_tokens",
                                                                                        "forward_tokens")}


def same_completion(a, b, logprob_tol=1e-4):
    assert a.token_ids == b.token_ids and a.text == b.text
    assert a.finish_reason == b.finish_reason and a.stop_reason == b.stop_reason
    assert (a.logprobs is None) == (b.logprobs is None)
    if a.logprobs is not None:
        assert len(a.logprobs) == len(b.logprobs) == len(a.token_ids)
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.token_id == y.token_id
            assert x.logprob == pytest.approx(y.logprob, abs=logprob_tol) or x.logprob == y.logprob == -math.inf
            xs, ys = sorted(x.top.values()), sorted(y.top.values())
            assert len(xs) == len(ys)
            assert all(u == v or u == pytest.approx(v, abs=logprob_tol) for u, v in zip(xs, ys))


def on_and_off(make_model, jobs, **model_kw):
    m = make_model(background=False, **model_kw)
    off, steps_off, stats_off = run(m, jobs, jump=False)
    on, steps_on, stats_on = run(m, jobs, jump=True)
    assert stats_off["forced_tokens"] == 0
    for g_on, g_off in zip(on, off):
        assert g_on.future.exception() is None and g_off.future.exception() is None
        for a, b in zip(g_on.future.result(), g_off.future.result()):
            same_completion(a, b)
    return on, off, steps_on, steps_off, stats_on


def mixed_jobs(tokenizer, prompt_seed, **kw):
    c = constraints(tokenizer)
    ps = prompts(tokenizer, prompt_seed, 8)
    kinds = ["json", "choices", "lark", "fixed", "json", "choices", "lark", "json"]
    return [(p, c[k], kw) for p, k in zip(ps, kinds)]


def test_greedy_outputs_are_the_same_with_and_without_jump_forward(make_model, tokenizer):
    on, _, steps_on, steps_off, stats = on_and_off(make_model, mixed_jobs(tokenizer, 1))
    for g in on:
        for c in g.future.result():
            assert c.finish_reason == "stop"  # every constraint ran to its end
    json.loads(on[0].future.result()[0].text)
    assert on[1].future.result()[0].text in CHOICES
    assert stats["forced_tokens"] > 30
    assert steps_on < steps_off


def test_seeded_sampling_draws_the_same_tokens_with_and_without_jump_forward(make_model, tokenizer):
    jobs = mixed_jobs(tokenizer, 2, temperature=1.3, top_p=0.95, seed=7, n=2)
    on, _, steps_on, steps_off, stats = on_and_off(make_model, jobs)
    samples = [c.token_ids for g in on for c in g.future.result()]
    assert len(samples) == 16 and stats["forced_tokens"] > 30 and steps_on < steps_off
    assert any(a != b for a, b in zip(samples[::2], samples[1::2]))  # the draws did differ between samples


@pytest.mark.parametrize("masked", [False, True])
def test_forced_tokens_get_the_logprobs_their_forward_computes(make_model, tokenizer, masked):
    jobs = mixed_jobs(tokenizer, 3, logprobs=3, masked_logprobs=masked, repetition_penalty=1.2)
    on, _, steps_on, steps_off, stats = on_and_off(make_model, jobs)
    assert stats["forced_tokens"] > 30 and steps_on < steps_off
    fixed = on[3].requests[0]
    assert fixed.forced_tokens == len(fixed.output_ids) - 1  # all but the first token, sampled from the prompt
    assert fixed.forced_at == list(range(1, len(fixed.output_ids)))
    if masked:  # a forced token is the only one allowed: probability 1
        assert all(e.logprob == 0.0 for e in on[3].future.result()[0].logprobs)
    else:
        assert all(e.logprob < 0 for e in on[3].future.result()[0].logprobs)


def test_a_fully_forced_output_takes_no_decode_step(make_model, tokenizer):
    (p,) = prompts(tokenizer, 4, 1)
    on, _, steps_on, steps_off, stats = on_and_off(make_model, [(p, Grammar.lark(tokenizer, FIXED), {})])
    (c,) = on[0].future.result()
    assert c.text == "kvql serves every shared prefix from a radix tree of cached keys and values."
    assert c.finish_reason == "stop"
    assert steps_on == 1 and steps_off == len(c.token_ids) + 1
    # all but the first token, sampled from the prompt's logits; the forced EOS counts too
    assert on[0].requests[0].forced_tokens == stats["forced_tokens"] == len(c.token_ids)
    assert on[0].requests[0].forced_at == list(range(1, len(c.token_ids)))
    assert stats["forward_tokens"] == len(p)


@pytest.mark.parametrize("logprobs", [None, 0])
def test_max_tokens_stop_strings_and_stop_fn_cut_a_forced_run_where_they_would_without_it(
        make_model, tokenizer, logprobs):
    c = constraints(tokenizer)
    ps = prompts(tokenizer, 5, 5)

    def space(ids, text):
        return " " in text

    jobs = [(ps[0], c["fixed"], {"max_tokens": 4}),
            (ps[1], c["fixed"], {"stop": ("radix",)}),
            (ps[2], c["choices"], {"stop_fn": space}),
            (ps[3], c["json"], {"max_tokens": 3}),
            (ps[4], c["fixed"], {"stop": ("every",), "n": 2, "temperature": 1.0, "seed": 3})]
    jobs = [(p, g, {**kw, "logprobs": logprobs}) for p, g, kw in jobs]
    on, _, _, _, stats = on_and_off(make_model, jobs)
    first = [g.future.result()[0] for g in on]
    assert first[0].finish_reason == "length" and len(first[0].token_ids) == 4
    assert first[1].finish_reason == "stop" and first[1].stop_reason == "radix" and "radix" not in first[1].text
    assert first[2].finish_reason == "stop" and first[2].text.count(" ") == 1 and first[2].text not in CHOICES
    assert first[3].finish_reason == "length" and len(first[3].token_ids) == 3
    assert all(c.stop_reason == "every" for c in on[4].future.result())
    assert stats["forced_tokens"] > 10


def test_forks_of_n_samples_each_jump_forward(make_model, tokenizer):
    c = constraints(tokenizer)
    (p,) = prompts(tokenizer, 6, 1)
    on, _, steps_on, steps_off, _ = on_and_off(make_model, [(p, c["choices"], {"n": 4, "temperature": 2.0,
                                                                               "seed": 11})])
    completions = on[0].future.result()
    assert len(completions) == 4 and all(x.text in CHOICES for x in completions)
    assert all(r.forced_tokens > 0 for r in on[0].requests) and steps_on < steps_off


def test_forced_runs_survive_preemption_unchanged(make_model, tokenizer):
    c = constraints(tokenizer)
    ps = prompts(tokenizer, 7, 10)
    jobs = [(p, c["fixed" if i % 2 else "json"], {"logprobs": 1 if i % 3 else None}) for i, p in enumerate(ps)]
    m = make_model(background=False, cache_tokens=160)
    off, _, _ = run(m, jobs, jump=False)
    on, _, stats = run(m, jobs, jump=True)
    assert m.stats()["preemptions"] > 0 and stats["forced_tokens"] > 0
    for g_on, g_off in zip(on, off):
        same_completion(g_on.future.result()[0], g_off.future.result()[0])


class RaisingAfter:
    """A mask that opts in to jump-forward, forces a fixed run, and raises at history length `n`."""

    jump_forward = True

    def __init__(self, forced: list[int], n: int, vocab: int):
        self.forced, self.n, self.vocab = forced, n, vocab

    def __call__(self, ids):
        if len(ids) >= self.n:
            raise RuntimeError("constraint bug")
        import torch
        allowed = torch.zeros(self.vocab, dtype=torch.bool)
        allowed[self.forced[len(ids)]] = True
        return allowed


def test_a_mask_raising_inside_a_forced_run_fails_its_request_alone(make_model, tokenizer):
    c = constraints(tokenizer)
    ps = prompts(tokenizer, 8, 3)
    forced = tokenizer.encode(" quick brown fox jumps over the lazy dog")
    bad = (ps[0], lambda: RaisingAfter(forced, 5, len(tokenizer)), {})
    bad_pending = (ps[1], lambda: RaisingAfter(forced, 6, len(tokenizer)), {"logprobs": 0})
    bystander = (ps[2], c["json"], {})
    m = make_model(background=False)
    (solo,), _, _ = run(m, [bystander], jump=False)
    groups, _, _ = run(m, [bad, bad_pending, bystander], jump=True)
    for g in groups[:2]:
        with pytest.raises(RuntimeError, match="constraint bug"):
            g.future.result()
        assert g.requests[0].state is State.FAILED
    same_completion(groups[2].future.result()[0], solo.future.result()[0])
    assert groups[2].requests[0].forced_tokens > 0


def test_masks_without_the_opt_in_are_asked_only_when_their_logits_exist(make_model, tokenizer):
    forced = tokenizer.encode(" quick brown fox jumps over the lazy dog")

    class Plain(RaisingAfter):
        jump_forward = False

    (p,) = prompts(tokenizer, 9, 1)
    m = make_model(background=False)
    (g,), steps, stats = run(m, [(p, lambda: Plain(forced, 99, len(tokenizer)), {"max_tokens": 6})], jump=True)
    assert g.future.result()[0].token_ids == forced[:6]
    assert stats["forced_tokens"] == 0 and g.requests[0].forced_tokens == 0 and steps == 6


def test_turning_jump_forward_off_computes_one_token_per_decode_step(make_model, tokenizer):
    (p,) = prompts(tokenizer, 10, 1)
    m = make_model(background=False)
    (g,), steps, stats = run(m, [(p, Grammar.lark(tokenizer, FIXED), {})], jump=False)
    n = len(g.future.result()[0].token_ids)
    assert stats["forced_tokens"] == 0 and steps == n + 1 and stats["forward_tokens"] == len(p) + n
