"""kvql serve behind vllm-router: the fields the router adds to every body, and vLLM's render endpoints.

vllm-router re-serializes each request with its own type, adding `no_stop_trim`, `ignore_eos`,
`skip_special_tokens`, `return_hidden_states` (chat also `continue_final_message`, `separate_reasoning`,
`stream_reasoning`, `include_reasoning`) at its defaults, and its cache_aware policy first asks the worker's
`/v1/completions/render` (or `/v1/chat/completions/render`) for the prompt's token ids. A real server on
loopback; the `openai` client for generation, httpx for the render endpoints (the client has none).
"""

from __future__ import annotations

import copy

import httpx
import openai
import pytest
from tokenizers import processors

import kvql
from kvql.server.app import create_app
from conftest import serving

KEY = "router-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
ROUTER_COMPLETION_FIELDS = {"no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
                            "return_hidden_states": False}
ROUTER_CHAT_FIELDS = {**ROUTER_COMPLETION_FIELDS, "continue_final_message": False, "separate_reasoning": True,
                      "stream_reasoning": True, "include_reasoning": True}
PROMPT = "Question: what is the capital of France? Answer:"


@pytest.fixture(scope="module")
def served(tokenizer, llama):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TEMPLATE
    model = kvql.Model(llama, tok, name="tiny", cache_budget=4 << 20)
    with serving(create_app(model, api_key=KEY, max_tokens_cap=64)) as url:
        yield url, model


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key=KEY, max_retries=0)


def post(served, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(served[0] + path, json=body, headers=AUTH if headers is None else headers, timeout=60)


def metric(served, name: str) -> float:
    for line in httpx.get(served[0] + "/metrics", headers=AUTH).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


# ------------------------------------------------------------------------------- the router's fields
def test_the_router_completion_fields_at_its_defaults_change_nothing(client):
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, stop=["."])
    routed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, stop=["."],
                                       extra_body=ROUTER_COMPLETION_FIELDS)
    assert routed.choices[0].text == plain.choices[0].text
    assert routed.choices[0].finish_reason == plain.choices[0].finish_reason


def test_the_router_chat_fields_at_its_defaults_change_nothing(client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    routed = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                            extra_body=ROUTER_CHAT_FIELDS)
    assert routed.choices[0].message.content == plain.choices[0].message.content


def test_the_router_fields_are_accepted_on_a_stream(client):
    chunks = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, stream=True,
                                       extra_body=ROUTER_COMPLETION_FIELDS)
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text


