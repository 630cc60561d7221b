"""A cache that survives restarts: snapshots of the radix tree and its KV (engine/snapshot.py, cache_dir.py)."""

from __future__ import annotations

import copy
import logging
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvql
from conftest import free_port, random_prompts, reference_greedy, start_server, tiny_model
from kvql.engine import snapshot
from kvql.engine.cache_dir import snapshot_path
from kvql.engine.snapshot import SnapshotError, read_header


def expected(hf_model, tokenizer, prompts, max_tokens):
    return [reference_greedy(hf_model, p, max_tokens, tokenizer.eos_token_id) for p in prompts]


def tree_contents(model) -> list[tuple]:
    """Every node as (salt, tokens from its root to its end), least recently used first."""
    tree = model.engine.tree
    out = []
    for salt, root in tree.roots.items():
        stack = [(c, []) for c in root.children.values()]
        while stack:
            node, above = stack.pop()
            path = above + node.key
            out.append((node.last_access, salt, tuple(path)))
            stack.extend((c, path) for c in node.children.values())
    return [(salt, path) for _, salt, path in sorted(out)]


def cache_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvql.cache" and r.levelno >= logging.WARNING]


# -- explicit save / load ---------------------------------------------------------------------------
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), count=st.integers(1, 10), salted=st.booleans(),
       slots=st.one_of(st.none(), st.integers(80, 400)))
def test_save_then_load_keeps_the_tree_its_lru_order_and_exact_outputs(make_model, llama, tokenizer, seed, count,
                                                                       salted, slots):
    prompts = random_prompts(seed, count, len(tokenizer))
    a = make_model()
    for i, p in enumerate(prompts):  # one at a time: a known LRU order
        a.generate([p], max_tokens=4, cache_salt=("tenant" if salted and i % 2 else None))
    with tempfile.TemporaryDirectory() as d:
        saved = a.save_cache(Path(d) / "snap.safetensors")
        assert saved["tokens"] == a.engine.tree.total_tokens
        b = make_model(cache_tokens=slots or 4096)
        loaded = b.load_cache(Path(d) / "snap.safetensors")
    b.check_integrity()
    assert loaded["tokens"] == b.engine.tree.total_tokens == min(saved["tokens"], b.engine.pool.num_slots)
    assert loaded["dropped"] == saved["tokens"] - loaded["tokens"]
    if not loaded["dropped"]:
        assert tree_contents(b) == tree_contents(a)
    else:  # what was kept is the most recently used part of the saved tree
        kept = tree_contents(b)
        full = {s: [p for q, p in tree_contents(a) if q == s] for s in (None, "tenant")}
        for salt, path in kept:
            assert any(p[:len(path)] == path for p in full[salt])  # a prefix of a saved path
    for i, p in enumerate(prompts):
        salt = "tenant" if salted and i % 2 else None
        (c,) = b.generate([p], max_tokens=6, cache_salt=salt)
        assert c.token_ids == reference_greedy(llama, p, 6, tokenizer.eos_token_id)
    b.check_integrity()


def test_a_loaded_cache_serves_the_saved_prompts_and_their_outputs_exactly(make_model, llama, tokenizer, tmp_path):
    prompts = random_prompts(seed=7, count=12, vocab=len(tokenizer))
    a = make_model()
    before = a.generate(prompts, max_tokens=8)
    a.save_cache(tmp_path / "snap")
    b = make_model()
    b.load_cache(tmp_path / "snap")
    b.check_integrity()
    after = b.generate(prompts, max_tokens=8)
    assert [c.token_ids for c in after] == [c.token_ids for c in before] == expected(llama, tokenizer, prompts, 8)
    assert all(c.cached_tokens == c.prompt_tokens - 1 for c in after)  # all from the snapshot
    assert b.stats()["computed_tokens"] == len(prompts)


