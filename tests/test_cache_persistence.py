"""A cache that survives restarts, in one format: the disk tier's files (engine/cache/disk_tier.py, persistence.py,
autosave.py). `disk_cache=DIR` (also spelled `cache_dir=DIR`): the next start's tree is what the files hold,
every node on disk until a request reads it back; what only memory holds is written there on close, on
`save_cache()` and when idle every `cache_save_interval` seconds."""

from __future__ import annotations

import copy
import errno
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

import kvql
from conftest import free_port, random_prompts, reference_greedy, save_model, start_server, tiny_model
from kvql.engine.cache.tier_file import SUFFIX
from kvql.engine.cache.memory import MIN_LOAD_TOKENS


def expected(hf_model, tokenizer, prompts, max_tokens):
    return [reference_greedy(hf_model, p, max_tokens, tokenizer.eos_token_id) for p in prompts]


def leaves(model) -> list[tuple]:
    """Every leaf of the tree as (salt, tokens from its root to its end), least recently used first: what a
    restart must keep (the nodes above may be cut differently)."""
    out = []
    for salt, root in model.engine.tree.roots.items():
        stack = [(c, []) for c in root.children.values()]
        while stack:
            node, above = stack.pop()
            path = above + node.key
            if not node.children:
                out.append((node.last_access, salt, tuple(path)))
            stack.extend((c, path) for c in node.children.values())
    return [(salt, path) for _, salt, path in sorted(out)]


def tier_files(model):
    return sorted(p for p in model.engine.tier.path.iterdir() if p.name.endswith(SUFFIX))


def cache_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvql.cache" and r.levelno >= logging.WARNING]


def warm(completions) -> bool:
    """Served from the cache: all but the last prompt token, or all but a run on disk too short to read back
    (memory.MIN_LOAD_TOKENS: computed instead)."""
    return all(c.cached_tokens >= c.prompt_tokens - 1 - MIN_LOAD_TOKENS for c in completions) and \
        any(c.cached_tokens > 0 for c in completions)


# -- restart ----------------------------------------------------------------------------------------------
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), count=st.integers(1, 8), salted=st.booleans(),
       slots=st.one_of(st.none(), st.integers(80, 300)))
def test_a_restart_keeps_every_path_its_lru_order_and_exact_outputs(make_model, llama, tokenizer, tmp_path_factory,
                                                                    seed, count, salted, slots):
    directory = tmp_path_factory.mktemp("cache")
    prompts = random_prompts(seed, count, len(tokenizer))
    salts = ["tenant" if salted and i % 2 else None for i in range(count)]
    kw = {} if slots is None else {"cache_tokens": slots}
    a = make_model(disk_cache=directory, cache_save_interval=0, **kw)
    for p, salt in zip(prompts, salts):  # one at a time: a known LRU order; a small pool spills to disk meanwhile
        a.generate([p], max_tokens=4, cache_salt=salt)
    before = leaves(a)
    a.close()
    b = make_model(disk_cache=directory, cache_save_interval=0, **kw)
    b.check_integrity()
    assert leaves(b) == before
    assert b.stats()["cache_tokens"] == 0  # all on disk until asked for
    for p, salt, want in zip(prompts, salts, expected(llama, tokenizer, prompts, 4)):
        (c,) = b.generate([p], max_tokens=4, cache_salt=salt)
        assert c.token_ids == want and warm([c]) or c.prompt_tokens <= MIN_LOAD_TOKENS
    assert b.stats()["disk_tokens"] > 0 or max(len(p) for p in prompts) <= MIN_LOAD_TOKENS
    b.check_integrity()


def test_cache_dir_saves_on_close_and_the_next_start_serves_from_it(make_model, llama, tokenizer, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="kvql.cache")
    prompts = random_prompts(seed=3, count=8, vocab=len(tokenizer))
    a = make_model(cache_dir=tmp_path, cache_save_interval=0)
    before = a.generate(prompts, max_tokens=6)
    assert tier_files(a) == []  # nothing was evicted: memory alone held it until close
    a.close()
    assert tier_files(a) and not list(a.engine.tier.path.glob(".*.tmp"))  # no temporary left behind
    b = make_model(cache_dir=tmp_path, cache_save_interval=0)
    after = b.generate(prompts, max_tokens=6)
    assert [c.token_ids for c in after] == [c.token_ids for c in before]
    assert warm(after) and 0 < b.stats()["disk_tokens"] <= sum(c.cached_tokens for c in after)
    assert not cache_warnings(caplog)
    b.check_integrity()


