"""Snapshot files made by an unlucky or malicious user (issue 25): crafted byte by byte with a valid checksum,
a FIFO at the path, saves killed mid-write. Each must start cold with one warning line, take no pool slot,
leave `check_integrity()` clean, and let later saves work."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from conftest import random_prompts, save_model
from kvql.engine import snapshot
from kvql.engine.cache_dir import PREFIX, snapshot_path

_TYPES = {torch.float32: "F32", torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.bfloat16: "BF16"}


def craft(path: Path, tensors: dict | None = None, meta: dict | None = None) -> None:
    """Rewrite snapshot `path` with some tensors (any dtype) or metadata replaced, its checksum recomputed
    as the writer computes it: the file is valid but for what was changed."""
    with safe_open(str(path), framework="pt") as f:
        old_meta = f.metadata()
        names = sorted(f.keys(), key=lambda k: (k not in snapshot._STRUCTURE, snapshot._STRUCTURE.index(k)
                                                if k in snapshot._STRUCTURE else 0, k))
        data = {k: f.get_tensor(k) for k in names}
    data.update(tensors or {})
    meta = {k: v for k, v in {**old_meta, **(meta or {})}.items() if k != "checksum"}
    entries = [(k, _TYPES[t.dtype], list(t.shape), t.numel() * t.element_size()) for k, t in data.items()]
    blobs = [t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in data.values()]
    header = snapshot._header(meta, entries, "00000000")
    crc = zlib.crc32(header)
    for b in blobs:
        crc = zlib.crc32(b, crc)
    path.write_bytes(snapshot._header(meta, entries, f"{crc:08x}") + b"".join(blobs))


def saved_snapshot(make_model, tokenizer, directory: Path) -> Path:
    a = make_model(cache_dir=directory, cache_save_interval=0)
    a.generate(random_prompts(seed=3, count=5, vocab=len(tokenizer)), max_tokens=4)
    a.close()
    return a.cache_dir.path


def own_path(make_model, directory: Path) -> Path:
    """Where make_model()'s models keep their snapshot in `directory`."""
    return snapshot_path(directory, make_model().engine.fingerprint())


