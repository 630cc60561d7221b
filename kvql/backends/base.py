"""The backend contract: all that kvql's query runtime may ask of a model.

Two backends implement it: `kvql.backends.local.LocalBackend` (kvql's engine, in this process) and
`kvql.backends.remote.RemoteBackend` (an OpenAI-compatible server: kvql serve, vLLM, SGLang). The runtime
(`kvql.runtime`) uses nothing else, so a query runs the same way on both; where a backend cannot do
something, it raises `Unsupported` before anything is computed or sent, naming itself and the feature.
This module is the bottom of the stack: it imports nothing of kvql's but `kvql.completion`. The model
objects users hold (`kvql.Model`, `kvql.RemoteModel`) are these backends with LMQL's model methods on top
(`kvql.llm.LLM`: `generate`, `generate_sync`, `score`, `score_sync`).

What a backend offers:
- `tokenizer`: a Hugging Face tokenizer (its chat template included), a server's own
  (`kvql.backends.server_tokenizer.ServerTokenizer`: encode, decode, special ids, chat template; no
  vocabulary: `get_vocab` is absent, so checks that read every token are skipped), or None. With one, the
  runtime keeps every prompt as token ids and sends ids (the `TOKEN_IDS` capability); without, it sends text.
- `eos_ids`: the token ids that end a sequence; `context_length`: tokens, or None when unknown.
- `agenerate(prompts, **options)` -> one `Completion` per prompt and sample, with the options below;
  `stream(prompt, **options)` -> `StreamChunk`s.
- `ascore(prompt_ids, continuations)`: the log-probability of each token of each continuation (lists of
  token ids) after the prompt, under the raw model distribution.
- `stats()`: the backend's counters (prompt, cached and computed tokens, hit rate where known).

Generation options: `kvql.backends.options.GenerateOptions` is the one list of them (every backend accepts
these names; unknown ones raise TypeError): each option's name, default, meaning and checks, and how it
reaches the engine, a server's request body and the HTTP fields.
`agenerate` (and the model objects' `generate` and `complete`) also take progress=False: True shows a tqdm bar of completions
done / total on stderr, as vLLM's `LLM.generate(use_tqdm=True)` does; a callable is called as tqdm is
(`functools.partial(tqdm, file=f)`, vLLM's other `use_tqdm` form). See `progress_bar`.
Each capability below names options or methods that need it.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import AsyncIterator

from ..completion import Completion

TOKEN_IDS = "token_ids"          # a tokenizer is known: prompts are token ids, chat templates render roles
SCORE = "score"                  # ascore (prompt log-probabilities)
LOGPROBS = "logprobs"            # top-k log-probabilities by token id
MASKED_LOGPROBS = "masked_logprobs"  # log-probabilities of the constrained distribution; grammar_prefix
MIN_TOKENS = "min_tokens"
STOP_FN = "stop_fn"
SAMPLING = "sampling"            # top_k, min_p and repetition_penalty (OpenAI's API has none of them)
CACHE_SALT = "cache_salt"
TOKEN_GRAMMAR = "token_grammar"  # Lark grammars may name tokens by id (`<[123]>`, llguidance's syntax)
HEAL = "heal"                    # token healing (the heal option)
CONSTRAINTS = ("regex", "choices", "json_schema", "grammar")  # each a capability of its own


def progress_bar(progress, total: int, desc: str = "Generating"):
    """The bar that a `progress=` option asks for, counting `total` completions (None when off).
    The caller updates it as completions finish and closes it, also on error."""
    if progress is None or progress is False:
        return None
    if progress is True:
        from tqdm.auto import tqdm

        progress = tqdm
    elif not callable(progress):
        raise TypeError(f"progress must be a bool or a callable that makes a tqdm bar, got {type(progress).__name__}")
    return progress(total=total, desc=desc, unit="completion")


class Unsupported(ValueError):
    """A backend cannot provide a feature; raised before anything is computed or sent."""


class BackendError(ValueError):
    """A backend failed a request for a reason of its own (a server's error answer, a lost connection)."""


@dataclass
class StreamChunk:
    """One step of a streamed request: `text` is the new text it made final (may be ""); `token_id` is -1
    when the backend does not know it."""

    sample: int
    text: str
    token_id: int
    completion: Completion | None  # set on the sample's last chunk


class Backend(abc.ABC):
    """A model the runtime can run queries on (see the module docstring for the contract)."""

    name: str
    tokenizer = None
    context_length: int | None = None
    eos_ids: frozenset[int] = frozenset()
    capabilities: frozenset[str] = frozenset()

    def require(self, capability: str, feature: str) -> None:
        """Raise `Unsupported` naming this backend and `feature` unless it has `capability`."""
        if capability not in self.capabilities:
            raise Unsupported(f"{feature} is not available on {self.describe()}: {self.why_not(capability)}")

    def why_not(self, capability: str) -> str:
        """Why this backend lacks `capability` (one clause, for error messages)."""
        return f"it lacks the {capability!r} capability"

    def describe(self) -> str:
        return repr(self)

    @abc.abstractmethod
    async def agenerate(self, prompts, **options) -> list[Completion]:
        """Complete each prompt (a string or a list of token ids); `len(prompts) * n` completions."""

    @abc.abstractmethod
    def stream(self, prompt, **options) -> AsyncIterator[StreamChunk]:
        """Stream one prompt's completion, chunk by chunk."""

    @abc.abstractmethod
    async def ascore(self, prompt_ids: list[int], continuations: list[list[int]]
                     ) -> tuple[list[list[float]], list[Completion]]:
        """-> (per continuation, the log-probability of each of its tokens after the prompt; the
        completions that computed them, for their cached-token counts). Needs `SCORE`."""

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        pass
