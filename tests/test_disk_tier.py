"""The disk tier (kvql/engine/cache/disk_tier.py; `kvql.Model(..., disk_cache=DIR, disk_budget=...)`): KV evicted from
the pool goes to files and is read back instead of computed again; the tree is rebuilt from the files at start.

Every test checks outcomes a wrong tier would change: token-identical greedy answers (fp32, against an uncached
reference), the stats that say where tokens came from, the files on disk, and `check_integrity()`. None depends
on timing: a request whose prefix is being read back waits for the read, so what is read back is deterministic.
"""

from __future__ import annotations

import concurrent.futures
import shutil
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import kvql
from conftest import reference_greedy, tiny_model
from kvql.engine.cache import disk_tier, memory
from kvql.engine.cache.tier_file import SUFFIX
from kvql.engine.cache.kv_pool import KVPool

LENGTH = 60  # tokens per prompt: more than 1/3 of the 150-token pools below
OUT = 4  # tokens generated per request


def distinct_prompts(seed: int, count: int, vocab: int, length: int = LENGTH) -> list[list[int]]:
    """`count` random prompts of `length` tokens that share no first token (no prefix shared by chance)."""
    g = torch.Generator().manual_seed(seed)
    firsts = torch.randperm(vocab - 1, generator=g)[:count] + 1
    return [[int(f)] + torch.randint(1, vocab, (length - 1,), generator=g).tolist() for f in firsts]


def reference(hf_model, tokenizer, prompts, max_tokens: int = OUT) -> list[list[int]]:
    """Uncached greedy answers (conftest.reference_greedy), on one thread: for a model this small, OpenMP's
    wake-ups cost more than a second thread gains (25x on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [reference_greedy(hf_model, p, max_tokens, tokenizer.eos_token_id) for p in prompts]
    finally:
        torch.set_num_threads(threads)


def tier_files(model) -> list[Path]:
    """The tier's files on disk (written ones: call `settle` first)."""
    return sorted(p for p in model.engine.tier.path.iterdir() if p.name.endswith(SUFFIX))


def settle(model) -> None:
    """Wait until the tier's writer has written or deleted everything queued."""
    model.engine.tier.flush()


def file_tokens(path: Path) -> list[int]:
    """The tokens a tier file's KV follows and holds: its prefix, then its own tokens."""
    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor("prefix").tolist() + f.get_tensor("tokens").tolist()


def files_of(model, prompt: list[int]) -> list[Path]:
    """The tier files whose tokens lie on `prompt`'s path."""
    return [p for p in tier_files(model) if prompt[:len(t := file_tokens(p))] == t[:len(prompt)]]


def spelled(model, tokens: list[int], salt=None) -> tuple[int, int]:
    """How many leading `tokens` the tree spells (in the pool or on disk), and how many of those are on disk
    (read-only: no node is split)."""
    tree = model.engine.tree
    node, pos, disk = tree.roots.get(salt), 0, 0
    while node is not None and pos < len(tokens):
        child = node.children.get(tokens[pos])
        if child is None:
            break
        n = 0
        while n < len(child.key) and pos + n < len(tokens) and child.key[n] == tokens[pos + n]:
            n += 1
        disk += n if child.slots is None else 0
        pos += n
        if n < len(child.key):
            break
        node = child
    return pos, disk


def ask(model, prompt, salt=None):
    """One request alone: its completion and how many of its prompt tokens were read back from disk for it."""
    before = model.stats()["disk_tokens"]
    (c,) = model.generate([prompt], max_tokens=OUT, cache_salt=salt)
    return c, model.stats()["disk_tokens"] - before


@pytest.fixture
def tiered(make_model, tmp_path):
    """`tiered(cache_tokens=..., **kw)`: a model over the shared tiny Llama with a disk tier in `tmp_path/tier`
    (1 MB budget unless `disk_budget=` says otherwise)."""

    def make(cache_tokens: int = 150, **kw):
        kw.setdefault("disk_budget", 1 << 20)
        return make_model(cache_tokens=cache_tokens, disk_cache=kw.pop("disk_cache", tmp_path / "tier"), **kw)

    return make


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return distinct_prompts(seed=1, count=5, vocab=len(tokenizer))


@pytest.fixture(scope="module")
def answers(llama, tokenizer, prompts):
    return reference(llama, tokenizer, prompts)


