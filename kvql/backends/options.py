"""`GenerateOptions`: the generation options of the backend contract, their defaults and the checks every
backend shares, written once. A backend reads a call's keywords with `GenerateOptions.read(options, extra)`
and translates the result: the local backend into the engine's `SamplingParams` and masks, the remote one
into an OpenAI-compatible request body (as SGLang's `SglSamplingParams.to_*_kwargs`). What each option
means: `kvql.backends.base`.

The checks here are the ones that do not depend on the backend (an unknown option, more than one
constraint, a negative `min_tokens`); range checks of sampling values are the engine's (a server makes its
own), and what a backend cannot do it refuses itself, naming itself (`Backend.require`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from .base import CONSTRAINTS  # at most one per request

CACHE_SALT_MAX = 256
"""The longest `cache_salt` (characters), in Python as over HTTP (kvql.server.protocol)."""

JSON_SPACING = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""llguidance's JSON options for the JSON kvql's constraints produce: written as `json.dumps` writes it. A
grammar built above the engine that embeds a schema (`%json`) carries them as its `x-guidance`; the engine
has its twin, `kvql.engine.decode.grammar.JSON_SPACING` (it imports nothing of the contract)."""


@dataclass(frozen=True)
class GenerateOptions:
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()  # a string given alone is read as one stop string
    stop_fn: Callable | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    n: int = 1
    seed: int | None = None
    logprobs: int | None = None
    masked_logprobs: bool = False
    ignore_eos: bool = False
    cache_salt: str | None = None
    regex: str | None = None
    choices: tuple | list | None = None
    json_schema: dict | str | None = None
    grammar: str | None = None
    grammar_prefix: int = 0
    heal: bool = False

    @classmethod
    def read(cls, options: dict, extra: tuple[str, ...] = ()) -> tuple[GenerateOptions, dict]:
        """-> (the contract's options, the backend's own `extra` ones given). TypeError for a name that is
        neither; ValueError for values no backend can take."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(options) - names - set(extra)
        if unknown:
            raise TypeError(f"unexpected keyword arguments (unknown options) {sorted(unknown)}")
        own = {k: v for k, v in options.items() if k in names}
        stop = own.get("stop")
        own["stop"] = (stop,) if isinstance(stop, str) else tuple(stop or ())
        o = cls(**own)
        given = [k for k in CONSTRAINTS if getattr(o, k) is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one of {', '.join(CONSTRAINTS)}; got {given}")
        if not isinstance(o.min_tokens, int) or o.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {o.min_tokens!r}")
        if not isinstance(o.grammar_prefix, int) or o.grammar_prefix < 0:
            raise ValueError(f"grammar_prefix must be an integer >= 0, got {o.grammar_prefix!r}")
        if o.cache_salt is not None and not isinstance(o.cache_salt, str):
            raise TypeError(f"cache_salt must be a string, got {type(o.cache_salt).__name__}")
        if o.cache_salt is not None and not 1 <= len(o.cache_salt) <= CACHE_SALT_MAX:
            raise ValueError(f"cache_salt must have 1 to {CACHE_SALT_MAX} characters, got {len(o.cache_salt)}")
        return o, {k: v for k, v in options.items() if k in extra}

    @property
    def constraint(self) -> tuple[str, object] | None:
        """(kind, value) of the request's constraint, or None."""
        return next(((k, getattr(self, k)) for k in CONSTRAINTS if getattr(self, k) is not None), None)
