"""Disk tier: the KV of radix-tree nodes evicted from the pool, kept in files and read back into pool slots
instead of being computed again (`kvql.model(..., disk_cache=DIR, disk_budget=...)`).

The radix tree stays the one index (radix_cache.py): a node's KV is in pool slots, in an `Extent` of a tier
file, or both (a clean copy: evicting the node again writes nothing). This module only moves bytes and
checks them; which node goes where is the tier policy's decision (tier_policy.py), and when one is read back
`Memory`'s.

It is also how the cache survives restarts (one format: `disk_cache=DIR`, also spelled `cache_dir=DIR`): at
start the tree is rebuilt from the files (every node on disk, read back when a request needs it), and the
engine writes what only the pool holds to the tier when it closes and, when idle, every `cache_save_interval`
seconds (persistence.py).

Files: `DIR/<16 hex digits of the fingerprint's SHA-256>/<sequence>-<random>.kv.safetensors` (fingerprint.py:
one directory per model, dtype, device and tokenizer, so models sharing `DIR` never read each other's KV), one
per spilled node, never rewritten and never reused under another name; what a file holds, how it is checked
and read without trusting it: tier_file.py. A file's modification time orders the LRU across restarts: a read
back touches it, and `order` (at a save) sets every file's in the tree's LRU order.

One model at a time uses a directory: its tier holds an exclusive lock on `DIR/<digest>/lock` (flock, let go by
`close` or the process's end) while it is open; another opening it, in this process or another, gets `TierBusy`;
a directory that cannot be created, read and written gets `TierUnavailable` (the engine then runs without a
tier, saying so: persistence.py). Temporary files of writes that never finished are therefore
a closed or dead tier's, and `scan` removes them.

Contract:
- `spill(items)` (engine thread, between steps): copies the K/V of each `SpillItem` out of the pool into
  staging tensors, returns one `Extent` per item and queues the writes; the caller may free the slots at
  once. The writer thread hashes and writes each file (temporary name, then rename); until it is written,
  reads are served from its staging copy. `room(n)`: whether `n` more tokens may be staged (at most
  MAX_STAGED bytes wait for the writer; past that the policy drops instead).
- `read(items, slots)` (engine thread) -> `Load`: the reader thread checks each `ReadItem` and copies its
  rows into its share of `slots` (rows of pool slots no one else writes: they are allocated to the load).
  `Load.done` / `Load.ok` (per item, in order) are set when it is finished; `wait`.
- `release(extent)`: one reference to a file fewer; the file is deleted (by the writer thread, after any
  write still queued for it) when none is left. `bytes` counts the live files' sizes on disk: a file staged
  for the writer counts at an upper bound of its size (`file_bytes`), replaced by its size once written (0 if
  the write failed), so `bytes` is never below what the files take and equals it once `flush()` returned;
  `over_budget()` when it exceeds `budget`.
- `order(files)`: the files' modification times are set in the order given (least recently used first).
- `close()`: writes what is queued, then stops the threads and lets go of the directory.
- The pool must be in CPU memory (ValueError otherwise): reads back are copied into it through numpy views.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import json
import logging
import os
import queue
import secrets
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from . import tier_file
from .fingerprint import digest as fingerprint_digest
from .tier_items import Extent, Load, ReadItem, ScannedFile, SpillItem, TierFile

MAX_STAGED = 512 * 2**20
"""Bytes of spilled KV that may wait for the writer thread; past that, eviction drops (as without a tier)."""
log = logging.getLogger("kvql.cache")


def tier_dir(directory, fingerprint: dict[str, str]) -> Path:
    """Where the tier of the model with `fingerprint` lives under `directory` (module doc)."""
    return Path(directory).expanduser() / fingerprint_digest(fingerprint)[:16]


class TierUnavailable(RuntimeError):
    """The tier's directory cannot be used: it cannot be created, read or written (module doc)."""


class TierBusy(TierUnavailable):
    """Another model has this tier's directory open (module doc)."""


