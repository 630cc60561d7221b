"""Log-probabilities in the response shapes of vLLM 0.32 (`entrypoints/openai/completion/serving.py`,
`chat_completion/serving.py`).

- completions `logprobs`: `{"text_offset": [int], "tokens": [str], "token_logprobs": [float | None],
  "top_logprobs": [{token: float} | None]}`; each step's `top_logprobs` holds the chosen token and
  the `k` most likely ones (so k or k + 1 entries; an id whose text another entry already has is
  spelled `"token_id:{id}"`, so no entry is lost); a step without logprobs (the first prompt token,
  when echoed) has `None` for both.
- chat `logprobs`: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}]}]}` with the `k` most likely tokens.
- `prompt_logprobs`: `[None, {token_id: {"logprob", "rank", "decoded_token"}}, ...]`: per prompt token
  after the first, the actual token and the `k` most likely ones.
- `return_tokens_as_token_ids`: every token spelled `"token_id:{id}"` (in `tokens`, as keys of
  `top_logprobs`, as chat `token`), so that tokens that are not valid text can be told apart.
"""

from __future__ import annotations

from ..completion import TokenLogprob

FLOOR = -9999.0  # vLLM's (and OpenAI's) stand-in for -inf, which JSON cannot hold

PROMPT_TOP = 20
"""The engine is asked for this many alternatives per prompt token, whatever `k` is: a token among them
gets its exact `rank`; the answer shows `k`."""


class Spelling:
    """How a token id is written: its decoded text, or `"token_id:{id}"`."""

    def __init__(self, tokenizer, as_ids: bool):
        self.tokenizer, self.as_ids = tokenizer, as_ids

    def __call__(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else self.tokenizer.decode([token_id])


def _lp(value: float) -> float:
    return max(value, FLOOR)


def completion_logprobs(spell: Spelling, token_ids: list[int], entries: list[TokenLogprob | None], k: int,
                        text_offset: int = 0) -> dict:
    """vLLM's completions `logprobs` for `token_ids`, `entries[i]` being the logprobs of `token_ids[i]`."""
    out = {"text_offset": [], "tokens": [], "token_logprobs": [], "top_logprobs": []}
    for token_id, e in zip(token_ids, entries):
        token = spell(token_id)
        out["text_offset"].append(text_offset)
        text_offset += len(token)
        out["tokens"].append(token)
        if e is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_lp(e.logprob))
        top, owner = {token: _lp(e.logprob)}, {token: token_id}  # the chosen token first, then the k best
        for t, lp in _best(e.top, k):
            key = spell(t)
            if owner.setdefault(key, t) != t:  # another id with the same text: spelled by its id, not lost
                key = f"token_id:{t}"
                owner[key] = t
            top.setdefault(key, _lp(lp))
        out["top_logprobs"].append(top)
    return out


def chat_logprobs(spell: Spelling, token_ids: list[int], entries: list[TokenLogprob], k: int) -> dict:
    """vLLM's (OpenAI's) chat `logprobs` for `token_ids`."""
    def item(token_id: int, lp: float) -> dict:
        token = spell(token_id)
        return {"token": token, "logprob": _lp(lp), "bytes": list(token.encode("utf-8", errors="replace"))}

    return {"content": [item(t, e.logprob) | {"top_logprobs": [item(a, lp) for a, lp in _best(e.top, k)]}
                        for t, e in zip(token_ids, entries)]}


def prompt_logprobs(tokenizer, entries: list[TokenLogprob | None], k: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token, `{token_id: {"logprob", "rank", "decoded_token"}}`
    for the actual token and the `k` most likely ones. `rank` is 1 + the number of tokens more likely;
    it is None for an actual token outside the engine's `PROMPT_TOP` alternatives (its rank is not known
    there; vLLM computes it over the whole vocabulary)."""
    out: list[dict | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        ranked = sorted(e.top.items(), key=lambda a: -a[1])
        rank = 1 + sum(lp > e.logprob for _, lp in ranked) if e.token_id in e.top else None
        step = {e.token_id: {"logprob": _lp(e.logprob), "rank": rank, "decoded_token": tokenizer.decode([e.token_id])}}
        for t, lp in ranked[:k]:
            step.setdefault(t, {"logprob": _lp(lp), "rank": 1 + sum(x > lp for _, x in ranked),
                                "decoded_token": tokenizer.decode([t])})
        out.append(step)
    return out


def _best(top: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(top.items(), key=lambda a: -a[1])[:k]
