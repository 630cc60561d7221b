"""Checking a value against a plan's grammar on its text, whatever the tokenization (`matcher`: an llguidance
matcher over the 256 bytes), and what a tokenizer can spell in how many tokens (`fewest_tokens`,
`longest_token`)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import llguidance

from .errors import ConstraintError

class _ByteVocab:
    """A vocabulary of the 256 bytes (and an end token): a matcher over it reads any text exactly,
    independent of how a model would tokenize it."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b""]
    special_token_ids = [256]

    def __call__(self, text):
        return list(text if isinstance(text, bytes) else text.encode())


@dataclass
class Matcher:
    initial: llguidance.LLMatcher
    satisfiable: bool


@functools.lru_cache(maxsize=1)
def _bytes_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocab()))


@functools.lru_cache(maxsize=256)
def matcher(lark: str) -> Matcher:
    # Compiled here, on the caller's thread: a plan's grammar is one terminal, nested only as deep as
    # its where expression, and llguidance refuses deep nesting itself ("too deeply nested", regex
    # nest limit); the chained rules that need engine.grammar's big-stack compile cannot occur.
    limits = llguidance.LLParserLimits(verbose_errors=False)
    m = llguidance.LLMatcher(_bytes_tokenizer(), llguidance.LLMatcher.grammar_from_lark(lark), log_level=0,
                             limits=limits)
    if m.is_error():
        raise ConstraintError(f"invalid constraint: {m.get_error().rstrip()}")
    probe = m.deep_copy()
    probe.compute_bitmask()  # an empty intersection has no first byte: llguidance reports an error here
    return Matcher(m, not probe.is_error())


@functools.lru_cache(maxsize=8)
def _pieces(tokenizer) -> tuple[frozenset[bytes], int]:
    """The byte strings of a Hugging Face tokenizer's ordinary tokens, and the longest one's length."""
    import llguidance.hf  # imports transformers: only once a tokenizer is at hand

    ll = llguidance.hf.from_tokenizer(tokenizer)
    pieces = frozenset(ll.decode_bytes([i]) for i in range(ll.vocab_size) if not ll.is_special_token(i)) - {b""}
    return pieces, max(map(len, pieces), default=1)


def warm_up(tokenizer) -> None:
    """Do now what the first choice constraint's token count would pay: a pass over the whole vocabulary
    (its cost: docs/benchmarks.md, Design measurements)."""
    _pieces(tokenizer)


def fewest_tokens(tokenizer, text: str) -> float:
    """The fewest tokens of `tokenizer` that spell `text` in any tokenization (math.inf if none do):
    a lower bound on what generating `text` takes, whatever the model or the mask prefers."""
    pieces, longest = _pieces(tokenizer)
    b = text.encode()
    best = [0] + [math.inf] * len(b)
    for i in range(len(b)):
        if best[i] != math.inf:
            for k in range(1, min(longest, len(b) - i) + 1):
                if b[i:i + k] in pieces and best[i] + 1 < best[i + k]:
                    best[i + k] = best[i] + 1
    return best[-1]


def longest_token(tokenizer) -> int:
    """Bytes in the longest token: `n` tokens spell at most `n * longest_token` characters."""
    return _pieces(tokenizer)[1]
