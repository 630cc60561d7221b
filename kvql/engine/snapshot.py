"""Snapshot: the radix tree and the KV of its slots in one file, written and read back exactly.

The file is a safetensors file (written here layer by layer, so saving never holds a second copy of
the cache in memory; read with `safetensors.safe_open`):

    tokens  int64 [T]        every node's key, concatenated (nodes in parent-before-child order)
    parent  int64 [N]        index of each node's parent node, -1 under its salt's root
    length  int64 [N]        tokens per node (>= 1)
    salt    int64 [N]        index into the metadata's `salts` (the node's partition)
    rank    int64 [N]        LRU order of the nodes: 0 is the least recently used
    k.L, v.L [kv_heads, T, head_dim] (the pool's dtype)  the K and V of every token, layer L

    metadata: kvql_format (FORMAT), fingerprint (JSON, `fingerprint()`), salts (JSON list),
              checksum (CRC-32 of the header with checksum "00000000", then every data byte)

Contract:
- `save(tree, pool, path, fp)` writes every node of the tree, with the K/V of its slots. The caller
  holds the engine between steps (no forward runs) during `write`, the part that reads tree and
  pool; `Pending.commit()` (fsync and rename: most of the time on a slow disk) needs neither. Tree
  content is always computed KV (memory.py inserts tokens only after their forward); nodes locked
  by running requests are saved too, since a tree slot is never written again while the tree holds
  it (saving only unlocked nodes would cut the tree above them). A running request's own slots (past its
  `tree_len`) are not in the tree and never saved. The file appears atomically: it is written under
  a temporary name in the same directory (unique per save, mode 0600: it holds prompts' tokens),
  fsynced, then renamed over `path`; a crash leaves the old snapshot or none, never half of one.
- `load(tree, pool, path, fp)` rebuilds the tree into an empty `tree`, taking slots from the pool's
  free list, or raises `SnapshotError` (a one-line reason) and leaves tree and pool as they were:
  another fingerprint (model, dtype, device, tokenizer, format), a truncated or corrupted file (the
  checksum covers every byte but the checksum itself), an inconsistent tree, a field of another type
  or shape than `write` makes (checked from the header before a slot is allocated), token ids outside
  the vocabulary, a header over MAX_HEADER, or a path that is no regular file (opened without blocking:
  a FIFO there fails at once). Nothing is written to the tree before the whole file is read and verified.
- A save holds an exclusive lock on its temporary file until `commit` / `discard`; `remove_stale` (at
  start, cache_dir.py) deletes temporaries of saves that were killed: unlocked and unchanged for
  STALE_AFTER seconds, so another process saving into the same directory is left alone.
- Budget: when the snapshot holds more tokens than the pool has free slots, the least recently used
  leaves are dropped first (the last one cut to fit), as `RadixCache.evict` would have: what is kept
  is the most recently used part and still a tree (a node is dropped only with all its children).
- After `load`, LRU order among the loaded nodes is the saved one; every loaded node is unlocked.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import heapq
import json
import os
import stat
import struct
import tempfile
import time
import zlib
from pathlib import Path

import torch

from .kv_pool import KVPool
from .radix_cache import Node, RadixCache

FORMAT = "kvql-kv-snapshot-1"
"""Bumped whenever the layout above changes: an older snapshot then starts cold."""

SAMPLE = 4096
"""Elements hashed per weight tensor (a fixed stride over the whole tensor): `fingerprint()`."""

_STRUCTURE = ("tokens", "parent", "length", "salt", "rank")
_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
           torch.int64: "I64"}
_NO_CHECKSUM = "00000000"


class SnapshotError(ValueError):
    """A snapshot that cannot be used here; the message says why in one line."""


# -- fingerprint ---------------------------------------------------------------------------------
def fingerprint(hf_model, tokenizer, pool: KVPool) -> dict[str, str]:
    """What must match for a snapshot's KV to be the KV this model would compute.

    - `model`: SHA-256 over the config (minus names, paths, dtype and version fields) and, for every
      tensor of the state dict in name order, its name, shape, dtype and a fixed strided sample of
      `SAMPLE` elements spread over the whole tensor (first and last included). Hashing every weight
      of a 135M model would take ~0.3 s per save; the sample takes milliseconds and tells any two
      trained or randomly initialised models apart. Weights edited in a few places only (outside
      the sample) go unnoticed: give such a model its own cache dir.
    - `dtype` and `device` (the device type: KV computed by other kernels differs in the last bits),
      `kv`: the pool's layer/head geometry, `tokenizer`: SHA-256 of the vocabulary (token -> id),
      `format`: `FORMAT`.
    """
    h = hashlib.sha256()
    config = {k: v for k, v in hf_model.config.to_dict().items()
              if not k.startswith("_") and k not in ("transformers_version", "dtype", "torch_dtype")}
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, t in sorted(hf_model.state_dict().items()):
            flat = t.detach().reshape(-1)
            h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
            if flat.numel():
                m = min(SAMPLE, flat.numel())
                index = torch.arange(m, device=flat.device) * (flat.numel() - 1) // max(m - 1, 1)
                h.update(_bytes(flat.index_select(0, index).cpu()))  # (`flat[index]`: 100x slower)
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    layers, kv_heads, _, head_dim = pool.k.shape
    return {"format": FORMAT, "model": h.hexdigest(), "dtype": str(pool.k.dtype).removeprefix("torch."),
            "device": pool.device.type, "kv": f"{layers}x{kv_heads}x{head_dim}",
            "tokenizer": hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()}


def _bytes(t: torch.Tensor):
    """The raw bytes of a CPU tensor, without a copy (any dtype, bfloat16 included)."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


