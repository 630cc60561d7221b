"""`min_p` end to end, and the one option set it was added to (`kvql.backends.options.GenerateOptions`):
checked once for every backend, sampled exactly as vLLM means it, taken over HTTP (the real `openai` client),
sent by the remote backend; and every option accounted for in each translation (the engine's parameters, a
remote request body, the HTTP fields), so a new option cannot be silently left out of one."""

from __future__ import annotations

import dataclasses
import json
import math

import httpx
import openai
import pytest
import torch
from hostile_server import Hostile, answer, completion
from starlette.requests import Request as HttpRequest

import kvql
from kvql.backends.base import Unsupported
from kvql.backends.local import LocalBackend, request_spec
from kvql.backends.options import GenerateOptions, Sent
from kvql.engine.decode.sampler import sample
from kvql.engine.request import Request, RequestGroup, SamplingParams
from kvql.server.protocol import ChatRequest, CompletionRequest, parse_request
from kvql.server.served import Served

PROMPT = "Once upon a time"
PYTHON_ONLY = {"stop_fn", "masked_logprobs", "grammar_prefix", "heal"}  # no HTTP field can give these


# -- one place checks it -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [-0.1, 1.5, math.nan, math.inf])
def test_min_p_outside_0_1_is_refused_in_python_naming_it(make_model, value):
    with pytest.raises(ValueError, match=r"min_p must be in \[0, 1\]"):
        GenerateOptions(min_p=value)
    m = make_model()
    with pytest.raises(ValueError, match="min_p"):
        m.generate([PROMPT], max_tokens=4, temperature=1.0, min_p=value)
    assert m.stats()["prompt_tokens"] == 0  # refused before anything was queued


def test_min_p_outside_0_1_is_refused_by_the_remote_backend_before_sending():
    with Hostile() as h:
        h.routes["/v1/completions"] = answer(completion())
        m = kvql.model(h.url + "/v1", tokenizer=False)
        with pytest.raises(ValueError, match="min_p"):
            m.generate([PROMPT], max_tokens=2, temperature=1.0, min_p=2)
        assert [path for path, _ in h.requests if path == "/v1/completions"] == []


# -- the sampler -------------------------------------------------------------------------------------------------
def draws(tokenizer, row: torch.Tensor, count: int = 300, **params) -> set[int]:
    """The tokens `sample` draws from `row` over `count` seeds."""
    out = set()
    for seed in range(count):
        group = RequestGroup([1, 2, 3], SamplingParams(max_tokens=4, seed=seed, **params), 0)
        out.add(sample(row, Request(group, 0, tokenizer, "cpu"))[0])
    return out


def test_min_p_removes_exactly_the_tokens_below_min_p_times_the_top_probability(tokenizer):
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    row = probs.log()
    assert draws(tokenizer, row, temperature=1.0) == {0, 1, 2, 3, 4}
    assert draws(tokenizer, row, temperature=1.0, min_p=0.3) == {0, 1, 2}  # 0.1 < 0.3 * 0.4 <= 0.15
    assert draws(tokenizer, row, temperature=1.0, min_p=0.2) == {0, 1, 2, 3}  # 0.1 >= 0.08: kept
    # after temperature: at t=2 the probabilities go as sqrt(p), 0.1 -> sqrt(0.25) = 0.5 of the top one's
    assert draws(tokenizer, row, temperature=2.0, min_p=0.45) == {0, 1, 2, 3}
    assert draws(tokenizer, row, temperature=2.0, min_p=0.55) == {0, 1, 2}


def test_min_p_comes_before_top_p_as_in_vllm(tokenizer):
    row = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]).log()
    # min-p keeps 0.4, 0.3, 0.15 (renormalized: 0.47, 0.35, 0.18); top_p=0.8 then stops after the first two.
    # (top-p first, on the whole row, would keep three: 0.4 + 0.3 < 0.8)
    assert draws(tokenizer, row, temperature=1.0, top_p=0.8) == {0, 1, 2}
    assert draws(tokenizer, row, temperature=1.0, min_p=0.3, top_p=0.8) == {0, 1}


def test_min_p_1_samples_exactly_the_greedy_tokens(make_model):
    m = make_model()
    greedy = m.generate([PROMPT], max_tokens=24, temperature=0, ignore_eos=True)[0].token_ids
    hot = [m.generate([PROMPT], max_tokens=24, temperature=3.0, seed=s, ignore_eos=True)[0].token_ids
           for s in range(3)]
    assert any(ids != greedy for ids in hot)  # sampling at t=3 leaves the greedy path...
    for seed in (0, 1, 2, None):  # ...min_p=1 keeps only the most likely token (unseeded: drafted too)
        c = m.generate([PROMPT], max_tokens=24, temperature=3.0, min_p=1.0, seed=seed, ignore_eos=True)[0]
        assert c.token_ids == greedy


# -- over HTTP and through the remote backend ----------------------------------------------------------------
def test_min_p_over_http_with_the_openai_client(served, client):
    greedy = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    for seed in (1, 2):
        r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=3.0, seed=seed,
                                      extra_body={"min_p": 1.0})
        assert r.choices[0].text == greedy
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                          temperature=2.0, extra_body={"min_p": 0.5})
    assert chat.choices[0].finish_reason in ("stop", "length")
    for value in (1.5, -0.5):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", prompt=PROMPT, temperature=1.0, extra_body={"min_p": value})
        assert e.value.status_code == 400 and e.value.body["param"] == "min_p"


