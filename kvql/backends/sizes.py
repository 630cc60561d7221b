"""Byte sizes as people write them (`"512MB"`, `"2GiB"`): parsed without importing torch, so that a command
line checks `--cache-budget` before anything heavy is imported or loaded."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(size: int | str) -> int:
    """`1073741824`, `"512MB"`, `"2GiB"` -> bytes; ValueError with an example for anything else."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", str(size))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {size!r} as a size (e.g. 536870912, '512MB', '2GiB')")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