# -- save ----------------------------------------------------------------------------------------
def save(tree: RadixCache, pool: KVPool, path: str | os.PathLike, fp: dict[str, str]) -> dict:
    """Write the snapshot of `tree` to `path` atomically; `{"tokens", "nodes", "bytes"}`."""
    return write(tree, pool, path, fp).commit()


class Pending:
    """A snapshot written under a temporary name; `commit()` makes it durable and puts it at its path
    (it needs neither tree nor pool: the engine may step meanwhile), `discard()` removes it. The open
    temporary file holds an exclusive lock until then: `remove_stale` leaves it alone."""

    def __init__(self, tmp: Path, path: Path, info: dict, file):
        self.tmp, self.path, self.info, self.file = tmp, path, info, file

    def commit(self) -> dict:
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
            os.replace(self.tmp, self.path)
        except BaseException:
            self.discard()
            raise
        self.file.close()
        _fsync_dir(self.path.parent)
        return {**self.info, "bytes": self.path.stat().st_size}

    def discard(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


STALE_AFTER = 60.0
"""Seconds since a temporary file last changed before `remove_stale` may take it for a dead save's."""


def remove_stale(path: str | os.PathLike) -> int:
    """Remove the temporary files that saves to `path` killed mid-write left behind (not one a live save
    holds locked, nor one written to in the last STALE_AFTER seconds); how many were removed."""
    path, removed = Path(path), 0
    for tmp in path.parent.glob(f".{path.name}.*.tmp"):
        try:
            fd = os.open(tmp, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or time.time() - st.st_mtime < STALE_AFTER:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by a live save: BlockingIOError
            tmp.unlink()
            removed += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def write(tree: RadixCache, pool: KVPool, path: str | os.PathLike, fp: dict[str, str],
          lock=contextlib.nullcontext()) -> Pending:
    """Write the snapshot of `tree` next to `path` under a temporary name (the first half of `save`).

    `lock` (the engine's, taken between steps) is held while the tree is read, and again while each
    layer's K/V is gathered, not while it is written: the engine steps between layers. A tree slot
    keeps its K/V until the tree lets go of it, which only eviction does, so the slots read first are
    still the tree's as long as `tree.evicted_tokens` has not moved; if it has, `CacheChanged` is
    raised (the temporary file removed) and the caller may write again holding `lock` throughout."""
    path = Path(path)
    with lock:
        evicted = tree.evicted_tokens
        structure, slots, salts = _tree_arrays(tree, pool)
    layers, kv_heads, _, head_dim = pool.k.shape
    n_tokens = structure["tokens"].numel()
    kv_shape, kv_dtype = [kv_heads, n_tokens, head_dim], _DTYPES[pool.k.dtype]
    kv_bytes = kv_heads * n_tokens * head_dim * pool.k.element_size()
    entries = [(name, "I64", list(t.shape), t.numel() * 8) for name, t in structure.items()]
    entries += [(f"{kv}.{layer}", kv_dtype, kv_shape, kv_bytes) for layer in range(layers) for kv in "kv"]
    meta = {"kvql_format": FORMAT, "fingerprint": json.dumps(fp, sort_keys=True), "salts": json.dumps(salts)}
    header = _header(meta, entries, _NO_CHECKSUM)
    if len(header) > MAX_HEADER:  # load would refuse it: write nothing rather than a file no load reads
        raise SnapshotError(f"not saved: its header would take {len(header):,} bytes ({len(salts):,} cache "
                            f"partitions, cache_salt values), over the {MAX_HEADER:,} a snapshot may have")

    def chunks():
        for t in structure.values():
            yield _bytes(t)
        for layer in range(layers):
            for kv in (pool.k, pool.v):
                with lock:
                    if tree.evicted_tokens != evicted:
                        raise CacheChanged("the cache evicted tokens during the save")
                    part = kv[layer].index_select(1, slots).cpu()  # a copy: the pool may change after
                yield _bytes(part)

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)  # one per save
    tmp = Path(tmp)
    f = open(fd, "wb")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # until commit or discard: see remove_stale
        f.write(header)
        crc = zlib.crc32(header)
        for chunk in chunks():
            f.write(chunk)
            crc = zlib.crc32(chunk, crc)
        f.seek(0)
        f.write(_header(meta, entries, f"{crc:08x}"))  # the same length: only the checksum differs
    except BaseException:
        f.close()
        tmp.unlink(missing_ok=True)
        raise
    return Pending(tmp, path, {"tokens": n_tokens, "nodes": structure["parent"].numel()}, f)


class CacheChanged(RuntimeError):
    """The tree evicted tokens while `write` was not holding the engine: the snapshot was dropped."""


def _tree_arrays(tree: RadixCache, pool: KVPool) -> tuple[dict[str, torch.Tensor], torch.Tensor, list]:
    """The structure tensors (module doc), the slots of every token in the same order, the salts. Nodes in
    the pool only: a node on the disk tier (and all below it) has its KV in the tier's files."""
    nodes, parents, salts_of, salts = [], [], [], []
    for salt, root in tree.roots.items():
        si = len(salts)
        salts.append(salt)
        stack = [(child, -1) for child in root.children.values() if child.slots is not None]
        while stack:  # parent before children
            node, parent = stack.pop()
            parents.append(parent)
            salts_of.append(si)
            stack.extend((c, len(nodes)) for c in node.children.values() if c.slots is not None)
            nodes.append(node)
    order = sorted(range(len(nodes)), key=lambda i: nodes[i].last_access)
    rank = [0] * len(nodes)
    for r, i in enumerate(order):
        rank[i] = r
    tokens = [t for n in nodes for t in n.key]
    slots = torch.cat([n.slots for n in nodes]) if nodes else torch.empty(0, dtype=torch.long, device=pool.device)
    long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    structure = {"tokens": long(tokens), "parent": long(parents), "length": long([len(n.key) for n in nodes]),
                 "salt": long(salts_of), "rank": long(rank)}
    return structure, slots, salts


def _header(meta: dict[str, str], entries, checksum: str) -> bytes:
    """The 8-byte length and the JSON header, padded with spaces to 8-byte alignment."""
    info, offset = {"__metadata__": {**meta, "checksum": checksum}}, 0
    for name, dtype, shape, nbytes in entries:
        info[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(info, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# -- load ----------------------------------------------------------------------------------------
MAX_HEADER = 4 << 20
"""Bytes a header may have (`write` refuses to make a larger one): its tensor entries take ~100 bytes per
layer, its salts ~260 each (~15,000 partitions fit). Parsing JSON costs up to ~25 times its size (measured:
a 4 MiB header of empty containers peaks at ~100 MiB while parsed, then freed; a 16 MB one cost 413 MiB)."""


def read_header(path: str | os.PathLike) -> tuple[dict, bytes]:
    """The parsed header and its raw bytes (length prefix included) with the checksum zeroed. Only a
    regular file is read (a FIFO or device at the path is refused without blocking on it)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise SnapshotError(f"cannot be opened ({e.strerror})") from None
    with open(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SnapshotError("not a regular file")
        prefix = f.read(8)
        if len(prefix) < 8:
            raise SnapshotError("truncated (no header)")
        (n,) = struct.unpack("<Q", prefix)
        if n > st.st_size - 8:
            raise SnapshotError("truncated or corrupt (header length)")
        if n > MAX_HEADER:
            raise SnapshotError(f"corrupt (a {n:,}-byte header; a snapshot's is at most {MAX_HEADER:,})")
        raw = f.read(n)
    try:
        info = json.loads(raw)
        checksum = info["__metadata__"]["checksum"]
    except (ValueError, KeyError, TypeError):
        raise SnapshotError("corrupt (unreadable header)") from None
    if not isinstance(checksum, str) or len(checksum) != len(_NO_CHECKSUM):
        raise SnapshotError("corrupt (checksum field)")
    field = f'"checksum":"{checksum}"'.encode()
    if raw.count(field) != 1:
        raise SnapshotError("corrupt (checksum field)")
    zeroed = raw.replace(field, f'"checksum":"{_NO_CHECKSUM}"'.encode())
    return info, prefix + zeroed


def check_fingerprint(info: dict, fp: dict[str, str]) -> None:
    """SnapshotError naming what differs when the snapshot's fingerprint is not `fp`."""
    meta = info["__metadata__"]
    if meta.get("kvql_format") != FORMAT:
        raise SnapshotError(f"another snapshot format ({meta.get('kvql_format')!r}, this kvql reads {FORMAT!r})")
    try:
        saved = json.loads(meta["fingerprint"])
    except (ValueError, KeyError):
        raise SnapshotError("corrupt (fingerprint)") from None
    differ = [k for k in fp if saved.get(k) != fp[k]]
    if differ:
        what = {"model": "another model", "dtype": f"dtype {saved.get('dtype')}, not {fp['dtype']}",
                "device": f"device {saved.get('device')}, not {fp['device']}", "tokenizer": "another tokenizer"}
        raise SnapshotError("saved for " + ", ".join(what.get(k, f"another {k}") for k in differ))


def load(tree: RadixCache, pool: KVPool, path: str | os.PathLike, fp: dict[str, str], vocab_size: int) -> dict:
    """Rebuild the saved tree into the empty `tree`; `{"tokens", "nodes", "dropped"}` (tokens that
    did not fit in the pool's free slots). SnapshotError (nothing changed, no slot taken) if the file
    cannot be used: every field is checked (types, shapes, token ids below `vocab_size`, the tree)
    before a slot is allocated."""
    from safetensors import safe_open

    assert tree.total_tokens == 0, "load into an empty tree"
    info, header = read_header(path)
    check_fingerprint(info, fp)
    try:
        names = sorted((k for k in info if k != "__metadata__"), key=lambda k: int(info[k]["data_offsets"][0]))
    except (KeyError, TypeError, ValueError, IndexError):
        raise SnapshotError("corrupt (tensor offsets)") from None
    layers, kv_heads, _, head_dim = pool.k.shape
    expected = {*_STRUCTURE, *(f"{kv}.{i}" for i in range(layers) for kv in "kv")}
    if set(names) != expected or set(names[:len(_STRUCTURE)]) != set(_STRUCTURE):
        raise SnapshotError("corrupt (tensor names)")
    try:
        _check_entries(info, pool)
    except (AttributeError, TypeError, KeyError, IndexError):
        raise SnapshotError("corrupt (tensor entries)") from None
    try:
        salts = json.loads(info["__metadata__"]["salts"])
    except (ValueError, KeyError, TypeError):
        raise SnapshotError("corrupt (salts)") from None
    if not isinstance(salts, list):
        raise SnapshotError("corrupt (salts)")
    crc = zlib.crc32(header)
    dest = None
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            structure = {}
            for name in names[:len(_STRUCTURE)]:
                structure[name] = t = f.get_tensor(name)
                crc = zlib.crc32(_bytes(t), crc)
            plan = _plan(structure, salts, pool.num_free, vocab_size)
            dest = pool.alloc(plan.kept_tokens)
            keep = plan.keep_index.to(pool.device)
            for name in names[len(_STRUCTURE):]:
                t = f.get_tensor(name)  # of the dtype and shape _check_entries read from the header
                crc = zlib.crc32(_bytes(t), crc)
                kv, layer = name.split(".")
                target = (pool.k if kv == "k" else pool.v)[int(layer)]
                t = t.to(pool.device)
                target.index_copy_(1, dest, t if plan.kept_tokens == plan.total else t.index_select(1, keep))
    except SnapshotError:
        _give_back(pool, dest)
        raise
    except Exception as e:  # safetensors' own errors on a truncated or mangled file
        _give_back(pool, dest)
        why = (str(e).splitlines() or [""])[0][:120]
        raise SnapshotError(f"truncated or corrupt ({type(e).__name__}: {why})") from None
    if f"{crc:08x}" != info["__metadata__"]["checksum"]:
        _give_back(pool, dest)
        raise SnapshotError("corrupt (checksum mismatch)")
    _build(tree, plan, dest, salts)
    return {"tokens": plan.kept_tokens, "nodes": plan.kept_nodes, "dropped": plan.total - plan.kept_tokens}


def _check_entries(info: dict, pool: KVPool) -> None:
    """Every tensor's type and shape as `write` makes them, read from the header alone."""
    layers, kv_heads, _, head_dim = pool.k.shape
    shape = lambda name: info[name].get("shape")  # noqa: E731
    for name in _STRUCTURE:
        s = shape(name)
        if info[name].get("dtype") != "I64" or not (isinstance(s, list) and len(s) == 1):
            raise SnapshotError(f"corrupt (type of {name})")
    n = shape("parent")[0]
    if any(shape(k) != [n] for k in _STRUCTURE[1:]):
        raise SnapshotError("corrupt (tree arrays)")
    kv = [kv_heads, shape("tokens")[0], head_dim]
    for name in (f"{x}.{i}" for i in range(layers) for x in "kv"):
        if info[name].get("dtype") != _DTYPES[pool.k.dtype] or shape(name) != kv:
            raise SnapshotError(f"corrupt (type or shape of {name})")


def _give_back(pool: KVPool, dest: torch.Tensor | None) -> None:
    if dest is not None:
        pool.free(dest)


class _Plan:
    """Which saved tokens to load: `keep[i]` leading tokens of node i (0: dropped)."""

    def __init__(self, tokens, parent, length, salt, rank, keep):
        self.tokens, self.parent, self.length, self.salt, self.rank, self.keep = tokens, parent, length, salt, rank, keep
        self.total = len(tokens)
        self.start = [0] * len(length)
        for i in range(1, len(length)):
            self.start[i] = self.start[i - 1] + length[i - 1]
        self.kept_tokens = sum(keep)
        self.kept_nodes = sum(1 for k in keep if k)
        parts = [torch.arange(s, s + k) for s, k in zip(self.start, keep) if k]
        self.keep_index = torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)


def _plan(structure: dict[str, torch.Tensor], salts: list, free: int, vocab_size: int) -> _Plan:
    """Check the saved tree's shape, then choose what fits in `free` slots: LRU leaves dropped first."""
    tokens, parent, length, salt, rank = (structure[k].tolist() for k in _STRUCTURE)
    if tokens and not (0 <= min(tokens) and max(tokens) < vocab_size):
        raise SnapshotError(f"corrupt (token ids outside the vocabulary [0, {vocab_size}))")
    n = len(parent)
    if not (len(length) == len(salt) == len(rank) == n and sum(length) == len(tokens)
            and all(x >= 1 for x in length) and sorted(rank) == list(range(n))
            and all(-1 <= p < i for i, p in enumerate(parent)) and all(0 <= s < len(salts) for s in salt)
            and all(isinstance(s, (str, type(None))) for s in salts) and len({json.dumps(s) for s in salts}) == len(salts)):
        raise SnapshotError("corrupt (tree structure)")
    start, first = 0, set()
    for i in range(n):
        edge = (parent[i], salt[i] if parent[i] < 0 else None, tokens[start])
        if edge in first or (parent[i] >= 0 and salt[parent[i]] != salt[i]):
            raise SnapshotError("corrupt (tree structure)")
        first.add(edge)
        start += length[i]
    keep = list(length)
    excess = len(tokens) - free
    if excess > 0:
        children = [0] * n
        for p in parent:
            if p >= 0:
                children[p] += 1
        heap = [(rank[i], i) for i in range(n) if children[i] == 0]
        heapq.heapify(heap)
        while excess > 0 and heap:
            _, i = heapq.heappop(heap)
            if keep[i] > excess:  # the least recent leaf still needed: keep its head
                keep[i] -= excess
                break
            excess -= keep[i]
            keep[i] = 0
            p = parent[i]
            if p >= 0:
                children[p] -= 1
                if children[p] == 0:
                    heapq.heappush(heap, (rank[p], p))
    return _Plan(tokens, parent, length, salt, rank, keep)


def _build(tree: RadixCache, plan: _Plan, dest: torch.Tensor, salts: list) -> None:
    """Attach the kept nodes (parents first) with their new slots, then replay the saved LRU order."""
    made: dict[int, Node] = {}
    offset = 0
    for i, k in enumerate(plan.keep):
        if not k:
            continue
        key = plan.tokens[plan.start[i]:plan.start[i] + k]
        p = plan.parent[i]
        made[i] = tree.add_child(made[p] if p >= 0 else None, key, dest[offset:offset + k], salts[plan.salt[i]])
        offset += k
    for i in sorted(made, key=lambda i: plan.rank[i]):
        tree.touch(made[i])