# -- exactness under pressure ---------------------------------------------------------------------------------
def test_a_working_set_larger_than_the_pool_is_read_back_from_disk_and_answered_exactly(make_model, tiered, prompts,
                                                                                        answers):
    on, off = tiered(), make_model(cache_tokens=150)  # 150 slots for 5 prompts of 60 tokens
    for rnd in range(3):
        for p, want in zip(prompts, answers):
            for m in (on, off):
                (c,) = m.generate([p], max_tokens=OUT)
                assert c.token_ids == want, f"round {rnd}"
                if m is on and rnd > 0:
                    assert c.cached_tokens == len(p) - 1  # all of it from the cache (invariant 3: not the last)
        on.check_integrity()
        off.check_integrity()
    s, t = on.stats(), off.stats()
    assert t["cached_tokens"] == 0  # round robin over LRU: without the tier nothing survives
    assert s["disk_tokens"] == 2 * sum(len(p) - 1 for p in prompts)  # rounds 2 and 3, read back from disk
    assert s["tier_read_tokens"] == s["disk_tokens"] and s["tier_failed_reads"] == 0
    assert s["computed_tokens"] == sum(len(p) for p in prompts) + 2 * len(prompts) < t["computed_tokens"]
    assert s["locked_nodes"] == 0 and s["tier_reads_in_flight"] == 0


def batch_over(prompts) -> list[list[int]]:
    """The prompts again, longer ones that continue them and shorter ones that branch off them."""
    return prompts + [p + [7, 8, 9] for p in prompts] + [p[:30] + [11, 12] for p in prompts]


def test_requests_batched_with_reads_back_in_flight_keep_every_invariant_at_every_step(tiered, llama, tokenizer,
                                                                                      prompts):
    m = tiered(background=False, max_batch_tokens=32)  # prefills take several steps
    for p in prompts:  # one at a time: the older ones go to disk
        m._submit([p], max_tokens=OUT)
        m.engine.run_until_idle()
    batch = batch_over(prompts)
    groups = m._submit(batch, max_tokens=OUT)
    beside = 0  # most reads in flight seen while requests computed
    while not m.engine.idle():
        m.engine.step()
        m.check_integrity()  # between steps, reads in flight hold their slots (invariant 2)
        s = m.stats()
        beside = max(beside, s["tier_reads_in_flight"] if s["running"] else 0)
    assert beside >= 2
    assert [g.future.result()[0].token_ids for g in groups] == reference(llama, tokenizer, batch)
    s = m.stats()
    assert s["disk_tokens"] > 0 and s["tier_failed_reads"] == 0
    assert s["locked_nodes"] == 0 and m.engine.tree.locked_tokens == 0  # invariant 6
    assert s["tier_reads_in_flight"] == 0


def test_one_generate_call_of_many_prompts_over_the_tier_is_exact(tiered, llama, tokenizer, prompts):
    m = tiered()
    for p in prompts:
        m.generate([p], max_tokens=OUT)
    batch = batch_over(prompts)
    out = m.generate(batch, max_tokens=8)
    assert [c.token_ids for c in out] == reference(llama, tokenizer, batch, 8)
    m.check_integrity()
    s = m.stats()
    assert s["disk_tokens"] > 0 and s["preemptions"] > 0  # reads back and preemptions under pressure
    assert s["locked_nodes"] == 0 and s["tier_reads_in_flight"] == 0


def test_a_prefix_a_running_request_computes_while_it_is_read_back_keeps_the_computed_copy(
        tiered, monkeypatch, llama, tokenizer, prompts, answers):
    p = prompts[0]
    m = tiered(cache_tokens=200, background=False, max_batch_tokens=20)
    m._submit([p], max_tokens=OUT)
    m.engine.run_until_idle()
    m.engine.tree.evict(m.engine.tree.total_tokens)  # all of it to disk
    assert spelled(m, p) == (len(p), len(p))
    # `r` shares 23 tokens with `p` and computes them (no read back may start): 20, then the rest of its 35
    r = p[:23] + [t % 399 + 1 for t in p[23:35]]
    monkeypatch.setattr(memory, "MIN_LOAD_TOKENS", 10**9)
    (rg,) = m._submit([r], max_tokens=OUT)
    m.engine.step()
    monkeypatch.setattr(memory, "MIN_LOAD_TOKENS", 16)
    # `p` itself: the rest of its path (from 20) is read back while `r`'s next chunk computes 3 tokens of it
    # (with 8 or more, `p` would wait for `r` instead: in-batch dedup)
    (pg,) = m._submit([p], max_tokens=OUT)
    m.engine.step()
    assert m.stats()["tier_reads_in_flight"] == 1
    assert len(m.engine.scheduler.running) == 1  # `p` waits for its read
    m.check_integrity()
    while not m.engine.idle():
        m.engine.step()
        m.check_integrity()
    assert rg.future.result()[0].token_ids == reference(llama, tokenizer, [r])[0]
    (c,) = pg.future.result()
    assert c.token_ids == answers[0] and c.cached_tokens == len(p) - 1
    s = m.stats()
    assert s["disk_tokens"] == len(p) - 1 - 23  # the 3 tokens `r` computed meanwhile were not read back
    assert s["locked_nodes"] == 0


