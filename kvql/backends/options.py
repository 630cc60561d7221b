"""`GenerateOptions`: the generation options of the backend contract. Each is declared, defaulted, documented
and checked here, once. A backend reads a call's keywords with `GenerateOptions.read(options, extra)` and
translates the result once: the local backend into the engine's per-request parameters (`SamplingParams`, one
per prompt, from `kvql.backends.local.request_spec`), the remote one into an OpenAI-compatible request body
(`RemoteBackend._request`, as SGLang's `SglSamplingParams.to_*_kwargs`); the server reads them from HTTP
fields (`kvql.server.served.Served.options`).

Each field's metadata (`option`) says how it reaches those three places. An option that travels under its
own name, as it is, needs no line in any translation; one translated otherwise says how. So adding an option
is one field here (and its check), the engine's field and sampler code, and the HTTP field
(`kvql.server.protocol`); tests/test_min_p.py checks that every field is accounted for in all three places.

The checks are those no backend may skip (an unknown option, a value out of range, more than one
constraint): every backend refuses the same values before anything is computed or sent. What a backend
cannot do it refuses itself, naming itself (`Backend.require`); a server checks its HTTP fields first
(`kvql.server.protocol`, naming the field).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

from .base import CACHE_SALT, CONSTRAINTS, MIN_TOKENS, SAMPLING  # CONSTRAINTS: at most one per request

CACHE_SALT_MAX = 256
"""The longest `cache_salt` (characters), in Python as over HTTP (kvql.server.protocol)."""

JSON_SPACING = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""llguidance's JSON options for the JSON kvql's constraints produce: written as `json.dumps` writes it. A
grammar built above the engine that embeds a schema (`%json`) carries them as its `x-guidance`; the engine
has its twin, `kvql.engine.decode.grammar.JSON_SPACING` (it imports nothing of the contract)."""


@dataclass(frozen=True)
class Sent:
    """How an option travels in a remote request body: under its own name, as it is, when it is not at its
    default (`always`: in every body); `needs`: the capability (`kvql.backends.base`) a server must have to
    take it, else the request is refused (`Unsupported`) before it is sent."""

    always: bool = False
    needs: str | None = None


def option(default, *, engine: bool | str = True, remote: Sent | str = Sent(), http: bool | tuple | None = True):
    """A `GenerateOptions` field, and how it reaches each place (its metadata, read by `GenerateOptions.rules`):
    - `engine`: True: the engine's `SamplingParams` field of the same name, as it is; a string: what the local
      backend makes of it instead (a mask, the stop function, ...);
    - `remote`: a `Sent`: the request-body field of the same name; a string: how the remote backend translates
      it instead, or why it refuses it;
    - `http`: True: the HTTP request field of the same name (when not null); a tuple: the HTTP fields the server
      reads it from otherwise (`Served.options`); None: Python only (a callable, or what only a query uses):
      no HTTP request can give it (an unknown field is a 400)."""
    return dataclasses.field(default=default, metadata={"engine": engine, "remote": remote, "http": http})


_MASK = "the constraint's mask (kvql.engine.decode.grammar)"
_SPELLED = "the server's spelling of the constraint (remote._SPELLINGS); refused where it has none"