def _as_numpy(t: torch.Tensor):
    """A numpy view of a CPU tensor of any dtype (bfloat16 as int16): numpy copies take no OpenMP threads."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


class DiskTier:
    def __init__(self, directory, fingerprint: dict[str, str], pool, budget: int):
        if budget <= 0:
            raise ValueError(f"disk_budget must be > 0 bytes, got {budget}")
        if pool.k.device.type != "cpu":  # the reader copies rows through numpy views of the pool
            raise ValueError(f"disk_cache needs the KV pool in CPU memory, not on {pool.k.device.type}")
        self.digest = fingerprint_digest(fingerprint)
        self.path = tier_dir(directory, fingerprint)
        try:  # a full or read-only disk, a file in the directory's place: a tier that cannot be (module doc)
            self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
            if not os.access(self.path, os.R_OK | os.W_OK | os.X_OK):  # its lock file may exist already
                raise OSError("not readable and writable by this process (read-only?)")
            self._lock_fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise TierUnavailable(f"{self.path} cannot be used: {e.strerror or e}") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self._lock_fd)
            if e.errno != errno.EWOULDBLOCK:  # a file system without locks
                raise TierUnavailable(f"{self.path} cannot be locked: {e.strerror or e}") from None
            raise TierBusy(f"{self.path} is in use by another kvql model (this process or another)") from None
        self.pool, self.budget = pool, budget
        self.bytes = 0  # the live files' sizes (module doc), the side file's included
        self.side_bytes = 0  # the recurrent states' snapshots file beside the K/V files (`side_file`)
        self.staged_bytes = 0
        self.written_tokens = self.read_tokens = self.failed_reads = 0
        self._token_bytes = pool.token_bytes
        self._seq = itertools.count(time.time_ns())
        self._writes: queue.Queue = queue.Queue()
        self._reads: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # guards `staged_bytes`, `bytes` and the writer's view of `TierFile.refs`
        self.closed = False
        self._threads = [threading.Thread(target=self._writer, name="kvql-tier-writer", daemon=True),
                         threading.Thread(target=self._reader, name="kvql-tier-reader", daemon=True)]
        for t in self._threads:
            t.start()

    # -- spilling (engine thread) ----------------------------------------------------------------
    def room(self, n_tokens: int) -> bool:
        """Whether `n_tokens` more may be staged for the writer now (all a caller's pending ones together: `spill`
        stages them only when it is called)."""
        with self._lock:
            return self.staged_bytes + n_tokens * self._token_bytes <= MAX_STAGED

    def file_bytes(self, prefix_len: int, n_tokens: int, salt) -> int:
        """An upper bound of the size of the file `spill` writes for `n_tokens` after `prefix_len` under `salt`:
        their K/V, both token lists (int64) and the header (the salt's JSON at most doubled by escaping)."""
        return n_tokens * self._token_bytes + 8 * (prefix_len + n_tokens) + tier_file.HEADER_BYTES + 2 * len(json.dumps(salt))

    def spill(self, items: list[SpillItem]) -> list[Extent]:
        """One Extent per item (module doc)."""
        extents = []
        for prefix, tokens, salt, slots in items:
            k = self.pool.k[:, :, slots]  # a copy: the slots may be reused as soon as this returns
            v = self.pool.v[:, :, slots]
            nbytes = len(tokens) * self._token_bytes
            name = f"{next(self._seq)}-{secrets.token_hex(4)}{tier_file.SUFFIX}"
            staging = (torch.tensor(prefix, dtype=torch.long), torch.tensor(tokens, dtype=torch.long), k, v)
            file = TierFile(self.path / name, self.file_bytes(len(prefix), len(tokens), salt), refs=1, staging=staging)
            with self._lock:
                self.staged_bytes += nbytes
                self.bytes += file.bytes
            self.written_tokens += len(tokens)
            self._writes.put(("write", file, salt))
            extents.append(Extent(file, 0, len(tokens)))
        return extents

    def adopt(self, path: Path, nbytes: int) -> TierFile:
        """A file found on disk at start (`scan`), taken into the budget; its references are the caller's."""
        with self._lock:
            self.bytes += nbytes
        return TierFile(path, nbytes, refs=0)

    def release(self, extent: Extent) -> None:
        file = extent.file
        with self._lock:  # against the writer's correction of `bytes` (`_writer`)
            file.refs -= 1
            if file.refs == 0:
                self.bytes -= file.bytes
        if file.refs == 0:
            self._writes.put(("delete", file, None))

    def order(self, files: list[TierFile]) -> None:
        """Set the files' modification times in this order (module doc), after the writes queued before."""
        now = time.time_ns() - len(files)
        for i, file in enumerate(files):
            self._writes.put(("touch", file, now + i))

    def side_file(self, nbytes: int) -> None:
        """The size of the tier's one side file now (the recurrent states' snapshots, state_snapshots.FILE; 0:
        none): counted in the budget beside the K/V files, so that reclaiming makes room for it too."""
        with self._lock:
            self.bytes += nbytes - self.side_bytes
            self.side_bytes = nbytes

    def over_budget(self) -> bool:
        return self.bytes > self.budget

    def _writer(self) -> None:
        while True:
            op, file, salt = self._writes.get()
            if op == "stop":
                self._writes.task_done()
                return
            size = 0  # of the file written (none if the write failed)
            try:
                if op == "write":
                    size = self._write(file, salt)
                elif op == "touch":
                    if file.refs > 0:  # not through a link: only this directory's files are the tier's
                        os.utime(file.path, ns=(salt, salt), follow_symlinks=False)
                else:
                    file.path.unlink(missing_ok=True)
            except Exception as e:  # noqa: BLE001 -- a failed write is a file that is not there: a miss later
                log.warning("kvql disk tier: could not %s %s: %s", op, file.path.name, e)
            finally:
                if op == "write":
                    with file.lock:
                        staged, file.staging = file.staging, None
                    with self._lock:
                        self.staged_bytes -= staged[1].numel() * self._token_bytes if staged is not None else 0
                        if file.refs > 0:  # still live: count what it takes on disk (module doc)
                            self.bytes += size - file.bytes
                            file.bytes = size
                self._writes.task_done()

    def _write(self, file: TierFile, salt) -> int:
        """Write `file` from its staging copy (temporary name, then rename); its size (0: released before)."""
        if file.refs == 0:  # released before it was written
            return 0
        tensors = dict(zip(tier_file.NAMES, file.staging))
        meta = {"kvql_format": tier_file.FORMAT, "fingerprint": self.digest, "salt": json.dumps(salt),
                "sha256": tier_file.sha256(self.digest, salt, tensors)}
        tmp = file.path.with_name(f".{file.path.name}.tmp")
        save_file(tensors, str(tmp), metadata=meta)
        size = tmp.stat().st_size
        os.replace(tmp, file.path)
        return size

    # -- reading back --------------------------------------------------------------------------------
    def read(self, items: list[ReadItem], slots: torch.Tensor) -> Load:
        """`items` in tree order; their rows go to `slots` in order."""
        load = Load(list(items), slots)
        self._reads.put(load)
        return load

    def _reader(self) -> None:
        pool_k, pool_v = _as_numpy(self.pool.k), _as_numpy(self.pool.v)
        while True:
            load = self._reads.get()
            if load is None:
                return
            slots, at = load.slots.numpy(), 0
            for item in load.items:
                extent = item.extent
                rows = slots[at:at + extent.length]
                at += extent.length
                try:
                    k, v = self._check(item)
                    pool_k[:, :, rows] = _as_numpy(k)[:, :, extent.offset:extent.offset + extent.length]
                    pool_v[:, :, rows] = _as_numpy(v)[:, :, extent.offset:extent.offset + extent.length]
                    load.ok.append(True)
                except Exception as e:  # noqa: BLE001 -- any failure to read is a miss
                    log.warning("kvql disk tier: %s not used (%s); its tokens are computed again",
                                extent.file.path.name, e)
                    self.failed_reads += 1
                    load.ok.append(False)
            self.read_tokens += sum(item.extent.length for item, ok in zip(load.items, load.ok) if ok)
            load.done.set()

    def _check(self, item: ReadItem):
        """The file's K/V if it is the KV of the item's `prefix + tokens` under its `salt` (module doc), else
        ValueError."""
        extent, prefix, tokens, salt = item
        with extent.file.lock:
            staged = extent.file.staging
        if staged is not None:
            p, t, k, v = staged
        else:  # at most the bytes it was written with: a file grown since is not read into memory
            meta, tensors, _ = tier_file.read(extent.file.path, max_bytes=extent.file.bytes)
            if meta.get("sha256") != tier_file.sha256(self.digest, salt, tensors):
                raise ValueError("checksum mismatch: not this model's file, or not of this cache partition, or damaged")
            p, t, k, v = (tensors[name] for name in tier_file.NAMES)
            want_k, want_v = ((*x.shape[:2], t.numel(), x.shape[3]) for x in (self.pool.k, self.pool.v))
            if {k.dtype, v.dtype} != {self.pool.k.dtype} or tuple(k.shape) != want_k or tuple(v.shape) != want_v:
                raise ValueError(f"K/V of shapes {tuple(k.shape)} {tuple(v.shape)} and dtypes {k.dtype} {v.dtype}, "
                                 f"not {want_k} {want_v} {self.pool.k.dtype}")
            os.utime(extent.file.path, follow_symlinks=False)  # its mtime orders the LRU at the next start (`scan`)
        own = t.tolist()
        if p.tolist() + own[:extent.offset] != prefix or own[extent.offset:extent.offset + extent.length] != tokens:
            raise ValueError("its tokens are not the ones the tree expects there")
        return k, v

    # -- start and stop --------------------------------------------------------------------------------
    def scan(self, vocab_size: int) -> list[ScannedFile]:
        """Every usable file of this tier, shortest prefix first, then least recently used first. Removed (one log
        line each): temporary files of writes that never finished, and files that are not this tier's (another
        format or fingerprint, a header over tier_file.MAX_HEADER, token ids outside `[0, vocab_size)`); what is
        not a regular file is left alone (one log line). Files are opened as `read` opens them
        (`tier_file.open_regular`); the KV is checked only when read back (`read`)."""
        found = []
        for path in self.path.iterdir():
            if path.name.startswith(".") and path.name.endswith(".tmp"):
                try:
                    path.unlink(missing_ok=True)
                except OSError:  # a directory of that name: not the writer's
                    pass
                continue
            if not path.name.endswith(tier_file.SUFFIX):
                continue
            try:
                found.append(self._scan_one(path, vocab_size))
            except tier_file.NotAFile as e:  # a FIFO, a link, a directory: not a file the tier wrote; left alone
                log.warning("kvql disk tier: %s ignored (%s)", path.name, e)
            except Exception as e:  # noqa: BLE001 -- an unreadable file is deleted: it can serve nothing
                log.warning("kvql disk tier: %s removed (%s)", path.name, e)
                path.unlink(missing_ok=True)
        found.sort(key=lambda f: (len(f.prefix), f.mtime_ns))
        return found

    def _scan_one(self, path: Path, vocab_size: int) -> ScannedFile:
        meta, tensors, st = tier_file.read(path, names=("prefix", "tokens"))
        if meta.get("kvql_format") != tier_file.FORMAT or meta.get("fingerprint") != self.digest:
            raise ValueError("another format or model")
        prefix, tokens = tensors["prefix"], tensors["tokens"]
        salt = json.loads(meta["salt"])
        if prefix.dtype != torch.long or tokens.dtype != torch.long or prefix.dim() != 1 or tokens.dim() != 1:
            raise ValueError("token lists of another type or shape")
        both = torch.cat([prefix, tokens])
        if not tokens.numel() or not bool(((both >= 0) & (both < vocab_size)).all()):
            raise ValueError(f"no tokens, or token ids outside the vocabulary [0, {vocab_size})")
        if not isinstance(salt, (str, type(None))):
            raise ValueError("a cache partition that is not a string")
        return ScannedFile(st.st_mtime_ns, path, st.st_size, salt, prefix.tolist(), tokens.tolist())

    def release_unused(self, file: TierFile) -> None:
        """A file `scan` found that the tree cannot use (no file holds its prefix, or others hold all its
        tokens): out of the budget, deleted."""
        if file.refs == 0:
            with self._lock:
                self.bytes -= file.bytes
            self._writes.put(("delete", file, None))

    def flush(self) -> None:
        """Wait until every queued write and deletion is done."""
        self._writes.join()

    def close(self) -> None:
        """Write what is queued, then stop the threads (reads in flight finish first)."""
        self.closed = True
        self._writes.put(("stop", None, None))
        self._reads.put(None)
        for t in self._threads:
            t.join()
        os.close(self._lock_fd)  # lets go of the directory's lock
