"""Models by spec: `model(spec)` loads one (local) or connects to a server (remote), `tokenizer(spec)`; and
the registry queries use, `get_model(spec)`: one model per spec, loaded on first use and shared by every
query of the process, with `set_default_model` for queries that name none.

What it returns are the API's model objects (`kvql.local_model.LocalModel`, `kvql.remote_model.RemoteModel`):
a backend with LMQL's model methods on top."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m"
_random_models: dict = {}
_models: dict = {}
_default = None


def set_default_model(model) -> None:
    """Model used by queries that name none (default: the embedded SmolLM2-135M); a model or a spec."""
    global _default
    _default = model


def get_model(model=None):
    """A loaded model: the object itself (any `kvql.backends.base.Backend`), or one loaded once per spec and
    shared by all queries."""
    from .backends.base import Backend

    model = model if model is not None else (_default or DEFAULT_MODEL)
    if isinstance(model, Backend):
        return model
    if not isinstance(model, str):
        raise TypeError(f"model must be a kvql.Model or a spec string, got {type(model).__name__}")
    if model not in _models:
        _models[model] = load(model)
    return _models[model]


def size_text(n: int) -> str:
    """Bytes for people: `4.0 GiB`, `12.5 MiB`, `512 B`."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def banner(m) -> str:
    """One line saying what was loaded: model, device, dtype, context length, KV cache in tokens and bytes
    (for a remote model: the server and what prompts travel as)."""
    engine = getattr(m, "engine", None)
    if engine is None:
        return repr(m)
    from .backends.dtype import name

    return (f"model {m.name} · device {m.device} · {name(m.hf_model.dtype)} · context {m.context_length:,} tokens · "
            f"KV cache {engine.pool.num_slots:,} tokens ({size_text(engine.pool.bytes)})")


def directory_problem(path, writable: bool = True) -> str | None:
    """Why kvql could not write files into directory `path` (created at the first write when missing), or
    None. Checked before a model loads: a bad `--disk-cache` or `--out` is an error at once, not after it.
    `writable=False`: only a path that can never be a directory is a problem (a cache directory that cannot be
    written leaves the model memory-only, with one warning: kvql.engine.cache.persistence)."""
    p = Path(path).expanduser()
    if p.exists():
        if not p.is_dir():
            return "exists and is not a directory"
        return None if not writable or os.access(p, os.W_OK | os.X_OK) else "is not writable"
    above = next(a for a in p.parents if a.exists())  # the root always exists
    if not above.is_dir():
        return f"cannot be created: {above} is not a directory"
    return None if not writable or os.access(above, os.W_OK | os.X_OK) else f"cannot be created: {above} is not writable"


def check_options(*, device="cpu", dtype=None, cache_budget=None, cache_dir=None,
                  cache_save_interval: float = 300.0, disk_cache=None, disk_budget=None) -> None:
    """ValueError (one line, naming the option) when a local model's options cannot be used; loads nothing.
    `model()` calls it before anything else, commands before their "loading" line, so that a typo in
    `--cache-budget` is not found after a 13 s load."""
    from .backends.cache_options import tier_directory
    from .backends.dtype import resolve
    from .backends.loader import check_device
    from .backends.sizes import parse_bytes

    if cache_budget is not None and parse_bytes(cache_budget) <= 0:
        raise ValueError(f"cache_budget {cache_budget!r} is no size > 0 (e.g. '512MB', '2GiB')")
    if not cache_save_interval >= 0:
        raise ValueError(f"cache_save_interval must be >= 0 seconds, got {cache_save_interval!r}")
    if disk_budget is not None and parse_bytes(disk_budget) <= 0:
        raise ValueError(f"disk_budget {disk_budget!r} is no size > 0 (e.g. '20GiB')")
    directory = tier_directory(cache_dir, disk_cache, disk_budget)
    if directory is not None:
        problem = directory_problem(directory, writable=False)  # a start never fails over the cache (module doc)
        if problem is not None:
            raise ValueError(f"{'cache_dir' if disk_cache is None else 'disk_cache'} {str(directory)!r} {problem}")
    resolve(dtype, device)
    check_device(device)


def tokenizer(spec: str = "smollm2-135m"):
    """The Hugging Face tokenizer of model `spec` (as `model` reads specs), without loading the model."""
    from .backends.loader import load_tokenizer

    return load_tokenizer(spec)


