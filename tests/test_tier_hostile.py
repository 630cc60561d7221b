"""Disk tier files that are not what the tier wrote (disk_tier's module doc says what the directory is trusted for).

- Accidents are misses, answers stay exact: another model's file with its fingerprint field edited, tokens
  reordered by a tool that recomputed a checksum of the tensors (as the previous format's), a file of the
  previous format.
- No file freezes or crashes the process, at start or mid-run: a FIFO, or a link to one, under a file's name; a
  file rewritten in place while it is read; links are never followed (reading or touching).
- Files crafted with kvql's own checksum recomputed (`craft`: what only a writer of the directory, which the tier
  trusts, can do): one that is not the tier's layout is removed at start with one warning line (or, not being a
  regular file, left alone); one whose KV does not fit is a miss when read back; a header too large is refused.

The other files still serve, answers stay exact and `check_integrity()` clean."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import random_prompts, reference_greedy, tiny_model
from kvql.engine.cache import tier_file
from kvql.engine.cache.tier_file import SUFFIX


def craft(path: Path, meta: dict | None = None, **tensors) -> None:
    """Rewrite tier file `path` with some tensors (any dtype or shape) or metadata replaced, its sha256
    recomputed as kvql's writer computes it (for the salt it then claims, if that is JSON): the file is valid
    but for what was changed. Only a writer who knows the format does this (the directory trusts its writers)."""
    old_meta, data = metadata_of(path), tensors_of(path)
    data.update({k: t.contiguous() for k, t in tensors.items()})
    meta = {**old_meta, **(meta or {})}
    try:
        salt = json.loads(meta["salt"])
    except ValueError:
        salt = None
    save_file(data, str(path), metadata={**meta, "sha256": tier_file.sha256(old_meta["fingerprint"], salt, data)})


def tensors_hash(data: dict) -> str:
    """A checksum of the tensors' bytes alone (what kvql-kv-tier-1 carried, and a tool editing a file may redo)."""
    h = hashlib.sha256()
    for t in data.values():
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def tensors_of(path: Path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in ("prefix", "tokens", "k", "v")}


def metadata_of(path: Path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        return f.metadata()


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
    for path in a.engine.tier.path.glob(f"*{SUFFIX}"):
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
    "the previous format": {"kvql_format": "kvql-kv-tier-1"},
    "another model's digest": {"fingerprint": "0" * 64},
}


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
    craft(files[0], meta={"padding": "x" * (tier_file.MAX_HEADER + 1)})
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