# -- damaged files --------------------------------------------------------------------------------------------
def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) * 2 // 3] ^= 0xFF  # a byte of K or V (the header is at the front, K and V make up most)
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


def delete(path: Path) -> None:
    path.unlink()


@pytest.mark.parametrize("damage", [flip, truncate, delete])
def test_a_damaged_truncated_or_missing_tier_file_is_a_miss_and_the_answer_stays_exact(tiered, prompts, answers,
                                                                                      damage):
    m = tiered()
    for p in prompts[:3]:  # the first goes to disk
        m.generate([p], max_tokens=OUT)
    settle(m)
    assert spelled(m, prompts[0])[1] == len(prompts[0])
    hit = files_of(m, prompts[0])
    assert hit
    for path in hit:
        damage(path)
    c, from_disk = ask(m, prompts[0])
    assert c.token_ids == answers[0]
    assert from_disk == 0 and c.cached_tokens == 0  # computed again
    s = m.stats()
    assert s["tier_failed_reads"] >= 1 and s["tier_read_tokens"] == 0
    m.check_integrity()
    settle(m)
    assert not any(path.exists() for path in hit)  # a file that failed is gone
    c, _ = ask(m, prompts[0])  # and the recomputed KV serves the next request
    assert c.token_ids == answers[0] and c.cached_tokens == len(prompts[0]) - 1
    m.check_integrity()


def test_a_damaged_file_found_at_start_is_a_miss_too(tiered, prompts, answers):
    m = tiered()
    for p in prompts[:2]:
        m.generate([p], max_tokens=OUT)
    m.close()
    again = tiered()
    hit = files_of(again, prompts[0])
    assert hit and spelled(again, prompts[0])[1] == len(prompts[0])
    for path in hit:
        flip(path)
    c, from_disk = ask(again, prompts[0])
    assert c.token_ids == answers[0] and from_disk == 0
    assert again.stats()["tier_failed_reads"] >= 1
    c, from_disk = ask(again, prompts[1])  # an intact file still serves
    assert c.token_ids == answers[1] and from_disk == len(prompts[1]) - 1
    again.check_integrity()


# -- cache partitions -----------------------------------------------------------------------------------------
def test_kv_spilled_under_one_salt_is_never_served_to_another(tiered, prompts, answers):
    m = tiered()
    p = prompts[0]
    m.generate([p], max_tokens=OUT, cache_salt="alice")
    for q in prompts[1:3]:  # pushes alice's KV to disk
        m.generate([q], max_tokens=OUT, cache_salt="alice")
    assert spelled(m, p, "alice")[1] == len(p)
    for salt in ("bob", None):
        c, from_disk = ask(m, p, salt)
        assert c.token_ids == answers[0] and c.cached_tokens == 0 and from_disk == 0
    assert m.stats()["tier_read_tokens"] == 0
    m.check_integrity()
    m.close()
    # after a restart too: the files say their partition, and the tree is rebuilt under it
    again = tiered()
    assert spelled(again, p, "alice")[1] == len(p)
    assert spelled(again, p, "carol") == (0, 0)
    c, from_disk = ask(again, p, "carol")
    assert c.token_ids == answers[0] and c.cached_tokens == 0 and from_disk == 0
    c, from_disk = ask(again, p, "alice")
    assert c.token_ids == answers[0] and from_disk == len(p) - 1
    again.check_integrity()


# -- restart --------------------------------------------------------------------------------------------------
def test_a_new_model_on_the_same_directory_serves_earlier_prompts_from_disk(tiered, prompts, answers):
    m = tiered()
    for p in prompts:
        m.generate([p], max_tokens=OUT)
    m.close()  # writes what only the pool held
    again = tiered()
    s = again.stats()
    assert s["cache_tokens"] == 0 and s["tier_tokens"] >= sum(len(p) for p in prompts)
    for p in prompts:
        assert spelled(again, p) == (len(p), len(p))
    for p, want in zip(prompts, answers):
        c, from_disk = ask(again, p)
        assert c.token_ids == want and from_disk == len(p) - 1
    again.check_integrity()
    assert again.stats()["computed_tokens"] == len(prompts)


