"""Fields the `openai` client, LangChain and LiteLLM send by default, with their standard meaning; /metrics
via prometheus_client with histograms; the access log. A real server on loopback, the real `openai` client
and raw payloads written out as langchain-openai sends them."""

from __future__ import annotations

import copy
import json
import logging

import httpx
import openai
import pytest

import kvql
from kvql.server.app import create_app
from conftest import CHAT_TEMPLATE, serving

PROMPT = "Once upon a time"
USER = [{"role": "user", "content": "Question: what is the capital of France?"}]


def post(served, body, path="/v1/chat/completions"):
    return httpx.post(served[0] + path, json=body, timeout=60)


def events(served, body, path="/v1/chat/completions"):
    with httpx.stream("POST", served[0] + path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(e) for e in lines[:-1]]


def greedy_ids(model, ids, n=8, **kw):
    return model.generate([ids], max_tokens=n, temperature=0, **kw)[0].token_ids


def greedy_text(model, ids, n=8, **kw):
    return model.generate([ids], max_tokens=n, temperature=0, **kw)[0].text


def chat_ids(model, messages=USER):
    return model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


# -- what LangChain sends ------------------------------------------------------------------------

# langchain-openai's ChatOpenAI (defaults: temperature 0.7, n 1; streaming adds stream_options with
# include_usage, its stream_usage default), and its completion-model OpenAI class (BaseOpenAI._default_params)
LANGCHAIN_CHAT = {"model": "tiny", "messages": USER, "stream": False, "n": 1, "temperature": 0.7}
LANGCHAIN_CHAT_STREAM = {"model": "tiny", "messages": USER, "stream": True, "n": 1, "temperature": 0.7,
                         "stream_options": {"include_usage": True}}
LANGCHAIN_COMPLETION = {"model": "tiny", "prompt": [PROMPT], "temperature": 0.7, "top_p": 1, "frequency_penalty": 0,
                        "presence_penalty": 0, "n": 1, "logit_bias": {}, "max_tokens": 16, "seed": None,
                        "logprobs": None}
# every field of the issue at once, with the values clients send when the user sets nothing
ALL_FIELDS = {"model": "tiny", "messages": USER, "temperature": 0, "frequency_penalty": 0, "presence_penalty": 0,
              "top_k": -1, "min_p": 0, "logit_bias": {}, "user": "someone", "max_completion_tokens": 8,
              "stream": False}


def test_langchain_chat_payload_is_answered(served):
    r = post(served, LANGCHAIN_CHAT)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
    # no max_tokens: a chat runs to its end, here the server's cap of 64 (it was cut at 16: issue 26)
    tokens, finish = body["usage"]["completion_tokens"], body["choices"][0]["finish_reason"]
    assert (finish, tokens) == ("length", 64) or (finish == "stop" and 1 <= tokens <= 64)
    assert body["usage"]["prompt_tokens"] == len(chat_ids(served[1]))


def test_a_chat_without_max_tokens_runs_past_16_tokens_and_a_completion_stops_at_16(served):
    chat = post(served, {"messages": USER, "temperature": 0, "ignore_eos": True}).json()
    assert chat["usage"]["completion_tokens"] == 64 and chat["choices"][0]["finish_reason"] == "length"
    text = post(served, {"prompt": PROMPT, "temperature": 0, "ignore_eos": True}, "/v1/completions").json()
    assert text["usage"]["completion_tokens"] == 16  # OpenAI's and vLLM's completion default


