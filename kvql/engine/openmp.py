"""OpenMP worker threads: release the calling thread's pool, so that the engine thread's forwards keep
their workers spinning between parallel regions.

Why: every OS thread that runs a parallel region (a torch op, a kvql kernel) keeps its own pool of
OpenMP worker threads. GNU libgomp (torch's runtime on Linux) counts the threads of all pools, and once
they outnumber the CPUs, its workers spin only ~100 times after a region before they sleep, instead of
~300,000: every one of the ~300 parallel regions of a forward then wakes a sleeping worker. The engine
computes on its own thread, after the model was loaded (and its weights prepacked) on the caller's, so
on a 2-core machine the caller's idle pool alone crosses that line, and the wake-ups then cost a batched
decode step a visible share of its time (measured: docs/benchmarks.md, Design measurements).

`release()` frees the calling thread's pool (OpenMP 5.0 `omp_pause_resource_all`): its workers end; a
later parallel region on that thread starts a new pool. The engine calls it on the thread that built it
(which loaded the model), on each thread that submits work or runs an entry point computing on its own
thread, and on its own thread when it goes idle (engine.py's module doc). A thread that keeps running torch
work of its own while the engine computes brings the slowdown back for as long as its pool lives; it may
call `release()` when done.
"""

from __future__ import annotations

import ctypes
import functools
import os

OMP_PAUSE_HARD = 2  # omp_pause_resource_t: the pool's threads end (soft keeps them, asleep)


_found = None


def _runtime():
    """GNU libgomp when the process has it loaded (torch's on Linux, found by its soname), else None. Only
    libgomp: its pause frees the calling thread's pool alone. LLVM's and Intel's runtimes (they export
    `kmp_*` calls) wait by time (KMP_BLOCKTIME), not by a thread count, and their hard pause is not limited
    to the calling thread (LLVM's frees the whole runtime)."""
    global _found
    if _found is None:  # (not found yet: torch may load it later)
        try:
            lib = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
        except OSError:
            return None
        if not hasattr(lib, "omp_pause_resource_all") or hasattr(lib, "kmp_set_blocktime"):
            return None
        lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
        _found = lib
    return _found


def release() -> bool:
    """Free the calling thread's OpenMP worker pool (module doc). True when libgomp did; False where it is
    not the runtime, or it refused (inside a parallel region)."""
    lib = _runtime()
    return lib is not None and lib.omp_pause_resource_all(OMP_PAUSE_HARD) == 0


def releases_caller(method):
    """For an engine's entry points whose torch work may run on a caller's thread: afterwards, that thread's
    OpenMP pool is released (`self._release_caller_openmp()`, which spares the engine's own thread)."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        finally:
            self._release_caller_openmp()
    return wrapper