def test_the_remote_backend_sends_min_p_and_a_kvql_server_applies_it(served, tokenizer):
    url, model = served
    remote = kvql.model(url + "/v1", tokenizer=model.tokenizer)
    ids = model.tokenizer.encode(PROMPT)
    greedy = model.generate([ids], max_tokens=10, temperature=0, ignore_eos=True)[0].token_ids
    (c,) = remote.generate([ids], max_tokens=10, temperature=3.0, min_p=1.0, seed=5, ignore_eos=True)
    assert c.token_ids == greedy


def test_the_remote_backend_puts_min_p_in_its_body_only_when_set_and_only_where_it_is_taken():
    with Hostile() as h:  # a vLLM server by default
        h.routes["/v1/completions"] = answer(completion())
        m = kvql.model(h.url + "/v1", tokenizer=False)
        m.generate([PROMPT], max_tokens=2, temperature=1.0, min_p=0.25)
        m.generate([PROMPT], max_tokens=2, temperature=1.0)
        first, second = [body for path, body in h.requests if path == "/v1/completions"]
        assert first["min_p"] == 0.25 and "min_p" not in second
        del h.routes["/version"]  # now an OpenAI-style server: no min_p there
        plain = kvql.model(h.url + "/v1", tokenizer=False)
        with pytest.raises(Unsupported, match="the min_p option is not available on the openai server"):
            plain.generate([PROMPT], max_tokens=2, temperature=1.0, min_p=0.25)


# -- every option is accounted for in each translation ---------------------------------------------------------
NON_DEFAULT = {"max_tokens": 3, "min_tokens": 1, "stop": ("zz",), "temperature": 0.5, "top_p": 0.9, "top_k": 4,
               "min_p": 0.1, "repetition_penalty": 1.1, "frequency_penalty": 0.2, "presence_penalty": 0.3, "n": 2,
               "seed": 7, "logprobs": 2, "masked_logprobs": True, "ignore_eos": True, "cache_salt": "tenant", "logit_bias": {"5": 2.5}}


def test_every_option_has_a_rule_for_each_place():
    for f in dataclasses.fields(GenerateOptions):
        assert set(f.metadata) == {"engine", "remote", "http"}, f"{f.name}: declare it with option(...)"
        assert f.metadata["engine"] is True or (isinstance(f.metadata["engine"], str) and f.metadata["engine"])
        rule = f.metadata["remote"]
        assert (isinstance(rule, Sent) and rule.needs in (None, *LocalBackend.capabilities)) or (isinstance(rule, str) and rule)


def test_every_engine_option_reaches_the_engines_parameters():
    engine = {f.name for f in dataclasses.fields(SamplingParams)}
    same = [name for name, rule in GenerateOptions.rules("engine").items() if rule is True]
    assert set(same) <= engine, set(same) - engine
    assert set(same) <= set(NON_DEFAULT), "give the new option a non-default value in NON_DEFAULT"
    params = SamplingParams(**request_spec(GenerateOptions(**{k: NON_DEFAULT[k] for k in same})).params)
    assert {k: getattr(params, k) for k in same} == {k: NON_DEFAULT[k] for k in same}


def test_every_remote_option_reaches_the_request_body():
    rules = GenerateOptions.rules("remote")
    sent = [name for name, rule in rules.items() if isinstance(rule, Sent)]
    assert set(sent) <= set(NON_DEFAULT), "give the new option a non-default value in NON_DEFAULT"
    values = {k: NON_DEFAULT[k] for k in sent} | {"n": 1}  # the test server answers one choice
    with Hostile() as h:
        h.routes["/v1/completions"] = answer(completion())
        m = kvql.model(h.url + "/v1", tokenizer=False)
        m.generate([PROMPT], **values)
        m.generate([PROMPT])
        given, plain = [body for path, body in h.requests if path == "/v1/completions"]
    assert {k: given.get(k) for k in sent} == {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
    assert {k for k in sent if k in plain} == {k for k in sent if rules[k].always}  # defaults are not sent


def test_every_http_option_is_a_request_field_or_python_only(served):
    both = set(CompletionRequest.model_fields) & set(ChatRequest.model_fields)
    either = set(CompletionRequest.model_fields) | set(ChatRequest.model_fields)
    rules = GenerateOptions.rules("http")
    assert {name for name, rule in rules.items() if rule is None} == PYTHON_ONLY
    for name, rule in rules.items():
        if rule is True:
            assert name in both, f"{name}: add it to kvql.server.protocol._Common"
        elif rule is not None:
            assert rule and set(rule) <= either, f"{name}: read from {rule}"
    for name in PYTHON_ONLY:  # refused by name, never silently ignored
        r = httpx.post(served[0] + "/v1/completions", json={"prompt": PROMPT, name: 1}, timeout=60)
        assert r.status_code == 400 and name in r.json()["error"]["message"], name


def test_every_copied_http_field_reaches_the_models_options(served):
    url, model = served
    copied = [name for name, rule in GenerateOptions.rules("http").items() if rule is True]
    assert set(copied) <= set(NON_DEFAULT), "give the new option a non-default value in NON_DEFAULT"
    body = {"prompt": PROMPT, **{k: list(v) if isinstance(v, tuple) else v for k, v in NON_DEFAULT.items()
                                 if k in copied}}
    req = parse_request(json.dumps(body).encode(), CompletionRequest)
    s = Served(model, "tiny", (), {"requests": 0, "errors": 0}, salt_per_key=False, max_body_bytes=1 << 20,
               max_tokens_cap=64)
    opts = s.options(HttpRequest({"type": "http", "headers": []}), req, None)
    assert {k: opts[k] for k in copied} == {k: body[k] for k in copied}
    assert GenerateOptions.read(opts)[0].min_p == NON_DEFAULT["min_p"]