def model(spec: str = DEFAULT_MODEL, *, device: str = "cpu", dtype=None, cache_budget: int | str | None = None,
          max_batch_tokens: int = 1024, max_running: int = 64, name: str | None = None, api_key: str | None = None,
          tokenizer=None, seed: int | None = None, silent: bool = True, cache_dir=None,
          cache_save_interval: float = 300.0, speculate: bool = True, disk_cache=None, disk_budget=None,
          timeout: float | None = None):
    """Load a model for kvql's engine, or connect to a server.

    `spec`: `"smollm2-135m"` (the embedded default), a local Hugging Face model directory
    (optionally `"local:PATH"`), a Hugging Face Hub id `"ORG/NAME"` (also `"local:ORG/NAME"`; from the
    local Hugging Face cache, else downloaded: see `kvql.backends.loader`), or `"http(s)://HOST:PORT/v1"`: an OpenAI-compatible server (kvql serve,
    vLLM, SGLang) serving model `name`; `tokenizer=` (a tokenizer, a model directory or spec) makes
    queries keep and send token ids there (default: the served model's name, when it names a local
    model; see `kvql.backends.remote`); `timeout=` (seconds, default 600) is the deadline of each request to
    the server, from sending it to its answer's last byte. `cache_budget`: bytes of KV cache (int, or
    `"512MB"`, `"2GiB"`); default a quarter of free memory, at most 4 GiB (CPU) or half of free GPU memory (CUDA).
    `dtype`: `"auto"` (the default, as every `kvql` command's: bfloat16 on CUDA and on CPUs with native
    bf16 matrix units, else float32), `"float32"` (kvql's exact mode: ask for it where exactness matters),
    `"bfloat16"`, `"float16"` or a `torch.dtype` (see `kvql.backends.dtype`). Local models only.
    `disk_cache` (also spelled `cache_dir`): a directory for a second cache tier behind the memory budget, which
    also keeps the cache across restarts: KV evicted from memory is written there and read back when a request
    needs it again, instead of being computed again; what only memory holds is written there on close / exit
    and every `cache_save_interval` seconds when idle (0: only on close); at start the cache is what the
    directory holds for this model, dtype and tokenizer. It holds at most `disk_budget` bytes (default 20 GiB,
    at most half the disk's free space); see `kvql.engine.cache.disk_tier`. Local models only.
    `speculate`: speculative decoding without a draft model (on by default; outputs are the same either way):
    while few requests run, a greedy request verifies tokens drafted from the cache, its own prompt and earlier
    outputs several at a time (see `kvql.engine.decode.drafts`). Local models only.

    `"random"` (LMQL's test model, `seed=` as in LMQL; default 0) is a tiny random-weights Llama with
    SmolLM2's tokenizer (see `kvql.backends.loader.random_model`) and a 32 MB cache by default; calls with
    the same arguments share one instance. `silent=False` (LMQL's keyword; kvql's default is True) prints
    progress to stderr: a "loading" line (saying so when the embedded model's first load converts its GGUF
    file), then `banner(model)` with the seconds it took.
    """
    remote = spec.startswith(("http://", "https://"))
    if timeout is not None and not remote:
        raise TypeError("timeout= is for remote models; a local model's requests wait for their results")
    if not remote:
        from .backends.cache_options import tier_directory

        check_options(device=device, dtype=dtype, cache_budget=cache_budget, cache_dir=cache_dir,
                      cache_save_interval=cache_save_interval, disk_cache=disk_cache, disk_budget=disk_budget)
        disk_cache, cache_dir = tier_directory(cache_dir, disk_cache, disk_budget), None
    if not silent:
        from .backends.loader import first_load_note

        print(f"kvql: loading {spec} on {device} ...", file=sys.stderr, flush=True)
        note = first_load_note(spec)
        if note:
            print(f"kvql: {note}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        m = model(spec, device=device, dtype=dtype, cache_budget=cache_budget, max_batch_tokens=max_batch_tokens,
                  max_running=max_running, name=name, api_key=api_key, tokenizer=tokenizer, seed=seed,
                  cache_dir=cache_dir, cache_save_interval=cache_save_interval, speculate=speculate,
                  disk_cache=disk_cache, disk_budget=disk_budget, timeout=timeout)
        print(f"kvql: {banner(m)} · loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        return m
    if remote:
        if seed is not None:
            raise TypeError("seed= is for the 'random' model; a server's model has fixed weights")
        if dtype is not None:
            raise TypeError("dtype= is for local models; a server computes in its own dtype (vLLM, kvql serve: --dtype)")
        if cache_dir is not None:
            raise TypeError("cache_dir= is for local models; a server keeps its own cache (kvql serve: --disk-cache)")
        if speculate is not True:
            raise TypeError("speculate= is for local models; a server decides (kvql serve: --no-speculate)")
        if disk_cache is not None or disk_budget is not None:
            option = "disk_cache" if disk_cache is not None else "disk_budget"
            raise TypeError(f"{option}= is for local models; a server keeps its own cache (kvql serve: --disk-cache, "
                            "--disk-budget)")
        from .remote_model import RemoteModel

        return RemoteModel(spec, name=name, api_key=api_key, tokenizer=tokenizer,
                           **({} if timeout is None else {"timeout": timeout}))
    if tokenizer is not None:
        raise TypeError("tokenizer= is for remote models; a local model uses its own")
    from .backends.dtype import resolve
    from .backends.loader import ModelLoadError, load_hf, random_model
    from .local_model import LocalModel as Model

    dtype = resolve(dtype, device)

    if spec == "random":
        key = (seed or 0, device, dtype, cache_budget, max_batch_tokens, max_running, name, cache_save_interval,
               speculate, disk_cache, disk_budget)
        shared = _random_models.get(key)
        if shared is None or shared.closed:
            hf_model, tok = random_model(seed or 0, device=device, dtype=dtype)
            shared = _random_models[key] = Model(hf_model, tok, name=name or "random",
                                                 cache_budget=cache_budget or "32MB",
                                                 max_batch_tokens=max_batch_tokens, max_running=max_running,
                                                 cache_save_interval=cache_save_interval, speculate=speculate,
                                                 disk_cache=disk_cache, disk_budget=disk_budget)
        return shared
    if seed is not None:
        raise TypeError(f"seed= is for the 'random' model; model {spec!r} has fixed weights")
    from .engine.model.admission import UnsupportedModel

    hf_model, tok = load_hf(spec, device=device, dtype=dtype)
    try:
        return Model(hf_model, tok, name=spec, cache_budget=cache_budget, max_batch_tokens=max_batch_tokens,
                     max_running=max_running, cache_save_interval=cache_save_interval, speculate=speculate,
                     disk_cache=disk_cache, disk_budget=disk_budget)
    except UnsupportedModel as e:
        raise ModelLoadError(f"model {spec!r}: {e}") from None


load = model  # what get_model calls (its parameter hides the name `model`)
