"""Hostile and unlucky clients against a real uvicorn server on loopback (issue 8, server part).

Every bad request gets a 4xx in OpenAI's error shape (never a 500 or a framework's own shape); a
stream that fails mid-way says so; a web page cannot drive the server (Content-Type, Host); a client
that disconnects stops its generation; `cache_salt` partitions the cache; `/health` runs the
engine's integrity check.
"""

from __future__ import annotations

import asyncio
import copy
import json
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

import kvql
from kvql.server.app import create_app
from kvql.server.protocol import MAX_DEPTH
from conftest import serving

KEY, OTHER_KEY = "adv-key", "adv-key-2"
LONG = 500  # max_tokens of a request that must be cut short (greedy, "Once upon a time" meets no EOS)
AUTH = {"Authorization": f"Bearer {KEY}"}
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def chat_tokenizer(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TEMPLATE
    return tok


@pytest.fixture(scope="module")
def served(chat_tokenizer, llama):
    # one token per step: the cancellation tests need long requests still decoding when the client goes (drafted
    # from the tree, a prompt run before would finish at once); speculation's own isolation: test_speculation.py
    model = kvql.Model(llama, chat_tokenizer, name="tiny", cache_budget=4 << 20, speculate=False)
    app = create_app(model, aliases=["models/tiny"], api_key=[KEY, OTHER_KEY], max_tokens_cap=LONG)
    with serving(app) as url:
        yield url, model


def wait_idle(model, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if model.engine.idle():
            return True
        time.sleep(0.01)
    return False


def nested(depth: int) -> str:
    """The JSON text of a schema of `depth` objects, each holding the next as property "a" (2 JSON
    levels each); text, as json.dumps would recurse too deep."""
    head = '{"type": "object", "required": ["a"], "additionalProperties": false, "properties": {"a": '
    return head * depth + '{"type": "string"}' + "}}" * depth


DEEP = 100_000
C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]

# (method, path, body: dict | bytes | None, extra headers, status, words in the message)
BAD = [
    # JSON the parser cannot or must not take
    ("POST", C, b"[" * DEEP + b"]" * DEEP, {}, 400, "nested deeper than"),
    ("POST", C, b'{"prompt": ' + b"[" * DEEP + b"]" * DEEP + b"}", {}, 400, "nested deeper than"),
    ("POST", C, b'{"prompt": "x", "temperature": NaN}', {}, 400, "NaN"),
    ("POST", C, b'{"prompt": "x", "top_p": Infinity}', {}, 400, "Infinity"),
    ("POST", C, b'{"prompt": "x", "temperature": -Infinity}', {}, 400, "Infinity"),
    ("POST", C, b'{"prompt": "x", "temperature": 1e999}', {}, 400, "out of range"),
    ("POST", C, b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", {}, 400, "malformed JSON"),
    ("POST", C, b'{"prompt": "\xff\xfe"}', {}, 400, "malformed JSON"),
    ("POST", C, b"", {}, 400, "malformed JSON"),
    ("POST", C, b'["prompt"]', {}, 400, "JSON object"),
    # lone surrogates: valid JSON escapes, invalid Unicode
    ("POST", C, b'{"prompt": "ab\\ud800cd", "max_tokens": 2}', {}, 400, "prompt"),
    ("POST", C, b'{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', {}, 400, "prompt.1"),
    ("POST", CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', {}, 400, "messages.0.content"),
    ("POST", CHAT, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}', {}, 400,
     "messages.0.content.0.text"),
    ("POST", C, b'{"prompt": "x", "\\ud800": 1}', {}, 400, "surrogate"),
    # JSON schemas: too deep, not JSON, not an object
    ("POST", C, b'{"prompt": "x", "json_schema": ' + nested(600).encode() + b"}", {}, 400, "nested deeper than"),
    ("POST", C, {"prompt": "x", "json_schema": nested(600)}, {}, 400, "json_schema"),
    ("POST", C, {"prompt": "x", "json_schema": nested(300)}, {}, 400, "json_schema"),
    ("POST", C, {"prompt": "x", "json_schema": json.loads(nested(40))}, {}, 400, f"{MAX_DEPTH} levels"),
    ("POST", C, {"prompt": "x", "json_schema": {"type": "array", "items": json.loads("[" * 70 + "]" * 70)}}, {},
     400, f"{MAX_DEPTH} levels"),
    ("POST", C, {"prompt": "x", "json_schema": "{not json"}, {}, 400, "json_schema"),
    ("POST", C, {"prompt": "x", "json_schema": "[1, 2]"}, {}, 400, "JSON schema object"),
    ("POST", C, {"prompt": "x", "json_schema": 5}, {}, 400, "json_schema"),
    ("POST", C, {"prompt": "x", "structured_outputs": {"json": "nope{"}}, {}, 400, "structured_outputs.json"),
    ("POST", C, {"prompt": "x", "structured_outputs": {"json": "NaN"}}, {}, 400, "structured_outputs.json"),
    ("POST", CHAT, {"messages": USER, "response_format": {"type": "json_schema", "json_schema": "{}"}}, {}, 400,
     "response_format.json_schema"),
    ("POST", CHAT, {"messages": USER, "response_format": {"type": "json_schema"}}, {}, 400, "json_schema.schema"),
    ("POST", CHAT, {"messages": USER, "response_format": {"type": "xml"}}, {}, 400, "response_format.type"),
    ("POST", CHAT, {"messages": USER, "response_format": "json"}, {}, 400, "response_format"),
    # wrong types and values: one short line naming the field
    ("POST", CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, {}, 400,
     "messages.0.content"),
    ("POST", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     {}, 400, "only text parts"),
    ("POST", CHAT, {"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, {}, 400, "messages.0.content"),
    ("POST", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, {}, 400, "messages.0.role"),
    ("POST", CHAT, {"messages": "hi"}, {}, 400, "messages"),
    ("POST", CHAT, {"messages": []}, {}, 400, "messages"),
    ("POST", C, {"prompt": 5}, {}, 400, "prompt"),
    ("POST", C, {"prompt": {"a": 1}}, {}, 400, "prompt"),
    ("POST", C, {"prompt": [], "max_tokens": 2}, {}, 400, "prompt"),
    ("POST", C, {"prompt": [[]], "max_tokens": 2}, {}, 400, "empty"),
    ("POST", C, {"prompt": [10**6], "max_tokens": 2}, {}, 400, "vocabulary"),
    ("POST", C, {"prompt": "x", "seed": "x"}, {}, 400, "seed"),
    ("POST", C, {"prompt": "x", "n": 1000}, {}, 400, "n"),
    ("POST", C, {"prompt": "x", "stop": [1, 2]}, {}, 400, "stop"),
    ("POST", C, {"prompt": "x", "temperature": -1}, {}, 400, "temperature"),
    ("POST", C, {"prompt": "x", "logprobs": 100}, {}, 400, "logprobs"),
    ("POST", C, {"prompt": "x", "max_tokens": LONG + 1}, {}, 400, "cap"),
    ("POST", C, {"prompt": "x", "structured_outputs": {"choice": []}}, {}, 400, "structured_outputs.choice"),
    ("POST", C, {"prompt": "x", "structured_outputs": {"choice": "yes"}}, {}, 400, "structured_outputs.choice"),
    ("POST", C, {"prompt": "x", "structured_outputs": "regex"}, {}, 400, "structured_outputs"),
    ("POST", C, {"prompt": "x", "regex": "a(", "max_tokens": 2}, {}, 400, "invalid regex"),
    ("POST", C, {"prompt": "x", "regex": "(" * 5000 + "a" + ")" * 5000, "max_tokens": 2}, {}, 400, "regex"),
    ("POST", C, {"prompt": "x", "regex": "a", "json_schema": {}}, {}, 400, "one constraint"),
    ("POST", C, {"prompt": ["a", "b"], "stream": True}, {}, 400, "one prompt"),
    ("POST", C, {"prompt": "x", "cache_salt": 5}, {}, 400, "cache_salt"),
    ("POST", C, {"prompt": "x", "cache_salt": ""}, {}, 400, "cache_salt"),
    ("POST", C, {"prompt": "x", "guided_json": {}}, {}, 400, "guided_json"),
    # the model field names a model this server serves
    ("POST", C, {"prompt": "x", "model": "gpt-4"}, {}, 404, "gpt-4"),
    ("POST", CHAT, {"messages": USER, "model": "tiny2"}, {}, 404, "tiny2"),
    # browser reach: simple (preflight-free) cross-origin bodies, foreign Host headers, CORS preflights
    ("POST", C, b'{"prompt": "x"}', {"Content-Type": "text/plain"}, 415, "application/json"),
    ("POST", C, b"prompt=x", {"Content-Type": "application/x-www-form-urlencoded"}, 415, "application/json"),
    ("POST", CHAT, b'{"messages": []}', {"Content-Type": "multipart/form-data; boundary=x"}, 415, "application/json"),
    ("POST", C, b'{"prompt": "x"}', {"Content-Type": ""}, 415, "application/json"),
    ("POST", C, {"prompt": "x"}, {"Host": "evil.example"}, 403, "evil.example"),
    ("POST", C, {"prompt": "x"}, {"Host": "evil.example:8000"}, 403, "evil.example"),
    ("GET", "/v1/models", None, {"Host": "localhost.evil.example"}, 403, "not allowed"),
    ("GET", "/health", None, {"Host": "rebind.example"}, 403, "not allowed"),
    ("OPTIONS", C, None, {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}, 405, "OPTIONS"),
    # unknown paths and methods
    ("GET", "/v1/nothing", None, {}, 404, "/v1/nothing"),
    ("POST", "/v1/engines/tiny/completions", {"prompt": "x"}, {}, 404, "no endpoint"),
    ("GET", C, None, {}, 405, "GET"),
    ("DELETE", "/v1/models", None, {}, 405, "DELETE"),
    ("PUT", CHAT, {"messages": USER}, {}, 405, "PUT"),
]


@pytest.mark.parametrize("method, path, body, headers, status, words", BAD,
                         ids=[f"{i}-{b[0]}-{b[4]}" for i, b in enumerate(BAD)])
def test_bad_request_gets_a_4xx_in_openai_shape(served, method, path, body, headers, status, words):
    url, model = served
    content = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    sent = {**AUTH, **({"Content-Type": "application/json"} if body is not None else {}), **headers}
    r = httpx.request(method, url + path, content=content, headers=sent, timeout=60)
    assert r.status_code == status, r.text[:300]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"], error
    assert len(error["message"]) <= 600 and "pydantic" not in error["message"]  # short, not a validation dump
    assert httpx.post(url + C, json={"prompt": "ok", "max_tokens": 2}, headers=AUTH).status_code == 200
    assert wait_idle(model)
    model.check_integrity()


def test_openai_client_sees_model_not_found_and_aliases_work(served):
    url, model = served
    client = openai.OpenAI(base_url=url + "/v1", api_key=OTHER_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="not-here", prompt="x", max_tokens=2)
    assert e.value.code == "model_not_found"
    for name in ("tiny", "models/tiny"):
        out = client.completions.create(model=name, prompt="x", max_tokens=2)
        assert out.model == "tiny"
    assert httpx.post(url + C, json={"prompt": "x", "max_tokens": 2}, headers=AUTH).status_code == 200  # no model
    model.check_integrity()


def test_loopback_hosts_are_allowed_with_any_port(served):
    url, model = served
    for host in ("127.0.0.1:1234", "localhost", "LOCALHOST:80", "[::1]:9", "10.0.0.7"):
        r = httpx.get(url + "/v1/models", headers={**AUTH, "Host": host})
        assert r.status_code == 200, host


def test_allowed_hosts_option_accepts_the_named_hosts_only(chat_tokenizer, llama):
    model = kvql.Model(llama, chat_tokenizer, name="tiny", cache_budget=1 << 20)
    with serving(create_app(model, allowed_hosts=["kvql.internal"])) as url:
        assert httpx.get(url + "/v1/models", headers={"Host": "kvql.internal:8000"}).status_code == 200
        assert httpx.get(url + "/v1/models", headers={"Host": "evil.example"}).status_code == 403
    model = kvql.Model(llama, chat_tokenizer, name="tiny", cache_budget=1 << 20)
    with serving(create_app(model, allowed_hosts=["*"])) as url:
        assert httpx.get(url + "/v1/models", headers={"Host": "evil.example"}).status_code == 200


class FailsAfterFirstToken(kvql.Model):
    """A real model whose requests fail in the engine after their first token (a mask that raises: the
    engine fails that request alone, with that error)."""

    async def submit(self, prompts, on_update=None, **options):
        def mask(generated):
            if generated:
                raise RuntimeError("the engine failed mid-generation")
            return None

        return await super().submit(prompts, on_update, **{**options, "mask": mask})


@pytest.mark.parametrize("path, body", [
    (C, {"prompt": "Once upon a time", "max_tokens": 20, "n": 2, "temperature": 1.0, "seed": 1}),
    (CHAT, {"messages": USER, "max_tokens": 20}),
])
def test_stream_failing_midway_sends_an_error_event_and_finish_reason(chat_tokenizer, llama, path, body):
    model = FailsAfterFirstToken(llama, chat_tokenizer, name="tiny", cache_budget=1 << 20)
    with serving(create_app(model)) as url:
        with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as r:
            assert r.status_code == 200
            events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        parsed = [json.loads(e) for e in events[:-1]]
        errors = [i for i, e in enumerate(parsed) if "error" in e]
        assert len(errors) == 1 and parsed[errors[0]]["error"]["type"] == "server_error"
        assert errors[0] >= 1  # the first token was sent before the failure
        finished = [c for e in parsed[errors[0] + 1:] for c in e["choices"]]
        assert finished and all(c["finish_reason"] == "error" for c in finished)
        assert len(finished) == body.get("n", 1)  # every sample still open is closed

        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIError, match="internal server error"):
            # greedy: sampled (the API's default temperature 1), the first token may be end-of-sequence, and
            # the request ends before its mask fails
            list(client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=20, temperature=0,
                                           stream=True))
        remote = kvql.model(url + "/v1")  # kvql's own remote backend raises too, after the first chunk

        async def consume():
            return [chunk async for chunk in remote.stream("Once upon a time", max_tokens=20)]
        with pytest.raises(ValueError, match="internal server error"):
            asyncio.run(consume())
        assert wait_idle(model)
        model.check_integrity()


CLIENT = """
import sys, httpx
httpx.post(sys.argv[1], json={"prompt": "Once upon a time", "max_tokens": %d, "temperature": 0}, timeout=120,
           headers={"Authorization": "Bearer %s"})
""" % (LONG, KEY)


def test_killed_non_streaming_client_stops_its_generation(served, monkeypatch):
    url, model = served
    # greedy, this prompt runs to max_tokens without an end-of-sequence token (~0.6 s alone)
    assert model.generate(["Once upon a time"], max_tokens=LONG)[0].finish_reason == "length"
    assert wait_idle(model)
    # once the client is dead, every step waits for the server to cancel the request: on however slow a machine,
    # the request cannot run to max_tokens before the server notices the disconnect (the bound only catches a hang)
    killed, cancelled = threading.Event(), threading.Event()
    cancel, forward = model.engine.cancel, model.engine.runner.forward

    def noted(group):
        cancelled.set()
        cancel(group)

    def held(segments):
        if killed.is_set():
            cancelled.wait(120)
        return forward(segments)

    monkeypatch.setattr(model.engine, "cancel", noted)
    monkeypatch.setattr(model.engine.runner, "forward", held)
    before = model.stats()["generated_tokens"]
    child = subprocess.Popen([sys.executable, "-c", CLIENT, url + C])
    try:
        deadline = time.monotonic() + 60
        while model.stats()["generated_tokens"] < before + 5:  # the request is decoding
            assert time.monotonic() < deadline and child.poll() is None, "the request never started"
            time.sleep(0.02)
    finally:
        child.kill()
        child.wait()
        killed.set()
    at_kill = model.stats()["generated_tokens"]
    assert cancelled.wait(120), "the server never cancelled the request of the killed client"
    assert wait_idle(model, seconds=120), "still generating after the request was cancelled"
    stopped = model.stats()["generated_tokens"]
    assert stopped - before < LONG  # cut short, not run to max_tokens
    time.sleep(0.3)
    assert model.stats()["generated_tokens"] == stopped
    print(f"tokens generated after the kill: {stopped - at_kill}")
    model.check_integrity()
    metrics = httpx.get(url + "/metrics", headers=AUTH).text
    assert "kvql_running_requests 0" in metrics and "kvql_locked_nodes 0" in metrics


def test_client_that_times_out_cancels_its_request(served, monkeypatch):
    url, model = served
    assert wait_idle(model)
    # every step at least 5 ms: the request outlasts the client's 0.1 s by seconds whatever the machine's load
    # (alone it takes ~0.6 s, which a loaded machine's late timeout and disconnect poll could both exceed)
    forward = model.engine.runner.forward

    def slowed(segments):
        time.sleep(0.005)
        return forward(segments)

    monkeypatch.setattr(model.engine.runner, "forward", slowed)
    before = model.stats()["generated_tokens"]

    async def impatient():
        async with httpx.AsyncClient(timeout=0.1) as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.post(url + C, json={"prompt": "Once upon a time", "max_tokens": LONG, "temperature": 0},
                                  headers=AUTH)

    asyncio.run(impatient())
    assert wait_idle(model, seconds=2.0)
    assert model.stats()["generated_tokens"] - before < LONG  # cut short, not run to max_tokens
    model.check_integrity()


def test_metrics_report_preemptions_and_health_runs_the_integrity_check(served, monkeypatch):
    url, model = served
    metrics = httpx.get(url + "/metrics", headers=AUTH).text
    assert f"kvql_preemptions_total {model.stats()['preemptions']}" in metrics
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    calls = []

    def broken(**kwargs):
        calls.append(kwargs)
        raise AssertionError("free + tree + running != pool")

    monkeypatch.setattr(model, "check_integrity", broken)
    r = httpx.get(url + "/health")
    assert r.status_code == 503 and r.json() == {"status": "error", "detail": "free + tree + running != pool"}
    assert calls == [{"full": False}]  # the cheap form: health probes come often


def cached_tokens(url: str, key: str, prompt: str, **extra) -> int:
    r = httpx.post(url + C, json={"prompt": prompt, "max_tokens": 2, **extra},
                   headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cache_salt_partitions_the_prefix_cache(served):
    url, model = served
    prompt = "Question: which tenant asked this question before? Answer:"
    assert cached_tokens(url, KEY, prompt, cache_salt="tenant-a") == 0
    assert cached_tokens(url, KEY, prompt, cache_salt="tenant-a") > 0
    assert cached_tokens(url, KEY, prompt, cache_salt="tenant-b") == 0  # cannot probe tenant a's prompt
    assert cached_tokens(url, KEY, prompt) == 0  # nor can an unsalted client
    assert cached_tokens(url, KEY, prompt) > 0
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    chat = [{"role": "user", "content": "a salted chat"}]
    first, again = (client.chat.completions.create(model="tiny", messages=chat, max_tokens=2,
                                                   extra_body={"cache_salt": salt}) for salt in ("c", "d"))
    assert first.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens_details.cached_tokens == 0
    assert wait_idle(model)
    model.check_integrity()


def test_salt_per_key_gives_each_api_key_its_own_partition(chat_tokenizer, llama):
    with pytest.raises(ValueError, match="API keys"):
        create_app(None, salt_per_key=True)
    model = kvql.Model(llama, chat_tokenizer, name="tiny", cache_budget=1 << 20)
    with serving(create_app(model, api_key=[KEY, OTHER_KEY], salt_per_key=True)) as url:
        prompt = "Question: what is the PIN of the other tenant? Answer:"
        assert cached_tokens(url, KEY, prompt) == 0
        assert cached_tokens(url, KEY, prompt) > 0
        assert cached_tokens(url, OTHER_KEY, prompt) == 0  # another key: another partition
        assert cached_tokens(url, OTHER_KEY, prompt, cache_salt="x") == 0  # a client salt subdivides a key's
        assert cached_tokens(url, KEY, prompt, cache_salt="x") == 0  # the same client salt under another key
        assert cached_tokens(url, OTHER_KEY, prompt, cache_salt="x") > 0
        assert wait_idle(model)
        model.check_integrity()


def test_the_deepest_schema_admitted_compiles_and_one_level_more_is_refused(served):
    url, model = served
    # body (1) > json_schema (2) > 2 levels per object (properties, schema): 31 objects reach level 64
    r = httpx.post(url + C, json={"prompt": "x", "max_tokens": 40, "json_schema": json.loads(nested(31))}, headers=AUTH)
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith('{"a": {"a": {"a": '), r.text[:300]
    r = httpx.post(url + C, json={"prompt": "x", "max_tokens": 8, "json_schema": json.loads(nested(32))}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "json_schema"
    assert wait_idle(model)
    model.check_integrity()
