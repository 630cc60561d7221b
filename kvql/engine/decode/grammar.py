"""Constraints compiled to token masks with llguidance.

A `Grammar` is a constraint compiled for one tokenizer: a regex, a choice among strings, a JSON schema
or a Lark grammar. It always constrains the *whole* generated text (a regex must match all of it,
like `re.fullmatch`). `grammar.mask_fn()` gives the engine's `MaskFn`: it allows the tokens that
keep the text a prefix of something the grammar accepts, plus EOS once the text is complete (only
EOS when nothing more can follow, so the engine ends the sequence with finish_reason "stop").
Where the grammar leaves a choice, every such token is allowed; bytes the grammar forces are offered
only in their canonical tokenization (llguidance's default, which keeps the model on tokenizations
it was trained on; `%llguidance {"no_forcing": true}` in a Lark grammar turns it off). Histories
are accepted in any tokenization.

Regexes use the syntax of Rust's `regex` crate (https://docs.rs/regex/latest/regex/#syntax); `.`
does not match a newline unless written `(?s:.)`. Inside a regex, `&` and `~` are plain characters.
Intersection and negation exist only in Lark terminal definitions, outside the `/.../` delimiters:

    MATCH: /[a-z ]+/ & /.*x.*/                   both regexes match
    MATCH: /[a-z ]+/ & ~/(?s:.*)bad(?s:.*)/      the first matches and the text does not contain "bad"

`&` binds tighter than `|`, and `~` tighter than `*` or `+` (`~A+` is `(~A)+`). `~A` alone also
matches invalid UTF-8, so intersect it with a positive regex as above. `Grammar.regex_all` builds
the intersection of plain regexes; for negation write the terminal in a grammar, e.g.
`Grammar.lark(tok, 'start: MATCH\\nMATCH: /[a-z ]+/ & ~/(?s:.*)bad(?s:.*)/')`.

Untrusted constraints reach native code here, so they are bounded first: at most `MAX_BYTES` of
grammar text (a regex, a Lark grammar, a schema's JSON, the choices together) and JSON nested at
most `MAX_DEPTH` deep, checked without recursion; anything larger is a ValueError that says so.
llguidance's compiler recurses natively along chains of rules or `$ref`s (3,000 chained rules
overflow an 8 MiB thread stack and kill the process), so compilation runs on a thread whose stack
(`COMPILE_STACK`) holds the deepest chain that fits in `MAX_BYTES` several times over
(measured: 70,000 chained Lark rules, 1 MB of text, compile in a 512 MiB stack; 30,000 `$ref`s in
256 MiB). The stack is virtual memory, committed only as far as it is used. And every grammar is
compiled, and its first mask computed, in a sandbox process before it is compiled here
(`grammar_sandbox`): a crash or hang there that the bounds did not foresee refuses that constraint
with a ValueError, and this process never runs the grammar that caused it.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections import OrderedDict
from typing import Callable

import llguidance
import llguidance.hf
import numpy as np
import torch

from . import grammar_sandbox

_LIMITS = llguidance.LLParserLimits(verbose_errors=False)  # errors without parser-state dumps
MAX_BYTES = 256 * 1024
MAX_DEPTH = 64
COMPILE_STACK = 256 * 2**20
_stack_size_lock = threading.Lock()
COMPILED_PER_TOKENIZER = 256  # compiled grammars kept per tokenizer, least recently used dropped first
_ll_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> _TokenizerState
_ll_tokenizers_lock = threading.Lock()


class _TokenizerState:
    """llguidance's view of one tokenizer and the grammars compiled for it: grammar text -> (initial
    matcher, None) or (None, llguidance's error). Requests repeat their constraints (one JSON schema for
    many requests), and each compile costs a sandbox round trip plus the compile itself; an initial matcher
    is never advanced (each mask function deep-copies it), so one serves every request of that text."""

    def __init__(self, ll: llguidance.LLTokenizer):
        self.ll = ll
        self.compiled: OrderedDict[str, tuple] = OrderedDict()

    def lookup(self, text: str) -> tuple | None:
        with _ll_tokenizers_lock:
            found = self.compiled.get(text)
            if found is not None:
                self.compiled.move_to_end(text)
            return found

    def store(self, text: str, result: tuple) -> None:
        with _ll_tokenizers_lock:
            self.compiled[text] = result
            while len(self.compiled) > COMPILED_PER_TOKENIZER:
                self.compiled.popitem(last=False)


JSON_SPACING = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""llguidance's JSON options for every JSON constraint: whitespace as `json.dumps` writes it (see
`Grammar.json_schema`); `kvql.backends.options.JSON_SPACING` is its twin above the engine."""

