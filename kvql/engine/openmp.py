"""OpenMP worker threads: release the calling thread's pool, so that the engine thread's forwards keep
their workers spinning between parallel regions.

Why: every OS thread that runs a parallel region (a torch op, a kvql kernel) keeps its own pool of
OpenMP worker threads. GNU libgomp (torch's runtime on Linux) counts the threads of all pools, and once
they outnumber the CPUs, its workers spin only ~100 times after a region before they sleep, instead of
~300,000: every one of the ~300 parallel regions of a forward then wakes a sleeping worker. The engine
computes on its own thread, after the model was loaded (and its weights prepacked) on the caller's, so
on a 2-core machine the caller's idle pool alone crosses that line. Measured (SmolLM2-135M bf16, batch-24
decode step, 2 threads, benchmarks/forward_overhead.py's setup run on a second thread): 55 ms with the
loading thread's pool kept, 43.5 ms with it released (48 ms on the loading thread itself).

`release()` frees the calling thread's pool (OpenMP 5.0 `omp_pause_resource_all`): its workers end; a
later parallel region on that thread starts a new pool. The engine calls it where its caller loaded the
model (`Engine.__init__`). Threads that keep running torch work of their own bring the slowdown back for
as long as their pool lives (e.g. a benchmark's plain transformers baseline on the main thread): they may
call `release()` when done.
"""

from __future__ import annotations

import ctypes
import os
import functools

OMP_PAUSE_HARD = 2  # omp_pause_resource_t: the pool's threads end (soft keeps them, asleep)


@functools.cache
def _runtime():
    """The process's OpenMP runtime (torch's, already loaded: found by its soname), or None."""
    for name in ("libgomp.so.1", "libomp.so", "libiomp5.so"):
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
        except OSError:
            continue
        if hasattr(lib, "omp_pause_resource_all"):
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            return lib
    return None


def release() -> bool:
    """Free the calling thread's OpenMP worker pool (module doc). True when the runtime did; False where
    there is none loaded, it lacks the call, or it refused (inside a parallel region)."""
    lib = _runtime()
    return lib is not None and lib.omp_pause_resource_all(OMP_PAUSE_HARD) == 0
