"""One tier file: what it holds, its checksum, and how it is read without trusting it (disk_tier.py moves the
files; this is their format).

Files: `DIR/<16 hex digits of the fingerprint's SHA-256>/<sequence>-<random>.kv.safetensors` (fingerprint.py:
one directory per model, dtype, device and tokenizer, so models sharing `DIR` never read each other's KV), one
per spilled node, never rewritten and never reused under another name:

    prefix  I64 [P]   the tokens on the node's tree path before it (from its partition's root)
    tokens  I64 [N]   the node's own tokens
    k, v    [layers, kv_heads, N, head_dim] (the pool's dtype)
    metadata: kvql_format (FORMAT), fingerprint (its full digest), salt (JSON: the cache partition),
              sha256 (`sha256`: of everything above, keyed by the fingerprint's digest)

A file thus says by itself which KV it holds (the tokens it follows, its own tokens, its partition), so a
restart rebuilds the tree from the files alone (`DiskTier.scan`) and a file read back is checked against the tree
path it is read for: its sha256 must be the one this model would write for the file's tokens under the
partition the tree reads it for, with the file's dtypes and shapes; prefix and tokens must be the tree's
path there, K/V the pool's dtype and geometry; else the read fails and the tokens are computed again.

What the directory is trusted for: whoever can write to it can change answers (the hash is no secret: a file
crafted with it recomputed is used), as with the model's own files; kvql creates it private (0700). What the
checks make sure is that an accident is a miss, never a wrong token: a file of another model, dtype, device,
tokenizer or format (hashed under another digest: editing its fingerprint field does not make it this model's),
of another partition, a damaged or partial copy, tokens reordered by a tool that recomputed a checksum of its
own; files of an earlier FORMAT live in another directory (the format is part of the fingerprint) and one
moved here is removed at start. And that no file, hostile or not, crashes or freezes the process: files are
opened without following links and without blocking, used only when the descriptor is a regular file's
(`open_regular`: a FIFO under a file's name is a miss, not a reader blocked in `open`), and copied into memory
(`read`: never mapped, as a file rewritten under a mapping kills the process with SIGBUS; one rewritten under
a read gives bytes that fail the checks). disk_tier.py reads on its reader thread, which holds no lock the
engine waits on, and never follows a link when it touches a file.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
from pathlib import Path

import torch

FORMAT = "kvql-kv-tier-2"
"""2: the sha256 covers the header too, keyed by the fingerprint (`sha256`); 1 hashed the tensors' bytes only."""
SUFFIX = ".kv.safetensors"
MAX_HEADER = 1 << 20
"""Bytes a file's safetensors header may have (`DiskTier.scan` removes a file with more: one holds 4 tensors and a salt)."""
HEADER_BYTES = 1024
"""Bound of a file's safetensors header (8-byte length, tensor entries, metadata) besides its salt (`DiskTier.file_bytes`)."""
NAMES = ("prefix", "tokens", "k", "v")
"""The tensors of a tier file (module doc), in the order `sha256` covers them."""
DTYPES = {"I64": torch.int64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
"""The safetensors dtypes a tier file may hold: token ids, and K/V in a pool's dtype."""


class NotAFile(ValueError):
    """What is under a tier file's name is not a regular file: a symbolic link, a FIFO, a directory..."""


def sha256(digest: str, salt, tensors: dict[str, torch.Tensor]) -> str:
    """A file's sha256: over one JSON document (self-delimiting) of FORMAT, the fingerprint's `digest`, the `salt`
    and each of NAMES' dtype and shape, then their bytes in that order. The reader computes it with its own
    digest and the salt the tree reads the file for, so a file of another model or partition fails it whatever
    its header says. It proves no authorship: anyone who knows the digest (no secret) can compute it."""
    header = [FORMAT, digest, salt] + [[n, str(tensors[n].dtype), list(tensors[n].shape)] for n in NAMES]
    h = hashlib.sha256(json.dumps(header).encode())
    for n in NAMES:
        h.update(tensors[n].contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def open_regular(path: Path) -> tuple[int, os.stat_result]:
    """A descriptor of `path` opened for reading, and its status: never through a symbolic link (O_NOFOLLOW),
    never blocking (O_NONBLOCK: a FIFO's open returns at once), NotAFile unless it is a regular file (checked on
    the descriptor itself: nothing can be swapped in between)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        if not stat.S_ISREG(os.lstat(path).st_mode):  # a link (ELOOP), a socket (ENXIO)...
            raise NotAFile("not a regular file") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotAFile("not a regular file")
    return fd, st


def read_into(fd: int, buf) -> None:
    """Fill the writable buffer `buf` with the next bytes of `fd`; ValueError if the file ends first (it changed
    under the read)."""
    view, got = memoryview(buf).cast("B"), 0
    while got < len(view):
        n = os.readv(fd, [view[got:]])
        if n == 0:
            raise ValueError(f"the file ended {len(view) - got:,} bytes early (changed while it was read)")
        got += n


def read(path: Path, names=NAMES, max_bytes: int | None = None) -> tuple[dict, dict, os.stat_result]:
    """(metadata, {name: tensor} for `names`, status) of the tier file at `path`, opened by `open_regular` and copied into
    memory (module doc: never mapped). Only the bytes up to the last of `names` are read. ValueError (NotAFile one
    of them) or OSError unless it is a safetensors file of at most `max_bytes` holding `names` in `DTYPES`."""
    fd, st = open_regular(path)
    try:
        if max_bytes is not None and st.st_size > max_bytes:
            raise ValueError(f"{st.st_size:,} bytes, more than the {max_bytes:,} written")
        raw = bytearray(8)
        read_into(fd, raw)
        n = int.from_bytes(raw, "little")
        if n > MAX_HEADER or n + 8 > st.st_size:
            raise ValueError(f"a {n:,}-byte header in a {st.st_size:,}-byte file")
        raw = bytearray(n)
        read_into(fd, raw)
        header = json.loads(raw)
        spans = {name: _span(header, name, st.st_size - 8 - n) for name in names}
        ends = {name: begin + math.prod(shape) * dtype.itemsize for name, (dtype, shape, begin) in spans.items()}
        data = torch.empty(max(ends.values()), dtype=torch.uint8)  # (not zeroed first, as a bytearray would be)
        read_into(fd, data.numpy())
    finally:
        os.close(fd)
    tensors = {name: data[begin:ends[name]].view(dtype).reshape(shape) for name, (dtype, shape, begin) in spans.items()}
    return header.get("__metadata__") or {}, tensors, st


def _span(header: dict, name: str, size: int) -> tuple[torch.dtype, list[int], int]:
    """(dtype, shape, offset) of tensor `name` in a safetensors header whose data has `size` bytes; ValueError
    unless its dtype is in `DTYPES` and its bytes lie within the data, aligned to its elements."""
    entry = header.get(name)
    dtype = DTYPES.get(entry.get("dtype")) if isinstance(entry, dict) else None
    if dtype is None:
        raise ValueError(f"no tensor {name!r} of a dtype a tier file holds")
    shape, (begin, end) = [int(d) for d in entry["shape"]], entry["data_offsets"]
    if (min(shape, default=0) < 0 or not 0 <= begin <= end <= size or begin % dtype.itemsize
            or end - begin != math.prod(shape) * dtype.itemsize):
        raise ValueError(f"tensor {name!r} of shape {shape} at bytes [{begin}, {end}) of {size}")
    return dtype, shape, begin
