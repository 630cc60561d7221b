"""Bounded reads through a GGUF file for its check (gguf_check.py): every read first checked against the bytes
that remain, strings and arrays counted against caps, every failure a `ModelLoadError` naming the file, the item
being read and its byte."""

from __future__ import annotations

import struct

from .load_error import ModelLoadError

MAX_STRING = 16 << 20  # a chat template is ~10 KB
MAX_ITEMS = 1 << 22  # strings and arrays inside arrays, all keys together: a 262k vocabulary is 262,144
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


def fail(name: str, where: str, at: int, problem: str):
    raise ModelLoadError(f"{name}: {where} at byte {at}: {problem}")


class Cursor:
    """Reads forward through the file, every read first checked against the bytes that remain; a window of the
    file is buffered (fixed-size arrays are skipped, never read). `where` and `at` name the item being read
    for messages."""

    CHUNK = 1 << 20

    def __init__(self, f, size: int, name: str):
        self.f, self.size, self.name = f, size, name
        self.pos, self.buf, self.base = 0, b"", 0
        self.where, self.at, self.items = "header", 0, 0

    def begin(self, where: str) -> None:
        self.where, self.at = where, self.pos

    def fail(self, problem: str):
        fail(self.name, self.where, self.at, problem)

    def bound(self, count: int, each: int, what: str) -> None:
        """`count` items of at least `each` bytes fit in what remains (before looping over them)."""
        if count * each > self.size - self.pos:
            self.fail(f"{what} {count:,} needs at least {count * each:,} bytes; the file has "
                      f"{self.size - self.pos:,} after byte {self.pos}")

    def take(self, n: int) -> bytes:
        if n > self.size - self.pos:
            self.fail(f"needs {n:,} bytes at byte {self.pos}; the file ends {self.size - self.pos:,} bytes "
                      f"later (truncated?)")
        start = self.pos - self.base
        if start < 0 or start + n > len(self.buf):
            self.f.seek(self.pos)
            self.buf, self.base, start = self.f.read(max(n, self.CHUNK)), self.pos, 0
            if len(self.buf) < n:
                self.fail("the file shrank while it was read")
        self.pos += n
        return self.buf[start:start + n]

    def skip(self, n: int) -> None:
        if n > self.size - self.pos:
            self.take(n)  # fails, saying so
        self.pos += n

    def u32(self) -> int:
        return _U32.unpack(self.take(4))[0]

    def u64(self) -> int:
        return _U64.unpack(self.take(8))[0]

    def string(self, limit: int = MAX_STRING, what: str = "string") -> str:
        n = self.u64()
        if n > limit:
            self.fail(f"{what} of {n:,} bytes at byte {self.pos - 8}: at most {limit:,}")
        raw = self.take(n)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} at byte {self.pos - n - 8} is not UTF-8")

    def strings(self, count: int) -> None:
        """Skip `count` strings, each checked (the vocabulary: the one loop that runs 10^5 times)."""
        for i in range(count):
            start = self.pos - self.base
            if start >= 0 and start + 8 <= len(self.buf):
                n = _U64.unpack_from(self.buf, start)[0]
                end = start + 8 + n
                if n <= MAX_STRING and end <= len(self.buf) and self.pos + 8 + n <= self.size:
                    try:
                        self.buf[start + 8:end].decode("utf-8")
                    except UnicodeDecodeError:
                        self.fail(f"element {i} at byte {self.pos} is not UTF-8")
                    self.pos += 8 + n
                    continue
            self.string(what=f"element {i}")  # at a window's end: refills, or fails with the reason

    def spend(self, count: int) -> None:
        """Count `count` strings or arrays read inside arrays against `MAX_ITEMS`, all keys together."""
        self.items += count
        if self.items > MAX_ITEMS:
            self.fail(f"more than {MAX_ITEMS:,} strings and arrays inside arrays in the file")
