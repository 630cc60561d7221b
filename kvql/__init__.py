"""kvql: LMQL-style queries on local transformers models, served from a token-granular radix KV cache."""

from __future__ import annotations

import torch

from .runtime import decorators
from .backends.loader import ModelLoadError, load_hf, load_tokenizer, random_model
from .backends.local import Model, StreamChunk
from .backends.remote import RemoteModel
from .completion import Completion, TokenLogprob
from .lang.compiler import QuerySyntaxError
from .certificate import InferenceCertificate
from .llm import LLM
from .output import headless, printing, silent, stream
from .query import (F, LMQLResult, Query, QueryError, ScoreResult, ScoringResult, UnmetConstraint, generate,
                    generate_sync, get_model, main, query, run, run_sync, score, score_sync, set_default_model)
from .runtime.constraints import ConstraintError

__all__ = ["model", "Model", "LLM", "RemoteModel", "Completion", "TokenLogprob", "StreamChunk", "ModelLoadError",
           "query", "run", "run_sync", "F", "main", "generate", "generate_sync", "score", "score_sync",
           "set_default_model", "get_model", "Query", "LMQLResult", "ScoringResult", "ScoreResult", "QueryError",
           "UnmetConstraint", "QuerySyntaxError", "ConstraintError", "InferenceCertificate", "decorators",
           "printing", "stream", "headless", "silent", "tokenizer"]

_random_models: dict = {}


def tokenizer(spec: str = "smollm2-135m"):
    """The Hugging Face tokenizer of model `spec` (as `model` reads specs), without loading the model."""
    return load_tokenizer(spec)


def model(spec: str = "smollm2-135m", *, device: str = "cpu", dtype: torch.dtype | None = None,
          cache_budget: int | str | None = None, max_batch_tokens: int = 1024, max_running: int = 64,
          name: str | None = None, api_key: str | None = None, seed: int | None = None,
          silent: bool = True) -> Model | RemoteModel:
    """Load a model for kvql's engine, or connect to a server.

    `spec`: `"smollm2-135m"` (the embedded default), a local Hugging Face model directory
    (optionally `"local:PATH"`), or `"http(s)://HOST:PORT/v1"`: an OpenAI-compatible server (kvql serve,
    vLLM, SGLang) serving model `name`. `cache_budget`: bytes of KV cache (int, or `"512MB"`, `"2GiB"`);
    default a quarter of free memory, at most 4 GiB (CPU) or half of free GPU memory (CUDA).

    `"random"` (LMQL's test model, `seed=` as in LMQL; default 0) is a tiny random-weights Llama with
    SmolLM2's tokenizer (see `kvql.backends.loader.random_model`) and a 32 MB cache by default; calls with
    the same arguments share one instance. `silent` is accepted for LMQL code (kvql prints nothing on load).
    """
    if spec == "random":
        key = (seed or 0, device, dtype, cache_budget, max_batch_tokens, max_running, name)
        shared = _random_models.get(key)
        if shared is None or shared.closed:
            hf_model, tokenizer = random_model(seed or 0, device=device, dtype=dtype)
            shared = _random_models[key] = Model(hf_model, tokenizer, name=name or "random",
                                                 cache_budget=cache_budget or "32MB",
                                                 max_batch_tokens=max_batch_tokens, max_running=max_running)
        return shared
    if seed is not None:
        raise TypeError(f"seed= is for the 'random' model; model {spec!r} has fixed weights")
    if spec.startswith(("http://", "https://")):
        return RemoteModel(spec, name=name, api_key=api_key)
    hf_model, tokenizer = load_hf(spec, device=device, dtype=dtype)
    return Model(hf_model, tokenizer, name=spec, cache_budget=cache_budget,
                 max_batch_tokens=max_batch_tokens, max_running=max_running)