@pytest.mark.parametrize("other", ["weights", "dtype"])
def test_a_model_with_another_fingerprint_uses_none_of_the_files(tiered, tokenizer, llama, prompts, other):
    m = tiered()
    for p in prompts[:2]:
        m.generate([p], max_tokens=OUT)
    m.close()
    mine = m.engine.tier.path
    files = sorted(p.name for p in mine.iterdir())
    hf = tiny_model(tokenizer, seed=1) if other == "weights" else tiny_model(tokenizer).to(torch.bfloat16)
    b = tiered(hf_model=hf)  # its own directory under disk_cache
    theirs = b.engine.tier.path
    assert theirs != mine and b.stats()["tier_tokens"] == 0
    b.close()
    for f in mine.iterdir():  # the first model's files copied into it: none is used
        shutil.copy(f, theirs)
    b = tiered(hf_model=hf)
    assert b.stats()["tier_tokens"] == 0 and b.stats()["tier_bytes"] == 0
    settle(b)
    assert tier_files(b) == []  # another model's files are removed from its directory
    c, from_disk = ask(b, prompts[0])
    assert from_disk == 0 and c.cached_tokens == 0
    if other == "weights":
        assert c.token_ids == reference(hf, tokenizer, prompts[:1])[0]
    b.check_integrity()
    assert sorted(p.name for p in mine.iterdir()) == files  # the first model's own are untouched


def test_closing_with_a_read_back_in_flight_finishes_it_and_leaves_a_usable_tier(tiered, prompts, answers):
    m = tiered(background=False)
    for p in prompts[:3]:
        m._submit([p], max_tokens=OUT)
        m.engine.run_until_idle()
    (g,) = m._submit([prompts[0]], max_tokens=OUT)
    m.engine.step()
    assert m.stats()["tier_reads_in_flight"] == 1
    m.close()
    with pytest.raises(concurrent.futures.CancelledError):
        g.future.result()
    again = tiered()
    for p, want in zip(prompts[:3], answers):
        c, from_disk = ask(again, p)
        assert c.token_ids == want and from_disk == len(p) - 1
    again.check_integrity()


def test_clear_cache_empties_the_tier_too(tiered, prompts):
    m = tiered()
    for p in prompts:
        m.generate([p], max_tokens=OUT)
    assert m.stats()["tier_tokens"] > 0
    m.clear_cache()
    settle(m)
    s = m.stats()
    assert s["cache_tokens"] == s["tier_tokens"] == s["tier_bytes"] == 0
    assert tier_files(m) == []
    m.check_integrity()


def test_a_pool_off_the_cpu_is_refused_rather_than_left_waiting_for_reads(tmp_path):
    pool = KVPool(num_layers=2, kv_heads=2, head_dim=16, num_slots=8, dtype=torch.float32, device="meta")
    with pytest.raises(ValueError, match="disk_cache"):
        disk_tier.DiskTier(tmp_path, {"model": "x"}, pool, 1 << 20)


# -- budget ---------------------------------------------------------------------------------------------------
def test_the_tier_stays_within_its_budget_dropping_the_least_recently_used_first(tiered, tokenizer, llama):
    prompts = distinct_prompts(seed=3, count=6, vocab=len(tokenizer))
    per_prompt = (LENGTH + OUT) * 512  # bytes of K and V per token: 2 layers x 2 heads x 16 x fp32, K and V
    budget = int(2.5 * per_prompt)
    m = tiered(cache_tokens=100, disk_budget=budget)
    for i, p in enumerate(prompts):
        m.generate([p], max_tokens=OUT)
        settle(m)
        s = m.stats()
        assert s["tier_bytes"] <= budget
        assert s["tier_bytes"] == sum(f.stat().st_size for f in tier_files(m))  # the count is the files'
    m.check_integrity()
    # the pool holds the newest; the tier the ones evicted last; the oldest are gone
    assert spelled(m, prompts[-1])[1] == 0 and spelled(m, prompts[-1])[0] == LENGTH
    assert spelled(m, prompts[-2])[1] == LENGTH
    assert spelled(m, prompts[0]) == (0, 0) and spelled(m, prompts[1]) == (0, 0)
    c, from_disk = ask(m, prompts[-2])
    assert c.token_ids == reference(llama, tokenizer, prompts[-2:-1])[0] and from_disk == LENGTH - 1
    m.close()
    kept = [f.name for f in tier_files(m)]
    assert sum(f.stat().st_size for f in tier_files(m)) <= budget
    # at the next start, every file kept is one the tree can use
    again = tiered(cache_tokens=100, disk_budget=budget)
    settle(again)
    assert [f.name for f in tier_files(again)] == kept
    assert again.stats()["tier_bytes"] == sum(f.stat().st_size for f in tier_files(again)) <= budget
    again.check_integrity()


