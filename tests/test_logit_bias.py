"""Sampling as clients send it, against transformers' own logits processors on the same logits: `logit_bias`
(OpenAI's: added to the token's logit, -100 / 100 exact), `min_p`, the repetition penalty; the bias in Python,
over HTTP (the real `openai` client) and through the remote backend alike; a request's bias never reaches its
batch mates."""

from __future__ import annotations

import asyncio

import openai
import pytest
import torch
from transformers import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

import kvql
from kvql.backends.options import GenerateOptions
from kvql.engine.decode.sampler import _adjust, _min_p
from kvql.engine.request import Request, RequestGroup, SamplingParams

PROMPT = "Once upon a time"


def _request(tokenizer, prompt_ids, output_ids=(), **params) -> Request:
    req = Request(RequestGroup(list(prompt_ids), SamplingParams(max_tokens=4, **params), 0), 0, tokenizer, "cpu")
    req.output_ids.extend(output_ids)
    return req


@pytest.mark.parametrize("seed, whole", [(0, False), (1, False), (2, False), (3, False), (4, True)])
def test_bias_and_repetition_penalty_equal_transformers_processors_on_the_same_logits(tokenizer, seed, whole):
    """`whole`: a bias on every token of the vocabulary (built once per request: sampling adds one vector)."""
    g = torch.Generator().manual_seed(seed)
    row = torch.randn(len(tokenizer), generator=g) * 4
    prompt, output = torch.randint(0, len(tokenizer), (12,), generator=g).tolist(), [7, 9, 7]
    size = len(tokenizer) if whole else 6
    tokens = torch.randperm(len(tokenizer), generator=g)[:size]
    bias = {int(t): float(v) for t, v in zip(tokens, torch.empty(size).uniform_(-99, 99, generator=g))}
    ids = torch.tensor([prompt + output])
    for params in ({"logit_bias": tuple(bias.items())}, {"repetition_penalty": 1.3},
                   {"repetition_penalty": 1.3, "logit_bias": tuple(bias.items())}):
        want = row[None].clone()
        if "repetition_penalty" in params:  # kvql: penalties, then the bias
            want = RepetitionPenaltyLogitsProcessor(params["repetition_penalty"])(ids, want)
        if "logit_bias" in params:
            want = SequenceBiasLogitsProcessor({(t,): v for t, v in bias.items()})(ids, want)
        got = _adjust(row, _request(tokenizer, prompt, output, **params))
        assert torch.equal(got, want[0]), params


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5, 1.0])
def test_min_p_keeps_the_tokens_transformers_min_p_warper_keeps(min_p):
    row = torch.randn(1, 500, generator=torch.Generator().manual_seed(3)) * 3
    want = MinPLogitsWarper(min_p)(torch.zeros(1, 1, dtype=torch.long), row.clone())[0]
    assert torch.equal(torch.isinf(_min_p(row[0], min_p)), torch.isinf(want))


def test_logit_bias_is_checked_once_for_every_backend():
    assert GenerateOptions(logit_bias={"5": 3}).logit_bias == {5: 3.0}
    assert GenerateOptions(logit_bias={}).logit_bias is None
    for bias, words in [({"5": 150}, r"not a number in \[-100, 100\]"), ({"x": 1}, "not a token id"),
                        ({"5": float("nan")}, "not a number"), ({-1: 2}, "not a token id")]:
        with pytest.raises(ValueError, match=words):
            GenerateOptions(logit_bias=bias)
    with pytest.raises(TypeError, match="dict"):
        GenerateOptions(logit_bias=[1, 2])


def test_an_additive_bias_changes_greedy_tokens_as_transformers_generate_does(make_model, llama, tokenizer):
    """fp32 greedy: a bias against the model's first choice and for another token gives transformers' own
    `generate(sequence_bias=...)` tokens; an unbiased request submitted with it keeps its own greedy tokens."""
    m = make_model()  # the tiny Llama is float32
    ids, other = tokenizer.encode(PROMPT), tokenizer.encode("The dog")
    plain, alone = (c.token_ids for c in m.generate([ids, other], max_tokens=8, ignore_eos=True))
    bias = {plain[0]: -8.5, plain[2]: 3.25}
    want = llama.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                          sequence_bias={(t,): v for t, v in bias.items()}, pad_token_id=tokenizer.eos_token_id,
                          eos_token_id=tokenizer.eos_token_id)[0, len(ids):].tolist()
    m.clear_cache()

    async def both():
        return await asyncio.gather(m.agenerate([ids], max_tokens=8, ignore_eos=True, logit_bias=bias),
                                    m.agenerate([other], max_tokens=8, ignore_eos=True))

    (biased,), (mate,) = asyncio.run(both())
    assert biased.token_ids == want and want != plain
    assert mate.token_ids == alone


def test_logit_bias_over_http_and_through_the_remote_backend(served, client):
    """The `openai` client's `logit_bias` with values between the absolute ones changes the output as in Python;
    the remote backend sends it and a kvql server applies it."""
    url, model = served
    ids = model.tokenizer.encode(PROMPT)
    plain = model.generate([ids], max_tokens=6, ignore_eos=True)[0].token_ids
    bias = {str(plain[0]): -30.5, str(plain[1]): 12.0}
    local = model.generate([ids], max_tokens=6, ignore_eos=True, logit_bias=bias)[0].token_ids
    assert local != plain
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logit_bias=bias,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    assert r.choices[0].model_extra["token_ids"] == local
    remote = kvql.model(url + "/v1", tokenizer=model.tokenizer)
    assert remote.generate([ids], max_tokens=6, ignore_eos=True, logit_bias=bias)[0].token_ids == local
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=PROMPT, logit_bias={str(plain[0]): -101})
    assert e.value.body["param"] == "logit_bias" and "-101" in e.value.body["message"]
