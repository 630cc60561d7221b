"""OpenMP worker pools: a thread's `openmp.release()` ends its workers; the engine releases a loading or
submitting thread's pool and its own when idle (kvql.engine.openmp, engine.py's module doc)."""

import os
import threading
import time

import pytest
import torch

from kvql.engine import openmp

pytestmark = pytest.mark.skipif(openmp._runtime() is None, reason="torch without GNU libgomp (the runtime whose pools openmp.release frees)")


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def parallel_work() -> None:
    x = torch.randn(1024, 1024)
    (x @ x).sum()


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def until(condition, seconds: float = 20.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def settled() -> int:
    """The thread count once threads that were ending have ended (two readings 50 ms apart agree)."""
    last = os_threads()
    for _ in range(100):
        time.sleep(0.05)
        now = os_threads()
        if now == last:
            return now
        last = now
    return last


def test_release_ends_the_calling_threads_workers(two_threads):
    openmp.release()
    idle = settled()
    parallel_work()
    assert os_threads() > idle  # the pool's worker
    assert openmp.release()
    assert until(lambda: os_threads() == idle)  # (the workers end on their own threads)
    parallel_work()  # a later region starts a new pool
    assert os_threads() > idle
    openmp.release()


def test_engine_releases_the_submitting_thread_and_its_own_when_idle(two_threads, local):
    openmp.release()
    idle = settled()  # this thread's pool gone; the engine thread not started yet
    local.generate(["a b c"], max_tokens=3)  # the engine thread starts and computes
    assert until(lambda: local.engine.idle())
    engine_thread = local.engine._thread
    assert engine_thread.is_alive()
    # idle, the engine thread holds no worker: the only extra thread is itself
    assert until(lambda: os_threads() == idle + 1)
    parallel_work()  # this thread's own pool again ...
    assert os_threads() > idle + 1
    local.generate(["d e f"], max_tokens=3)  # ... released when it submits
    assert until(lambda: os_threads() == idle + 1)


def test_release_in_another_thread_leaves_this_ones_pool(two_threads):
    parallel_work()
    mine = os_threads()
    done = []
    t = threading.Thread(target=lambda: (parallel_work(), done.append(openmp.release())))
    t.start()
    t.join()
    assert done == [True] and until(lambda: os_threads() == mine)
    openmp.release()
