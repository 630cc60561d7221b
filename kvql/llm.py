"""`LLM`: LMQL's model-object API (`lmql.LLM`) on top of a backend (`kvql.backends.base.Backend`).

`m = lmql.model(...)` then `await m.generate(prompt, max_tokens=..., decoder=..., n=...)`,
`m.generate_sync(...)`, `await m.score(prompt, values)`, `m.score_sync(...)`; see `kvql.generations`
for what each returns. `m.generate(prompts, **options)` outside an event loop is kvql's batch API (a
list of completions); `m.complete(...)` is that list always.

The model classes (`kvql.local_model`, `kvql.remote_model`) are `class X(SomeBackend, LLM)`: the backend
knows requests, this layer knows LMQL's programs. `kvql.generations` (and through it the query language)
is imported on first use, so that a remote model alone stays a light import.
"""

from __future__ import annotations

import asyncio

from .completion import Completion
from .sync import run_sync


class LLM:
    """LMQL's methods of a model object; the model is passed to the query runtime as `model=self`."""

    def generate(self, prompts, **options) -> list[Completion]:
        """Complete each prompt (a string or token ids); returns `len(prompts) * n` completions,
        prompt by prompt, samples in order. Raises the first request's error after all finished.

        Called inside a running event loop (an `async def`, a notebook) it returns a
        `kvql.generations.PendingGeneration` instead, so that LMQL's `await m.generate(prompt, ...)`
        works too: awaited, it is LMQL's generate (a str, or list[str] for n > 1; see
        `kvql.generations.generate`); used as a sequence, it is this method's list of completions,
        computed on first use (blocking that thread until they are done)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return self.complete(prompts, **options)
        from . import generations

        return generations.PendingGeneration(self, prompts, options)

    def complete(self, prompts, **options) -> list[Completion]:
        """`generate`, always synchronous: the list of completions, also inside an event loop (there,
        on a worker thread)."""
        return run_sync(lambda: self.agenerate(prompts, **options))

    def generate_sync(self, prompt: str, max_tokens: int | None = None, **kwargs):
        """LMQL's `LLM.generate_sync`: the generated text (list[str] for several sequences)."""
        from . import generations

        return generations.generate_sync(prompt, max_tokens, model=self, **kwargs)

    async def score(self, prompt: str, values, **kwargs):
        """LMQL's `LLM.score`: a `ScoringResult` for `values` (a string or a list) after `prompt`."""
        from . import generations

        return await generations.score(prompt, values, model=self, **kwargs)

    def score_sync(self, prompt: str, values, **kwargs):
        """Synchronous `score`."""
        from . import generations

        return generations.score_sync(prompt, values, model=self, **kwargs)
