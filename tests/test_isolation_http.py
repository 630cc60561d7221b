"""Isolation over HTTP: concurrent clients that fail, time out or disconnect never change another
client's answer (a real uvicorn server on loopback, httpx clients)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

import kvql
from kvql.server.app import create_app
from conftest import reference_greedy, serving


@pytest.fixture(scope="module")
def server(tokenizer, llama):
    model = kvql.Model(llama, tokenizer, name="tiny", cache_budget=4 << 20)
    with serving(create_app(model, max_tokens_cap=256)) as url:
        yield url, model


def test_failing_timed_out_and_disconnected_clients_leave_the_others_exact(server, llama, tokenizer):
    url, model = server
    prompts = [f"Question: what is the capital of France? Answer: {i}" for i in range(12)]
    solo = [reference_greedy(llama, tokenizer.encode(p), 24, tokenizer.eos_token_id) for p in prompts]

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            async def good(p):
                r = await client.post("/v1/completions", json={"prompt": p, "max_tokens": 24, "temperature": 0,
                                                               "return_token_ids": True})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["token_ids"]

            async def failing():  # fails after its three samples forked (llguidance builds it lazily)
                r = await client.post("/v1/completions", json={"prompt": "hi", "n": 3, "max_tokens": 8,
                                                               "structured_outputs": {"regex": "a{1000000}"}})
                return r.status_code

            async def impatient(i):  # gives up (closes its connection) mid-generation
                try:
                    async with httpx.AsyncClient(base_url=url, timeout=0.01 * (1 + i % 4)) as own:
                        await own.post("/v1/completions", json={"prompt": prompts[i] + " and", "max_tokens": 200})
                except httpx.TimeoutException:
                    return "gone"
                return "done"

            async def later(delay, job):
                await asyncio.sleep(delay)
                return await job

            # staggered, so failing groups fork ahead of good requests in some batches
            jobs = [later(0.004 * i, good(p)) for i, p in enumerate(prompts)]
            jobs += [later(0.003 * i, failing()) for i in range(16)]
            jobs += [later(0.005 * i, impatient(i)) for i in range(6)]
            return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    answers, failed = results[:12], results[12:28]
    assert all(status == 400 for status in failed), failed
    for i, (got, want) in enumerate(zip(answers, solo)):
        assert got == want, f"answer {i} changed by a failing or disconnected neighbour"
    for _ in range(500):
        if model.engine.idle():
            break
        time.sleep(0.01)
    model.check_integrity()
    assert model.stats()["locked_nodes"] == 0


def _lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "a"\n'


def _ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    return {"$ref": "#/$defs/d0", "$defs": defs | {f"d{n}": {"type": "string", "maxLength": 3}}}


def test_grammar_payloads_that_crashed_the_compiler_leave_the_server_up(server):
    url, model = server
    nested: dict = {"type": "string"}
    for _ in range(600):
        nested = {"type": "array", "items": nested}
    payloads = [
        ({"grammar": _lark_chain(3000)}, 200),          # segfaulted the process before
        ({"json": _ref_chain(3000)}, 200),
        ({"grammar": _lark_chain(30_000)}, 400),        # over the size bound
        ({"json": nested}, 400),                        # over the depth bound
        ({"regex": "(" * 5000 + "a" + ")" * 5000}, 400),
        ({"grammar": "start: " + "(" * 5000 + '"a"' + ")" * 5000}, 400),
    ]
    with httpx.Client(base_url=url, timeout=120) as client:
        for constraint, status in payloads:
            r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4,
                                                     "structured_outputs": constraint})
            assert r.status_code == status, (list(constraint), r.status_code, r.text[:300])
            if status == 400:
                assert "error" in r.json()
            assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    model.check_integrity()


def test_remote_backend_sends_cache_salt(server):
    url, model = server
    remote = kvql.model(url + "/v1")
    prompt = "Once upon a time there was a little robot who liked to count"
    (a,) = remote.generate([prompt], max_tokens=4, cache_salt="remote-a")
    (b,) = remote.generate([prompt], max_tokens=4, cache_salt="remote-b")
    (a2,) = remote.generate([prompt], max_tokens=4, cache_salt="remote-a")
    assert a.cached_tokens == 0 and b.cached_tokens == 0 and a2.cached_tokens > 0
    assert a.text == b.text == a2.text
    model.check_integrity()
