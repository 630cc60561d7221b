"""kvql serve behind vllm-router, and scripts/router_check.py's pieces that need no server.

The router tests (marked `router`) run vllm-router in front of two kvql serve apps on loopback serving the
tiny test model, nothing in between; the first run installs it as scripts/router_check.py does (pip, PyPI,
into ${KVQL_ROUTER_VENV:-~/.cache/kvql/router-venv}). `./dev test -m "not router"` leaves them out. The whole
measurement (two SmolLM2 workers, ~3 minutes) is the script itself: `.venv/bin/python scripts/router_check.py`.
"""

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest

import kvql
from kvql.server.app import create_app
from conftest import serving

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "router_check.py"
needs_router = pytest.mark.router
PREFIX = "Question: what is the capital of France? Answer: Paris.\nQuestion: how many legs does a spider have? Answer:"


@pytest.fixture(scope="module")
def rc():
    spec = importlib.util.spec_from_file_location("router_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_workloads_have_48_distinct_inputs_over_one_or_two_prefixes(rc):
    shared, two = rc.workload("shared", 48), rc.workload("two-task", 48)
    assert len(set(shared)) == len(set(two)) == 48
    assert {p for p, _ in shared} == {rc.QA_PREFIX}
    assert [p for p, _ in two].count(rc.QA_PREFIX) == [p for p, _ in two].count(rc.WORD_PREFIX) == 24
    assert rc.workload("two-task", 48) == two  # the mix is fixed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _router(router_bin: Path, workers: list[str], policy: str):
    """vllm-router over `workers`: yields (its URL, its Prometheus URL) once its /health answers 200."""
    port, prom = _free_port(), _free_port()
    proc = subprocess.Popen([str(router_bin), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
                             "--policy", policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom),
                             "--worker-startup-check-interval", "1", "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            assert proc.poll() is None, f"vllm-router exited with {proc.returncode}"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.1)
        else:
            raise AssertionError("vllm-router did not become healthy")
        yield url, f"http://127.0.0.1:{prom}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def _counter(prom_url: str, prefix: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(prom_url + "/metrics").text.splitlines()
               if line.startswith(prefix))


@pytest.fixture(scope="module")
def router_bin(rc) -> Path:
    """The vllm-router executable, installed on first use."""
    return rc.ensure_router()


@pytest.fixture(scope="module")
def two_workers(tokenizer, llama):
    models = [kvql.Model(llama, tokenizer, name="tiny", cache_budget=4 << 20) for _ in range(2)]
    with serving(create_app(models[0])) as a, serving(create_app(models[1])) as b:
        yield [a, b], models


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name} at {url}")


@needs_router
def test_text_prompts_through_the_cache_aware_router_answer_as_one_worker_and_are_routed_on_rendered_ids(
        two_workers, router_bin):
    (a, b), models = two_workers
    questions = [f"{PREFIX} ({i})" for i in range(6)]
    want = [c.text for c in models[0].generate(questions, max_tokens=5)]
    with _router(router_bin, [a, b], "cache_aware") as (url, prom):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        got = [client.completions.create(model="tiny", prompt=q, max_tokens=5, temperature=0).choices[0].text
               for q in questions]
        rendered = _counter(prom, 'vllm_router_kv_routing_inputs_total{transport="http",result="render"}')
    assert got == want
    assert rendered == 2 * len(questions)  # the router asks every worker's /v1/completions/render, per request


@needs_router
def test_chat_and_streams_pass_through_the_router(two_workers, router_bin):
    (a, b), models = two_workers
    with _router(router_bin, [a, b], "round_robin") as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        direct = openai.OpenAI(base_url=a + "/v1", api_key="none", max_retries=0)
        stream = client.completions.create(model="tiny", prompt=PREFIX, max_tokens=6, temperature=0, stream=True)
        plain = direct.completions.create(model="tiny", prompt=PREFIX, max_tokens=6, temperature=0)
        assert "".join(c.choices[0].text for c in stream) == plain.choices[0].text
        ids = client.completions.create(model="tiny", prompt=[5, 17, 42, 9], max_tokens=4, temperature=0)
        assert ids.choices[0].text == direct.completions.create(model="tiny", prompt=[5, 17, 42, 9], max_tokens=4,
                                                                temperature=0).choices[0].text


@needs_router
def test_a_field_kvql_does_not_implement_is_refused_through_the_router(two_workers, router_bin):
    with _router(router_bin, two_workers[0], "round_robin") as (url, _):
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "skip_special_tokens": False})
    assert r.status_code == 400 and "skip_special_tokens" in r.text
