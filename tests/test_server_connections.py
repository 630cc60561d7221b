"""Idle and slow clients never lock the others out (issue 25): a `kvql serve` subprocess under a small open-file
limit, flooded with connections that never send a request."""

from __future__ import annotations

import resource
import socket

import httpx
import pytest

from conftest import free_port, save_model, start_server

LIMIT = 256  # the child's open-file limit, soft and hard: a `ulimit -n` it cannot raise


@pytest.fixture(scope="module")
def limited(tmp_path_factory, llama, tokenizer):
    model_dir = save_model(tmp_path_factory.mktemp("limited") / "model", llama, tokenizer)
    port = free_port()
    proc = start_server(model_dir, port, "--header-timeout", "3",
                        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, LIMIT)))
    yield port, proc
    proc.kill()
    proc.wait()


def _idle(port: int, n: int) -> list[socket.socket]:
    out = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # a request head that never ends
        out.append(s)
    return out


def test_more_idle_connections_than_the_file_limit_leave_new_clients_answered(limited):
    port, proc = limited
    idle = _idle(port, LIMIT + 100)
    try:
        # (before: new clients hung until they timed out, and accept errors flooded the log)
        r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30)
        assert r.status_code == 200
        name = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"][0]["id"]
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                       json={"model": name, "prompt": [5, 6, 7], "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        for s in idle:
            s.close()
    assert proc.poll() is None


def test_a_connection_that_never_finishes_its_request_head_is_closed(limited):
    port, _ = limited
    (s,) = _idle(port, 1)
    s.settimeout(60)  # --header-timeout 3: closed long before (without it: never)
    assert s.recv(100) == b""  # closed by the server, nothing answered
    s.close()
