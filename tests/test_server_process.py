"""`kvql serve` as a real process: cross-process cache sharing, clean shutdown on SIGTERM / SIGINT."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import pytest
from conftest import free_port, start_server


@pytest.fixture
def model_dir(tmp_path, llama, tokenizer):
    llama.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def start(model_dir, port, *options):
    return start_server(model_dir, port, *options)


CLIENT = """
import json, sys, openai
c = openai.OpenAI(base_url=sys.argv[1], api_key="x", max_retries=0)
r = c.completions.create(model=c.models.list().data[0].id, prompt=sys.argv[2], max_tokens=6, temperature=0)
print(json.dumps({"text": r.choices[0].text, "cached": r.usage.prompt_tokens_details.cached_tokens,
                  "prompt": r.usage.prompt_tokens}))
"""


def client_process(url: str, prompt: str) -> dict:
    import json
    out = subprocess.run([sys.executable, "-c", CLIENT, url, prompt], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_two_client_processes_share_the_cache_and_the_server_exits_cleanly(model_dir, sig):
    port = free_port()
    proc = start(model_dir, port)
    try:
        url = f"http://127.0.0.1:{port}/v1"
        prefix = "Question: what is the capital of France? Answer: Paris. " * 4
        first = client_process(url, prefix + "Question: how many legs does a spider have?")
        second = client_process(url, prefix + "Question: what is the quick brown fox?")
        assert first["cached"] == 0
        assert second["cached"] >= len(prefix) // 8  # the shared prefix came from the first process's request
        # the same greedy output as an uncached run: restart-free check against a cold prompt copy
        cold = client_process(url, prefix + "Question: what is the quick brown fox?")
        assert cold["text"] == second["text"] and cold["cached"] == cold["prompt"] - 1
    finally:
        proc.send_signal(sig)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0


def test_remote_backend_on_kvql_serve_matches_the_local_backend(model_dir, llama, tokenizer):
    import asyncio

    import kvql

    port = free_port()
    proc = start(model_dir, port)
    try:
        remote = kvql.model(f"http://127.0.0.1:{port}/v1")
        assert remote.kind == "kvql" and "regex" in remote.supported_constraints
        local = kvql.Model(llama, tokenizer, cache_budget="4MB")
        prompts = ["The quick brown", "Once upon a time", [5, 6, 7, 8]]
        got, want = remote.generate(prompts, max_tokens=7), local.generate(prompts, max_tokens=7)
        assert [c.text for c in got] == [c.text for c in want]
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        (c,) = remote.generate(["Code:"], max_tokens=6, regex="[0-9]{3}")
        assert len(c.text) == 3 and c.text.isdigit()

        async def streamed():
            return [ch async for ch in remote.stream("The quick brown", max_tokens=7)]

        chunks = asyncio.run(streamed())
        assert "".join(ch.text for ch in chunks) == want[0].text
        with pytest.raises(ValueError, match="mask is a Python callback and cannot run on the kvql server"):
            remote.generate(["x"], max_tokens=2, mask=lambda ids: None)
        assert remote.stats()["prompt_tokens"] > 0

        # kvql queries run on the remote backend, their constraints sent as regex / stop strings
        q = kvql.query('"Pick: [A] then [N] and [S]" where A in ["red", "green"] and INT(N) and '
                       'len(TOKENS(N)) < 4 and STOPS_AT(S, "a") and len(TOKENS(S)) < 6\nreturn A, N, S',
                       is_async=False)
        a, n, s = q(model=remote)
        assert a in ("red", "green") and isinstance(n, int) and ("a" not in s[:-1])
        assert (a, n, s) == q(model=local)  # the served model's directory gave the tokenizer: token ids
        dist = '"Say [X]" distribution X in ["a", "b", "cd"]'
        got, want = kvql.run_sync(dist, model=remote), kvql.run_sync(dist, model=local)
        assert got.variables["X"] == want.variables["X"]
        assert [p for _, p in got.variables["P(X)"]] == pytest.approx([p for _, p in want.variables["P(X)"]], abs=1e-4)
        text_only = kvql.model(f"http://127.0.0.1:{port}/v1", tokenizer=False)
        assert text_only.tokenizer is None and q(model=text_only)[0] in ("red", "green")
        with pytest.raises(kvql.QueryError, match="tokenizer"):
            kvql.run_sync(dist, model=text_only)
        local.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def test_serve_options_name_keys_salts_and_hosts(model_dir):
    port = free_port()
    proc = start(model_dir, port, "--served-model-name", "tiny", "--api-key", "k1", "--api-key", "k2",
                 "--salt-per-key", "--allowed-host", "kvql.internal")
    try:
        url = f"http://127.0.0.1:{port}"

        def post(key, headers=None, **body):
            return httpx.post(url + "/v1/completions", json={"max_tokens": 2, **body},
                              headers={"Authorization": f"Bearer {key}", **(headers or {})}, timeout=60)

        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer k2"}).json()["data"][0]["id"] == "tiny"
        assert post("k1", prompt="x", model=str(model_dir)).status_code == 200  # the --model spec is an alias
        r = post("k1", prompt="x", model="nope")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert post("k3", prompt="x").status_code == 401
        assert post("k1", {"Host": "kvql.internal:8000"}, prompt="x").status_code == 200
        assert post("k1", {"Host": "evil.example"}, prompt="x").status_code == 403
        prompt = "Question: what is the capital of France? Answer:"
        cached = [post(k, prompt=prompt).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                  for k in ("k1", "k2", "k1")]
        assert cached[0] == cached[1] == 0 and cached[2] > 0  # each key its own cache partition
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
