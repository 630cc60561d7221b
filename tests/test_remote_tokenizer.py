"""The remote backend on a server whose served name is no tokenizer: it uses the server's (/tokenize,
/detokenize, /tokenizer_info), so distribution, scoring, token-id prompts, role tags and traces work
and give the local engine's results. The server is kvql serve (in this process, on loopback) serving the
tiny Llama as "something-else"; the reference is the same model on the local engine."""

from __future__ import annotations

import copy

import httpx
import pytest
from conftest import CHAT_TEMPLATE, serving

import kvql
from kvql.backends.server_tokenizer import ServerTokenizer
from kvql.server.app import create_app

TEXTS = ["", "The capital of France is", "  spaces\nand lines\t", "<eos>", "ünïcödé ✓"]


@pytest.fixture(scope="module")
def pair(tokenizer, llama):
    """(the remote model on the server, the same model local), the tokenizer with a chat template."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = CHAT_TEMPLATE
    local = kvql.Model(llama, tok, name="tiny", cache_budget=4 << 20)
    served = kvql.Model(llama, tok, name="tiny", cache_budget=4 << 20)
    with serving(create_app(served, name="something-else")) as url:
        remote = kvql.model(url + "/v1")
        yield remote, local
        remote.close()
    local.close()


def test_a_served_name_that_is_no_tokenizer_gets_the_servers_tokenizer(pair):
    remote, local = pair
    assert isinstance(remote.tokenizer, ServerTokenizer)
    assert {"token_ids", "score", "logprobs"} <= remote.capabilities
    for text in TEXTS:
        assert remote.tokenizer.encode(text, add_special_tokens=False) == local.tokenizer.encode(
            text, add_special_tokens=False)
        ids = local.tokenizer.encode(text, add_special_tokens=False)
        assert remote.tokenizer.decode(ids) == local.tokenizer.decode(ids)
        assert remote.tokenizer.decode(ids, skip_special_tokens=True) == local.tokenizer.decode(
            ids, skip_special_tokens=True)
    assert remote.tokenizer.eos_token_id == local.tokenizer.eos_token_id
    assert remote.tokenizer.bos_token_id == local.tokenizer.bos_token_id
    assert remote.eos_ids == local.eos_ids


def test_distribution_runs_and_equals_the_local_engine(pair):
    remote, local = pair
    q = 'argmax "Q: Is the sky blue?\\nA:[A]" distribution A in [" yes", " no"]'
    got, want = kvql.run_sync(q, model=remote), kvql.run_sync(q, model=local)
    assert got.variables["A"] == want.variables["A"]
    assert [p for _, p in got.variables["P(A)"]] == pytest.approx([p for _, p in want.variables["P(A)"]], abs=1e-5)


def test_score_and_token_id_prompts_equal_the_local_engine(pair):
    remote, local = pair
    got = kvql.score_sync("Q: Is the sky blue?\nA:", [" yes", " no"], model=remote)
    want = kvql.score_sync("Q: Is the sky blue?\nA:", [" yes", " no"], model=local)
    assert list(got.logprobs) == pytest.approx(list(want.logprobs), abs=1e-5)
    ids = local.tokenizer.encode("Q: What do bees make?\nA:")
    (by_id,) = remote.generate([ids], max_tokens=6)
    (ref,) = local.generate([ids], max_tokens=6)
    assert by_id.token_ids == ref.token_ids


def test_role_tags_render_through_the_servers_chat_template(pair):
    remote, local = pair
    q = '"{:user}Say hello.{:assistant}[A]" where len(TOKENS(A)) < 6\nreturn A'
    assert kvql.run_sync(q, model=remote) == kvql.run_sync(q, model=local)
    messages = [{"role": "user", "content": "hi"}]
    assert remote.tokenizer.apply_chat_template(messages, tokenize=False) == local.tokenizer.apply_chat_template(
        messages, tokenize=False)


def test_traces_show_the_same_tokens_and_the_server(pair):
    remote, local = pair
    q = '"Question: [A] and [B]" where len(TOKENS(A)) < 4 and len(TOKENS(B)) < 4'
    got, want = kvql.run_sync(q, model=remote).trace, kvql.run_sync(q, model=local).trace
    assert [(t.id, t.text, t.hole) for t in got.tokens] == [(t.id, t.text, t.hole) for t in want.tokens]
    assert got.server == remote.base_url and want.server is None
    assert remote.base_url in got.to_html()


def test_tokenizer_false_keeps_text_prompts_and_server_asks_for_the_servers(pair):
    remote, _ = pair
    text_only = kvql.model(remote.base_url, tokenizer=False)
    assert text_only.tokenizer is None and "token_ids" not in text_only.capabilities
    with pytest.raises(kvql.QueryError, match="/tokenize"):
        kvql.run_sync('argmax "Q:[A]" distribution A in [" yes", " no"]', model=text_only)
    forced = kvql.model(remote.base_url, tokenizer="server")
    assert isinstance(forced.tokenizer, ServerTokenizer)
    forced.close()


def test_the_tokenize_endpoints_answer_in_vllms_shapes(pair, tokenizer):
    remote, _ = pair
    root = remote.root
    r = httpx.post(root + "/tokenize", json={"model": "something-else", "prompt": "hello world"}).json()
    assert r["tokens"] == tokenizer.encode("hello world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 512 and r["token_strs"] is None
    d = httpx.post(root + "/detokenize", json={"model": "something-else", "tokens": r["tokens"]}).json()
    assert d == {"prompt": "hello world"}
    chat = httpx.post(root + "/tokenize", json={"messages": [{"role": "user", "content": "x"}]}).json()
    assert tokenizer.decode(chat["tokens"]) == "<|user|>x<|end|><|assistant|>"  # add_generation_prompt by default
    info = httpx.get(root + "/tokenizer_info").json()
    assert info["eos_token"] == "<eos>" and info["chat_template"] == CHAT_TEMPLATE
    assert info["added_tokens_decoder"]["0"] == {"content": "<eos>", "special": True}


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"model": "nosuch", "prompt": "x"}, 404, "model"),
    ("/tokenize", {"prompt": "x", "messages": []}, 400, "prompt"),
    ("/tokenize", {"prompt": 3}, 400, "prompt"),
    ("/detokenize", {"tokens": [10 ** 6]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "extra": 1}, 400, "extra"),
])
def test_the_tokenize_endpoints_refuse_bad_requests_in_openais_error_shape(pair, path, body, status, param):
    r = httpx.post(pair[0].root + path, json=body)
    assert r.status_code == status and r.json()["error"]["param"] == param
