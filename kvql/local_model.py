"""`kvql.Model` (`LocalModel`): kvql's engine in this process (`kvql.backends.local.LocalBackend`) with LMQL's
model methods (`kvql.llm.LLM`). `kvql.model(spec)` loads one; `LocalModel(hf_model, tokenizer, ...)` wraps
a transformers model already loaded."""

from __future__ import annotations

import threading

from .backends.local import LocalBackend
from .llm import LLM
from .runtime import value_check


class LocalModel(LocalBackend, LLM):
    """A causal LM behind kvql's engine (see `LocalBackend` for its options and methods, `LLM` for LMQL's).
    Its own synchronous `complete` (the engine's thread does the work; `progress=` counts completions)
    comes before `LLM`'s generic one. `plain_content`: chat content is tokenized as plain text, so a special
    token's text in it cannot forge a turn (kvql.runtime.plain_content): read by a query's roles and by
    `kvql.server.app.create_app` serving this model."""

    def __init__(self, *args, plain_content: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.plain_content = bool(plain_content)
        # the query runtime's count of a choice's fewest tokens reads every token's bytes once per tokenizer:
        # done now, beside the caller, rather than inside its first constrained hole
        threading.Thread(target=value_check.warm_up, args=(self.tokenizer,), name="kvql-choice-warm-up",
                         daemon=True).start()


Model = LocalModel  # kvql's first name for it
