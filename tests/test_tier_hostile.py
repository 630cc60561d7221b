"""Disk tier files made by an unlucky or malicious user: crafted with a valid checksum, a FIFO or a directory
under a file's name, a header too large to parse. The start never blocks or fails; a file that is not the
tier's is removed with one warning line (or, not being a regular file, left alone); a file whose KV does not
fit is a miss when read back; the other files still serve, answers stay exact and `check_integrity()` clean."""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import random_prompts, reference_greedy
from kvql.engine import disk_tier
from kvql.engine.disk_tier import SUFFIX


def craft(path: Path, meta: dict | None = None, **tensors) -> None:
    """Rewrite tier file `path` with some tensors (any dtype or shape) or metadata replaced, its sha256
    recomputed as the writer computes it: the file is valid but for what was changed."""
    with safe_open(str(path), framework="pt") as f:
        old_meta = f.metadata()
        data = {k: f.get_tensor(k) for k in ("prefix", "tokens", "k", "v")}
    data.update({k: t.contiguous() for k, t in tensors.items()})
    meta = {**old_meta, "sha256": disk_tier._hash(*data.values()), **(meta or {})}
    save_file(data, str(path), metadata=meta)


@pytest.fixture
def written(make_model, tokenizer, tmp_path):
    """A closed model's tier in `tmp_path`: prompts whose KV is all on disk, one file per prompt."""
    prompts = [p for p in random_prompts(seed=3, count=12, vocab=len(tokenizer)) if len(p) > 20][:3]
    prompts = [[i + 1] + p[1:] for i, p in enumerate(prompts)]  # distinct first tokens: one file each
    a = make_model(disk_cache=tmp_path, cache_save_interval=0)
    for p in prompts:
        a.generate([p], max_tokens=1)
    a.close()
    files = {}
    for path in a.engine.tree.tier.path.glob(f"*{SUFFIX}"):
        with safe_open(str(path), framework="pt") as f:
            files[f.get_tensor("tokens")[0].item()] = path
    assert sorted(files) == [1, 2, 3]
    return prompts, [files[1], files[2], files[3]]


def restart(make_model, tmp_path, caplog):
    caplog.clear()
    caplog.set_level(logging.INFO, logger="kvql.cache")
    m = make_model(disk_cache=tmp_path, cache_save_interval=0)
    m.check_integrity()
    return m, [r.getMessage() for r in caplog.records if r.name == "kvql.cache" and r.levelno >= logging.WARNING]


def answers_exactly(m, llama, tokenizer, prompts) -> list[int]:
    """Ask each prompt; the answers must be the reference's; how many tokens each read back from disk."""
    got = []
    for p in prompts:
        before = m.stats()["disk_tokens"]
        (c,) = m.generate([p], max_tokens=1)
        assert c.token_ids == reference_greedy(llama, p, 1, tokenizer.eos_token_id)
        got.append(m.stats()["disk_tokens"] - before)
    m.check_integrity()
    return got


CRAFTED = {
    "token id outside the vocabulary": lambda f: {"tokens": f["tokens"] + 10**6},
    "negative token id": lambda f: {"tokens": f["tokens"] - 10**6},
    "token ids as I32": lambda f: {"tokens": f["tokens"].int()},
    "token ids as F64": lambda f: {"tokens": f["tokens"].double()},
    "prefix as a 2-D tensor": lambda f: {"prefix": f["prefix"].reshape(1, -1)},
    "no tokens": lambda f: {"tokens": f["tokens"][:0]},
}
CRAFTED_META = {
    "salt not JSON": {"salt": "[nul"},
    "salt a JSON object": {"salt": json.dumps({"a": 1})},
    "another format": {"kvql_format": "kvql-kv-tier-0"},
    "another model's digest": {"fingerprint": "0" * 64},
}


def tensors_of(path: Path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in ("prefix", "tokens", "k", "v")}


@pytest.mark.parametrize("case", list(CRAFTED) + list(CRAFTED_META))
def test_a_crafted_file_is_removed_at_start_with_one_warning(make_model, llama, tokenizer, tmp_path, caplog,
                                                            written, case):
    prompts, files = written
    if case in CRAFTED:
        craft(files[0], **CRAFTED[case](tensors_of(files[0])))
    else:
        craft(files[0], meta=CRAFTED_META[case])
    m, warnings = restart(make_model, tmp_path, caplog)
    assert len(warnings) == 1 and files[0].name in warnings[0] and "removed" in warnings[0]
    assert not files[0].exists() and all(f.exists() for f in files[1:])
    assert m.stats()["tier_bytes"] == sum(f.stat().st_size for f in files[1:])
    read = answers_exactly(m, llama, tokenizer, prompts)
    assert read[0] == 0 and all(n == len(p) - 1 for n, p in zip(read[1:], prompts[1:]))


