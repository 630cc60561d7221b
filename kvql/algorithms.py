"""LMQL's `lmql.algorithms`: `map` and `reduce` over queries (`import kvql.algorithms as la`).

`await la.map(q, items)` runs query `q` once per item, all at once (the engine batches them and serves
their shared prompt prefix from its cache); `q` may be a query, an `F` template string (with
`where=`), or a plain function. `await la.reduce(f, items, initial)` folds the items with `f`.

LMQL's pickle cache of results (`caching(True)`, `.lmql-algorithms-cache`) is not kept: runs are served
from kvql's KV cache instead, so `caching` warns and results are computed each time.
"""

from __future__ import annotations

import asyncio
import inspect
import sys
import warnings

from .query import F, Query
from .runtime.result import LMQLResult

_stats = {"total": 0, "cached": 0}


async def apply(q, *args, **kwargs):
    """One call of `q` on `args`: a query (its one value: a one-element list, or an LMQLResult's RESULT
    variable, is unpacked as LMQL does), an `F` template string, or a plain (async) function."""
    if isinstance(q, str):
        q = F(q, constraints=kwargs.pop("where", None), is_async=True, model=kwargs.pop("model", None))
    if not isinstance(q, Query) and not isinstance(getattr(q, "__func__", None), Query):
        return (await q(*args)) if inspect.iscoroutinefunction(q) else q(*args)
    _stats["total"] += 1
    result = q(*args, **kwargs)
    if inspect.isawaitable(result):
        result = await result
    if isinstance(result, list) and len(result) == 1:
        result = result[0]
    if isinstance(result, LMQLResult) and "RESULT" in result.variables:
        result = str(result.variables["RESULT"]).strip()
    return result


async def map(q, items, chunksize: int | None = None, progress: bool = False, parameter=None, **kwargs) -> list:
    """`q` applied to each item, in order; `chunksize` items run at a time (default: all). `parameter` is
    accepted and unused, as in LMQL 0.7.3."""
    items = list(items)
    chunksize = chunksize or max(len(items), 1)
    chunks = [items[i:i + chunksize] for i in range(0, len(items), chunksize)]
    if progress:
        from tqdm.auto import tqdm

        chunks = tqdm(chunks, file=sys.stdout)
    out = []
    for chunk in chunks:
        out += await asyncio.gather(*(apply(q, x, **kwargs) for x in chunk))
    return out


async def reduce(f, items, initial=None):
    """`f(f(initial, items[0]), items[1])...` (without `initial`: starting from the first item)."""
    items = list(items)
    acc, rest = (items[0], items[1:]) if initial is None else (initial, items)
    for item in rest:
        acc = await apply(f, acc, item)
    return acc


def caching(state: bool) -> None:
    if state:
        warnings.warn("kvql.algorithms keeps no result cache (LMQL's .lmql-algorithms-cache): queries run each "
                      "time, their prompts served from kvql's KV cache", UserWarning, stacklevel=2)


def get_stats() -> str:
    return f"lmql.algorithms Stats: Total queries: {_stats['total']}, Cached queries: {_stats['cached']}"


__all__ = ["map", "reduce", "apply", "caching", "get_stats"]