def test_a_chat_default_is_the_rest_of_the_context_when_that_is_under_the_cap(tokenizer, llama):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = CHAT_TEMPLATE
    model = kvql.Model(llama, tok, name="tiny", cache_budget=4 << 20)
    prompt = len(chat_ids(model))
    with serving(create_app(model, max_tokens_cap=4096)) as url:
        r = httpx.post(url + "/v1/chat/completions", json={"messages": USER, "temperature": 0, "ignore_eos": True},
                       timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == model.context_length - prompt
    model.close()


def test_langchain_streaming_payload_ends_with_the_usage_chunk(served):
    got = events(served, LANGCHAIN_CHAT_STREAM)
    *chunks, last = got
    assert last["choices"] == [] and last["object"] == "chat.completion.chunk"
    assert all(c["usage"] is None and len(c["choices"]) == 1 for c in chunks)
    usage = last["usage"]
    prompt = len(chat_ids(served[1]))
    assert usage["prompt_tokens"] == prompt and usage["total_tokens"] == prompt + usage["completion_tokens"]
    assert 1 <= usage["completion_tokens"] <= 64  # the default: the rest of the context, within the cap
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_langchain_completion_payload_is_answered(served):
    r = post(served, LANGCHAIN_COMPLETION, "/v1/completions")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_every_default_field_at_once_raw_and_through_the_openai_client(served, client):
    raw = post(served, ALL_FIELDS).json()
    want = greedy_text(served[1], chat_ids(served[1]), 8)
    assert raw["choices"][0]["message"]["content"] == want
    fields = {k: v for k, v in ALL_FIELDS.items() if k not in ("messages", "model", "top_k", "min_p")}
    r = client.chat.completions.create(model="tiny", messages=USER, **fields,
                                       extra_body={"top_k": -1, "min_p": 0})
    assert r.choices[0].message.content == want and r.usage.completion_tokens <= 8


# -- each field's meaning ------------------------------------------------------------------------

def test_max_completion_tokens_is_max_tokens(served, client):
    r = client.chat.completions.create(model="tiny", messages=USER, max_completion_tokens=3, temperature=0)
    assert r.usage.completion_tokens <= 3
    assert r.choices[0].message.content == greedy_text(served[1], chat_ids(served[1]), 3)
    assert post(served, {"messages": USER, "max_completion_tokens": 65}).status_code == 400  # the cap holds


def test_include_usage_through_the_openai_client(client):
    for create in (lambda **kw: client.chat.completions.create(messages=USER, **kw),
                   lambda **kw: client.completions.create(prompt=PROMPT, **kw)):
        chunks = list(create(model="tiny", max_tokens=5, temperature=0, stream=True,
                             stream_options={"include_usage": True}))
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
        assert all(c.usage is None for c in chunks[:-1])
        plain = list(create(model="tiny", max_tokens=5, temperature=0, stream=True))
        assert all(c.choices for c in plain)  # without include_usage: no usage chunk


def test_stream_options_without_stream_is_a_400(served):
    r = post(served, {"messages": USER, "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


def test_frequency_and_presence_penalties_change_greedy_output(served, client):
    model = served[1]
    ids = model.tokenizer.encode(PROMPT)
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
    for field in ("frequency_penalty", "presence_penalty"):
        r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, **{field: 2.0})
        want = greedy_text(model, ids, 24, **{field: 2.0})
        assert r.choices[0].text == want and want != plain.choices[0].text
        zero = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, **{field: 0})
        assert zero.choices[0].text == plain.choices[0].text  # 0: off


def test_top_k_one_is_greedy_whatever_the_temperature(client):
    greedy = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    for seed in (1, 2, 3):
        r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=1.5, seed=seed,
                                      extra_body={"top_k": 1})
        assert r.choices[0].text == greedy


def test_min_p_is_taken_with_greedy_and_when_sampling(served, client):
    greedy = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"min_p": 0.3})
    assert r.choices[0].text == greedy  # min-p always keeps the most likely token
    assert post(served, {"messages": USER, "min_p": 0.0, "temperature": 1.0}).status_code == 200
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, extra_body={"min_p": 1.0})
    assert r.choices[0].text == greedy  # sampling among the tokens as likely as the top one (tests/test_min_p.py)


def test_logit_bias_bans_and_restricts_tokens(served, client):
    model = served[1]
    ids = model.tokenizer.encode(PROMPT)
    greedy = greedy_ids(model, ids, 6)
    banned = greedy[0]
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                  logit_bias={str(banned): -100}, extra_body={"return_token_ids": True})
    token_ids = r.choices[0].model_extra["token_ids"]
    assert banned not in token_ids and token_ids != greedy
    only = [5, 17, 42]
    for seed in range(3):
        r = post(served, {"prompt": PROMPT, "max_tokens": 10, "temperature": 1.0, "seed": seed, "ignore_eos": True,
                          "logit_bias": {str(t): 100 for t in only}, "return_token_ids": True}, "/v1/completions")
        assert set(r.json()["choices"][0]["token_ids"]) <= set(only)
    # with a constraint: both hold
    r = post(served, {"messages": USER, "max_tokens": 8, "temperature": 0, "logit_bias": {str(banned): -100},
                      "structured_outputs": {"choice": ["Paris", "Rome"]}})
    assert r.json()["choices"][0]["message"]["content"] in ("Paris", "Rome")


