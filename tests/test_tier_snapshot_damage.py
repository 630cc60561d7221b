"""A model with recurrent layers on a disk tier whose snapshots file (state_snapshots.FILE) is damaged or lacks a
snapshot (issue 51): the model starts without those snapshots, with one warning and no exception; no K/V is read
back from disk for a prefix that no snapshot lets a request resume from (admission caps a hybrid model's match at
its deepest snapshot); and `stats()` keeps its invariants (`check_stats`) with or without a tier."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import families as F
import kvql
from kvql.engine.cache import state_snapshots
from kvql.engine.cache.memory import MIN_LOAD_TOKENS
from kvql.engine.cache.state_snapshots import FILE

HYBRID = "lfm2"  # a short-convolution layer and an attention layer: K/V in the pool, a state per request
LENGTH = 40


def check_stats(s: dict) -> None:
    """What `Model.stats()` promises whatever ran: every counter >= 0; the cached prompt tokens are the ones from
    memory plus the ones read back from disk, none of them more than were read back; the pool's slots are free or
    held; an idle engine (nothing waiting, running or being read back) locks no node."""
    assert all(v >= 0 for v in s.values()), {k: v for k, v in s.items() if v < 0}
    assert 0 <= s["disk_tokens"] <= s["cached_tokens"] <= s["prompt_tokens"]
    assert s["ram_tokens"] == s["cached_tokens"] - s["disk_tokens"]
    assert s["computed_tokens"] == s["prompt_tokens"] - s["cached_tokens"] <= s["forward_tokens"]
    assert 0.0 <= s["hit_rate"] <= 1.0
    assert s["hit_rate"] == (s["cached_tokens"] / s["prompt_tokens"] if s["prompt_tokens"] else 0.0)
    assert s["accepted_tokens"] <= s["drafted_tokens"]
    assert s["cache_tokens"] + s["free_slots"] <= s["pool_slots"] and s["cache_bytes"] <= s["cache_budget_bytes"]
    assert s["locked_nodes"] <= s["tree_nodes"]
    if "tier_bytes" in s:
        assert s["disk_tokens"] <= s["tier_read_tokens"]
    if "snapshots" in s:
        assert s["snapshot_bytes"] <= s["snapshot_budget_bytes"]
    if s["waiting"] == s["running"] == s.get("tier_reads_in_flight", 0) == 0:
        assert s["locked_nodes"] == 0 and s["cache_tokens"] + s["free_slots"] == s["pool_slots"]


@pytest.fixture(scope="module")
def hybrid(tokenizer):
    return F.build(*F.FAMILIES[HYBRID], len(tokenizer), tokenizer.eos_token_id)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    """Three prompts sharing no first token, so each is its own tier file."""
    g = torch.Generator().manual_seed(21)
    firsts = torch.randperm(len(tokenizer) - 1, generator=g)[:3] + 1
    return [[int(f)] + torch.randint(1, len(tokenizer), (LENGTH - 1,), generator=g).tolist() for f in firsts]


def open_model(hf, tokenizer, directory):
    return kvql.Model(hf, tokenizer, cache_budget=8 << 20, disk_cache=directory, cache_save_interval=0)


@pytest.fixture
def saved(hybrid, tokenizer, prompts, tmp_path):
    """A closed hybrid model's tier in `tmp_path`: the prompts' K/V files and their snapshots; (answers, the
    snapshots file, the model's fingerprint digest: what the file's checksum is keyed by)."""
    a = open_model(hybrid, tokenizer, tmp_path)
    answers = [c.token_ids for c in a.generate(prompts, max_tokens=4)]
    check_stats(a.stats())
    path, digest = a.engine.tier.path / FILE, a.engine.tier.digest
    a.close()
    assert path.is_file()
    return answers, path, digest


def _cut_tail(path, digest):  # the header whole, the tensors' bytes short: what safetensors itself refuses
    path.write_bytes(path.read_bytes()[:-64])


def _cut_head(path, digest):
    path.write_bytes(path.read_bytes()[:5])


def _garbage(path, digest):
    path.write_bytes(os.urandom(path.stat().st_size))


def _header(text: bytes):
    def damage(path, digest):
        raw = path.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])
    return damage


def _rewrite(path, digest, entries=None):
    """The file written again as kvql writes it, its checksum keyed by `digest` over `entries` (None: the same)."""
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    text = meta["entries"] if entries is None else entries
    sha256 = state_snapshots._sha256(digest, text, tensors)
    save_file(tensors, str(path), metadata={**meta, "entries": text, "sha256": sha256})


LAYOUT = json.dumps([[None, 3, "00", {"layers": {"9": {}}}]])  # a layer the model does not have
DAMAGES = {
    "truncated": _cut_tail,
    "truncated to its first bytes": _cut_head,
    "garbage": _garbage,
    "a header that is not JSON": _header(b"\xff\xfe not json"),
    "a header that is not an object": _header(b"[1, 2, 3]"),
    "another model's digest": lambda p, digest: _rewrite(p, "0" * 64),
    # crafted with this model's checksum (only a writer of the directory can): still no exception at start
    "entries not a list": lambda p, digest: _rewrite(p, digest, json.dumps({"a": 1})),
    "an entry of another shape": lambda p, digest: _rewrite(p, digest, json.dumps([[None, "x", "zz", {}]])),
    "a state of another layout": lambda p, digest: _rewrite(p, digest, LAYOUT),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_snapshots_file_is_a_start_without_snapshots_and_one_warning(
        saved, hybrid, tokenizer, prompts, tmp_path, caplog, damage):
    answers, path, digest = saved
    DAMAGES[damage](path, digest)
    caplog.set_level(logging.WARNING)
    b = open_model(hybrid, tokenizer, tmp_path)
    try:
        warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warned) == 1 and FILE in warned[0], warned
        s = b.stats()
        assert s["snapshots"] == 0 and s["tier_tokens"] > 0  # the K/V files stay: no state to resume them from
        again = b.generate(prompts, max_tokens=4)
        assert [c.token_ids for c in again] == answers
        assert all(c.cached_tokens == c.disk_tokens == 0 for c in again)
        s = b.stats()
        assert s["tier_read_tokens"] == s["disk_tokens"] == 0  # nothing read back that could not be served
        check_stats(s)
        b.check_integrity()
    finally:
        b.close()


def test_no_kv_is_read_back_past_the_deepest_snapshot(hybrid, tokenizer, prompts, tmp_path):
    """A prompt's K/V is on disk in full but the snapshots file lacks the state after all but its last token
    (the deepest left is about halfway): the read back stops there, and counts only what was served."""
    p, half = prompts[0], LENGTH // 2
    a = open_model(hybrid, tokenizer, tmp_path)
    want = a.generate([p[:half + 1]], max_tokens=4)[0].token_ids  # snapshots about halfway
    answer = a.generate([p], max_tokens=4)[0].token_ids  # its K/V, and a snapshot after p[:-1]
    snapshots = a.engine.memory.snapshots
    with a.engine._state:
        snapshots._drop(state_snapshots._key(None, p[:-1]))
    cap = snapshots.deepest(None, p, LENGTH)
    assert half <= cap < LENGTH - 1 - MIN_LOAD_TOKENS  # enough K/V past the cap that a read would take it
    a.close()
    b = open_model(hybrid, tokenizer, tmp_path)
    try:
        c = b.generate([p], max_tokens=4)[0]
        assert c.token_ids == answer and c.cached_tokens == c.disk_tokens == cap
        s = b.stats()
        assert s["tier_read_tokens"] == s["disk_tokens"] == cap
        check_stats(s)
        assert b.generate([p[:half + 1]], max_tokens=4)[0].token_ids == want
        check_stats(b.stats())
        b.check_integrity()
    finally:
        b.close()


def test_stats_keep_their_invariants_on_a_hybrid_model_resumed_from_disk(saved, hybrid, tokenizer, prompts, tmp_path):
    answers, _, _ = saved
    b = open_model(hybrid, tokenizer, tmp_path)
    try:
        again = b.generate(prompts, max_tokens=4)
        assert [c.token_ids for c in again] == answers
        assert all(c.cached_tokens == c.disk_tokens == LENGTH - 1 for c in again)
        check_stats(b.stats())
        b.generate(prompts, max_tokens=4)  # from memory now
        s = b.stats()
        check_stats(s)
        assert s["ram_tokens"] == s["disk_tokens"] == 3 * (LENGTH - 1)
    finally:
        b.close()


def test_stats_keep_their_invariants_over_a_tier_smaller_than_the_working_set(make_model, tokenizer, prompts, tmp_path):
    """A Llama whose pool holds one prompt: the others are spilled, read back, evicted again."""
    m = make_model(cache_tokens=LENGTH + 20, disk_cache=tmp_path, disk_budget=1 << 20)
    for _ in range(3):
        for p in prompts:
            m.generate([p], max_tokens=3)
            check_stats(m.stats())
    m.generate(prompts, max_tokens=3)
    s = m.stats()
    check_stats(s)
    assert s["disk_tokens"] > 0 and s["evictions"] > 0
    m.check_integrity()
