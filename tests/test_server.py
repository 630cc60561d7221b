"""The OpenAI-compatible server: a real uvicorn server on loopback, the official `openai` client."""

from __future__ import annotations

import copy
import re
import time

import httpx
import openai
import pytest

import kvql
from kvql.server.app import create_app
from conftest import serving

KEY = "test-key"
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def served(tokenizer, llama):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TEMPLATE
    model = kvql.Model(llama, tok, name="tiny", cache_budget=4 << 20)
    with serving(create_app(model, api_key=KEY, max_body_bytes=20_000, max_tokens_cap=64)) as url:
        yield url, model


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key=KEY, max_retries=0)


def wait_idle(model):
    for _ in range(1000):
        if model.engine.idle():
            return
        time.sleep(0.01)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_completion_equals_local_generation(client, served):
    out = client.completions.create(model="tiny", prompt="The quick brown", max_tokens=6, temperature=0)
    local = served[1].generate(["The quick brown"], max_tokens=6)[0]
    assert out.choices[0].text == local.text
    assert out.usage.completion_tokens == len(local.token_ids)


def test_repeated_prompt_reports_cached_tokens(client):
    prompt = "Question: how many legs does a spider have? Answer:"
    client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0)
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1


def test_chat_completion_uses_the_chat_template(client, served):
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                         temperature=0)
    ids = served[1].tokenizer.encode("<|user|>hi<|end|><|assistant|>")
    assert out.choices[0].message.content == served[1].generate([ids], max_tokens=5)[0].text


def test_streamed_completion_adds_up_to_the_plain_one(client):
    plain = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason


def test_streamed_chat_sends_deltas(client):
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hey"}],
                                                 max_tokens=5, temperature=0, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_regex_and_choices_through_extra_body_are_obeyed(client):
    out = client.completions.create(model="tiny", prompt="Code:", max_tokens=8, temperature=1.0, seed=3,
                                    extra_body={"regex": "[0-9]{3}"})
    assert re.fullmatch("[0-9]{3}", out.choices[0].text)
    out = client.completions.create(model="tiny", prompt="Answer:", max_tokens=8, n=3, temperature=1.0, seed=4,
                                    extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert {c.text for c in out.choices} <= {"yes", "no"}


def test_chat_response_format_json_schema_is_obeyed(client):
    import json
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "json please"}], max_tokens=20, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert isinstance(json.loads(out.choices[0].message.content)["ok"], bool)


def test_missing_or_wrong_key_is_401_and_health_needs_none(served):
    url = served[0]
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/v1/models").status_code == 401
    r = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_body_over_the_limit_is_413(served):
    r = httpx.post(served[0] + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"prompt": "x" * 30_000, "max_tokens": 2})
    assert r.status_code == 413 and "bytes" in r.json()["error"]["message"]


@pytest.mark.parametrize("body, status, words", [
    ({"prompt": "x", "max_tokens": 2, "guided_regex": "[0-9]"}, 400, "guided_regex"),
    ({"prompt": "x", "max_tokens": 2, "structured_outputs": {"regx": "a"}}, 400, "regx"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 500}, 400, "cap"),
    ({"prompt": "x", "max_tokens": 2, "regex": "a("}, 400, "invalid regex"),
    ({"max_tokens": 2}, 400, "prompt"),
])
def test_bad_fields_get_a_4xx_with_a_message(served, body, status, words):
    r = httpx.post(served[0] + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, json=body)
    assert r.status_code == status
    assert words in r.json()["error"]["message"]


def test_malformed_json_is_400(served):
    r = httpx.post(served[0] + "/v1/completions", content=b"{not json",
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]