@dataclass(frozen=True)
class GenerateOptions:
    """The options every backend accepts (unknown ones raise TypeError), their defaults and meaning:

    - max_tokens=16; min_tokens=0 (vLLM's meaning: no end of sequence before that many tokens unless the
      constraint allows nothing else, and stop strings count only where they end after those tokens' text;
      see `kvql.engine.decode.masks`);
    - stop (strings; one string alone is one stop string): the text ends before the first one found,
      `stop_reason` names it; stop_fn (called with the generated ids and text after each token or streamed
      chunk; True ends the sequence, the text is not cut: it may run past the point where the function first
      said True);
    - temperature=0.0 (greedy below 1e-5), top_p=1.0, top_k=0 (0: every token), min_p=0.0 (vLLM's and SGLang's:
      after temperature, tokens whose probability is below min_p times the most likely token's are removed;
      0: off; only when sampling), repetition_penalty=1.0 (CTRL / transformers), frequency_penalty=0.0,
      presence_penalty=0.0 (OpenAI / vLLM), logit_bias=None ({token id: value in [-100, 100]}, OpenAI's: the
      value is added to the token's logit after the penalties; -100 and 100 are exact, a ban and a choice
      among the tokens given 100 only), n=1 samples per prompt, seed=None;
    - logprobs=None (the k most likely tokens at each step, by id, k in [0, 20]), masked_logprobs=False
      (log-probabilities of the constrained distribution);
    - ignore_eos=False (end-of-sequence tokens do not end the output; under a constraint its grammar's end
      still does, as in vLLM); cache_salt=None (requests share cached prefixes only with requests of the same
      salt, so tenants cannot probe each other's prompts);
    - at most one constraint: regex, choices, json_schema, grammar (Lark, llguidance dialect: `&` and `~`
      allowed); grammar_prefix=0: the constraint's value began that many tokens before the end of the prompt
      (the last `grammar_prefix` prompt tokens are the start of the constrained value; beam search uses it);
    - heal=False (token healing, needs `HEAL`): back up the prompt's last token(s) and generate them again, the
      text constrained to start with theirs and then to meet the constraint (one grammar), so a token may
      span the prompt's end ("A: " + " yes"); `text`, stops, `max_tokens` and `min_tokens` are the value's
      (after that text; `Completion.healed` says what was backed up). Off by default: the prompt's last
      tokens change. The rule of how many: `kvql.engine.decode.healing`.

    Made, the values are normalized (a number option with a float default is a float) and checked
    (`__post_init__`): an instance holds only values every backend takes.
    """

    max_tokens: int = option(16, remote=Sent(always=True), http=("max_tokens", "max_completion_tokens"))
    min_tokens: int = option(0, engine="stop_after, and a mask with no end of sequence before it",
                             remote=Sent(needs=MIN_TOKENS))
    stop: tuple[str, ...] = option(())
    stop_fn: Callable | None = option(None, engine="with ignore_eos, also ends at a constraint's end (_grammar_end)",
                                      remote="the request streamed, the function called on each chunk", http=None)
    temperature: float = option(0.0, remote=Sent(always=True))
    top_p: float = option(1.0, remote=Sent(always=True))
    top_k: int = option(0, remote=Sent(needs=SAMPLING), http=("top_k",))  # over HTTP vLLM's -1 is 0
    min_p: float = option(0.0, remote=Sent(needs=SAMPLING))
    repetition_penalty: float = option(1.0, remote=Sent(needs=SAMPLING))
    frequency_penalty: float = option(0.0)
    presence_penalty: float = option(0.0)
    logit_bias: dict | None = option(None, engine="-100 / 100 a mask, the other values SamplingParams.logit_bias "
                                                 "(kvql.engine.decode.masks.logit_bias)", http=("logit_bias",))
    n: int = option(1, remote=Sent(always=True))
    seed: int | None = option(None)
    logprobs: int | None = option(None, remote="logprobs, with return_tokens_as_token_ids",
                                  http=("logprobs", "top_logprobs"))
    masked_logprobs: bool = option(False, remote="refused under a constraint or min_tokens", http=None)
    ignore_eos: bool = option(False)
    cache_salt: str | None = option(None, engine="Engine.submit's cache_salt", remote=Sent(needs=CACHE_SALT),
                                    http=("cache_salt",))  # the server partitions by API key too
    regex: str | None = option(None, engine=_MASK, remote=_SPELLED, http=("regex", "structured_outputs"))
    choices: tuple | list | None = option(None, engine=_MASK, remote=_SPELLED, http=("structured_outputs",))
    json_schema: dict | str | None = option(None, engine=_MASK, remote=_SPELLED,
                                            http=("json_schema", "structured_outputs", "response_format"))
    grammar: str | None = option(None, engine=_MASK, remote=_SPELLED, http=("structured_outputs", "tools"))
    grammar_prefix: int = option(0, engine="the constraint's mask, continued from the prompt's last tokens",
                                 remote="refused with a constraint", http=None)
    heal: bool = option(False, engine="each prompt backed up and its parameters healed (decode.healing)",
                        remote="refused (needs HEAL)", http=None)

    def __post_init__(self):
        """Normalize, then check every value: ValueError (TypeError for a wrong kind) naming the option."""
        stop = self.stop
        object.__setattr__(self, "stop", (stop,) if isinstance(stop, str) else tuple(stop or ()))  # (frozen)
        for f in dataclasses.fields(self):
            if isinstance(f.default, float):  # 1 and 1.0 alike, in the engine and in a request body
                value = getattr(self, f.name)
                try:
                    object.__setattr__(self, f.name, float(value))
                except (TypeError, ValueError) as e:
                    raise type(e)(f"{f.name} must be a number, got {value!r}") from None
        self._check_sampling()
        self._check_request()

    def _check_sampling(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(self.stop)!r}")
        if self.stop_fn is not None and not callable(self.stop_fn):
            raise TypeError("stop_fn must be a callable (generated token ids, text -> bool)")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:  # NaN fails this too
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: no limit), got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:  # NaN fails this too
            raise ValueError(f"min_p must be in [0, 1] (0: off), got {self.min_p!r}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1: none), got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)!r}")
        self._check_logit_bias()
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.seed is not None and not isinstance(self.seed, int):  # the engine seeds a generator with it
            raise TypeError(f"seed must be an integer or None, got {self.seed!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")

    def _check_logit_bias(self) -> None:
        """Keys token ids (ints or their strings, as JSON has them), values numbers in [-100, 100]; {} is None.
        Whether a key is a token of the model is the backend's to say."""
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            raise TypeError(f"logit_bias must be a dict of token id -> bias, got {type(bias).__name__}")
        for key, value in bias.items():
            if isinstance(key, bool) or not (isinstance(key, int) and key >= 0 or isinstance(key, str) and key.isdigit()):
                raise ValueError(f"logit_bias: key {key!r} is not a token id (an integer >= 0)")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                raise ValueError(f"logit_bias: {value!r} for token {key} is not a number in [-100, 100]")
        object.__setattr__(self, "logit_bias", {int(k): float(v) for k, v in bias.items()} or None)

    def _check_request(self) -> None:
        given = [k for k in CONSTRAINTS if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one of {', '.join(CONSTRAINTS)}; got {given}")
        if not isinstance(self.grammar_prefix, int) or self.grammar_prefix < 0:
            raise ValueError(f"grammar_prefix must be an integer >= 0, got {self.grammar_prefix!r}")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise TypeError(f"cache_salt must be a string, got {type(self.cache_salt).__name__}")
        if self.cache_salt is not None and not 1 <= len(self.cache_salt) <= CACHE_SALT_MAX:
            raise ValueError(f"cache_salt must have 1 to {CACHE_SALT_MAX} characters, got {len(self.cache_salt)}")

    @classmethod
    def read(cls, options: dict, extra: tuple[str, ...] = ()) -> tuple[GenerateOptions, dict]:
        """-> (the contract's options, the backend's own `extra` ones given). TypeError for a name that is
        neither; ValueError for values no backend can take."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(options) - names - set(extra)
        if unknown:
            raise TypeError(f"unexpected keyword arguments (unknown options) {sorted(unknown)}")
        given = cls(**{k: v for k, v in options.items() if k in names})
        return given, {k: v for k, v in options.items() if k in extra}

    @classmethod
    def rules(cls, place: str) -> dict[str, object]:
        """{option: how it reaches `place`}, in declaration order; `place`: "engine", "remote" or "http" (`option`)."""
        return {f.name: f.metadata[place] for f in dataclasses.fields(cls)}

    @property
    def constraint(self) -> tuple[str, object] | None:
        """(kind, value) of the request's constraint, or None."""
        return next(((k, getattr(self, k)) for k in CONSTRAINTS if getattr(self, k) is not None), None)
