"""What every command shares: its usage error (`UsageError`, found before any model loads) and the model it runs
on (`load`: a loading line and the banner on stderr)."""

from __future__ import annotations

from .factory import is_remote


class UsageError(ValueError):
    """A mistake in the command line or its inputs, found before any model is loaded."""


def load(spec: str, args):
    """The model for a command, with a loading line and the banner on stderr (see kvql.factory); a server's
    URL connects to it, with `--timeout` and `--api-key` when the command has them."""
    import kvql

    timeout, api_key = getattr(args, "timeout", None), getattr(args, "api_key", None)
    if is_remote(spec):
        if getattr(args, "disk_cache", None):
            raise UsageError("--disk-cache (--cache-dir) is for local models; a server keeps its own cache "
                             "(kvql serve --disk-cache)")
        return kvql.model(spec, timeout=timeout, api_key=api_key, silent=False)
    for flag, value in (("--timeout", timeout), ("--api-key", api_key)):
        if value is not None:
            raise UsageError(f"{flag} is for a server's model (--model http://HOST:PORT/v1), not {spec!r}")
    return kvql.model(spec, device=getattr(args, "device", "cpu"), dtype=getattr(args, "dtype", None),
                      cache_budget=getattr(args, "cache_budget", None), disk_cache=getattr(args, "disk_cache", None), disk_budget=getattr(args, "disk_budget", None),
                      speculate=getattr(args, "speculate", True), weights=getattr(args, "weights", None), silent=False)
