"""`kvql serve` as a process: a port in use fails before any load, the banner, vLLM's flags
(--max-model-len, --dtype, --chat-template, --log-level, --served-model-name), and SIGINT/SIGTERM with a
long request in flight (it is cancelled within the shutdown timeout; exit 0, no traceback)."""

from __future__ import annotations

import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from transformers import LlamaConfig, LlamaForCausalLM

import kvql
from conftest import free_port, serving, wait_healthy
from kvql.server.app import create_app

SERVE = [sys.executable, "-m", "kvql.cli", "serve"]


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory, tokenizer):
    """A tiny Llama with a long context, so one request can run for many seconds."""
    import torch
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768,
                         initializer_range=0.2, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("long") / "model"
    LlamaForCausalLM(config).eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_port_in_use_fails_at_once_before_loading(long_model_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run([*SERVE, "--model", str(long_model_dir), "--port", str(port)],
                             capture_output=True, text=True, timeout=30)
    assert out.returncode != 0, out.stderr  # "at once": its one line is all it printed, no loading line
    assert out.stderr.strip() == f"kvql serve: port {port} on 127.0.0.1 is already in use (another server?); " \
                                 "choose another with --port"
    assert "loading" not in out.stdout  # the model was never loaded


def run_until_signal(model_dir, sig, *options, body, after: float = 1.0, exit_within: float = 60.0):
    """Start a server, send `body` (a long request) from a thread, signal the server `after` seconds into
    it (a streamed body: `after` seconds after its first event); -> (exit code, seconds from signal to exit,
    the client's status, body and the number of events it had when the signal came, stdout, stderr).
    `exit_within`: seconds the server has to exit after the signal (a bound that only catches a hang)."""
    port = free_port()
    proc = subprocess.Popen([*SERVE, "--model", str(model_dir), "--port", str(port), "--cache-budget", "64MB",
                             *options], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_healthy(proc, port), proc.stderr.read()[-2000:]
        got, lines, started = {}, [], threading.Event()

        def client():
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120) as r:
                got["status"] = r.status_code
                for line in r.iter_lines():
                    lines.append(line)
                    started.set()
            got["body"] = "\n".join(lines)
            started.set()

        t = threading.Thread(target=client)
        t.start()
        if body.get("stream"):
            assert started.wait(timeout=60)
        time.sleep(after)
        assert t.is_alive(), got  # the request is still running when the signal comes
        got["at_signal"] = len(lines)
        proc.send_signal(sig)
        signalled = time.monotonic()
        code = proc.wait(timeout=exit_within)
        elapsed = time.monotonic() - signalled
        t.join(timeout=30)
        return code, elapsed, got, proc.stdout.read(), proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


LONG = {"prompt": "Once upon a time", "max_tokens": 30000, "ignore_eos": True, "temperature": 0}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_with_a_long_request_cancels_it_after_the_shutdown_timeout_and_exits_0(long_model_dir, sig):
    code, elapsed, got, _, err = run_until_signal(long_model_dir, sig, "--shutdown-timeout", "1",
                                                  "--max-tokens-cap", "30000", body=LONG)
    assert code == 0, (code, elapsed, err)  # the 503 below: cancelled, not run to its 30,000 tokens
    assert got["status"] == 503 and "shutting down" in json.loads(got["body"])["error"]["message"]
    assert "Traceback" not in err and "CancelledError" not in err, err


def test_signal_with_a_long_stream_ends_it_with_an_error_event_and_exits_0(long_model_dir):
    code, elapsed, got, _, err = run_until_signal(long_model_dir, signal.SIGTERM, "--shutdown-timeout", "1",
                                                  "--max-tokens-cap", "30000", body={**LONG, "stream": True})
    assert code == 0, (code, elapsed, err)  # the 503 below: cancelled, not run to its 30,000 tokens
    events = [line[len("data: "):] for line in got["body"].splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "shutting down" in json.loads(events[-3])["error"]["message"]
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "error"
    assert "Traceback" not in err and "CancelledError" not in err, err


def test_a_request_that_fits_in_the_shutdown_timeout_finishes(long_model_dir):
    # streamed, so that the signal comes while it runs on however fast a machine (signalled at its first event);
    # a shutdown timeout of an hour, so that it fits however slow the machine (CI's may be loaded)
    body = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    code, _, got, _, err = run_until_signal(long_model_dir, signal.SIGTERM, "--max-tokens-cap", "2000",
                                            "--shutdown-timeout", "3600", body=body, after=0.0, exit_within=3600)
    assert code == 0 and "Traceback" not in err, err
    events = [line[len("data: "):] for line in got["body"].splitlines() if line.startswith("data: ")]
    assert got["status"] == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 2000
    assert json.loads(events[-3])["choices"][0]["finish_reason"] == "length"
    assert got["at_signal"] < len(got["body"].splitlines())  # events came after the signal: it was running


def test_banner_flags_and_access_log(long_model_dir, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] ")
    port = free_port()
    proc = subprocess.Popen([*SERVE, "--model", str(long_model_dir), "--port", str(port), "--cache-budget", "4MB",
                             "--max-model-len", "300", "--dtype", "bfloat16", "--chat-template", str(template),
                             "--served-model-name", "tiny", "--log-level", "info", "--playground-run"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_healthy(proc, port), proc.stderr.read()[-2000:]
        url = f"http://127.0.0.1:{port}/v1"
        assert httpx.get(url + "/models").json()["data"][0]["max_model_len"] == 300
        r = httpx.post(url + "/completions", json={"prompt": "Once", "max_tokens": 299})
        assert r.status_code == 400 and "context of 300 tokens" in r.json()["error"]["message"]
        r = httpx.post(url + "/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 2, "return_token_ids": True}).json()
        assert r["prompt_token_ids"] == _encode(long_model_dir, "[user] hi\n[assistant] ")
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    out, err = proc.stdout.read(), proc.stderr.read()
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == f"kvql serve: loading {long_model_dir} on cpu (bfloat16) ..."
    assert lines[1].startswith(f"kvql serve: model {long_model_dir} | device cpu | dtype bfloat16 | context 300 tokens "
                               "| KV cache ") and lines[1].endswith(" MiB)")
    slots = int(lines[1].split("KV cache ")[1].split()[0])
    assert 0 < slots * 2 * 2 * 2 * 16 * 2 <= 4_000_000  # layers, K and V, kv heads, head dim, bf16 bytes
    assert "POST /v1/chat/completions 200 prompt=" in err and "POST /v1/completions 400 " in err
    assert any(line.startswith("kvql serve: WARNING --playground-run is on") and "every loopback client" in line
               for line in lines)


def _encode(model_dir, text):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir).encode(text)


@pytest.mark.parametrize("options, message", [
    (["--chat-template", "no template here"], "neither a file nor a Jinja template"),
    (["--chat-template", "{% for %}"], "not a valid Jinja template"),
    (["--max-model-len", "100000"], "over the model's context of 32768"),
])
def test_bad_flags_are_one_line_and_a_nonzero_exit(long_model_dir, options, message):
    out = subprocess.run([*SERVE, "--model", str(long_model_dir), "--port", str(free_port()), *options],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and message in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("options, message", [
    (["--salt-per-key"], "--salt-per-key needs --api-key"),
    (["--playground-run", "--no-playground"], "--playground-run needs the playground"),
    (["--playground-run", "--salt-per-key", "--api-key", "k"], "--playground-run with --salt-per-key"),
])
def test_usage_errors_come_before_the_load(long_model_dir, options, message):
    out = subprocess.run([*SERVE, "--model", str(long_model_dir), "--port", str(free_port()), *options],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and message in out.stderr and "Traceback" not in out.stderr
    assert "loading" not in out.stdout


class _Lines(logging.Handler):
    """The access log's lines, and an event set at each."""

    def __init__(self):
        super().__init__()
        self.lines, self.arrived = [], threading.Event()

    def emit(self, record):
        self.lines.append(record.getMessage())
        self.arrived.set()


def test_a_stream_the_client_leaves_logs_the_tokens_it_streamed(long_model_dir):
    # the access line of a cancelled stream once said prompt=0 cached=0 generated=0 after ~395 tokens
    model = kvql.model(str(long_model_dir), dtype="float32", cache_budget="64MB")
    handler, access = _Lines(), logging.getLogger("kvql.access")
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    try:
        with serving(create_app(model, max_tokens_cap=LONG["max_tokens"])) as url:
            body = {**LONG, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                received = 0
                for line in r.iter_lines():
                    if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                        received += 1
                        if received == 40:
                            break  # the client leaves mid-stream
            assert handler.arrived.wait(120), "no access line"
    finally:
        access.removeHandler(handler)
        model.close()
    (line,) = handler.lines
    counts = dict(field.split("=") for field in line.split() if "=" in field)
    assert line.startswith("POST /v1/completions 200 ")
    assert int(counts["prompt"]) == len(model.tokenizer.encode(LONG["prompt"]))
    assert int(counts["cached"]) == 0
    assert 40 <= int(counts["generated"]) < LONG["max_tokens"]  # what was generated when it was cancelled