@pytest.mark.parametrize("bias, words", [
    ({"5": 150}, ["150", "-100", "100"]),
    ({"not-a-token": -100}, ["not-a-token", "token id"]),
    ({"99999": -100}, ["99999"]),
])
def test_logit_bias_keys_and_values_out_of_range_are_a_400_naming_it(served, client, bias, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=USER, logit_bias=bias)
    assert e.value.body["param"] == "logit_bias" and all(w in e.value.body["message"] for w in words)


def test_user_is_accepted_and_changes_nothing(client):
    a = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, user="alice")
    b = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0)
    assert a.choices[0].text == b.choices[0].text


@pytest.mark.parametrize("field, value, spelling", [
    ("guided_regex", "[0-9]+", "structured_outputs.regex"),
    ("guided_json", {"type": "object"}, "structured_outputs.json"),
    ("guided_choice", ["a", "b"], "structured_outputs.choice"),
    ("guided_grammar", "start: \"a\"", "structured_outputs.grammar"),
])
def test_old_constraint_fields_are_a_400_naming_the_supported_spelling(served, client, field, value, spelling):
    r = post(served, {"messages": USER, field: value})
    assert r.status_code == 400
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == field
    assert spelling in error["message"] and field in error["message"]
    with pytest.raises(openai.BadRequestError, match=spelling.replace(".", r"\.")):
        client.completions.create(model="tiny", prompt=PROMPT, extra_body={field: value})


def test_wrong_types_are_openai_errors_not_pydantic_dumps(served):
    for body in ({"messages": USER, "stream_options": {"include_usage": "maybe"}},
                 {"messages": USER, "logit_bias": [1, 2]}, {"messages": USER, "min_p": 2},
                 {"messages": USER, "stream": True, "stream_options": {"include_usage": True, "x": 1}}):
        r = post(served, body)
        assert r.status_code == 400, body
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert "pydantic" not in error["message"] and "\n" not in error["message"]
        assert error["param"].split(".")[0] in body


# -- /metrics and the access log -----------------------------------------------------------------

def test_metrics_have_help_type_counters_and_histograms(served, client):
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
    list(client.chat.completions.create(model="tiny", messages=USER, max_tokens=4, stream=True))
    text = httpx.get(served[0] + "/metrics").text
    for name in ("kvql_prompt_tokens_total", "kvql_cached_tokens_total", "kvql_generated_tokens_total",
                 "kvql_requests_total"):
        assert f"\n{name} " in text
    assert "# HELP kvql_prompt_tokens_total" in text and "# TYPE kvql_prompt_tokens_total counter" in text
    assert "# TYPE kvql_cache_hit_rate gauge" in text
    for hist in ("kvql_time_to_first_token_seconds", "kvql_e2e_request_latency_seconds",
                 "kvql_request_queue_time_seconds"):
        assert f"# TYPE {hist} histogram" in text
        count = next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"{hist}_count "))
        assert count >= 2
        inf = next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(f'{hist}_bucket{{le="+Inf"}}'))
        assert inf == count
    ttft = next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("kvql_time_to_first_token_seconds_sum"))
    e2e = next(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("kvql_e2e_request_latency_seconds_sum"))
    assert 0 < ttft <= e2e


def test_each_app_has_its_own_registry(tokenizer, llama, served):
    model = kvql.Model(llama, tokenizer, name="other", cache_budget=1 << 20)
    with serving(create_app(model)) as url:
        text = httpx.get(url + "/metrics").text
        assert "\nkvql_requests_total 0.0" in text and "kvql_time_to_first_token_seconds_count 0.0" in text
    model.close()


def test_access_log_has_one_line_per_request_with_tokens(served, client, caplog):
    with caplog.at_level(logging.INFO, logger="kvql.access"):
        prompt = "kvql serves every shared prefix from a radix tree"
        client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
        client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
        post(served, {"messages": USER, "guided_regex": "x"})
    lines = [r.getMessage() for r in caplog.records if r.name == "kvql.access"]
    assert len(lines) == 3
    n = len(served[1].tokenizer.encode(prompt))
    assert lines[0].startswith("POST /v1/completions 200 ") and f"prompt={n} cached=0 generated=3" in lines[0]
    assert f"prompt={n} cached={n - 1} generated=3" in lines[1] and lines[1].endswith("s")
    assert lines[2].startswith("POST /v1/chat/completions 400 ")
