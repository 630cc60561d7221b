"""Token healing: back up the prompt's last tokens and let the first generated tokens span the boundary.

A prompt that ends inside what the model would write as one token ("The capi", "http://www.goo", or
"A: " before a word the tokenizer spells with its leading space) makes the model continue from a token
boundary it rarely saw in training. Healing removes the prompt's last tokens and constrains the
generated text to start with their text, so that the model picks its own token across the boundary
(" capital", "google", " yes").

How many tokens are backed up (`Healer.backup`): the longest run of trailing prompt tokens, at most
`MAX_TOKENS`, whose text (bytes) is a proper prefix of some token of the vocabulary (so some single
token can span the boundary); never a special token, never the prompt's first token, and only a run
whose text is whole UTF-8. When no run qualifies, no token could span the boundary: nothing is backed
up and the request is sent as it is.

What the generated text is constrained to (`Healing.constraint` / `Healing.mask`): the backed-up text
followed by the request's own constraint, as ONE llguidance Lark grammar (`start: "<text>" inner`, the
constraint nested with `%lark { ... }`); choices come out in the canonical tokenization of text +
choice (token ids, `<[id]>`); without a constraint, a mask that only allows tokens agreeing with the
backed-up text until it is spelled, then anything.

What counts as the value: the generated text after the backed-up text (`Completion.text`; stop strings
are searched in it only, see `Detokenizer(skip=...)`). Its tokens are the generated tokens that carry at
least one byte of it: a token spanning the boundary counts, a token wholly inside the backed-up text
does not. `max_tokens`, `min_tokens` and `stop_fn` see the value's tokens and text.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import weakref

import llguidance
import torch

from .grammar import JSON_SPACING, _ll_tokenizer, check_choices
from . import masks

MAX_TOKENS = 8
_healers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_healers_lock = threading.Lock()


def healer(tokenizer) -> "Healer":
    """The `Healer` of a tokenizer, built once (a pass over the vocabulary)."""
    with _healers_lock:
        h = _healers.get(tokenizer)
        if h is None:
            h = _healers[tokenizer] = Healer(tokenizer)
        return h


class Healer:
    """The vocabulary's token bytes, and every proper prefix of them, for one tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        ll = _ll_tokenizer(tokenizer)
        self.vocab_size = ll.vocab_size
        self.special = frozenset(i for i in range(ll.vocab_size) if ll.is_special_token(i))
        self.pieces = [b"" if i in self.special else ll.decode_bytes([i]) for i in range(ll.vocab_size)]
        self.prefixes = frozenset(p[:j] for p in self.pieces for j in range(1, len(p)))
        self._agreeing: dict[bytes, torch.Tensor] = {}
        self._lock = threading.Lock()

    def backup(self, ids: list[int]) -> int:
        """How many of the prompt's last tokens to back up (the module's rule); 0: none."""
        best, tail = 0, b""
        for j in range(1, min(MAX_TOKENS, len(ids) - 1) + 1):
            t = ids[-j]
            if t in self.special or not 0 <= t < len(self.pieces):
                break
            tail = self.pieces[t] + tail
            if tail in self.prefixes and _whole_utf8(tail):
                best = j
        return best

    def heal(self, ids: list[int], max_tokens: int, min_tokens: int, stop_fn) -> "Healing | None":
        k = self.backup(ids)
        if not k:
            return None
        text = b"".join(self.pieces[t] for t in ids[-k:])
        return Healing(self, k, text, max_tokens, min_tokens, stop_fn)

    def agreeing(self, rest: bytes) -> torch.Tensor:
        """The tokens that agree with `rest`: each a prefix of it, or starting with all of it."""
        with self._lock:
            allowed = self._agreeing.get(rest)
            if allowed is None:
                allowed = torch.tensor([bool(p) and (rest.startswith(p) or p.startswith(rest)) for p in self.pieces])
                if len(self._agreeing) < 1024:
                    self._agreeing[rest] = allowed
            return allowed


def canonical_choices(tokenizer, choices) -> str:
    """A Lark grammar admitting each of `choices` in its canonical tokenization only (the ids the tokenizer
    gives it; by its text where those ids do not spell it back)."""
    check_choices(tokenizer, choices)
    alternatives = []
    for c in choices:
        ids = tokenizer.encode(c, add_special_tokens=False)
        ok = ids and tokenizer.decode(ids) == c
        alternatives.append(" ".join(f"<[{t}]>" for t in ids) if ok else json.dumps(c, ensure_ascii=False))
    return "start: " + " | ".join(alternatives)


