"""Where prompt tokens came from, with a disk tier (issue 28): from memory, from disk, or computed — in
`Model.stats()`, each `Completion`, a query's trace, the server's `/metrics` and the remote backend's stats."""

from __future__ import annotations

import asyncio
import logging
import re
import subprocess
import sys

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import kvql
from conftest import save_model, serving
from kvql.server.app import create_app

LENGTH = 60


@pytest.fixture(scope="module")
def prompts(tokenizer):
    """Three random prompts that share no first token."""
    g = torch.Generator().manual_seed(3)
    firsts = torch.randperm(len(tokenizer) - 1, generator=g)[:3] + 1
    return [[int(f)] + torch.randint(1, len(tokenizer), (LENGTH - 1,), generator=g).tolist() for f in firsts]


@pytest.fixture
def tiered(make_model, tmp_path):
    return make_model(cache_tokens=150, disk_cache=tmp_path / "tier", disk_budget=1 << 20)


def to_disk(model) -> None:
    """Everything the pool holds goes to the tier (eviction spills it)."""
    with model.engine._state:
        model.engine.tree.evict(model.engine.tree.total_tokens)


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_stats_split_cached_tokens_into_memory_and_disk(tiered, prompts):
    p, q = prompts[0], prompts[1]
    first = tiered.generate([p], max_tokens=3)[0]
    to_disk(tiered)
    tiered.generate([q], max_tokens=3)  # computed
    from_disk = tiered.generate([p], max_tokens=3)[0]
    from_ram = tiered.generate([p], max_tokens=3)[0]
    assert from_disk.token_ids == from_ram.token_ids == first.token_ids
    assert (from_disk.cached_tokens, from_disk.disk_tokens) == (LENGTH - 1, LENGTH - 1)
    assert (from_ram.cached_tokens, from_ram.disk_tokens) == (LENGTH - 1, 0)
    s = tiered.stats()
    assert s["disk_tokens"] == LENGTH - 1 and s["ram_tokens"] == LENGTH - 1
    assert s["ram_tokens"] + s["disk_tokens"] == s["cached_tokens"]
    assert s["computed_tokens"] == 2 * LENGTH + 2  # p and q once, then the last token of each repeat
    assert s["tier_read_tokens"] == LENGTH - 1 and s["tier_written_tokens"] >= LENGTH - 1


def test_without_a_tier_every_cached_token_is_from_memory(make_model, prompts):
    m = make_model()
    m.generate([prompts[0]] * 2, max_tokens=2)
    s = m.stats()
    assert s["disk_tokens"] == 0 and s["ram_tokens"] == s["cached_tokens"] > 0
    assert not any(k.startswith("tier_") for k in s)


QUERY = ('"The quick brown fox jumps over the lazy dog. Once upon a time there was a little robot who liked to '
         'count tokens. Question: what is the capital of France? Answer: [X]" where len(TOKENS(X)) < 3')


def test_a_query_trace_counts_the_tokens_read_back_from_disk(tiered):
    kvql.run_sync(QUERY, model=tiered)
    to_disk(tiered)
    trace = kvql.run_sync(QUERY, model=tiered).trace
    s = trace.summary()
    assert 0 < s["request_disk"] <= s["request_cached"]
    assert f"({s['request_disk']} read back from disk)" in trace.to_html()


def test_metrics_report_tokens_from_memory_from_disk_and_the_tier(tiered, prompts, tokenizer):
    with serving(create_app(tiered)) as url:
        p = prompts[0]
        body = {"model": "model", "prompt": p, "max_tokens": 2, "temperature": 0}
        httpx.post(url + "/v1/completions", json=body, timeout=60).raise_for_status()
        to_disk(tiered)
        httpx.post(url + "/v1/completions", json=body, timeout=60).raise_for_status()  # from disk
        httpx.post(url + "/v1/completions", json=body, timeout=60).raise_for_status()  # from memory
        m = metrics(url)
        assert m["kvql_prompt_tokens_from_disk_total"] == LENGTH - 1
        assert m["kvql_prompt_tokens_from_ram_total"] == LENGTH - 1
        assert m["kvql_cached_tokens_total"] == 2 * (LENGTH - 1)
        assert m["kvql_tier_read_tokens_total"] == LENGTH - 1 and m["kvql_tier_failed_reads_total"] == 0
        assert m["kvql_tier_bytes"] > 0 and m["kvql_tier_budget_bytes"] == 1 << 20
        assert {"kvql_tier_tokens", "kvql_tier_written_tokens_total", "kvql_tier_reads_in_flight"} <= m.keys()
        remote = kvql.model(url + "/v1", name="model", tokenizer=tokenizer).stats()
        assert (remote["disk_tokens"], remote["ram_tokens"]) == (LENGTH - 1, LENGTH - 1)


def test_metrics_without_a_tier_have_no_tier_families(make_model, prompts):
    with serving(create_app(make_model())) as url:
        body = {"model": "model", "prompt": prompts[0], "max_tokens": 2, "temperature": 0}
        for _ in range(2):
            httpx.post(url + "/v1/completions", json=body, timeout=60).raise_for_status()
        m = metrics(url)
    assert m["kvql_prompt_tokens_from_disk_total"] == 0
    assert m["kvql_prompt_tokens_from_ram_total"] == m["kvql_cached_tokens_total"] == LENGTH - 1
    assert not any(k.startswith("kvql_tier_") for k in m)


def test_the_servers_throughput_line_says_how_much_was_read_back_from_disk(tiered, prompts, caplog):
    from kvql.server.metrics import throughput_lines

    async def main():
        task = asyncio.create_task(throughput_lines(tiered, 0.2))
        await asyncio.sleep(0.05)
        await asyncio.to_thread(tiered.generate, [prompts[0]], max_tokens=2)
        to_disk(tiered)
        await asyncio.sleep(0.3)  # one line for the first request (computed), then one for the second
        await asyncio.to_thread(tiered.generate, [prompts[0]], max_tokens=2)
        await asyncio.sleep(0.3)
        task.cancel()

    with caplog.at_level(logging.INFO, logger="kvql.server"):
        asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("throughput")]
    first = next(i for i, line in enumerate(lines) if "hit rate 0% (0% from disk)" in line)
    assert any("hit rate 98% (98% from disk)" in line for line in lines[first + 1:]), lines


def test_kvql_run_stats_say_what_was_read_back_from_the_disk_cache(tmp_path, llama, tokenizer):
    save_model(tmp_path / "model", llama, tokenizer)
    (tmp_path / "q.lmql").write_text(f"{QUERY}\n")
    earlier = kvql.model(str(tmp_path / "model"), dtype="float32", disk_cache=tmp_path / "tier")
    answer = kvql.run_sync(QUERY, model=earlier).prompt
    earlier.close()  # its KV goes to the tier
    done = subprocess.run([sys.executable, "-m", "kvql.cli", "run", str(tmp_path / "q.lmql"), "--model",
                           str(tmp_path / "model"), "--dtype", "float32", "--disk-cache", str(tmp_path / "tier"),
                           "--stats"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert re.search(r"(\d+) from the cache, \1 of them read back from disk", done.stderr), done.stderr
    assert answer in done.stdout