def starts_cold(make_model, directory: Path, caplog) -> None:
    caplog.clear()
    caplog.set_level(logging.INFO, logger="kvql.cache")
    b = make_model(cache_dir=directory, cache_save_interval=0)
    warnings = [r.getMessage() for r in caplog.records if r.name == "kvql.cache" and r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "not loaded" in warnings[0], warnings
    b.check_integrity()
    assert b.engine.tree.total_tokens == 0 and b.engine.pool.num_free == b.engine.pool.num_slots
    b.generate([[5, 6, 7, 8]], max_tokens=3)
    assert b.save_cache(directory / "again.safetensors")["tokens"] > 0  # later saves work
    b.check_integrity()


def structure(path: Path, name: str) -> torch.Tensor:
    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(name)


CRAFTED = {
    "salt column as F64": lambda p: {"salt": structure(p, "salt").double()},
    "token ids as I32": lambda p: {"tokens": structure(p, "tokens").int()},
    "token ids as F64 with a NaN": lambda p: {"tokens": torch.cat([structure(p, "tokens")[:-1].double(),
                                                                   torch.tensor([float("nan")], dtype=torch.float64)])},
    "token id outside the vocabulary": lambda p: {"tokens": structure(p, "tokens") + 10**6},
    "negative token id": lambda p: {"tokens": structure(p, "tokens") - 10**6},
    "rank as F64": lambda p: {"rank": structure(p, "rank").double()},
    "parent as a 2-D tensor": lambda p: {"parent": structure(p, "parent").reshape(1, -1)},
    "a parent after its child": lambda p: {"parent": torch.arange(len(structure(p, "parent")))},
}
CRAFTED_META = {
    "salts as a JSON object": {"salts": json.dumps({"0": None})},
    "salts as a string": {"salts": json.dumps("abc")},
    "salts not JSON": {"salts": "[nul"},
}


@pytest.mark.parametrize("case", list(CRAFTED) + list(CRAFTED_META))
def test_a_crafted_snapshot_starts_cold_and_takes_no_slot(make_model, tokenizer, tmp_path, caplog, case):
    path = saved_snapshot(make_model, tokenizer, tmp_path)
    if case in CRAFTED:
        craft(path, tensors=CRAFTED[case](path))
    else:
        craft(path, meta=CRAFTED_META[case])
    starts_cold(make_model, tmp_path, caplog)


def test_an_oversized_header_is_refused_before_it_is_parsed(make_model, tokenizer, tmp_path, caplog):
    path = saved_snapshot(make_model, tokenizer, tmp_path)
    craft(path, meta={"padding": "x" * (snapshot.MAX_HEADER + 1)})
    with pytest.raises(snapshot.SnapshotError, match="header"):
        snapshot.read_header(path)
    starts_cold(make_model, tmp_path, caplog)


def test_a_cache_whose_header_would_be_over_the_limit_is_not_saved(make_model, tokenizer, tmp_path, monkeypatch):
    # load refuses a header over MAX_HEADER, so a save writing one would be lost at the next start: it writes
    # nothing, says why, and the last good snapshot stays
    path = saved_snapshot(make_model, tokenizer, tmp_path)
    before = path.read_bytes()
    m = make_model()
    for i in range(4):
        m.generate([random_prompts(seed=i, count=1, vocab=len(tokenizer))[0]], max_tokens=2, cache_salt=f"{i}" * 200)
    monkeypatch.setattr(snapshot, "MAX_HEADER", 1000 + 4 * 100)  # the entries fit, four 200-char salts not
    with pytest.raises(snapshot.SnapshotError, match=r"not saved: .*\(5 cache partitions"):
        m.save_cache(path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == [path.name]
    m.check_integrity()


def test_a_fifo_at_the_snapshot_path_does_not_block_the_start(make_model, tmp_path, caplog):
    os.mkfifo(own_path(make_model, tmp_path))
    done = []
    t = threading.Thread(target=lambda: done.append(starts_cold(make_model, tmp_path, caplog)), daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive() and done == [None]


def test_a_directory_at_the_snapshot_path_starts_cold(make_model, tmp_path, caplog):
    own_path(make_model, tmp_path).mkdir()
    starts_cold(make_model, tmp_path, caplog)


def test_a_killed_save_leaves_a_temporary_file_that_the_next_start_removes(make_model, llama, tmp_path, caplog):
    model_dir = save_model(tmp_path / "model", llama, make_model().tokenizer)
    cache = tmp_path / "cache"
    script = ("import kvql, sys\n"
              f"m = kvql.model({str(model_dir)!r}, dtype='float32', cache_dir={str(cache)!r}, cache_save_interval=0)\n"
              "m.generate([[i % 300 + 1 for i in range(k, k + 200)] for k in range(40)], max_tokens=1)\n"
              "print('ready', flush=True)\n"
              "while True:\n    m.save_cache(m.cache_dir.path)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    temporaries = f".{PREFIX}*.tmp"
    try:
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        while not list(cache.glob(temporaries)) and time.monotonic() < deadline:
            time.sleep(0.001)
        proc.kill()  # SIGKILL, mid-save
        proc.wait()
    finally:
        proc.kill()
    left = list(cache.glob(temporaries))
    assert left, "the save was not interrupted mid-write"
    old = time.time() - snapshot.STALE_AFTER - 5
    for tmp in left:
        os.utime(tmp, (old, old))
    name = left[0].name[1:].split(".safetensors.")[0] + ".safetensors"
    fresh = cache / f".{name}.writing.tmp"  # another process's save, just written to: kept
    fresh.write_bytes(b"x")
    caplog.set_level(logging.INFO, logger="kvql.cache")
    b = make_model(cache_dir=cache, cache_save_interval=0)
    b.check_integrity()
    assert not any(t.exists() for t in left) and fresh.exists()
    assert any("interrupted saves" in r.getMessage() for r in caplog.records)


def test_a_temporary_file_a_live_save_holds_is_never_removed(tmp_path):
    import fcntl

    path = tmp_path / f"{PREFIX}0123456789abcdef.safetensors"
    tmp = tmp_path / f".{path.name}.live.tmp"
    tmp.write_bytes(b"partial")
    old = time.time() - snapshot.STALE_AFTER - 5
    os.utime(tmp, (old, old))
    with open(tmp, "rb+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        assert snapshot.remove_stale(path) == 0 and tmp.exists()
    assert snapshot.remove_stale(path) == 1 and not tmp.exists()