def test_two_dtypes_sharing_a_directory_each_get_their_own_warm_restart(make_model, llama, tokenizer, tmp_path,
                                                                          caplog):
    caplog.set_level(logging.INFO, logger="kvql.cache")
    prompts = random_prompts(seed=9, count=6, vocab=len(tokenizer))
    half = copy.deepcopy(llama).to(torch.bfloat16)
    before = {}
    for name, hf in (("float32", llama), ("bfloat16", half)):
        a = make_model(hf, disk_cache=tmp_path, cache_save_interval=0)
        before[name] = [c.token_ids for c in a.generate(prompts, max_tokens=5)]
        a.close()
    assert len([d for d in tmp_path.iterdir() if d.is_dir()]) == 2
    for name, hf in (("float32", llama), ("bfloat16", half)):
        b = make_model(hf, disk_cache=tmp_path, cache_save_interval=0)
        assert b.engine.pool.k.dtype is hf.dtype
        after = b.generate(prompts, max_tokens=5)
        assert warm(after), name  # its own files
        assert [c.token_ids for c in after] == before[name]
        b.check_integrity()
    assert before["float32"] == expected(llama, tokenizer, prompts, 5)
    assert not cache_warnings(caplog)


# -- saving while serving ---------------------------------------------------------------------------------
def test_a_save_while_requests_run_writes_only_computed_tree_content(make_model, llama, tokenizer, tmp_path):
    prompts = random_prompts(seed=11, count=6, vocab=len(tokenizer))
    m = make_model(disk_cache=tmp_path, cache_save_interval=0, background=False)
    groups = m._submit(prompts, max_tokens=8)
    for _ in range(4):
        m.engine.step()
    assert m.stats()["running"] > 0
    saved = m.save_cache()
    policy = m.engine.memory.tier_policy
    assert saved["tokens"] == sum(len(x.key) for x in m.engine.tree.nodes() if policy.extent(x) is not None)
    assert policy.unwritten() == []
    want = expected(llama, tokenizer, prompts, 8)
    spelled = [p + w for p, w in zip(prompts, want)]
    for f in tier_files(m):
        with safe_open(str(f), framework="pt") as t:
            tokens = t.get_tensor("prefix").tolist() + t.get_tensor("tokens").tolist()
        assert any(s[:len(tokens)] == tokens for s in spelled)  # each file is KV some request computed
    m.engine.run_until_idle()
    assert [g.future.result()[0].token_ids for g in groups] == want
    m.check_integrity()


def test_saves_racing_requests_leave_a_tier_the_next_start_serves_exactly(make_model, llama, tokenizer, tmp_path):
    prompts = random_prompts(seed=13, count=12, vocab=len(tokenizer))
    m = make_model(disk_cache=tmp_path, cache_save_interval=0, cache_tokens=300)
    stop, saves = threading.Event(), []

    def save_often():
        while not stop.is_set():
            saves.append(m.save_cache())

    t = threading.Thread(target=save_often)
    t.start()
    try:
        first = m.generate(prompts, max_tokens=5)
    finally:
        stop.set()
        t.join()
    assert saves and [c.token_ids for c in first] == expected(llama, tokenizer, prompts, 5)
    m.check_integrity()
    m.close()
    b = make_model(disk_cache=tmp_path, cache_save_interval=0, cache_tokens=300)
    again = [b.generate([p], max_tokens=5)[0] for p in prompts]
    assert [c.token_ids for c in again] == [c.token_ids for c in first] and warm(again)
    b.check_integrity()


def test_an_idle_model_writes_its_cache_to_disk_every_interval(make_model, tokenizer, tmp_path):
    m = make_model(disk_cache=tmp_path, cache_save_interval=0.01)
    m.generate([[4, 5, 6, 7, 8, 9]], max_tokens=2)
    for _ in range(6000):  # written once idle, whatever the machine's speed
        if m.engine.saves:
            break
        time.sleep(0.01)
    assert m.engine.saves >= 1
    with m.engine._state:
        assert m.engine.memory.tier_policy.unwritten() == [] and tier_files(m)


def test_save_cache_without_a_disk_tier_says_what_it_needs(make_model):
    with pytest.raises(ValueError, match="disk_cache"):
        make_model().save_cache()


# -- one directory, one model at a time ---------------------------------------------------------------------
def test_a_second_model_on_a_directory_in_use_runs_from_memory_and_harms_nothing(make_model, llama, tokenizer,
                                                                                tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="kvql.cache")
    prompts = random_prompts(seed=15, count=4, vocab=len(tokenizer))
    a = make_model(disk_cache=tmp_path, cache_save_interval=0)
    a.generate(prompts[:2], max_tokens=4)
    b = make_model(disk_cache=tmp_path, cache_save_interval=0)
    (line,) = cache_warnings(caplog)
    assert "in use" in line and "memory only" in line
    assert b.engine.tier is None and "tier_bytes" not in b.stats()
    assert [c.token_ids for c in b.generate(prompts, max_tokens=4)] == expected(llama, tokenizer, prompts, 4)
    b.close()  # writes nothing: it has no tier
    a.close()
    c = make_model(disk_cache=tmp_path, cache_save_interval=0)  # free again
    assert warm(c.generate(prompts[:2], max_tokens=4))
    c.check_integrity()


