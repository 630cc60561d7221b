"""The rules between a local model's cache options, in one place: checked by `kvql.model()` and every command
before anything loads (`kvql.factory.check`) and by `LocalBackend` itself (a `kvql.Model` built from
a model already loaded). Imports nothing heavy."""

from __future__ import annotations


def tier_directory(cache_dir, disk_cache, disk_budget):
    """The disk tier's directory: `disk_cache`, or `cache_dir`, its other name (one format keeps the cache across
    restarts and past the memory budget: kvql.engine.cache.disk_tier); None for none. ValueError when both are given or
    `disk_budget` is given without either (it is that directory's size)."""
    if disk_cache is not None and cache_dir is not None:
        raise ValueError("cache_dir is another name for disk_cache: pass one of them")
    directory = disk_cache if disk_cache is not None else cache_dir
    if disk_budget is not None and directory is None:
        raise ValueError("disk_budget is the size of disk_cache: give disk_cache a directory too")
    return directory
