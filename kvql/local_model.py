"""`kvql.Model` (`LocalModel`): kvql's engine in this process (`kvql.backends.local.LocalBackend`) with LMQL's
model methods (`kvql.llm.LLM`). `kvql.model(spec)` loads one; `LocalModel(hf_model, tokenizer, ...)` wraps
a transformers model already loaded."""

from __future__ import annotations

from .backends.local import LocalBackend
from .llm import LLM


class LocalModel(LocalBackend, LLM):
    """A causal LM behind kvql's engine (see `LocalBackend` for its options and methods, `LLM` for LMQL's).
    Its own synchronous `complete` (the engine's thread does the work; `progress=` counts completions)
    comes before `LLM`'s generic one."""


Model = LocalModel  # kvql's first name for it