def check_choices(tokenizer, options) -> None:
    """ValueError / TypeError for choices no output can be: none, not strings, or holding a special token's
    text (llguidance would match it with the special token itself, and an end-of-sequence token ends the
    output without its text: the value would be one that is none of the choices)."""
    if not options:
        raise ValueError("choices needs at least one option")
    if not all(isinstance(o, str) for o in options):
        raise TypeError(f"choices must be strings, got {list(options)!r}")
    for o in options:
        hit = next((t for t in tokenizer.all_special_tokens if t and t in o), None)
        if hit is not None:
            raise ValueError(f"choice {o!r} holds the text of the special token {hit!r}: a model writes special "
                             "tokens only as tokens, never as text, so no output can be this choice")


def _ll_tokenizer(tokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of a Hugging Face fast tokenizer, built once per tokenizer object (a pass over the
    whole vocabulary; its cost: docs/benchmarks.md, Design measurements)."""
    return _state(tokenizer).ll


def _state(tokenizer) -> _TokenizerState:
    with _ll_tokenizers_lock:
        state = _ll_tokenizers.get(tokenizer)
        if state is None:
            if tokenizer.eos_token_id is None:
                raise ValueError("the tokenizer has no EOS token, which a grammar needs to end the output")
            state = _ll_tokenizers[tokenizer] = _TokenizerState(llguidance.hf.from_tokenizer(tokenizer))
        return state


def warm_up(tokenizer) -> None:
    """Do now what the first constraint for `tokenizer` would pay: llguidance's view of it here and in the
    sandbox child (the child's start included; docs/benchmarks.md, Design measurements). A server calls it
    at start, so its first constrained request is not slower. A failure is left for that request to report (a
    tokenizer without EOS, say)."""
    try:
        Grammar.lark(tokenizer, 'start: "kvql"')
    except (ValueError, OSError):
        pass


def _json_depth(value) -> int:
    """Nesting depth of dicts and lists in `value`, without recursion (so any depth is safe)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def _check_size(text: str, what: str) -> None:
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_BYTES:
        raise ValueError(f"{what} is {size} bytes; kvql compiles constraints of at most {MAX_BYTES} bytes")


def _on_big_stack(fn):
    """Run `fn()` on a new thread with a `COMPILE_STACK` stack; return its result or raise its error."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # re-raised in the caller's thread
            out["error"] = e

    with _stack_size_lock:
        previous = threading.stack_size(COMPILE_STACK)
        try:
            thread = threading.Thread(target=run, name="kvql-grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def _plain_error(error: str, generated: int) -> str:
    """llguidance's error text in the user's terms where it has a name for it."""
    if error.startswith("NoExtensionBias"):
        return ("it accepts no text at all (its conditions contradict each other)" if generated == 0 else
                f"it allows no continuation of the {generated} tokens generated so far")
    return error.rstrip()


_POSITION = re.compile(r"(?:at )?(\d+)\((\d+)\): ")  # llguidance's "at 3(9): " (line, column in the Lark text)
_LISTING = re.compile(r"\n +\d+ \| ")  # the start of the grammar's lines it appends after the reason
SHOWN = 200  # characters of a constraint (or of a grammar's line) an error message quotes


def _cut(text: str) -> str:
    return text if len(text) <= SHOWN else text[:SHOWN] + "..."


def _compile_error(what: str, shown: str, error: str, lark: str | None) -> str:
    """The message of a constraint that does not compile: `invalid <what>: <llguidance's reason>` first,
    then where: the line of the Lark grammar `lark` that llguidance points at, else the constraint, each
    cut to `SHOWN` characters. (llguidance appends the grammar's lines, in full, after its reason: a grammar
    of many lines, or one long line, would bury it; the text of a schema can be as long.)"""
    error = _plain_error(error, 0)
    listing = _LISTING.search(error)
    reason = error[:listing.start()] if listing else error
    at = _POSITION.match(reason)
    reason = reason[at.end():] if at else reason
    lines = lark.split("\n") if lark is not None and at else []
    line = int(at[1]) if at else 0
    where = (f"line {line} of the grammar: {_cut(lines[line - 1])}" if 0 < line <= len(lines) else _cut(shown))
    return f"invalid {what}: {reason} ({where})"


class Grammar:
    """A compiled constraint for one tokenizer; immutable and shareable between requests.

    Build it with `regex`, `regex_all`, `choices`, `json_schema` or `lark`; they raise ValueError,
    saying what is wrong first, then what was given (cut short), when the constraint is invalid. `vocab_size` is the
    length of the masks.
    """

    def __init__(self, tokenizer, build, what: str, shown: str, lark: str | None = None):
        """`build()` returns llguidance's grammar text. It is compiled in the sandbox process first,
        then here, on a big stack; a text compiled before for this tokenizer is not compiled again.
        An error is `_compile_error(what, shown, ..., lark)`: `what` the kind of constraint, `shown` the
        constraint as a message quotes it, `lark` the Lark source of a Lark grammar."""
        state = _state(tokenizer)
        self._ll = state.ll
        text = _on_big_stack(build)
        found = state.lookup(text)
        if found is None:
            error = grammar_sandbox.check(tokenizer, text)
            initial = None
            if error is None:
                initial = _on_big_stack(lambda: llguidance.LLMatcher(self._ll, text, log_level=0, limits=_LIMITS))
                error = initial.get_error() if initial.is_error() else None
            found = (None, error) if error is not None else (initial, None)
            state.store(text, found)
        self._initial, error = found
        if error is not None:
            raise ValueError(_compile_error(what, shown, error, lark))
        self.vocab_size: int = self._ll.vocab_size

    @classmethod
    def regex(cls, tokenizer, pattern: str) -> Grammar:
        """The whole output matches `pattern`."""
        if not isinstance(pattern, str):
            raise TypeError(f"a regex must be a string, got {type(pattern).__name__}")
        _check_size(pattern, "the regex")
        return cls(tokenizer, lambda: llguidance.LLMatcher.grammar_from_regex(pattern), "regex", repr(pattern))

    @classmethod
    def regex_all(cls, tokenizer, patterns: list[str]) -> Grammar:
        """The whole output matches every one of `patterns` (their intersection)."""
        if not patterns:
            raise ValueError("regex_all needs at least one pattern")
        _check_size("".join(patterns), "the regexes")

        def build():
            terms = " & ".join(f"/{llguidance.regex_to_lark(p, '')}/" for p in patterns)
            return llguidance.LLMatcher.grammar_from_lark(f"start: MATCH\nMATCH: {terms}")
        return cls(tokenizer, build, "regexes", repr(list(patterns)))

    @classmethod
    def choices(cls, tokenizer, options: list[str]) -> Grammar:
        """The output is exactly one of `options`, however the model tokenizes it."""
        check_choices(tokenizer, options)
        lark = "start: " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)
        _check_size(lark, "the choices")
        return cls(tokenizer, lambda: llguidance.LLMatcher.grammar_from_lark(lark), "choices", repr(list(options)))

    @classmethod
    def json_schema(cls, tokenizer, schema: dict | str) -> Grammar:
        """The output is JSON valid under `schema` (a dict or its JSON text).

        Whitespace is fixed, as `json.dumps` writes it (`{"a": 1, "b": [1, 2]}`), so the output is
        never padded with whitespace; a schema's `"x-guidance"` options (e.g.
        `{"whitespace_flexible": true}`) override this.
        """
        if isinstance(schema, str):
            _check_size(schema, "the JSON schema")
            try:
                schema = json.loads(schema)
            except (json.JSONDecodeError, RecursionError) as e:
                raise ValueError(f"invalid JSON schema: not JSON ({e}) ({_cut(schema)})") from None
        if not isinstance(schema, (dict, bool)):
            raise TypeError(f"a JSON schema is an object (dict) or its JSON text, got {type(schema).__name__}")
        depth = _json_depth(schema)
        if depth > MAX_DEPTH:
            raise ValueError(f"the JSON schema is nested {depth} deep; kvql compiles schemas nested at most "
                             f"{MAX_DEPTH} deep")
        text = json.dumps(schema)
        _check_size(text, "the JSON schema")
        def build():
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_SPACING)
            except ValueError as e:
                raise ValueError(_compile_error("JSON schema", text, str(e), None)) from None
        return cls(tokenizer, build, "JSON schema", text)

    @classmethod
    def lark(cls, tokenizer, grammar: str) -> Grammar:
        """The output is derived from the rule `start` of a Lark grammar in llguidance's dialect
        (https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md)."""
        if not isinstance(grammar, str):
            raise TypeError(f"a Lark grammar must be a string, got {type(grammar).__name__}")
        _check_size(grammar, "the Lark grammar")
        return cls(tokenizer, lambda: llguidance.LLMatcher.grammar_from_lark(grammar), "Lark grammar", repr(grammar),
                   grammar)

    def mask_fn(self) -> Callable[[list[int]], torch.Tensor]:
        """A new kvql `MaskFn`: generated ids so far -> bool tensor `[vocab_size]` of allowed next tokens.

        It answers for any history, so the samples or beams of one prompt may share it: it advances
        when the ids extend the previous call's, else rolls back to the common prefix. It is
        thread-safe. A history the grammar rejects raises ValueError with llguidance's message.
        """
        return _Mask(self._initial, self.vocab_size)


class _Mask:
    """One mask function: a matcher that follows whichever history it is called with. It depends on
    the ids alone, so the engine may ask it ahead (`jump_forward`, see `request.MaskFn`)."""

    jump_forward = True

    def __init__(self, initial: llguidance.LLMatcher, vocab_size: int):
        self._initial = initial
        self._matcher = initial.deep_copy()
        self._consumed: list[int] = []
        self._vocab_size = vocab_size
        self._lock = threading.Lock()

    def __call__(self, ids: list[int]) -> torch.Tensor:
        ids = list(ids)
        with self._lock:
            consumed = self._consumed
            common = next((i for i, (a, b) in enumerate(zip(consumed, ids)) if a != b),
                          min(len(consumed), len(ids)))
            if common < len(consumed):  # a failed rollback leaves the matcher in error: raised below
                self._matcher.rollback(len(consumed) - common)
            del consumed[common:]
            self._matcher.consume_tokens(ids[common:])
            consumed.extend(ids[common:])
            if not self._matcher.is_error():
                bits = self._matcher.compute_bitmask()
            if self._matcher.is_error():
                error = self._matcher.get_error()
                self._matcher, self._consumed = self._initial.deep_copy(), []  # errors are permanent
                raise ValueError(f"grammar error after {len(ids)} generated tokens: {_plain_error(error, len(ids))}")
        allowed = np.unpackbits(np.frombuffer(bits, dtype=np.uint8), bitorder="little")[:self._vocab_size]
        return torch.from_numpy(allowed.view(np.bool_))
