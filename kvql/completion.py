"""The result of one generated sequence, shared by every backend."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """Log-probability of a token under the model, and the `k` most likely alternatives at its position."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


@dataclass
class Completion:
    """One sequence generated for one prompt.

    `index` is the prompt's position in the call, `sample` which of its `n` samples this is.
    `text` excludes any stop string; `token_ids` are the generated tokens (an EOS that ended the
    sequence is not included). `cached_tokens` counts prompt tokens served from the KV cache.
    `prompt_logprobs` (when asked for): one entry per prompt token, None for the first (nothing
    precedes it), then each token's logprob given the tokens before it, with the `k` most likely
    alternatives at that position; every sample of a prompt carries the same list.
    Token healing (`heal=True`): `healed` is the text of the last `healed_prompt_tokens` prompt tokens, which
    were backed up (not sent: `prompt_tokens` excludes them) and generated again; `token_ids` spell `healed`
    + `text` (up to a stop), and their first `healed_output_tokens` lie wholly inside `healed` (they are not
    the value's: `max_tokens` and `min_tokens` count the others). `text` excludes `healed`.
    `forced`: the indices in `token_ids` of tokens a constraint forced (its mask allowed only that token; the
    engine appended them without a decode step of their own: jump-forward); empty where the backend does not
    tell (servers). `prepare_seconds`: how long the call took before its requests were queued (checking the
    options, tokenizing, compiling the constraint); 0 where the backend does not tell (servers).
    Speculative decoding: `drafted_tokens` were drafted for this sequence and verified, and `accepted` are the
    indices in `token_ids` of those it accepted (computed ahead, several in one forward); 0 and empty where
    nothing was drafted or the backend does not tell. Neither takes part in equality: an answer is the same
    whether or not its tokens were drafted. `disk_tokens`: of `cached_tokens`, those whose KV the engine read back
    from its disk tier for this request (`disk_cache=`); 0 without one or where the backend does not tell (servers).
    """

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    cached_tokens: int
    index: int = 0
    sample: int = 0
    logprobs: list[TokenLogprob] | None = None
    stop_reason: str | None = None  # the stop string that ended the sequence, if one did
    prompt_logprobs: list[TokenLogprob | None] | None = None
    healed: str = ""
    healed_prompt_tokens: int = 0
    healed_output_tokens: int = 0
    forced: list[int] = field(default_factory=list)
    prepare_seconds: float = field(default=0.0, compare=False)  # a timing: two equal answers are equal
    drafted_tokens: int = field(default=0, compare=False)
    accepted: list[int] = field(default_factory=list, compare=False)
    disk_tokens: int = field(default=0, compare=False)  # where the cache found them: an answer is the same