def test_a_smaller_budget_keeps_the_most_recently_used_part(make_model, llama, tokenizer, tmp_path):
    prompts = [list(range(1 + 20 * i, 21 + 20 * i)) for i in range(10)]  # 10 disjoint 20-token prompts
    a = make_model()
    for p in prompts:  # in this order: the last is the most recently used
        a.generate([p], max_tokens=1)
    a.save_cache(tmp_path / "snap")
    total = a.engine.tree.total_tokens
    b = make_model(cache_tokens=total // 2)
    got = b.load_cache(tmp_path / "snap")
    b.check_integrity()
    assert got["dropped"] > 0 and b.engine.tree.total_tokens == b.engine.pool.num_slots
    newest, oldest = prompts[-3:], prompts[:3]
    assert all(b.engine.tree.match_prefix(p)[0].numel() >= len(p) for p in newest)
    assert all(b.engine.tree.match_prefix(p)[0].numel() == 0 for p in oldest)
    out = b.generate(newest + oldest, max_tokens=5)
    assert [c.token_ids for c in out] == expected(llama, tokenizer, newest + oldest, 5)
    assert [c.cached_tokens for c in out[:3]] == [len(p) - 1 for p in newest]
    b.check_integrity()


def test_a_snapshot_taken_while_requests_run_holds_only_computed_tree_content(make_model, llama, tokenizer, tmp_path):
    prompts = random_prompts(seed=11, count=6, vocab=len(tokenizer))
    a = make_model(background=False, max_batch_tokens=16)  # long prompts take several steps
    groups = a._submit(prompts, max_tokens=6)
    for _ in range(3):
        a.engine.step()
    assert a.engine.scheduler.running
    saved = a.save_cache(tmp_path / "snap")
    assert 0 < saved["tokens"] == a.engine.tree.total_tokens
    a.engine.run_until_idle()
    b = make_model()
    assert b.load_cache(tmp_path / "snap")["tokens"] == saved["tokens"] == b.engine.tree.total_tokens
    b.check_integrity()
    assert b.engine.tree.locked_tokens == 0
    out = b.generate(prompts, max_tokens=6)
    assert sum(c.cached_tokens for c in out) > 0
    assert [c.token_ids for c in out] == expected(llama, tokenizer, prompts, 6)
    assert [g.future.result()[0].token_ids for g in groups] == [c.token_ids for c in out]


def test_a_save_that_sees_an_eviction_between_layers_is_dropped_and_redone_holding_the_engine(make_model, llama,
                                                                                              tokenizer, tmp_path):
    prompts = random_prompts(seed=13, count=6, vocab=len(tokenizer))
    m = make_model()
    m.generate(prompts, max_tokens=4)
    engine = m.engine

    class StepsBetweenLayers:
        """The engine's lock, with a step that evicts a leaf between the second and third layer gathers."""
        entered = 0

        def __enter__(self):
            engine._state.acquire()
            self.entered += 1
            if self.entered == 3:
                engine.tree.evict(1)

        def __exit__(self, *exc):
            engine._state.release()

    with pytest.raises(snapshot.CacheChanged):
        snapshot.write(engine.tree, engine.pool, tmp_path / "snap", engine.fingerprint(), StepsBetweenLayers())
    assert list(tmp_path.iterdir()) == []  # its temporary file is gone
    saved = m.save_cache(tmp_path / "snap")
    b = make_model()
    assert b.load_cache(tmp_path / "snap")["tokens"] == saved["tokens"] == engine.tree.total_tokens
    b.check_integrity()
    out = b.generate(prompts, max_tokens=4)
    assert [c.token_ids for c in out] == expected(llama, tokenizer, prompts, 4)


def test_saves_while_requests_run_give_loadable_exact_snapshots(make_model, llama, tokenizer, tmp_path):
    prompts = random_prompts(seed=17, count=16, vocab=len(tokenizer))
    m = make_model(cache_tokens=600)  # small: requests evict while the saves run
    pending = m._submit(prompts, max_tokens=8)
    saves = [m.save_cache(tmp_path / f"snap{i}") for i in range(3)]
    done = [g.future.result()[0].token_ids for g in pending]
    assert done == expected(llama, tokenizer, prompts, 8)
    for i, saved in enumerate(saves):
        b = make_model()
        assert b.load_cache(tmp_path / f"snap{i}")["tokens"] == saved["tokens"]
        b.check_integrity()
        assert [c.token_ids for c in b.generate(prompts[:4], max_tokens=8)] == done[:4]


def test_load_cache_refuses_another_models_snapshot_and_leaves_the_cache_empty(make_model, tokenizer, tmp_path):
    a = make_model()
    a.generate([[5, 6, 7, 8, 9]], max_tokens=3)
    a.save_cache(tmp_path / "snap")
    b = make_model(tiny_model(tokenizer, seed=1))
    b.generate([[1, 2, 3]], max_tokens=2)
    with pytest.raises(SnapshotError, match="another model"):
        b.load_cache(tmp_path / "snap")
    assert b.engine.tree.total_tokens == 0
    b.check_integrity()


_made: dict = {}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7), cut=st.booleans())
def test_any_flipped_bit_or_truncation_is_refused_and_leaves_an_empty_valid_cache(make_model, tokenizer, tmp_path,
                                                                                  where, bit, cut):
    good = tmp_path / "good"
    if tmp_path not in _made:  # one snapshot and one loading model for all examples
        a = make_model()
        a.generate(random_prompts(seed=19, count=4, vocab=len(tokenizer)), max_tokens=3, cache_salt="s")
        a.save_cache(good)
        _made[tmp_path] = make_model()
    b = _made[tmp_path]
    data = bytearray(good.read_bytes())
    at = int(where * len(data))
    if cut:
        del data[at:]
    else:
        data[at] ^= 1 << bit
    (tmp_path / "bad").write_bytes(bytes(data))
    with pytest.raises(SnapshotError):
        b.load_cache(tmp_path / "bad")
    assert b.engine.tree.total_tokens == 0
    b.check_integrity()