# -- accidents: a miss, never a wrong token -----------------------------------------------------------------------
@torch.inference_mode()
def reference_logprobs(hf_model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Uncached greedy tokens and their log-probabilities."""
    ids, out, logprobs = list(prompt), [], []
    for _ in range(n):
        lp = torch.log_softmax(hf_model(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1)
        out.append(int(lp.argmax()))
        logprobs.append(float(lp[out[-1]]))
        ids.append(out[-1])
    return out, logprobs


def assert_exact(m, hf_model, prompt: list[int]) -> int:
    """Four greedy tokens of `prompt` and their log-probabilities are the reference's; how many tokens were read
    back from disk for it."""
    before = m.stats()["disk_tokens"]
    (c,) = m.generate([prompt], max_tokens=4, logprobs=1)
    want, logprobs = reference_logprobs(hf_model, prompt, 4)
    assert c.token_ids == want and [e.logprob for e in c.logprobs] == pytest.approx(logprobs, abs=1e-4)
    return m.stats()["disk_tokens"] - before


def test_tokens_reordered_with_a_checksum_of_the_tensors_recomputed_are_a_miss(make_model, llama, tmp_path, caplog,
                                                                              written):
    prompts, files = written
    data = tensors_of(files[0])
    g = torch.Generator().manual_seed(0)
    rest = data["tokens"][1:]  # (its first token kept: the file stays on its own path)
    data["tokens"] = torch.cat([data["tokens"][:1], rest[torch.randperm(rest.numel(), generator=g)]])
    save_file(data, str(files[0]), metadata={**metadata_of(files[0]), "sha256": tensors_hash(data)})
    m, _ = restart(make_model, tmp_path, caplog)
    assert assert_exact(m, llama, data["tokens"].tolist() + [5]) == 0  # the KV of other tokens: not read back
    assert m.stats()["tier_failed_reads"] == 1
    m.check_integrity()


def test_another_models_file_with_its_fingerprint_field_edited_is_a_miss(make_model, llama, tokenizer, tmp_path,
                                                                          caplog, written):
    prompts, files = written
    other = make_model(tiny_model(tokenizer, seed=1), disk_cache=tmp_path, cache_save_interval=0)  # its own directory
    other.generate([prompts[0]], max_tokens=1)
    other.close()
    (theirs,) = other.engine.tier.path.glob(f"*{SUFFIX}")
    meta = {**metadata_of(theirs), "fingerprint": metadata_of(files[0])["fingerprint"]}  # its sha256 left as written
    files[0].unlink()
    save_file(tensors_of(theirs), str(files[0]), metadata=meta)
    m, warnings = restart(make_model, tmp_path, caplog)
    assert warnings == []  # its header says it is this model's: it is found, and fails when read back
    assert assert_exact(m, llama, prompts[0]) == 0 and m.stats()["tier_failed_reads"] == 1
    assert answers_exactly(m, llama, tokenizer, prompts[1:]) == [len(p) - 1 for p in prompts[1:]]


# -- files swapped or changed mid-run: never a freeze, never a crash ----------------------------------------------
def in_thread(fn):
    """`fn()` on another thread, which must end within 120 s (a bound no slow machine reaches: only a freeze)."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "frozen"
    assert out, "it raised (see the thread's traceback above)"
    return out[0]


def unblocker(fifo: Path, after: float = 60) -> subprocess.Popen:
    """A process that opens `fifo` for writing after `after` seconds, which frees a reader blocked opening it
    (holding the GIL, it freezes the whole process): code that blocks there fails a test instead of hanging it."""
    code = "import sys, time; time.sleep(float(sys.argv[1])); open(sys.argv[2], 'wb').close()"
    return subprocess.Popen([sys.executable, "-c", code, str(after), str(fifo)])


@pytest.mark.parametrize("swap", ["a FIFO", "a link to a FIFO"])
def test_a_file_swapped_for_a_fifo_mid_run_is_a_miss_and_freezes_nothing(make_model, llama, tokenizer, tmp_path,
                                                                         caplog, written, swap):
    prompts, files = written
    m, _ = restart(make_model, tmp_path, caplog)
    fifo = files[0] if swap == "a FIFO" else tmp_path / "elsewhere.fifo"
    files[0].unlink()
    os.mkfifo(fifo)
    if fifo != files[0]:
        files[0].symlink_to(fifo)
    helper = unblocker(fifo)
    try:
        read = in_thread(lambda: answers_exactly(m, llama, tokenizer, prompts))
    finally:
        helper.kill()
        helper.wait()
    assert read == [0] + [len(p) - 1 for p in prompts[1:]] and m.stats()["tier_failed_reads"] == 1
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert files[0].name in line and "not a regular file" in line  # refused, not read until the helper wrote
    m.check_integrity(full=False)  # what /health asks
    in_thread(m.close)
    assert fifo.exists() == (swap == "a link to a FIFO")  # the tier deleted its name; nothing outside it


@pytest.mark.parametrize("change", ["truncated", "rewritten"])
def test_a_file_changed_in_place_while_it_is_read_is_a_miss_not_a_crash(make_model, llama, tokenizer, tmp_path,
                                                                        caplog, written, monkeypatch, change):
    # `cp other file` truncates the file, then writes it: a reader that mapped it dies of SIGBUS. Here the file
    # changes once the reader has the status of its descriptor (so the size it knows is stale), before it reads.
    prompts, files = written
    m, _ = restart(make_model, tmp_path, caplog)
    target, changed, fstat = os.path.realpath(files[0]), [], os.fstat

    def fstat_then_change(fd):
        st = fstat(fd)
        try:
            ours = isinstance(fd, int) and not changed and os.readlink(f"/proc/self/fd/{fd}") == target
        except OSError:  # a descriptor closed meanwhile
            ours = False
        if ours:
            changed.append(fd)
            data = bytearray(files[0].read_bytes())
            data[-1] ^= 0xFF  # a byte of K or V
            with open(target, "r+b") as f:
                f.truncate(len(data) // 2) if change == "truncated" else f.write(data)
        return st

    monkeypatch.setattr(os, "fstat", fstat_then_change)
    read = answers_exactly(m, llama, tokenizer, prompts)
    assert changed, "the reader did not read through a descriptor it checked"
    assert read == [0] + [len(p) - 1 for p in prompts[1:]] and m.stats()["tier_failed_reads"] == 1


def test_a_file_swapped_for_a_link_mid_run_is_neither_read_nor_touched_through_it(make_model, llama, tokenizer,
                                                                                  tmp_path, caplog, written):
    prompts, files = written
    m, _ = restart(make_model, tmp_path, caplog)
    outside = tmp_path / "outside" / files[0].name  # the very file, valid, moved out of the tier's directory
    outside.parent.mkdir()
    shutil.move(files[0], outside)
    files[0].symlink_to(outside)
    os.utime(outside, ns=(10**18, 10**18))
    m.save_cache()  # sets every file's modification time in the LRU order
    assert outside.stat().st_mtime_ns == 10**18
    assert answers_exactly(m, llama, tokenizer, prompts) == [0] + [len(p) - 1 for p in prompts[1:]]
    assert m.stats()["tier_failed_reads"] == 1 and outside.stat().st_mtime_ns == 10**18