# -- a start never fails over the cache -----------------------------------------------------------------------
def test_a_full_disk_starts_the_model_memory_only_with_one_warning(make_model, llama, tokenizer, tmp_path, caplog,
                                                                   monkeypatch):
    prompts = random_prompts(seed=16, count=3, vocab=len(tokenizer))
    a = make_model(disk_cache=tmp_path, cache_save_interval=0)
    a.generate(prompts, max_tokens=4)
    a.close()
    files = {p: p.read_bytes() for p in tier_files(a)}
    caplog.set_level(logging.INFO, logger="kvql.cache")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=10**9, used=10**9, free=0))
    b = make_model(disk_cache=tmp_path, cache_save_interval=0)  # no disk_budget: half the free space, none
    (line,) = cache_warnings(caplog)
    assert str(tmp_path) in line and "no free space" in line and "memory only" in line
    assert b.engine.tier is None
    assert [c.token_ids for c in b.generate(prompts, max_tokens=4)] == expected(llama, tokenizer, prompts, 4)
    b.close()
    assert {p: p.read_bytes() for p in tier_files(a)} == files  # the cache it found is kept for a later start
    with pytest.raises(ValueError, match="disk_budget"):  # a budget given is the caller's: 0 is an error
        make_model(disk_cache=tmp_path, disk_budget=0)


def read_only(directory: Path, monkeypatch) -> None:
    """Make `directory` read-only: its mode, and where that does not stop writes (root: a process with
    CAP_DAC_OVERRIDE) a read-only file system's answer to opening a file in it for writing (errno 30)."""
    directory.chmod(0o500)
    try:
        (directory / "probe").touch()
    except PermissionError:
        return  # the mode is enough
    (directory / "probe").unlink()
    real_open = os.open

    def open_read_only(path, flags, *args, **kw):
        if Path(path).parent == directory and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", open_read_only)


@pytest.mark.parametrize("case", ["read-only", "a file in its place"])
def test_a_tier_directory_that_cannot_be_written_starts_the_model_memory_only_with_one_warning(
        make_model, llama, tokenizer, tmp_path, caplog, monkeypatch, case):
    prompts = random_prompts(seed=17, count=3, vocab=len(tokenizer))
    a = make_model(disk_cache=tmp_path, cache_save_interval=0)  # DIR stays writable: only the model's directory
    a.generate(prompts, max_tokens=4)
    a.close()
    directory = a.engine.tier.path
    if case == "read-only":
        before = sorted(p.name for p in directory.iterdir())
        read_only(directory, monkeypatch)
    else:
        shutil.rmtree(directory)
        directory.write_bytes(b"not a directory")
    caplog.set_level(logging.INFO, logger="kvql.cache")
    try:
        b = make_model(disk_cache=tmp_path, cache_save_interval=0)
        (line,) = cache_warnings(caplog)
        assert str(directory) in line and "memory only" in line
        assert b.engine.tier is None
        assert [c.token_ids for c in b.generate(prompts, max_tokens=4)] == expected(llama, tokenizer, prompts, 4)
        b.close()
        if case == "read-only":
            assert sorted(p.name for p in directory.iterdir()) == before  # nothing removed, nothing written
        else:
            assert directory.read_bytes() == b"not a directory"
    finally:
        if directory.is_dir():
            directory.chmod(0o700)  # (for tmp_path's removal)


def test_a_cache_location_that_cannot_be_written_starts_kvql_model_memory_only_with_one_warning(
        llama, tokenizer, tmp_path, caplog, monkeypatch):
    """`kvql.model(DIR, disk_cache=...)` with a location kvql cannot write (checked before the load, as commands
    do): not an error, one warning. (Root writes through a mode; the location answers as a read-only one.)"""
    model_dir = save_model(tmp_path / "model", llama, tokenizer)
    location = tmp_path / "cache"
    location.mkdir(mode=0o500)
    real_access, real_mkdir = os.access, Path.mkdir
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == location and mode & os.W_OK
                        else real_access(p, mode, **kw))

    def mkdir(self, *args, **kw):
        if self.parent == location:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real_mkdir(self, *args, **kw)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    caplog.set_level(logging.INFO, logger="kvql.cache")
    prompts = random_prompts(seed=18, count=2, vocab=len(tokenizer))
    m = kvql.model(str(model_dir), dtype="float32", disk_cache=location)
    try:
        (line,) = cache_warnings(caplog)
        assert str(location) in line and "memory only" in line and m.engine.tier is None
        assert [c.token_ids for c in m.generate(prompts, max_tokens=4)] == expected(llama, tokenizer, prompts, 4)
    finally:
        m.close()
        location.chmod(0o700)