def _whole_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


@dataclasses.dataclass(eq=False)
class Healing:
    """One prompt's healing: the last `tokens` prompt tokens, whose bytes are `data`, are generated again.
    Built by `Healer.heal`; `apply` turns a request's parameters into the healed request's."""

    healer: Healer
    tokens: int
    data: bytes
    max_tokens: int
    min_tokens: int
    user_stop_fn: object = None

    def __post_init__(self):
        self.text = self.data.decode("utf-8")
        self._stopped: set[tuple[int, ...]] = set()  # outputs the caller's stop_fn ended (not the token cap)

    def inside(self, ids: list[int]) -> int:
        """How many leading `ids` lie wholly inside the backed-up text (they are not the value's tokens)."""
        size = 0
        for n, t in enumerate(ids):
            size += len(self.healer.pieces[t]) if 0 <= t < len(self.healer.pieces) else 1
            if size > len(self.data):
                return n
        return len(ids)

    # -- the constraint ------------------------------------------------------------------------------
    def constraint(self, tokenizer, kind: str, value) -> str:
        """The request's constraint (`kind`: regex, choices, json_schema, grammar) after the backed-up
        text, as one Lark grammar. Choices: each in the canonical tokenization of text + choice."""
        if kind == "choices":
            return canonical_choices(tokenizer, [self.text + c for c in value])
        if kind == "regex":
            inner = f"start: VALUE\nVALUE: /{llguidance.regex_to_lark(value, '')}/"
        elif kind == "json_schema":
            schema = json.loads(value) if isinstance(value, str) else value
            if isinstance(schema, dict):
                schema = {**schema, "x-guidance": {**JSON_SPACING, **schema.get("x-guidance", {})}}
            inner = f"start: %json {json.dumps(schema)}"
        elif kind == "grammar":
            inner = value
        else:
            raise ValueError(f"token healing does not combine with a {kind} constraint")
        return f"start: {json.dumps(self.text, ensure_ascii=False)} healed_value\nhealed_value: %lark {{\n{inner}\n}}"

    def mask(self, vocab: int):
        """Without a constraint: only tokens agreeing with the backed-up text until it is spelled, then any."""
        data, pieces, healer = self.data, self.healer.pieces, self.healer

        def mask(generated: list[int]):
            done = b"".join(pieces[t] for t in generated[:len(data)])
            if len(done) >= len(data):
                return None
            return healer.agreeing(data[len(done):])

        mask.jump_forward = True  # a function of the ids alone
        return mask

    # -- the request -------------------------------------------------------------------------------
    def apply(self, params, mask, eos_ids, vocab: int, context: int | None, prompt_len: int):
        """`params` (a SamplingParams for the original prompt) for the healed prompt: `mask` (the healed
        constraint's, or None) with no end before `min_tokens` value tokens, the token cap counted on the
        value's tokens (`stop_fn`), the backed-up text left out of the text."""
        if mask is None:
            mask = self.mask(vocab)
        mask = masks.no_end_before(mask, self.min_tokens, eos_ids, vocab,
                                   counted=lambda generated: len(generated) - self.inside(generated))
        extra = len(self.data)  # tokens wholly inside the backed-up text: at most one per byte
        if context is not None:
            extra = max(0, min(extra, context - prompt_len - self.max_tokens))
        return dataclasses.replace(params, max_tokens=self.max_tokens + extra, mask=mask, stop_fn=self._stop_fn,
                                   healing=self)

    def _stop_fn(self, out: list[int], text: str) -> bool:
        value = out[self.inside(out):]
        if self.user_stop_fn is not None and self.user_stop_fn(value, text):
            self._stopped.add(tuple(out))
            return True
        return len(value) >= self.max_tokens

    def finish(self, c):
        """The engine's completion of the healed request, as the caller asked for it."""
        c.healed, c.healed_prompt_tokens = self.text, self.tokens
        c.healed_output_tokens = self.inside(c.token_ids)
        capped = len(c.token_ids) - c.healed_output_tokens >= self.max_tokens
        if c.finish_reason == "stop" and c.stop_reason is None and capped and tuple(c.token_ids) not in self._stopped:
            c.finish_reason = "length"
        return c
