"""Models by spec: `model(spec)` loads one (local) or connects to a server (remote), `tokenizer(spec)`.

`model` is three steps, each usable alone (`kvql serve` prints its own lines between them): `check` reads its
keywords into an `Options`, checked once, before anything loads; `make` loads (`_local`) or connects (`_remote`);
with `silent=False`, `_loudly` says so on stderr around it. What it returns are the API's model objects
(`kvql.local_model.LocalModel`, `kvql.remote_model.RemoteModel`): a backend with LMQL's model methods on top. The
registry queries use (one model per spec) is `kvql.registry`."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

from .registry import DEFAULT_MODEL

_random_models: dict = {}


def is_remote(spec) -> bool:
    """Whether model spec `spec` names a server (`http(s)://HOST:PORT/v1`) rather than a model to load here."""
    return isinstance(spec, str) and spec.startswith(("http://", "https://"))


def size_text(n: int) -> str:
    """Bytes for people: `4.0 GiB`, `12.5 MiB`, `512 B`."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def banner(m) -> str:
    """One line saying what local model `m` is: model, device, dtype, context length, KV cache in tokens and
    bytes, and where the engine runs it on the model's own forward (the backend's public `dtype`, `cache_slots`,
    `cache_bytes`, `own_forward`)."""
    from .backends.dtype import name

    own = " · the model's own forward, one request per forward" if m.own_forward else ""
    quantization = f" · {m.quantization}" if getattr(m, "quantization", None) else ""
    return (f"model {m.name} · device {m.device} · {name(m.dtype)} · context {m.context_length:,} tokens · "
            f"KV cache {m.cache_slots:,} tokens ({size_text(m.cache_bytes)}){own}{quantization}")


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


@dataclasses.dataclass(frozen=True)
class Options:
    """`model()`'s keywords (see there) once `check` has read them: a local model's with `dtype` resolved and
    `disk_cache` the disk tier's one directory (`cache_dir` is another name for it), or a remote one's. Frozen:
    what was checked is what loads."""

    device: Any = "cpu"
    dtype: Any = None
    cache_budget: int | str | None = None
    max_batch_tokens: int = 1024
    max_running: int = 64
    name: str | None = None
    api_key: str | None = None
    tokenizer: Any = None
    seed: int | None = None
    cache_save_interval: float = 300.0
    speculate: bool = True
    disk_cache: Any = None
    disk_budget: int | str | None = None
    timeout: float | None = None
    weights: str | None = None
    plain_content: bool = False

    def engine_options(self) -> dict:
        """The keywords a `LocalModel` takes from these options (the rest: its model, name and GGUF file)."""
        return {"cache_budget": self.cache_budget, "max_batch_tokens": self.max_batch_tokens,
                "max_running": self.max_running, "cache_save_interval": self.cache_save_interval,
                "speculate": self.speculate, "disk_cache": self.disk_cache, "disk_budget": self.disk_budget,
                "weights": self.weights, "plain_content": self.plain_content}


def check(spec: str, *, cache_dir=None, **keywords) -> Options:
    """`model()`'s keywords for `spec` as checked `Options`; loads nothing. TypeError for a keyword the kind of
    model (`is_remote(spec)`) does not take; ValueError (one line, naming the option) for a local option that
    cannot be used. `model()` calls it before anything else, `kvql serve` before its "loading" line, so that a
    typo in `--cache-budget` is not found after a 13 s load."""
    given = Options(**keywords)
    return _remote_checked(given, cache_dir) if is_remote(spec) else _local_checked(spec, given, cache_dir)


def _local_checked(spec: str, o: Options, cache_dir) -> Options:
    from .backends.cache_options import tier_directory
    from .backends.dtype import resolve
    from .backends.loader import check_device, check_spec
    from .backends.sizes import parse_bytes
    from .backends.weights import check as check_weights

    if o.timeout is not None:
        raise TypeError("timeout= is for remote models; a local model's requests wait for their results")
    if o.tokenizer is not None:
        raise TypeError("tokenizer= is for remote models; a local model uses its own")
    if o.seed is not None and spec != "random":
        raise TypeError(f"seed= is for the 'random' model; model {spec!r} has fixed weights")
    if o.cache_budget is not None and parse_bytes(o.cache_budget) <= 0:
        raise ValueError(f"cache_budget {o.cache_budget!r} is no size > 0 (e.g. '512MB', '2GiB')")
    if not o.cache_save_interval >= 0:
        raise ValueError(f"cache_save_interval must be >= 0 seconds, got {o.cache_save_interval!r}")
    if o.disk_budget is not None and parse_bytes(o.disk_budget) <= 0:
        raise ValueError(f"disk_budget {o.disk_budget!r} is no size > 0 (e.g. '20GiB')")
    directory = tier_directory(cache_dir, o.disk_cache, o.disk_budget)
    if directory is not None:
        problem = directory_problem(directory, writable=False)  # a start never fails over the cache (module doc)
        if problem is not None:
            raise ValueError(f"{'cache_dir' if o.disk_cache is None else 'disk_cache'} {str(directory)!r} {problem}")
    check_weights(spec, o.weights, o.device)
    check_spec(spec)  # a missing path fails here, before torch is imported and the "loading" line
    dtype = resolve(o.dtype, o.device)
    check_device(o.device)
    return dataclasses.replace(o, dtype=dtype, disk_cache=directory)