def test_snapshots_of_an_earlier_kvql_are_named_once_and_left_alone(make_model, tmp_path, caplog):
    old = tmp_path / "kv-cache-0123456789abcdef.safetensors"
    old.write_bytes(b"an old snapshot")
    caplog.set_level(logging.INFO, logger="kvql.cache")
    m = make_model(cache_dir=tmp_path, cache_save_interval=0)
    (line,) = cache_warnings(caplog)
    assert old.name in line and "does not read" in line
    m.generate([[3, 4, 5, 6]], max_tokens=2)
    m.close()
    assert old.read_bytes() == b"an old snapshot"


def test_a_process_killed_mid_write_leaves_a_tier_the_next_start_cleans_and_serves(make_model, llama, tokenizer,
                                                                                     tmp_path):
    model_dir = save_model(tmp_path / "model", llama, tokenizer)
    cache = tmp_path / "cache"
    script = ("import kvql\n"
              f"m = kvql.model({str(model_dir)!r}, dtype='float32', disk_cache={str(cache)!r}, cache_budget='40KB',"
              " cache_save_interval=0)\n"
              "print('ready', flush=True)\n"
              "k = 0\n"
              "while True:\n"
              "    m.generate([[(k * 7 + i) % 300 + 1 for i in range(40)]], max_tokens=1)\n"
              "    k += 1\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (list(cache.glob(f"*/*{SUFFIX}")) and list(cache.glob("*/.*.tmp"))):
            time.sleep(0.001)
        proc.kill()  # SIGKILL: no close, files half written
        proc.wait()
    finally:
        proc.kill()
    assert list(cache.glob(f"*/*{SUFFIX}")), "nothing was written before the kill"
    b = make_model(disk_cache=cache, cache_save_interval=0)  # the dead process's lock went with it
    assert b.engine.tier is not None and not list(b.engine.tier.path.glob(".*.tmp"))
    b.check_integrity()
    served = []
    for k in range(0, 200):  # every prompt it spells is answered exactly
        p = [(k * 7 + i) % 300 + 1 for i in range(40)]
        tree = b.engine.tree
        node = tree.roots[None].children.get(p[0])
        if node is None or node.key[:len(p)] != p[:len(node.key)]:
            continue
        (c,) = b.generate([p], max_tokens=1)
        assert c.token_ids == reference_greedy(llama, p, 1, tokenizer.eos_token_id)
        served.append(c.cached_tokens)
        if len(served) == 5:
            break
    assert served and b.stats()["disk_tokens"] > 0
    b.check_integrity()


# -- kvql serve --disk-cache: SIGTERM, restart --------------------------------------------------------------
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


def test_a_restarted_server_answers_from_the_cache_it_wrote_on_sigterm(tmp_path, llama, tokenizer):
    model_dir, other_dir, cache = tmp_path / "model", tmp_path / "other", tmp_path / "cache"
    llama.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    port = free_port()
    proc = start_server(model_dir, port, "--cache-dir", str(cache))
    try:
        before = [_ask(port, SHARED + q) for q in QUESTIONS]
    finally:
        log = _stop(proc)
    assert len(list(cache.glob(f"*/*{SUFFIX}"))) >= 1, log
    assert before[0]["cached"] == 0 and before[1]["cached"] > 0

    tiny_model(tokenizer, seed=4).save_pretrained(other_dir)  # another model on the same directory first
    tokenizer.save_pretrained(other_dir)
    proc = start_server(other_dir, port, "--disk-cache", str(cache))
    try:
        assert _ask(port, SHARED + QUESTIONS[0])["cached"] == 0
    finally:
        log = _stop(proc)
    assert "kvql.cache" not in log  # its own (empty) directory: no warning
    assert len([d for d in cache.iterdir() if d.is_dir()]) == 2

    proc = start_server(model_dir, port, "--disk-cache", str(cache))
    try:
        first = _ask(port, SHARED + QUESTIONS[0])  # the first request after the restart
    finally:
        log = _stop(proc)
    shared = len(tokenizer.encode(SHARED))
    assert first["cached"] >= 0.9 * shared  # the other model left the first one's files alone
    assert first["text"] == before[0]["text"]
    ids = tokenizer.encode(SHARED + QUESTIONS[0])
    assert first["text"] == tokenizer.decode(reference_greedy(llama, ids, 8, tokenizer.eos_token_id))
    assert "kvql.cache" not in log
