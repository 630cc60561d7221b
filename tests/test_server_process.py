"""`kvql serve` as a real process: cross-process cache sharing, clean shutdown on SIGTERM / SIGINT."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def model_dir(tmp_path, llama, tokenizer):
    llama.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def start(model_dir, port):
    proc = subprocess.Popen([sys.executable, "-m", "kvql.cli", "serve", "--model", str(model_dir), "--port",
                             str(port), "--cache-budget", "4MB"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.1)
        if proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"server did not start: {proc.stdout.read().decode()[-2000:]}")


CLIENT = """
import json, sys, openai
c = openai.OpenAI(base_url=sys.argv[1], api_key="x", max_retries=0)
r = c.completions.create(model="m", prompt=sys.argv[2], max_tokens=6, temperature=0)
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
