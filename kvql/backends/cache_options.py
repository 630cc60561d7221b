"""The rules between a local model's cache options, in one place: checked by `kvql.model()` and every command
before anything loads (`kvql.factory.check_options`) and by `LocalBackend` itself (a `kvql.Model` built from
a model already loaded). Imports nothing heavy."""

from __future__ import annotations


def check_tiers(cache_dir, disk_cache, disk_budget) -> None:
    """ValueError when `cache_dir` and `disk_cache` are both given (each keeps the cache across restarts) or
    `disk_budget` is given without `disk_cache` (it is that directory's size)."""
    if disk_cache is not None and cache_dir is not None:
        raise ValueError("cache_dir and disk_cache both keep the cache across restarts: pass one (disk_cache "
                         "also keeps what the memory budget cannot hold)")
    if disk_budget is not None and disk_cache is None:
        raise ValueError("disk_budget is the size of disk_cache: give disk_cache a directory too")
