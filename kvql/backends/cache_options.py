"""The rules between a local model's cache options, in one place: checked by `kvql.model()` and every command
before anything loads (`kvql.factory.check`) and by `LocalBackend` itself (a `kvql.Model` built from
a model already loaded). Imports nothing heavy."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from .sizes import parse_bytes

log = logging.getLogger("kvql.cache")


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


def default_disk_budget(directory) -> int:
    """20 GiB, at most half the free space of the disk that holds `directory` (0 when there is none, or the
    disk cannot tell)."""
    if directory is None:
        return 0
    path = Path(directory).expanduser()
    while not path.exists():
        path = path.parent
    try:
        return min(20 * 2**30, shutil.disk_usage(path).free // 2)
    except OSError:
        return 0


def disk_tier(cache_dir, disk_cache, disk_budget) -> tuple[object, int]:
    """The disk tier's directory (`tier_directory`) and its budget in bytes (given, or `default_disk_budget`);
    a directory whose disk has no free space for the default is no tier (one WARNING line, logger `kvql.cache`,
    naming it): a given 0 is the caller's error, refused by the tier itself."""
    directory = tier_directory(cache_dir, disk_cache, disk_budget)
    budget = parse_bytes(disk_budget) if disk_budget is not None else default_disk_budget(directory)
    if directory is not None and disk_budget is None and budget <= 0:
        log.warning("disk cache not used: no free space on the disk of %s (the default disk_budget is half of "
                    "it); this model keeps its cache in memory only", directory)
        return None, budget
    return directory, budget