@pytest.mark.parametrize("case", ["K of another shape", "V of another dtype", "tokens swapped for others"])
def test_a_crafted_file_whose_kv_does_not_fit_is_a_miss_when_read_back(make_model, llama, tokenizer, tmp_path, caplog,
                                                                       written, case):
    prompts, files = written
    t = tensors_of(files[0])
    craft(files[0], **{"K of another shape": {"k": t["k"][:, :1]},
                       "V of another dtype": {"v": t["v"].double()},
                       "tokens swapped for others": {"tokens": t["tokens"].flip(0)}}[case])
    m, warnings = restart(make_model, tmp_path, caplog)
    read = answers_exactly(m, llama, tokenizer, prompts)
    assert read[0] == 0 and m.stats()["tier_failed_reads"] == (case != "tokens swapped for others")
    assert all(n == len(p) - 1 for n, p in zip(read[1:], prompts[1:]))


def test_an_oversized_header_is_refused_before_it_is_parsed(make_model, llama, tokenizer, tmp_path, caplog, written):
    prompts, files = written
    craft(files[0], meta={"padding": "x" * (disk_tier.MAX_HEADER + 1)})
    m, warnings = restart(make_model, tmp_path, caplog)
    assert len(warnings) == 1 and "header" in warnings[0] and not files[0].exists()
    assert answers_exactly(m, llama, tokenizer, prompts)[1:] == [len(p) - 1 for p in prompts[1:]]


def test_a_fifo_under_a_files_name_does_not_block_the_start(make_model, llama, tokenizer, tmp_path, caplog, written):
    prompts, files = written
    fifo = files[0].with_name("1-fifo" + SUFFIX)
    os.mkfifo(fifo)
    done = []
    t = threading.Thread(target=lambda: done.append(restart(make_model, tmp_path, caplog)), daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive()
    m, warnings = done[0]
    assert len(warnings) == 1 and "not a regular file" in warnings[0] and fifo.exists()  # left alone
    assert answers_exactly(m, llama, tokenizer, prompts) == [len(p) - 1 for p in prompts]


def test_a_directory_under_a_files_name_is_left_alone(make_model, llama, tokenizer, tmp_path, caplog, written):
    prompts, files = written
    (files[0].with_name("2-dir" + SUFFIX) / "inside").mkdir(parents=True)
    m, warnings = restart(make_model, tmp_path, caplog)
    assert len(warnings) == 1 and "not a regular file" in warnings[0]
    assert answers_exactly(m, llama, tokenizer, prompts) == [len(p) - 1 for p in prompts]
    m.close()
    assert (files[0].with_name("2-dir" + SUFFIX) / "inside").is_dir()


def test_a_file_moved_into_another_partition_is_never_served_there(make_model, llama, tokenizer, tmp_path, caplog,
                                                                    written):
    # the salt names the partition the file's node is attached under; a checksum-valid file claiming another
    # partition is attached there, and serves only requests of that partition: its KV is still this prompt's
    prompts, files = written
    craft(files[0], meta={"salt": json.dumps("tenant")})
    m, warnings = restart(make_model, tmp_path, caplog)
    assert warnings == []
    read = answers_exactly(m, llama, tokenizer, prompts[:1])
    assert read == [0]  # the default partition no longer holds it
    before = m.stats()["disk_tokens"]
    (c,) = m.generate([prompts[0]], max_tokens=1, cache_salt="tenant")
    assert c.token_ids == reference_greedy(llama, prompts[0], 1, tokenizer.eos_token_id)
    assert m.stats()["disk_tokens"] - before == len(prompts[0]) - 1
    m.check_integrity()


def test_token_ids_from_a_file_are_checked_before_they_can_become_drafts(make_model, tokenizer, tmp_path, caplog,
                                                                          written):
    prompts, files = written
    t = tensors_of(files[0])
    craft(files[0], tokens=torch.cat([t["tokens"][:-1], torch.tensor([len(tokenizer) + 5])]))
    m, warnings = restart(make_model, tmp_path, caplog)
    assert len(warnings) == 1 and "vocabulary" in warnings[0]
    assert all(max(x.key) < len(tokenizer) for x in m.engine.tree.nodes() if x.key)