@pytest.mark.parametrize("field", ["separate_reasoning", "stream_reasoning"])
def test_reasoning_split_fields_take_either_value_as_there_is_no_reasoning_parser(client, field):
    messages = [{"role": "user", "content": "hello"}]
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0,
                                         extra_body={field: False})
    assert out.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize("path,field,value,said", [
    ("/v1/completions", "no_stop_trim", True, "stop string"),
    ("/v1/completions", "skip_special_tokens", False, "special tokens"),
    ("/v1/completions", "return_hidden_states", True, "hidden states"),
    ("/v1/chat/completions", "no_stop_trim", True, "stop string"),
    ("/v1/chat/completions", "skip_special_tokens", False, "special tokens"),
    ("/v1/chat/completions", "return_hidden_states", True, "hidden states"),
    ("/v1/chat/completions", "continue_final_message", True, "new assistant turn"),
    ("/v1/chat/completions", "include_reasoning", False, "reasoning parser"),
])
def test_a_value_kvql_does_not_implement_is_a_400_naming_the_field_and_the_one_it_takes(served, path, field,
                                                                                       value, said):
    body = {"model": "tiny", "max_tokens": 2, field: value}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    r = post(served, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field
    assert error["message"].startswith(f"{field}: {str(value).lower()} is not supported")
    assert f"only {str(not value).lower()}" in error["message"] and said in error["message"]


def test_a_refused_value_is_refused_by_the_render_endpoint_too(served):
    r = post(served, "/v1/completions/render", {"model": "tiny", "prompt": "hi", "skip_special_tokens": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "skip_special_tokens"


@pytest.mark.parametrize("field", ["continue_final_message", "include_reasoning", "separate_reasoning"])
def test_chat_only_fields_are_unknown_on_completions(served, field):
    r = post(served, "/v1/completions", {"model": "tiny", "prompt": "hi", field: True})
    assert r.status_code == 400 and field in r.json()["error"]["message"]


def test_the_router_fields_keep_their_json_types(served):
    r = post(served, "/v1/completions", {"model": "tiny", "prompt": "hi", "no_stop_trim": "maybe"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "no_stop_trim"


# ------------------------------------------------------------------------------- /v1/completions/render
def test_render_answers_vllms_shape_with_the_prompts_token_ids(served, tokenizer):
    r = post(served, "/v1/completions/render", {"model": "tiny", "prompt": PROMPT, "max_tokens": 4,
                                                 "cache_salt": "t1", **ROUTER_COMPLETION_FIELDS})
    assert r.status_code == 200, r.text
    (item,) = r.json()
    assert item["token_ids"] == tokenizer.encode(PROMPT)
    assert item["request_id"].startswith("cmpl-")
    assert item["model"] == "tiny" and item["stream"] is False and item["cache_salt"] == "t1"


def test_rendered_ids_are_what_the_engine_was_fed(client, served):
    """A text prompt, then its rendered ids as the prompt: the second is served from the first's cache up
    to its last token, so the engine saw exactly these ids for the text."""
    prompt = "Once upon a time there was a little robot who counted tokens:"
    client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0)
    (item,) = post(served, "/v1/completions/render", {"model": "tiny", "prompt": prompt}).json()
    again = client.completions.create(model="tiny", prompt=item["token_ids"], max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens == len(item["token_ids"])
    assert again.usage.prompt_tokens_details.cached_tokens == len(item["token_ids"]) - 1


def test_render_of_several_prompts_answers_one_item_each_in_order(served, tokenizer):
    prompts = ["The quick brown fox", "def add(a, b):"]
    items = post(served, "/v1/completions/render", {"model": "tiny", "prompt": prompts}).json()
    assert [i["token_ids"] for i in items] == [tokenizer.encode(p) for p in prompts]
    base = items[0]["request_id"].rsplit("-", 1)[0]
    assert [i["request_id"] for i in items] == [f"{base}-0", f"{base}-1"]


def test_render_of_token_ids_answers_them_unchanged(served):
    (item,) = post(served, "/v1/completions/render", {"model": "tiny", "prompt": [5, 17, 42]}).json()
    assert item["token_ids"] == [5, 17, 42]


def test_render_generates_nothing(served):
    requests, prompt_tokens = metric(served, "kvql_requests_total"), metric(served, "kvql_prompt_tokens_total")
    assert post(served, "/v1/completions/render", {"model": "tiny", "prompt": "a new prompt, never seen"}).is_success
    assert post(served, "/v1/chat/completions/render",
                {"model": "tiny", "messages": [{"role": "user", "content": "never seen"}]}).is_success
    assert metric(served, "kvql_requests_total") == requests
    assert metric(served, "kvql_prompt_tokens_total") == prompt_tokens


@pytest.mark.parametrize("body,status,words", [
    ({"model": "tiny", "prompt": ""}, 400, "empty"),
    ({"model": "tiny", "prompt": [1, 10_000]}, 400, "outside the vocabulary"),
    ({"model": "other", "prompt": "hi"}, 404, "not served"),
    ({"model": "tiny", "prompt": "hi", "guided_regex": "a"}, 400, "guided_regex"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": 1000}, 400, "cap"),
])
def test_render_refuses_what_the_completion_would_refuse(served, body, status, words):
    r = post(served, "/v1/completions/render", body)
    assert r.status_code == status and words in r.json()["error"]["message"], r.text
    assert post(served, "/v1/completions", body).status_code == status


def test_render_is_guarded_like_every_endpoint(served):
    body = {"model": "tiny", "prompt": "hi"}
    for path in ("/v1/completions/render", "/v1/chat/completions/render"):
        assert post(served, path, body, headers={}).status_code == 401
        assert post(served, path, body, headers={"Authorization": "Bearer wrong"}).status_code == 401
        r = post(served, path, body, headers={**AUTH, "Host": "evil.example"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
        r = httpx.post(served[0] + path, content=b'{"prompt": "hi"}', headers={**AUTH, "Content-Type": "text/plain"})
        assert r.status_code == 415


def test_render_answers_405_to_get(served):
    r = httpx.get(served[0] + "/v1/completions/render", headers=AUTH)
    assert r.status_code == 405


# ------------------------------------------------------------------------------- /v1/chat/completions/render
def test_chat_render_answers_one_object_with_the_templated_prompt(served):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    r = post(served, "/v1/chat/completions/render", {"model": "tiny", "messages": messages, **ROUTER_CHAT_FIELDS})
    assert r.status_code == 200, r.text
    item = r.json()
    tok = served[1].tokenizer
    assert item["token_ids"] == tok.encode("<|system|>Be brief.<|end|><|user|>hi<|end|><|assistant|>")
    assert item["request_id"].startswith("chatcmpl-") and item["model"] == "tiny"


def test_chat_rendered_ids_are_what_the_chat_endpoint_fed_the_engine(client, served):
    messages = [{"role": "user", "content": "kvql serves every shared prefix from a radix tree"}]
    client.chat.completions.create(model="tiny", messages=messages, max_tokens=1, temperature=0)
    item = post(served, "/v1/chat/completions/render", {"model": "tiny", "messages": messages}).json()
    again = client.completions.create(model="tiny", prompt=item["token_ids"], max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == len(item["token_ids"]) - 1


def test_chat_render_refuses_a_non_text_part_as_the_chat_endpoint_does(served):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    r = post(served, "/v1/chat/completions/render", {"model": "tiny", "messages": messages})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content"


# ------------------------------------------------------------------------------- special tokens
def test_render_includes_the_special_tokens_the_tokenizer_adds(tokenizer, llama):
    """A tokenizer that starts every text with a BOS: the render carries it, since the engine is fed it
    (tokenizing with add_special_tokens=False, as a proxy might, would route on other ids)."""
    tok = copy.deepcopy(tokenizer)
    bos = tok.convert_tokens_to_ids("<eos>")
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<eos> $A", special_tokens=[("<eos>", bos)])
    assert tok.encode("hi")[0] == bos != tok.encode("hi", add_special_tokens=False)[0]
    model = kvql.Model(llama, tok, name="bos", cache_budget=1 << 20)
    with serving(create_app(model)) as url:
        (item,) = httpx.post(url + "/v1/completions/render", json={"prompt": PROMPT}).json()
        assert item["token_ids"] == tok.encode(PROMPT) and item["token_ids"][0] == bos
        out = httpx.post(url + "/v1/completions", json={"prompt": item["token_ids"], "max_tokens": 1}).json()
        assert out["usage"]["prompt_tokens"] == len(item["token_ids"])
