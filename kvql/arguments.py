"""Command-line arguments that more than one command takes (`kvql.cli`'s commands, `kvql serve`'s flags in
`kvql.server.launch`): the argument types, each checking one argument as argparse reads it (a usage error, exit 2,
before any model loads), the disk tier's flags and the help texts they share. Imports nothing heavy, so that
`kvql --help` and argument errors return at once."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

MODEL_HELP = ("smollm2-135m (embedded), a local model directory, a Hugging Face Hub id ORG/NAME (from the local "
              "HF cache, else downloaded), local:PATH_OR_ID, or http://HOST:PORT/v1")
DTYPE_HELP = ("auto: bfloat16 on CUDA and on a CPU with native bf16 matrix units (AMX-BF16 or AVX-512 BF16), else "
              "float32 (the same rule for every command and for kvql.model()); float32: kvql's exact mode")
SPECULATE_HELP = ("speculative decoding: while few requests run, greedy ones verify tokens drafted from the cache, their "
                  "own prompt and earlier outputs several per step (the same outputs, faster)")


# --- argument types -------------------------------------------------------------------------------------

def size(text: str) -> int:
    """`--cache-budget 512MB` -> bytes (> 0)."""
    from .backends.sizes import parse_bytes

    try:
        n = parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is no size > 0 (e.g. '512MB', '2GiB')")
    return n


def at_least(minimum: int, at_most: int | None = None):
    """An int type accepting `minimum` and above (up to `at_most`)."""
    def count(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if n < minimum or (at_most is not None and n > at_most):
            bounds = f"from {minimum} to {at_most}" if at_most is not None else f"at least {minimum}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {n}")
        return n
    return count


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def seconds(text: str) -> float:
    """`--timeout 30`: a number of seconds > 0."""
    x = _number(text)
    if not 0 < x < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return x


def non_negative(text: str) -> float:
    """Seconds, a temperature: a number >= 0 (not NaN)."""
    x = _number(text)
    if not x >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return x


def directory(text: str, writable: bool = True) -> str:
    """A directory kvql writes into: existing and writable, or one it can create (`writable=False`: or one that
    is not writable, as a cache directory may be: factory.directory_problem)."""
    from .factory import directory_problem

    problem = directory_problem(text, writable)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{text!r} {problem}")
    return text


def cache_directory(text: str) -> str:
    return directory(text, writable=False)


def output_file(text: str) -> str:
    """A file kvql writes: not a directory, in an existing writable directory."""
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file name (e.g. trace.html)")
    parent = path.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: directory {str(parent)!r} is not writable")
    return text


def workload(text: str) -> str:
    """A `kvql bench` workload's name."""
    from .bench import WORKLOADS  # names only: kvql.bench imports torch when it runs

    if text not in WORKLOADS:
        raise argparse.ArgumentTypeError(f"unknown workload {text!r}; known: {', '.join(WORKLOADS)}")
    return text


_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|[0-7]{1,3}|N\{[^}]*\}|[\\'\"abfnrtv])")


def unescape(text: str) -> str:
    r"""`--stop '\n'`: backslash escapes decoded as a Python string literal decodes them (`\n`, `\t`, `\\`,
    `\x41`, `\u00e9`, `\N{BULLET}`, ...), so that a shell's single quotes can carry a newline. A backslash
    that starts no escape (`\d`, one at the end, an unknown `\N{name}`) is refused, not kept or dropped."""
    out, at = [], 0
    while (i := text.find("\\", at)) >= 0:
        m = _ESCAPE.match(text, i)
        try:
            decoded = m.group(0).encode("ascii").decode("unicode_escape") if m else None
        except UnicodeError:  # an unknown \N{name}
            decoded = None
        if decoded is None:
            raise argparse.ArgumentTypeError(
                f"{text!r}: {text[i:i + 2]!r} at character {i} starts no escape (\\n, \\t, \\\\, \\x41, \\u00e9, "
                f"...); write \\\\ for a backslash")
        out += [text[at:i], decoded]
        at = m.end()
    return "".join(out) + text[at:]


def disk_options(p: argparse.ArgumentParser) -> None:
    """--disk-cache (also --cache-dir), --disk-budget: the disk tier behind the memory budget, which also keeps
    the cache between runs (kvql.engine.cache.disk_tier)."""
    p.add_argument("--disk-cache", "--cache-dir", dest="disk_cache", type=cache_directory, default=None, metavar="DIR",
                   help="keep the KV cache in DIR: what memory cannot hold is written there and read back instead of "
                        "computed again, and the next run (same model and dtype) starts from it")
    p.add_argument("--disk-budget", type=size, default=None, metavar="SIZE",
                   help="bytes the disk cache may hold, e.g. 20GiB (default: 20 GiB, at most half the free space)")
