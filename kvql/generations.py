"""LMQL's Generations API: `generate` / `score` on a model, top-level or as `lmql.model(...)` methods.

`generate(prompt, max_tokens=None, model=None, **kwargs)` runs the one-hole query
`"{prompt}[RESPONSE]" where len(TOKENS(RESPONSE)) <= max_tokens` (no bound when `max_tokens` is None:
until the model ends the sequence, within `max_len` and the model's context) and returns RESPONSE:
the generated text without the prompt; a list of them when the decoder yields several sequences
(`decoder="sample", n=2`; `argmax` with `n=2` gives n copies of its one result, as in LMQL). Other
keyword arguments are those of a query call: `decoder`, `n`, `temperature`, `max_len`, `seed`, ...,
`output_writer`, `certificate`.

`score(prompt, values, model=None)` scores whole continuations and returns a `ScoringResult`.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

from .registry import get_model
from .query import Query
from .runtime import scoring
from .sync import run_sync


def _generate_query(bounded: bool):
    key = "bounded" if bounded else "open"
    if key not in _queries:
        where = " where len(TOKENS(RESPONSE)) <= max_tokens" if bounded else ""
        params = [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in ("prompt", "max_tokens")]
        _queries[key] = Query(f'"{{prompt}}[RESPONSE]"{where}\nreturn RESPONSE', name="lmql.generate",
                              signature=inspect.Signature(params))
    return _queries[key]


_queries: dict = {}


async def generate(prompt: str, max_tokens: int | None = None, model=None, **kwargs):
    """Complete `prompt` (LMQL's `lmql.generate`): the generated text, or a list for several sequences."""
    if not isinstance(prompt, str):
        raise TypeError("LMQL's generate takes one prompt string; for kvql's batch form (lists of prompts, "
                        "token ids, Completion objects) use `await model.agenerate(prompts, ...)`")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"max_tokens must be a positive int or None, got {max_tokens!r}")
    m = get_model(model)
    decoder = kwargs.get("decoder", "argmax")
    copies = int(kwargs.pop("n", 1)) if decoder == "argmax" else 1
    if decoder != "argmax" and "n" in kwargs:
        kwargs["n"] = int(kwargs["n"])
    result = await _generate_query(max_tokens is not None).run(prompt, max_tokens, model=m, **kwargs)
    if copies > 1:  # argmax has one answer; LMQL's argmax(n=k) returns it k times
        return [result] * copies
    return result


def generate_sync(prompt: str, max_tokens: int | None = None, model=None, **kwargs):
    """Synchronous `generate` (also callable from inside a running event loop: it runs on a worker thread)."""
    return run_sync(lambda: generate(prompt, max_tokens, model, **kwargs))


async def score(prompt: str, values, model=None, **kwargs) -> scoring.ScoringResult:
    """Score `values` (a string or a list of them) as continuations of `prompt` (LMQL's `lmql.score`)."""
    if kwargs:
        raise TypeError(f"score() got unexpected keyword arguments {sorted(kwargs)}")
    return await scoring.score(get_model(model), prompt, values)


def score_sync(prompt: str, values, model=None, **kwargs) -> scoring.ScoringResult:
    return run_sync(lambda: score(prompt, values, model, **kwargs))


class PendingGeneration(Sequence):
    """What `Model.generate(prompts, **options)` returns inside a running event loop.

    - `await pending`: LMQL's `await m.generate(prompt, max_tokens=None, decoder=..., n=..., ...)`,
      the module-level `generate` on this model (one prompt string; a str, or list[str] for several
      sequences). The event loop is not blocked.
    - used as a sequence (`len`, `[i]`, iteration, `==`, `repr`): kvql's `Model.generate` result, the list
      of `Completion`s with kvql's options and defaults (max_tokens=16, greedy), computed on first use;
      that first use blocks the calling thread until the engine has finished.
    Nothing is generated until one of the two happens (and only one of them should).
    """

    def __init__(self, model, prompts, options: dict):
        self._model, self._prompts, self._options = model, prompts, dict(options)
        self._completions = None

    def __await__(self):
        return generate(self._prompts, model=self._model, **self._options).__await__()

    def _resolved(self) -> list:
        if self._completions is None:
            self._completions = self._model.complete(self._prompts, **self._options)
        return self._completions

    def __len__(self) -> int:
        return len(self._resolved())

    def __getitem__(self, i):
        return self._resolved()[i]

    def __eq__(self, other) -> bool:
        return self._resolved() == (list(other) if isinstance(other, PendingGeneration) else other)

    # asyncio.gather / ensure_future key awaitables by hash: hash by identity (an unresolved
    # generation has no contents to hash)
    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return repr(self._resolved())