# -- cache_dir: load at start, save on close, cold on anything wrong ----------------------------------
def test_cache_dir_saves_on_close_and_loads_on_start(make_model, llama, tokenizer, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="kvql.cache")
    prompts = random_prompts(seed=3, count=8, vocab=len(tokenizer))
    a = make_model(cache_dir=tmp_path, cache_save_interval=0)
    before = a.generate(prompts, max_tokens=6)
    a.close()
    assert a.cache_dir.path.is_file() and not list(tmp_path.glob(".*tmp"))  # no temporary left behind
    b = make_model(cache_dir=tmp_path, cache_save_interval=0)
    b.check_integrity()
    after = b.generate(prompts, max_tokens=6)
    assert [c.token_ids for c in after] == [c.token_ids for c in before]
    assert all(c.cached_tokens == c.prompt_tokens - 1 for c in after)
    assert not cache_warnings(caplog)


def test_two_dtypes_sharing_a_cache_dir_each_get_their_own_warm_restart(make_model, llama, tokenizer, tmp_path,
                                                                          caplog):
    # kvql run (float32) and kvql serve (bf16) on one --cache-dir once overwrote each other's snapshot
    caplog.set_level(logging.INFO, logger="kvql.cache")
    prompts = random_prompts(seed=9, count=6, vocab=len(tokenizer))
    half = copy.deepcopy(llama).to(torch.bfloat16)
    before = {}
    for name, hf in (("float32", llama), ("bfloat16", half)):
        a = make_model(hf, cache_dir=tmp_path, cache_save_interval=0)
        before[name] = [c.token_ids for c in a.generate(prompts, max_tokens=5)]
        a.close()
    assert len(list(tmp_path.glob("kv-cache-*.safetensors"))) == 2
    for name, hf in (("float32", llama), ("bfloat16", half)):
        b = make_model(hf, cache_dir=tmp_path, cache_save_interval=0)
        assert b.engine.pool.k.dtype is hf.dtype
        after = b.generate(prompts, max_tokens=5)
        assert all(c.cached_tokens == c.prompt_tokens - 1 for c in after), name  # warm: its own snapshot
        assert [c.token_ids for c in after] == before[name]
        b.check_integrity()
    assert before["float32"] == expected(llama, tokenizer, prompts, 5)
    assert not cache_warnings(caplog)


def test_an_idle_model_saves_its_cache_every_interval(make_model, tokenizer, tmp_path):
    m = make_model(cache_dir=tmp_path, cache_save_interval=0.01)
    m.generate([[4, 5, 6, 7]], max_tokens=2)
    for _ in range(6000):  # saved once idle, whatever the machine's speed
        if m.cache_dir.saves:
            break
        time.sleep(0.01)
    assert m.cache_dir.saves >= 1
    assert read_header(m.cache_dir.path)[0]["tokens"]["shape"] == [m.engine.tree.total_tokens]


