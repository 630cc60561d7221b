"""The remote backend does not trust its server: against a hostile one on loopback (`hostile_server`), endless
answers end at a byte limit, drips end at the request's deadline, an endless stream ends at `max_tokens` and
is closed, and every malformed field is an error naming the server, the path and the field, never a value.

No test here depends on the machine's speed: deadlines are short and the servers would go on forever, so the
assertion is the error that ends them, not a time budget."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from hostile_server import DRIP_SECONDS, Hostile, answer, completion, events, start

import kvql
from kvql.backends import bounded_http
from kvql.backends.base import BackendError
from kvql.backends.server_tokenizer import ServerTokenizer
from kvql.cli import main
from kvql.runtime.errors import QueryError

CAP = 1 << 20           # the body and stream limits in these tests
LINE = CAP // 4         # the line limit
IN_FLIGHT = 16 << 20    # what loopback socket buffers may hold beyond what the client read
DEADLINE = 1.5          # seconds: the timeout of the requests that must end at it


@pytest.fixture
def h(monkeypatch):
    monkeypatch.setattr(bounded_http, "MAX_BODY_BYTES", CAP)
    monkeypatch.setattr(bounded_http, "MAX_LINE_BYTES", LINE)
    monkeypatch.setattr(bounded_http, "MAX_STREAM_BYTES", CAP)
    with Hostile() as server:
        yield server


def endless(h: Hostile, prefix: bytes, content_type="application/json"):
    """A route answering `prefix` and then bytes without end."""
    def route(handler, body):
        start(handler, content_type)
        handler.wfile.write(prefix)
        h.write_forever(handler, b"x" * 65536)
    return route


def drip(h: Hostile, prefix: bytes = b""):
    """A route answering headers, then `prefix`, then one byte every DRIP_SECONDS without end."""
    def route(handler, body):
        start(handler)
        handler.wfile.write(prefix)
        h.write_forever(handler, b" ", pause=DRIP_SECONDS)
    return route


def remote(h: Hostile, **options):
    return kvql.model(h.url + "/v1", tokenizer=options.pop("tokenizer", False), **options)


def raises_naming(h: Hostile, path: str, *parts: str):
    """pytest.raises(BackendError) whose message names the server, `path`, and each of `parts`."""
    return pytest.raises(BackendError, match=".*".join(re.escape(p) for p in (f"server {h.url}: {path} ", *parts)))


def generate(m, **options):
    return m.generate(["hi"], max_tokens=options.pop("max_tokens", 5), **options)


def consume(m, **options) -> list:
    async def run():
        return [chunk async for chunk in m.stream("hi", max_tokens=options.pop("max_tokens", 5), **options)]
    return asyncio.run(run())


# -- endless bodies and lines: read up to a limit --------------------------------------------------------------
TOKENIZE = answer({"tokens": [1], "count": 1, "max_model_len": 2048})


@pytest.mark.parametrize("path", ["/v1/models", "/tokenize", "/tokenizer_info", "/detokenize", "/v1/completions",
                                  "/metrics"])
def test_an_endless_body_ends_at_the_body_limit_and_is_closed(h, path):
    h.routes.update({"/tokenize": TOKENIZE, path: endless(h, b'{"tokens": ["')})
    with raises_naming(h, path, f"answered more than {CAP:,} bytes"):
        if path in ("/v1/models", "/tokenize", "/tokenizer_info"):
            remote(h, tokenizer="server")
        elif path == "/detokenize":
            remote(h, tokenizer="server").tokenizer.decode([5])
        elif path == "/metrics":
            remote(h).stats()
        else:
            generate(remote(h))
    assert h.closed.wait(10)
    assert h.sent < CAP + IN_FLIGHT  # before: 600 MiB and more, the client's memory growing past 1.4 GiB


def test_an_endless_event_line_ends_at_the_line_limit(h):
    h.routes["/v1/completions"] = endless(h, b'data: {"choices": [{"index": 0, "text": "', "text/event-stream")
    with raises_naming(h, "/v1/completions", f"streamed a line longer than {LINE:,} bytes"):
        consume(remote(h))
    assert h.closed.wait(10) and h.sent < CAP + IN_FLIGHT


def test_an_endless_stream_of_empty_chunks_ends_at_the_stream_limit(h):
    empty = {"choices": [{"index": 0, "text": "", "finish_reason": None}]}  # no token: max_tokens cannot end it
    h.routes["/v1/completions"] = events(h, [], then_forever=empty)
    with raises_naming(h, "/v1/completions", f"streamed more than {CAP:,} bytes"):
        generate(remote(h), stop_fn=lambda ids, text: False)
    assert h.closed.wait(10) and h.sent < CAP + IN_FLIGHT


def test_a_compressed_answer_is_refused(h):
    def gzipped(handler, body):
        handler.send_response(200)
        handler.send_header("Content-Encoding", "gzip")
        handler.end_headers()
    h.routes["/v1/completions"] = gzipped
    with raises_naming(h, "/v1/completions", "Content-Encoding 'gzip'"):
        generate(remote(h))


# -- drips: end at the request's deadline ----------------------------------------------------------------------
def header_drip(h: Hostile):
    """A route whose status line and headers never end."""
    def route(handler, body):
        handler.wfile.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
        h.write_forever(handler, b"a", pause=DRIP_SECONDS)
    return route


@pytest.mark.parametrize("case", ["models", "tokenize", "completions", "completion headers", "streamed",
                                  "stream", "metrics"])
def test_a_drip_ends_at_the_requests_deadline(h, case):
    path = {"models": "/v1/models", "tokenize": "/tokenize", "metrics": "/metrics"}.get(case, "/v1/completions")
    h.routes[path] = header_drip(h) if case == "completion headers" else \
        drip(h, b"data: " if case in ("streamed", "stream") else b"")
    with raises_naming(h, path, f"within the request's deadline of {DEADLINE:g} s"):
        if case in ("models", "tokenize"):
            remote(h, tokenizer="server", timeout=DEADLINE)
        elif case == "metrics":
            remote(h, timeout=DEADLINE).stats()
        elif case == "streamed":
            generate(remote(h, timeout=DEADLINE), stop_fn=lambda ids, text: False)
        elif case == "stream":
            consume(remote(h, timeout=DEADLINE))
        else:
            generate(remote(h, timeout=DEADLINE))
    assert h.closed.wait(10)  # before: read forever, each byte resetting the per-read timeout


def test_the_deadline_covers_a_whole_stream_of_valid_chunks(h):
    chunk = {"choices": [{"index": 0, "text": "a", "token_ids": [7], "finish_reason": None}]}

    def slow(handler, body):
        start(handler, "text/event-stream")
        h.write_forever(handler, b"data: " + json.dumps(chunk).encode() + b"\n\n", pause=DRIP_SECONDS)
    h.routes["/v1/completions"] = slow
    with raises_naming(h, "/v1/completions", "deadline"):
        generate(remote(h, timeout=DEADLINE), max_tokens=10**6, stop_fn=lambda ids, text: False)
    assert h.closed.wait(10)


def test_the_timeout_is_checked_and_is_for_remote_models_only(h):
    with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
        remote(h, timeout=0)
    with pytest.raises(TypeError, match="timeout= is for remote models"):
        kvql.model("random", timeout=5)
    assert remote(h, timeout=7).timeout == 7.0 and remote(h).timeout == 600.0


# -- max_tokens ends an endless stream -------------------------------------------------------------------------
@pytest.mark.parametrize("ids", [True, False], ids=["token ids", "no token ids"])
def test_max_tokens_ends_an_endless_stream_and_closes_it(h, ids):
    chunk = {"index": 0, "text": "a", "finish_reason": None, **({"token_ids": [7]} if ids else {})}
    h.routes["/v1/completions"] = events(h, [], then_forever={"choices": [chunk]})
    (c,) = generate(remote(h), stop_fn=lambda ids, text: False)  # the path guarded LMQL stops take
    assert (c.text, c.finish_reason) == ("aaaaa", "length") and c.token_ids == ([7] * 5 if ids else [])
    assert h.closed.wait(10)  # before: read forever
    h.closed.clear()
    chunks = consume(remote(h))
    assert "".join(x.text for x in chunks) == "aaaaa" and chunks[-1].completion.finish_reason == "length"
    assert h.closed.wait(10)


def test_a_stream_ends_each_sample_at_its_own_finish(h):
    done = [{"choices": [{"index": 1, "text": "b", "token_ids": [8], "finish_reason": "stop"}]}]
    more = {"choices": [{"index": 0, "text": "a", "token_ids": [7], "finish_reason": None},
                        {"index": 1, "text": "!", "token_ids": [9], "finish_reason": None}]}
    h.routes["/v1/completions"] = events(h, done, then_forever=more)
    a, b = generate(remote(h), n=2, max_tokens=3, stop_fn=lambda ids, text: False)
    assert (a.text, a.finish_reason, b.text, b.finish_reason) == ("aaa", "length", "b", "stop")
    assert h.closed.wait(10)


# -- malformed answers: errors naming the field, never values --------------------------------------------------
MALFORMED = {
    "no choices": ({"choices": []}, "choices = [] (expected a list of 1 choice)"),
    "choices missing": ({"id": "x"}, "no choices (expected a list)"),
    "two choices for one": ({"choices": completion()["choices"] * 2}, "expected a list of 1 choice"),
    "text null": (completion(text=None), "no choices[0].text (expected a string)"),
    "text a number": (completion(text=12345), "choices[0].text = 12345 (expected a string)"),
    "token ids": (completion(token_ids=["a"]), "choices[0].token_ids = ['a'] (expected a list of integers)"),
    "index": (completion(index=3), "choices[0].index = 3 (expected a sample number below 1, each once)"),
    "finish reason": (completion(finish_reason=5), "choices[0].finish_reason = 5 (expected a string)"),
    "stop reason": (completion(stop_reason=[1]), "choices[0].stop_reason = [1]"),
    "usage": ({**completion(), "usage": {"prompt_tokens": "3"}}, "usage.prompt_tokens = '3' (expected an integer)"),
    "cached tokens": ({**completion(), "usage": {"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 1.5}}},
                      "usage.prompt_tokens_details.cached_tokens = 1.5"),
    "a list": ([], "answered [] (expected a JSON object)"),
    "not JSON": (b'{"choices": [', "answered something that is not JSON: '{\"choices\": ['"),
    "too deep": (b"[" * 100_000 + b"]" * 100_000, "not JSON"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_completion_is_an_error_naming_the_field(h, case):
    body, message = MALFORMED[case]
    h.routes["/v1/completions"] = answer(body)
    with raises_naming(h, "/v1/completions", message):
        generate(remote(h))  # before: [] for no choices, None or 12345 as the text, JSONDecodeError, KeyError...


def test_a_malformed_text_never_becomes_a_querys_value(h):
    h.routes["/v1/completions"] = answer(completion(text=12345))
    with pytest.raises(QueryError, match=r"generating X: server .*choices\[0\]\.text = 12345 \(expected a string"):
        kvql.run_sync('"Say: [X]" where len(TOKENS(X)) < 5\nreturn X', model=remote(h))  # before: 12345


LOGPROBS = {
    "not token ids": ({"tokens": ["a"], "token_logprobs": [-1.0], "top_logprobs": None},
                      "choices[0].logprobs.tokens[0] = 'a' (expected 'token_id:N'"),
    "lengths": ({"tokens": ["token_id:1"], "token_logprobs": [], "top_logprobs": None},
                "choices[0].logprobs.token_logprobs = [] (expected a list of 1, one per token)"),
    "a value": ({"tokens": ["token_id:1"], "token_logprobs": ["x"], "top_logprobs": None},
                "choices[0].logprobs.token_logprobs[0] = 'x' (expected a number)"),
    "a top key": ({"tokens": ["token_id:1"], "token_logprobs": [-1.0], "top_logprobs": [{"b": -1.0}]},
                  "choices[0].logprobs.top_logprobs[0] = 'b'"),
    "missing": (None, "no choices[0].logprobs (expected a JSON object)"),
}


@pytest.mark.parametrize("case", list(LOGPROBS))
def test_malformed_logprobs_are_an_error_naming_the_field(h, case):
    logprobs, message = LOGPROBS[case]
    h.routes["/v1/completions"] = answer(completion(logprobs=logprobs))
    with raises_naming(h, "/v1/completions", message):
        generate(remote(h), logprobs=2)


def test_well_formed_logprobs_are_read(h):
    lp = {"tokens": ["token_id:1"], "token_logprobs": [-0.5], "top_logprobs": [{"token_id:1": -0.5, "token_id:2": -2}]}
    h.routes["/v1/completions"] = answer(completion(token_ids=[1], logprobs=lp))
    (c,) = generate(remote(h), logprobs=2)
    assert [(t.token_id, t.logprob, t.top) for t in c.logprobs] == [(1, -0.5, {1: -0.5, 2: -2.0})]


STREAMED = {
    "text null": ({"choices": [{"index": 0, "text": None}]}, "no choices[0].text (expected a string)"),
    "index": ({"choices": [{"index": 2, "text": "a"}]}, "choices[0].index = 2 (expected a sample number below 1)"),
    "choices": ({"choices": {"index": 0}}, "choices = {'index': 0} (expected a list)"),
    "token ids": ({"choices": [{"index": 0, "text": "a", "token_ids": [1.5]}]}, "choices[0].token_ids = [1.5]"),
    "error event": ({"error": {"message": "boom", "type": "server_error"}}, "failed after its stream began: boom"),
    "cut short": ({"choices": [{"index": 0, "text": "a"}]}, "ended its stream before sample 0 had a finish_reason"),
    "no choices": ({"choices": []}, "ended its stream before sample 0 had a finish_reason"),
}


@pytest.mark.parametrize("case", list(STREAMED))
def test_a_malformed_streamed_chunk_is_an_error_naming_the_field(h, case):
    chunk, message = STREAMED[case]
    h.routes["/v1/completions"] = events(h, [chunk])
    with raises_naming(h, "/v1/completions", message):
        generate(remote(h), stop_fn=lambda ids, text: False)
    with raises_naming(h, "/v1/completions", message):
        consume(remote(h))


def test_an_error_status_names_the_server_and_its_message(h):
    h.routes["/v1/completions"] = answer({"error": {"message": "no such model"}}, status=404)
    with raises_naming(h, "/v1/completions", "answered 404: no such model"):
        generate(remote(h))
    with raises_naming(h, "/v1/completions", "answered 404: no such model"):
        consume(remote(h))


def test_scores_check_the_prompt_logprobs(h):
    rows = [None, {"2": {"logprob": -1.0}}]
    h.routes["/v1/completions"] = answer({**completion(), "prompt_logprobs": rows})
    m = remote(h)
    assert asyncio.run(m.ascore([1], [[2]]))[0] == [[-1.0]]
    h.routes["/v1/completions"] = answer({**completion(), "prompt_logprobs": rows[:1]})
    with raises_naming(h, "/v1/completions", "prompt_logprobs = [None] (expected a list of 2 rows"):
        asyncio.run(m.ascore([1], [[2]]))
    h.routes["/v1/completions"] = answer({**completion(), "prompt_logprobs": [None, {"2": {"logprob": None}}]})
    with raises_naming(h, "/v1/completions", "no prompt_logprobs[1]['2'].logprob (expected a number)"):
        asyncio.run(m.ascore([1], [[2]]))


MODELS = {
    "no data": ({"object": "list"}, "no data (expected a list)"),
    "an id": ({"data": [{"name": "m"}]}, "no data[0].id (expected a string)"),
    "a length": ({"data": [{"id": "m", "max_model_len": "2048"}]},
                 "data[0].max_model_len = '2048' (expected an integer)"),
}


@pytest.mark.parametrize("case", list(MODELS))
def test_a_malformed_model_list_is_an_error_naming_the_field(h, case):
    body, message = MODELS[case]
    h.routes["/v1/models"] = answer(body)
    with raises_naming(h, "/v1/models", message):
        remote(h)  # before: KeyError 'id'


TOKENIZER = {
    "tokens": ("/tokenize", {"tokens": ["a"]}, "tokens = ['a'] (expected a list of integers)"),
    "eos": ("/tokenizer_info", {"eos_token": 7}, "eos_token = 7 (expected a string)"),
    "bos content": ("/tokenizer_info", {"bos_token": {"special": True}}, "no bos_token.content (expected a string)"),
    "template": ("/tokenizer_info", {"chat_template": 3}, "chat_template = 3 (expected a string)"),
    "info": ("/tokenizer_info", b"nope", "answered something that is not JSON: 'nope'"),
}


@pytest.mark.parametrize("case", list(TOKENIZER))
def test_a_malformed_tokenizer_answer_is_an_error_naming_the_field(h, case):
    path, body, message = TOKENIZER[case]
    h.routes.update({"/tokenize": TOKENIZE, path: answer(body)})
    with raises_naming(h, path, message):
        remote(h, tokenizer="server")


def test_a_server_tokenizer_that_answers_well_is_used_and_one_that_refuses_is_not(h):
    h.routes.update({"/tokenize": TOKENIZE, "/detokenize": answer({"prompt": "x"}),
                     "/tokenizer_info": answer({"eos_token": "x", "chat_template": [{"name": "a"}]})})
    tok = remote(h, tokenizer="server").tokenizer
    assert isinstance(tok, ServerTokenizer) and tok.eos_token_id == 1 and tok.decode([1]) == "x"
    h.routes["/detokenize"] = answer({"prompt": 5})
    with raises_naming(h, "/detokenize", "prompt = 5 (expected a string)"):
        tok.decode([2])
    h.routes.pop("/tokenize")
    assert remote(h, tokenizer=None).tokenizer is None  # a refusal (404): no tokenizer, text prompts
    with raises_naming(h, "/tokenize", "answered 404"):
        remote(h, tokenizer="server")


def test_blocking_calls_keep_their_deadline_inside_an_event_loop(h):
    h.routes["/tokenize"] = TOKENIZE
    tok = remote(h, tokenizer="server").tokenizer
    h.routes["/tokenize"] = drip(h)
    tok.timeout = DEADLINE

    async def inside():  # the query runtime calls its tokenizer from async code
        return tok.encode("new text")
    with raises_naming(h, "/tokenize", "deadline"):
        asyncio.run(inside())


# -- the command line ------------------------------------------------------------------------------------------
def test_kvql_generate_takes_a_servers_url_and_a_timeout(h, capsys):
    h.routes["/v1/completions"] = answer(completion(text=" hello"))
    main(["generate", "hi", "--model", h.url + "/v1"])  # before: "dtype= is for local models"
    assert capsys.readouterr().out == " hello\n"
    h.routes["/v1/completions"] = drip(h)
    with pytest.raises(SystemExit) as e:
        main(["generate", "hi", "--model", h.url + "/v1", "--timeout", str(DEADLINE)])
    assert e.value.code == 2 and f"deadline of {DEADLINE:g} s" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["generate", "hi", "--timeout", "5"])  # a local model: refused before it loads
    assert e.value.code == 2 and "--timeout is for a server's model" in capsys.readouterr().err


def test_kvql_run_takes_a_timeout_for_a_servers_model(h, tmp_path, capsys):
    query = tmp_path / "q.lmql"
    query.write_text('"Say: [X]" where len(TOKENS(X)) < 4\nreturn X\n')
    h.routes["/v1/completions"] = drip(h)
    with pytest.raises(SystemExit) as e:
        main(["run", str(query), "--model", h.url + "/v1", "--timeout", str(DEADLINE)])
    assert e.value.code == 2 and f"deadline of {DEADLINE:g} s" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["run", str(query), "--model", "random", "--timeout", "5"])  # a local model: refused before it loads
    assert e.value.code == 2 and "--timeout is for a server's model" in capsys.readouterr().err
