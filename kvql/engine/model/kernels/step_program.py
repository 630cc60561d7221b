"""A decode step's kernel calls bound once and run by one C call (step_program.c): the lean forward compiles a
model's step description into this list (kvql.engine.model.lean_model._Program), and a step runs it.

Why: a decode step makes a few hundred kernel calls; through ctypes each pays its argument conversion before the
kernel starts, and residual adds and K/V writes done as torch ops pay torch's dispatch besides: together about a
tenth of a bf16 batch-1 step (docs/benchmarks.md, Design measurements).

Contract: `Program.add(kind, fn, *args)` appends a call: `fn` a ctypes function of kvql's kernel libraries
whose signature is the kind's (gemv, qgemm, rms_norm, rope, gated_mul, attention: their C files), `args` its
arguments as integers (pointers as addresses; float arguments through `f32`); attention takes 19 and the
step's 8 segment arguments (`run`'s `tail`). Two kinds are this library's own: `add(dst, dst_stride, src,
src_stride, rows, n, is_bf16)` (dst += src row by row; src_stride 0 adds one row to every row, a bias) and
`write_kv(pool, head_stride, slot_stride, src, row_stride, slots, rows, heads, head_dim, elem)` (each row's
heads to its slot: index_copy_ on the pool's slot dim), with torch's arithmetic (bf16: a float32 add rounded once
to nearest even). `run(tail)` calls them in order and raises when a kernel reports an error. The arguments are
raw pointers: the caller keeps every tensor they point into alive and in place.

Availability: built once per machine (kvql.engine.model.kernels.build); `available()` is False without a compiler or
with `KVQL_STEP_PROGRAM=0` (the lean forward then runs its layers as module-level calls).
"""

from __future__ import annotations

import ctypes
import struct

import torch

from . import build

SIGNATURES = {"kvql_step_run": (build.I64, [build.PTR, build.I64, build.PTR])}
LIBRARY = build.Library("step_program", "KVQL_STEP_PROGRAM", "calling each kernel from Python", SIGNATURES,
                        flags=["-ffp-contract=off"], limits=("kvql_step_op_words",))
KINDS = {"gemv": 0, "rms_norm": 1, "rope": 2, "gated_mul": 3, "attention": 4, "add": 5, "write_kv": 6, "qgemm": 7}
TAIL = 8


def available() -> bool:
    """Whether the runner can run here (built on first call; a failure is warned about once)."""
    return LIBRARY.available()


def f32(x: float) -> int:
    """A float argument as the runner passes it: its float32 bits."""
    return struct.unpack("<I", struct.pack("<f", x))[0]


class Program:
    """Calls appended with `add`, run in order by `run` (module doc)."""

    def __init__(self):
        self._lib = LIBRARY.get()  # raises where the runner is unavailable
        self._words = LIBRARY.limits["kvql_step_op_words"]
        self._ops: list[list[int]] = []
        self._table: torch.Tensor | None = None
        self._tail = (ctypes.c_int64 * TAIL)()

    def add(self, kind: str, fn, *args: int) -> None:
        assert len(args) <= self._words - 2 and self._table is None, (kind, len(args))
        address = 0 if fn is None else ctypes.cast(fn, ctypes.c_void_p).value
        self._ops.append([KINDS[kind], address, *(int(a) for a in args)] + [0] * (self._words - 2 - len(args)))

    def run(self, tail: tuple) -> None:
        """Every call in order; `tail`: the attention calls' 8 step arguments (segment count, the q_start, q_len,
        key_start, n_keys and slots arrays' addresses, the longest segment's keys, threads)."""
        if self._table is None:
            self._table = torch.tensor(self._ops, dtype=torch.int64)
        self._tail[:] = tail
        failed = self._lib.kvql_step_run(self._table.data_ptr(), len(self._ops), self._tail)
        if failed:
            kind = next(k for k, v in KINDS.items() if v == self._ops[failed - 1][0])
            raise RuntimeError(f"step program: its {kind} call (#{failed - 1}) failed"
                               + (" (out of memory)" if kind == "attention" else ""))
