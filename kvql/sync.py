"""The one bridge from synchronous code to asyncio: `run_sync(make_coro)` runs a coroutine to completion and
returns its result, also when the calling thread already runs an event loop (a notebook, an `async def`):
there, on a worker thread with a loop of its own, the caller's thread blocked until it is done."""

from __future__ import annotations

import asyncio
import concurrent.futures


def run_sync(make_coro):
    """`make_coro()` (a function returning a coroutine, called on the thread that runs it), run to its end."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make_coro())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(make_coro())).result()
