"""An OpenAI completions answer read field by field, every field checked (`bounded_http.Reply`): the choices in
sample order, their stop strings, token log-probabilities (tokens named by id: `return_tokens_as_token_ids`),
vLLM's prompt log-probabilities, the usage counts. A field that is missing or of the wrong kind raises
`BackendError` naming the server, the path and the field (`Reply.wrong`): nothing malformed becomes a value."""

from __future__ import annotations

from ..completion import TokenLogprob
from .bounded_http import INTEGER, LIST, NUMBER, OBJECT, Reply


def choices(reply: Reply, n: int) -> list[tuple[str, dict]]:
    """The `n` choices of a completions answer in sample order, each with where it is in the answer."""
    choices = reply.get(reply.body, "choices", LIST)
    if len(choices) != n:
        raise reply.wrong("choices", choices, f"a list of {n} choice{'s' if n > 1 else ''}")
    found: dict[int, tuple[str, dict]] = {}
    for k, choice in enumerate(choices):
        where = f"choices[{k}]"
        reply.check(choice, OBJECT, where)
        i = reply.get(choice, "index", INTEGER, where)
        if not 0 <= i < n or i in found:
            raise reply.wrong(where + ".index", i, f"a sample number below {n}, each once")
        found[i] = where, choice
    return [found[i] for i in range(n)]


def stop_reason(reply: Reply, choice: dict, where: str) -> str | None:
    """The stop string that ended a choice: vLLM's and kvql's `stop_reason`, SGLang's `matched_stop` (both
    name a stop token by its id instead: no string then)."""
    for key in ("stop_reason", "matched_stop"):
        reason = choice.get(key)
        if isinstance(reason, str):
            return reason
        if reason is not None and type(reason) is not int:
            raise reply.wrong(f"{where}.{key}", reason, "a string, a token id or null")
    return None


def usage(reply: Reply) -> tuple[int, int]:
    """(prompt tokens, of them cached) of a completions answer; 0 where the server does not say."""
    usage = reply.get(reply.body, "usage", OBJECT, default={})
    details = reply.get(usage, "prompt_tokens_details", OBJECT, "usage", default={})
    return (reply.get(usage, "prompt_tokens", INTEGER, "usage", default=0),
            reply.get(details, "cached_tokens", INTEGER, "usage.prompt_tokens_details", default=0))


def token_id(reply: Reply, token, where: str) -> int:
    """A token named by id (`return_tokens_as_token_ids`): "token_id:N"."""
    digits = token[len("token_id:"):] if isinstance(token, str) and token.startswith("token_id:") else ""
    if not (digits.isascii() and digits.isdigit()):
        raise reply.wrong(where, token, "'token_id:N' (return_tokens_as_token_ids)")
    return int(digits)


def logprobs(reply: Reply, choice: dict, where: str) -> list[TokenLogprob]:
    """OpenAI's `logprobs` of a choice: a token, its log-probability and the top-k alternatives per step."""
    lp = reply.get(choice, "logprobs", OBJECT, where)
    where += ".logprobs"
    tokens = reply.get(lp, "tokens", LIST, where)
    values = reply.get(lp, "token_logprobs", LIST, where)
    tops = reply.get(lp, "top_logprobs", LIST, where, default=[None] * len(tokens))
    for key, found in (("token_logprobs", values), ("top_logprobs", tops)):
        if len(found) != len(tokens):
            raise reply.wrong(f"{where}.{key}", found, f"a list of {len(tokens)}, one per token")
    out = []
    for j, (token, value, top) in enumerate(zip(tokens, values, tops)):
        top = {} if top is None else reply.check(top, OBJECT, f"{where}.top_logprobs[{j}]")
        out.append(TokenLogprob(token_id(reply, token, f"{where}.tokens[{j}]"),
                                float(reply.check(value, NUMBER, f"{where}.token_logprobs[{j}]")),
                                {token_id(reply, k, f"{where}.top_logprobs[{j}]"):
                                 float(reply.check(x, NUMBER, f"{where}.top_logprobs[{j}][{k!r}]"))
                                 for k, x in top.items()}))
    return out


def prompt_logprob(reply: Reply, rows: list, where: str, position: int, token: int) -> float:
    """The log-probability of prompt token `token` at `position` in vLLM's prompt_logprobs rows:
    {token id (a string in JSON): {"logprob", "rank", "decoded_token"}} (or the number alone)."""
    row = reply.check(rows[position], OBJECT, f"{where}[{position}]")
    where = f"{where}[{position}][{str(token)!r}]"
    entry = row.get(str(token))
    if isinstance(entry, dict):
        return float(reply.get(entry, "logprob", NUMBER, where))
    return float(reply.check(entry, NUMBER, where))
