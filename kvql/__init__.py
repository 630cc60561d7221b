"""kvql: LMQL-style queries on local transformers models, served from a token-granular radix KV cache."""

from __future__ import annotations

import torch

from .backends.loader import ModelLoadError, load_hf
from .backends.local import Model, StreamChunk
from .backends.remote import RemoteModel
from .completion import Completion, TokenLogprob
from .lang.compiler import QuerySyntaxError
from .query import (F, LMQLResult, Query, QueryError, ScoreResult, UnmetConstraint, generate, generate_sync, get_model,
                    query, run, run_sync, score, score_sync, set_default_model)
from .runtime.constraints import ConstraintError

__all__ = ["model", "Model", "RemoteModel", "Completion", "TokenLogprob", "StreamChunk", "ModelLoadError", "query", "run",
           "run_sync", "F", "generate", "generate_sync", "score", "score_sync", "set_default_model", "get_model",
           "Query", "LMQLResult", "ScoreResult", "QueryError", "UnmetConstraint", "QuerySyntaxError", "ConstraintError"]


def model(spec: str = "smollm2-135m", *, device: str = "cpu", dtype: torch.dtype | None = None,
          cache_budget: int | str | None = None, max_batch_tokens: int = 1024, max_running: int = 64,
          name: str | None = None, api_key: str | None = None) -> Model | RemoteModel:
    """Load a model for kvql's engine, or connect to a server.

    `spec`: `"smollm2-135m"` (the embedded default), a local Hugging Face model directory
    (optionally `"local:PATH"`), or `"http(s)://HOST:PORT/v1"`: an OpenAI-compatible server (kvql serve,
    vLLM, SGLang) serving model `name`. `cache_budget`: bytes of KV cache (int, or `"512MB"`, `"2GiB"`);
    default a quarter of free memory, at most 4 GiB (CPU) or half of free GPU memory (CUDA).
    """
    if spec.startswith(("http://", "https://")):
        return RemoteModel(spec, name=name, api_key=api_key)
    hf_model, tokenizer = load_hf(spec, device=device, dtype=dtype)
    return Model(hf_model, tokenizer, name=spec, cache_budget=cache_budget,
                 max_batch_tokens=max_batch_tokens, max_running=max_running)