def _remote_checked(o: Options, cache_dir) -> Options:
    if o.seed is not None:
        raise TypeError("seed= is for the 'random' model; a server's model has fixed weights")
    if o.weights is not None:
        raise TypeError("weights= is for local models; a server computes with its own weights (kvql serve: --weights)")
    if o.dtype is not None:
        raise TypeError("dtype= is for local models; a server computes in its own dtype (vLLM, kvql serve: --dtype)")
    if cache_dir is not None:
        raise TypeError("cache_dir= is for local models; a server keeps its own cache (kvql serve: --disk-cache)")
    if o.speculate is not True:
        raise TypeError("speculate= is for local models; a server decides (kvql serve: --no-speculate)")
    if o.disk_cache is not None or o.disk_budget is not None:
        option = "disk_cache" if o.disk_cache is not None else "disk_budget"
        raise TypeError(f"{option}= is for local models; a server keeps its own cache (kvql serve: --disk-cache, "
                        "--disk-budget)")
    if o.plain_content:
        raise TypeError("plain_content= is for local models; a kvql server reads its chats' content as plain text "
                        "when started with --plain-content")
    return o


def tokenizer(spec: str = DEFAULT_MODEL):
    """The Hugging Face tokenizer of model `spec` (as `model` reads specs), without loading the model."""
    from .backends.loader import load_tokenizer

    return load_tokenizer(spec)


def model(spec: str = DEFAULT_MODEL, *, device: str = "cpu", dtype=None, cache_budget: int | str | None = None,
          max_batch_tokens: int = 1024, max_running: int = 64, name: str | None = None, api_key: str | None = None,
          tokenizer=None, seed: int | None = None, silent: bool = True, cache_dir=None,
          cache_save_interval: float = 300.0, speculate: bool = True, disk_cache=None, disk_budget=None,
          timeout: float | None = None, weights: str | None = None, plain_content: bool = False):
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
    `weights`: None (the default: weights as loaded, in `dtype`), `"gguf"` (a GGUF model's own quantized blocks: the
    built-in models, or a `.gguf` file as the spec), `"int8"` or `"int4"` (any model quantized per group of 32):
    linear layers on quantized weights, computed as llama.cpp computes them (`kvql.engine.model.quantized`; its
    layers' memory is the quantized bytes). CPU only. Local models only.
    `plain_content`: chat content (the text of a query's `{:user}` / `{:system}` / ... roles; the messages of a
    server made with `kvql.server.app.create_app(model)`) is tokenized as plain text, so a special token's text in
    it (`<|im_start|>`) stays text and cannot forge a turn; by default it becomes that control token, as
    transformers' `apply_chat_template` and vLLM read it (see `kvql.runtime.plain_content`). Local models only.

    `"random"` (LMQL's test model, `seed=` as in LMQL; default 0) is a tiny random-weights Llama with
    SmolLM2's tokenizer (see `kvql.backends.loader.random_model`) and a 32 MB cache by default; calls with
    the same arguments share one instance. `silent=False` (LMQL's keyword; kvql's default is True) prints
    progress to stderr: a "loading" line (saying so when the embedded model's first load converts its GGUF
    file), then `banner(model)` with the seconds it took.
    """
    options = check(spec, device=device, dtype=dtype, cache_budget=cache_budget, max_batch_tokens=max_batch_tokens,
                    max_running=max_running, name=name, api_key=api_key, tokenizer=tokenizer, seed=seed,
                    cache_dir=cache_dir, cache_save_interval=cache_save_interval, speculate=speculate,
                    disk_cache=disk_cache, disk_budget=disk_budget, timeout=timeout, weights=weights,
                    plain_content=plain_content)
    return make(spec, options) if silent else _loudly(spec, options)


def make(spec: str, options: Options):
    """The model `spec` names, with options `check` returned for it: loaded here, or connected to its server."""
    return _remote(spec, options) if is_remote(spec) else _local(spec, options)


def _loudly(spec: str, options: Options):
    """`make`, saying so on stderr: the "loading" line (and a note when the embedded model's first load converts
    its GGUF file), then what was loaded (`banner`; a remote model's repr) with the seconds it took."""
    from .backends.loader import first_load_note

    print(f"kvql: loading {spec} on {options.device} ...", file=sys.stderr, flush=True)
    note = first_load_note(spec)
    if note:
        print(f"kvql: {note}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    m = make(spec, options)
    loaded = repr(m) if is_remote(spec) else banner(m)
    print(f"kvql: {loaded} · loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return m


def _remote(spec: str, o: Options):
    from .remote_model import RemoteModel

    return RemoteModel(spec, name=o.name, api_key=o.api_key, tokenizer=o.tokenizer,
                       **({} if o.timeout is None else {"timeout": o.timeout}))


def _local(spec: str, o: Options):
    from .backends import loader
    from .local_model import LocalModel

    if spec == "random":
        return _random(o)
    hf_model, tok = loader.load_hf(spec, device=o.device, dtype=o.dtype, weights=o.weights)
    gguf = loader.gguf_file(spec) if o.weights == "gguf" else None
    with loader.admitting(spec):
        return LocalModel(hf_model, tok, name=spec, gguf=gguf, **o.engine_options())


def _random(o: Options):
    """LMQL's "random" model: one instance per set of options (its weights are a function of the seed)."""
    from .backends.loader import random_model
    from .local_model import LocalModel

    key = (o.seed or 0, o.device, o.dtype, o.cache_budget, o.max_batch_tokens, o.max_running, o.name,
           o.cache_save_interval, o.speculate, o.disk_cache, o.disk_budget, o.weights, o.plain_content)
    shared = _random_models.get(key)
    if shared is None or shared.closed:
        hf_model, tok = random_model(o.seed or 0, device=o.device, dtype=o.dtype)
        shared = _random_models[key] = LocalModel(hf_model, tok, name=o.name or "random",
                                                  **{**o.engine_options(), "cache_budget": o.cache_budget or "32MB"})
    return shared