def _flip(path: Path, where: str) -> None:
    info, header = read_header(path)
    start = len(header)
    offsets = {"kv data": start + info["v.1"]["data_offsets"][0] + 7,
               "tree tokens": start + info["tokens"]["data_offsets"][0] + 3,
               "header": len(header) // 2}
    data = bytearray(path.read_bytes())
    data[offsets[where]] ^= 0x10
    path.write_bytes(bytes(data))


DAMAGE = {  # another model's or dtype's snapshot has a name of its own: renamed to this model's here
    "another model": None,
    "another dtype": None,
    "truncated": lambda p: p.write_bytes(p.read_bytes()[:p.stat().st_size * 2 // 3]),
    "truncated header": lambda p: p.write_bytes(p.read_bytes()[:100]),
    "flipped byte in the KV": lambda p: _flip(p, "kv data"),
    "flipped byte in the tree": lambda p: _flip(p, "tree tokens"),
    "flipped byte in the header": lambda p: _flip(p, "header"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_an_unusable_snapshot_starts_cold_with_one_log_line(make_model, llama, tokenizer, tmp_path, caplog, damage):
    prompts = random_prompts(seed=5, count=6, vocab=len(tokenizer))
    writer = llama
    if damage == "another model":
        writer = tiny_model(tokenizer, seed=2)
    elif damage == "another dtype":
        writer = copy.deepcopy(llama).to(torch.bfloat16)
    a = make_model(writer, cache_dir=tmp_path, cache_save_interval=0)
    a.generate(prompts, max_tokens=4)
    a.close()
    own = snapshot_path(tmp_path, make_model().engine.fingerprint())
    if DAMAGE[damage] is None:
        assert a.cache_dir.path != own
        a.cache_dir.path.rename(own)
    else:
        DAMAGE[damage](own)
    caplog.set_level(logging.INFO, logger="kvql.cache")
    b = make_model(cache_dir=tmp_path, cache_save_interval=0)
    (line,) = cache_warnings(caplog)
    assert "not loaded" in line and "starting with an empty cache" in line
    b.check_integrity()
    assert b.engine.tree.total_tokens == 0 and b.engine.pool.num_free == b.engine.pool.num_slots
    (first,) = b.generate(prompts[:1], max_tokens=4)
    assert first.cached_tokens == 0
    out = [first, *b.generate(prompts[1:], max_tokens=4)]
    assert [c.token_ids for c in out] == expected(llama, tokenizer, prompts, 4)


# -- kvql serve --cache-dir: SIGTERM, restart -------------------------------------------------------
SHARED = ("Question: what is the capital of France? Answer: Paris.\n"
          "Question: how many legs does a spider have? Answer: eight.\n"
          "The quick brown fox jumps over the lazy dog.\n"
          "Once upon a time there was a little robot who liked to count tokens.\n")
QUESTIONS = ["Question: what is the quick brown fox? Answer:", "Question: what does the robot count? Answer:",
             "Question: how many legs does a dog have? Answer:"]


def _ask(port: int, prompt: str) -> dict:
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                   json={"prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    return {"text": body["choices"][0]["text"], "cached": body["usage"]["prompt_tokens_details"]["cached_tokens"]}


def _stop(proc) -> str:
    proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(timeout=120) == 0
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.stdout.read().decode()


def test_a_restarted_server_answers_from_the_cache_it_saved_on_sigterm(tmp_path, llama, tokenizer):
    model_dir, other_dir, cache = tmp_path / "model", tmp_path / "other", tmp_path / "cache"
    llama.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    port = free_port()
    proc = start_server(model_dir, port, "--cache-dir", str(cache))
    try:
        before = [_ask(port, SHARED + q) for q in QUESTIONS]
    finally:
        log = _stop(proc)
    assert len(list(cache.glob("kv-cache-*.safetensors"))) == 1, log
    assert before[0]["cached"] == 0 and before[1]["cached"] > 0

    proc = start_server(model_dir, port, "--cache-dir", str(cache))
    try:
        first = _ask(port, SHARED + QUESTIONS[0])  # the first request after the restart
    finally:
        log = _stop(proc)
    shared = len(tokenizer.encode(SHARED))
    assert first["cached"] >= 0.9 * shared
    assert first["text"] == before[0]["text"]
    ids = tokenizer.encode(SHARED + QUESTIONS[0])
    assert first["text"] == tokenizer.decode(reference_greedy(llama, ids, 8, tokenizer.eos_token_id))
    assert "not loaded" not in log

    tiny_model(tokenizer, seed=4).save_pretrained(other_dir)  # another model on the same cache dir
    tokenizer.save_pretrained(other_dir)
    proc = start_server(other_dir, port, "--cache-dir", str(cache))
    try:
        assert _ask(port, SHARED + QUESTIONS[0])["cached"] == 0
    finally:
        log = _stop(proc)
    assert "kvql.cache" not in log  # its own (absent) snapshot: no warning
    assert len(list(cache.glob("kv-cache-*.safetensors"))) == 2
    proc = start_server(model_dir, port, "--cache-dir", str(cache))
    try:
        again = _ask(port, SHARED + QUESTIONS[0])  # the first model's snapshot was left alone
    finally:
        log = _stop(proc)
    assert again["cached"] >= 0.9 * shared and again["text"] == before[0]["text"], log
