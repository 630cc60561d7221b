"""`LLM`: LMQL's model-object API (`lmql.LLM`), mixed into kvql's models.

`m = lmql.model(...)` then `await m.generate(prompt, max_tokens=..., decoder=..., n=...)`,
`m.generate_sync(...)`, `await m.score(prompt, values)`, `m.score_sync(...)`; see
`kvql.generations` for what each returns. (`generate` itself is the model's own method: kvql's
batch API outside an event loop, LMQL's awaitable inside one; see `Model.generate`.)
"""

from __future__ import annotations


class LLM:
    """LMQL's methods of a model object; the model is passed to the query runtime as `model=self`."""

    def generate_sync(self, prompt: str, max_tokens: int | None = None, **kwargs):
        """LMQL's `LLM.generate_sync`: the generated text (list[str] for several sequences)."""
        from .generations import generate_sync

        return generate_sync(prompt, max_tokens, model=self, **kwargs)

    async def score(self, prompt: str, values, **kwargs):
        """LMQL's `LLM.score`: a `ScoringResult` for `values` (a string or a list) after `prompt`."""
        from .generations import score

        return await score(prompt, values, model=self, **kwargs)

    def score_sync(self, prompt: str, values, **kwargs):
        """Synchronous `score`."""
        from .generations import score_sync

        return score_sync(prompt, values, model=self, **kwargs)