def test_over_its_budget_the_tier_drops_continuations_before_the_prefix_they_follow(tiered, tokenizer, llama):
    shared, b1, b2 = distinct_prompts(seed=5, count=3, vocab=len(tokenizer), length=20)
    prefix = shared + shared[::-1]  # 40 tokens, then two 20-token branches
    first, second = prefix + b1, prefix + b2
    budget = 48 * 512 + 4 * 1024  # K/V of 48 tokens and a few files' headers: not all 86 computed tokens
    m = tiered(cache_tokens=400, disk_budget=budget)
    m.generate([first], max_tokens=OUT)
    m.generate([second], max_tokens=OUT)
    m.close()  # writes the tree to the tier, then keeps what its budget holds
    files = [f.name for f in tier_files(m)]
    again = tiered(cache_tokens=400, disk_budget=budget)
    settle(again)
    assert [f.name for f in tier_files(again)] == files  # each file kept follows a file kept: all are used
    assert spelled(again, prefix) == (40, 40)  # the shared prefix, the most recently used, is kept
    assert spelled(again, first)[0] == 40  # the older branch went first
    c, from_disk = ask(again, second)
    assert c.token_ids == reference(llama, tokenizer, [second])[0] and from_disk >= 40
    again.check_integrity()


def test_eviction_stages_no_more_than_the_writer_allows_and_drops_the_rest(tiered, monkeypatch, prompts):
    m = tiered(cache_tokens=400, background=False)
    for p in prompts:
        m._submit([p], max_tokens=OUT)
        m.engine.run_until_idle()
    tier = m.engine.tier
    monkeypatch.setattr(disk_tier, "MAX_STAGED", 100 * tier._token_bytes)
    gate = threading.Event()
    write = tier._write
    monkeypatch.setattr(tier, "_write", lambda file, salt: gate.wait() and write(file, salt))  # the writer waits
    try:
        freed = m.engine.tree.evict(m.engine.tree.total_tokens)
        assert freed == sum(len(p) + OUT - 1 for p in prompts)
        assert 0 < tier.staged_bytes <= disk_tier.MAX_STAGED
        assert m.engine.tree.disk_tokens * tier._token_bytes <= disk_tier.MAX_STAGED
    finally:
        gate.set()
    settle(m)
    m.check_integrity()


# -- options --------------------------------------------------------------------------------------------------
def test_cache_dir_is_another_name_for_disk_cache_and_both_together_are_refused(tmp_path, llama, tokenizer, prompts):
    with pytest.raises(ValueError, match="another name"):
        kvql.model("random", disk_cache=tmp_path / "a", cache_dir=tmp_path / "b")
    with pytest.raises(ValueError, match="another name"):
        kvql.Model(llama, tokenizer, cache_budget="1MB", disk_cache=tmp_path / "a", cache_dir=tmp_path / "b")
    m = kvql.Model(llama, tokenizer, cache_budget="1MB", cache_dir=tmp_path / "a", disk_budget="1MB")
    m.generate([prompts[0]], max_tokens=OUT)
    m.close()
    again = kvql.Model(llama, tokenizer, cache_budget="1MB", disk_cache=tmp_path / "a")
    assert spelled(again, prompts[0]) == (len(prompts[0]), len(prompts[0]))
    assert again.stats()["tier_budget_bytes"] != 1 << 20  # its own default budget
    again.close()


def test_a_disk_budget_without_disk_cache_is_refused(llama, tokenizer):
    with pytest.raises(ValueError, match="disk_budget"):
        kvql.model("random", disk_budget="1GB")
    with pytest.raises(ValueError, match="disk_budget"):
        kvql.Model(llama, tokenizer, cache_budget="1MB", disk_budget="1GB")


def test_a_server_model_takes_no_disk_cache(tmp_path):
    with pytest.raises(TypeError, match="disk_cache"):
        kvql.model("http://127.0.0.1:9/v1", disk_cache=tmp_path)
    with pytest.raises(TypeError, match="disk_budget"):
        kvql.model("http://127.0.0.1:9/v1", disk_budget="1GB")