def test_client_leaving_a_stream_cancels_its_request(served):
    url, model = served
    with httpx.stream("POST", url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"prompt": "Once upon a time", "max_tokens": 64, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break
    wait_idle(model)
    model.check_integrity()
    metrics = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert "kvql_locked_nodes 0" in metrics and "kvql_cache_hit_rate" in metrics


def test_load_320_concurrent_requests_with_10_percent_disconnecting(served):
    import asyncio

    url, model = served
    prompts = [f"Question {i % 16}: what is the capital of France? Answer:" for i in range(320)]
    expected = {p: c.text for p, c in zip(prompts[:16], model.generate(prompts[:16], max_tokens=8))}
    headers = {"Authorization": f"Bearer {KEY}"}

    async def one(client, i):
        body = {"prompt": prompts[i], "max_tokens": 8, "temperature": 0}
        if i % 10 == 0:  # this client goes away after the first streamed event
            async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                                     headers=headers) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        return None
        r = await client.post(url + "/v1/completions", json=body, headers=headers)
        return r.json()["choices"][0]["text"]

    async def main():
        limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
        async with httpx.AsyncClient(limits=limits, timeout=120) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(320))), 240)

    results = asyncio.run(main())
    for i, text in enumerate(results):
        if i % 10:
            assert text == expected[prompts[i]], i
    wait_idle(model)
    model.check_integrity()  # no slot leaked: free + cached = pool
    metrics = httpx.get(url + "/metrics", headers=headers).text
    assert "kvql_locked_nodes 0" in metrics and "kvql_running_requests 0" in metrics


def test_metrics_need_the_key_by_default_and_not_with_metrics_auth_off(tokenizer, llama):
    model = kvql.Model(llama, tokenizer, name="tiny", cache_budget=4 << 20)
    with serving(create_app(model, api_key=KEY)) as closed, serving(create_app(model, api_key=KEY,
                                                                               metrics_auth=False)) as open_:
        assert httpx.get(closed + "/metrics").status_code == 401
        assert httpx.get(closed + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        r = httpx.get(open_ + "/metrics")
        assert r.status_code == 200 and "kvql_prompt_tokens_total" in r.text
        assert httpx.get(open_ + "/v1/models").status_code == 401  # only /metrics opened
    model.close()


def test_kvql_serve_has_a_no_metrics_auth_flag():
    import argparse

    from kvql.server.launch import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args([]).metrics_auth is True and p.parse_args(["--no-metrics-auth"]).metrics_auth is False


def test_the_remote_backend_reads_openai_base_url_and_api_key_from_the_environment(served, monkeypatch):
    url, _ = served
    monkeypatch.setenv("OPENAI_BASE_URL", url + "/v1")
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    remote = kvql.RemoteModel()
    assert remote.base_url == url + "/v1" and remote.kind == "kvql"
    assert remote.generate(["Hello"], max_tokens=2)[0].token_ids
    monkeypatch.setenv("OPENAI_API_KEY", "wrong")
    with pytest.raises(ValueError, match="401"):
        kvql.RemoteModel()
    assert kvql.RemoteModel(api_key=KEY).api_key == KEY  # a key given wins over the environment's
    monkeypatch.delenv("OPENAI_BASE_URL")
    with pytest.raises(ValueError, match="OPENAI_BASE_URL"):
        kvql.RemoteModel()


def test_kvql_run_and_generate_take_the_servers_api_key_and_a_401_says_how_to_give_it(served, monkeypatch, capsys,
                                                                                      tmp_path):
    """`--api-key` reaches a server started with one; without it (and without $OPENAI_API_KEY) the 401 names
    the flag, the Python argument and the environment variable."""
    from kvql.cli import main

    url, _ = served
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    query = tmp_path / "q.lmql"
    query.write_text('argmax\n    "Hello[X]" where len(TOKENS(X)) < 3\n')
    main(["run", str(query), "--model", url + "/v1", "--api-key", KEY])
    assert "X: " in capsys.readouterr().out
    main(["generate", "Hello", "--model", url + "/v1", "--api-key", KEY, "--max-tokens", "2"])
    assert capsys.readouterr().out.strip()
    for argv in (["run", str(query), "--model", url + "/v1"], ["generate", "Hello", "--model", url + "/v1"],
                 ["generate", "Hello", "--model", url + "/v1", "--api-key", "wrong"]):
        with pytest.raises(SystemExit):
            main(argv)
        err = capsys.readouterr().err
        assert "401" in err and "--api-key" in err and "OPENAI_API_KEY" in err and "api_key=" in err, (argv, err)
        assert ("the API key sent was refused" if "wrong" in argv else "no API key was sent") in err
