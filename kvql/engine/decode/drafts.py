"""Drafts for speculative decoding without a draft model: tokens a request is likely to produce next, read
from what the engine has already seen.

`Drafter.propose(req, limit)` returns up to `Draft.length` token ids for a decoding request, from the first of
these sources that has any:
1. the radix tree: when the request's whole context (prompt and output so far) is a path of the tree, the
   tokens that followed it there (an earlier or a finished request with the same context: a query run
   again, after a restart from the disk tier too); once its context leaves the tree, it is not looked in again;
2. its own context (prompt lookup, as vLLM's `ngram` method and transformers' `prompt_lookup_num_tokens`):
   the tokens that followed the latest earlier occurrence of its last 4, 3 or 2 tokens (extraction, copying
   from a document, a few-shot format);
3. earlier outputs (suffix-style, as SuffixDecoding): the same match over the outputs of finished requests
   of the same cache partition (answers that repeat across runs with new inputs).
A draft never changes an output: the engine verifies it (outputs.py: each drafted position is sampled from
its own logits as a decode step would, and the draft ends at the first token that differs; a sampled
request by speculative sampling, which keeps its distribution), so a draft only decides how many tokens
one forward may yield. Drafts respect cache partitions (`cache_salt`):
a request is never drafted from another partition's tokens.

Adaptive per request (`Draft`): a draft from the tree has the most tokens at once (it is what a request with the
same context produced); the other sources' length grows after a fully accepted draft and shrinks after a
rejected first token; a request whose drafts keep failing (a running mean of accepted tokens per draft below
`PAUSE_BELOW`) stops drafting and tries again after `PAUSE_STEPS` decode steps. Verifying k drafted tokens
costs a batch-1 forward little while the step is memory-bound (SmolLM2-135M, 2 threads, AVX2, 300 tokens of
context, 1 + k tokens vs one: fp32 1.08x for k = 1, 1.36x for 3, 1.93x for 7; bf16 1.24x, 1.57x, 2.49x; up to 8
rows run cpu_linear's small-batch kernel, 9 rows 3.0x / 3.4x), so a first draft from the request's context or
earlier outputs has 3 tokens and longer ones must be earned; the scheduler drafts only for small batches.
"""

from __future__ import annotations

import collections

from ..cache.radix_cache import Node

N_MAX, N_MIN = 4, 2
"""Lengths of the suffix n-grams looked up, longest first (one-token matches draft too often wrongly)."""
FIRST_LENGTH, MAX_LENGTH, MIN_LENGTH = 3, 7, 2
"""Draft lengths (module doc): a verified step of 1 + MAX_LENGTH tokens stays within cpu_linear's small-batch
kernel (8 rows)."""
PAUSE_BELOW, PAUSE_STEPS = 0.25, 16
OUTPUTS_MAX_TOKENS = 1 << 15
"""Earlier outputs kept for drafting, per engine (all partitions together; ~3 index entries of ~200 bytes per
token: ~20 MB at most); the oldest go first."""
OWN_MAX_TOKENS = 1 << 14
"""A request's own context is indexed from this many tokens before its end at its first draft (a longer
prompt's start is not looked in: ~10 MB and ~15 ms at most per drafting request)."""
LEAD = 8
"""Prompt tokens kept before a remembered output, so that an output's first tokens can be drafted."""


class NGrams:
    """The latest occurrence of every n-gram (N_MIN <= n <= N_MAX) of the sequences added that has a
    continuation: n-gram -> (the sequence, the index of the token after it)."""

    def __init__(self):
        self.table: dict[tuple, tuple[list[int], int]] = {}

    def add(self, seq: list[int], start: int = 0) -> None:
        """Index the n-grams of `seq` followed by a token at an index `j >= start` (a sequence that grew since it
        was added is added again with `start` = its old length)."""
        table = self.table
        for j in range(max(start, N_MIN), len(seq)):
            for n in range(N_MIN, min(N_MAX, j) + 1):
                table[tuple(seq[j - n:j])] = (seq, j)

    def lookup(self, context: list[int], k: int, own: bool = False) -> list[int]:
        """Up to `k` tokens that followed the longest suffix of `context` found; [] when none is. `own`: the
        index is `context`'s own, and a match that runs into its end continues into the draft itself (the
        tokens after a repeat repeat too: `a b c a b` drafts `c a b c ...`, not just `c a b`)."""
        for n in range(min(N_MAX, len(context)), N_MIN - 1, -1):
            hit = self.table.get(tuple(context[-n:]))
            if hit is not None:
                seq, j = hit
                out = seq[j:j + k]
                if own and len(out) < k:
                    period = len(out)
                    out.extend(out[i % period] for i in range(period, k))
                return out
        return []


class Draft:
    """A request's drafting state: its own context's n-grams and how well its drafts have done."""

    def __init__(self):
        self.context: list[int] = []  # the request's tokens so far (they only ever grow)
        self.own = NGrams()
        self.length = FIRST_LENGTH
        self.mean_accepted = 1.0
        self.paused = 0  # decode steps left without drafting
        self.off_tree = False  # its context has left the radix tree's paths

    def sync(self, tokens: list[int]) -> None:
        old = len(self.context)
        if len(tokens) > old:
            self.context.extend(tokens[old:])
            self.own.add(self.context, start=old or max(0, len(tokens) - OWN_MAX_TOKENS))

    def record(self, drafted: int, accepted: int) -> None:
        """One verified draft: adapt the length and pause when drafts keep failing (module doc)."""
        if accepted == drafted:
            self.length = min(MAX_LENGTH, self.length + 2)
        elif accepted == 0:
            self.length = max(MIN_LENGTH, self.length // 2)
        self.mean_accepted = 0.75 * self.mean_accepted + 0.25 * accepted
        if self.mean_accepted < PAUSE_BELOW:
            self.paused, self.mean_accepted = PAUSE_STEPS, 1.0


class Drafter:
    """Proposes drafts (module doc) and remembers finished outputs per cache partition."""

    def __init__(self):
        self.outputs: dict[str | None, NGrams] = {}
        self._kept: collections.deque[tuple[str | None, list[int]]] = collections.deque()
        self._kept_tokens = 0

    def propose(self, req, limit: int) -> list[int]:
        """Up to `min(limit, the request's draft length)` tokens to verify after `req`'s tokens ([] for none).
        `req` is decoding (its prompt computed) and holds its tree path (`node`, `tree_len`)."""
        state = req.draft
        if state is None:
            state = req.draft = Draft()
        if state.paused:
            state.paused -= 1
            return []
        k = min(limit, state.length)
        if k <= 0:
            return []
        tokens = req.tokens
        # the tree's continuation is what a request with this very context produced: drafted at full length
        draft = [] if state.off_tree else continuation(req.node, tokens[req.tree_len:], min(limit, MAX_LENGTH))
        state.off_tree = not draft  # once its context leaves the tree it stays out (a walk per step saved)
        if not draft:
            state.sync(tokens)
            draft = state.own.lookup(tokens, k, own=True)
        if not draft and req.salt in self.outputs:
            draft = self.outputs[req.salt].lookup(tokens, k)
        return draft

    def remember(self, salt: str | None, prompt: list[int], output: list[int]) -> None:
        """A finished request's output (with the last LEAD prompt tokens before it), for later drafts."""
        if not output:
            return
        seq = prompt[-LEAD:] + output
        self.outputs.setdefault(salt, NGrams()).add(seq)
        self._kept.append((salt, seq))
        self._kept_tokens += len(seq)
        if self._kept_tokens > OUTPUTS_MAX_TOKENS:
            self._forget_oldest_half()

    def _forget_oldest_half(self) -> None:
        while self._kept_tokens > OUTPUTS_MAX_TOKENS // 2:
            _, seq = self._kept.popleft()
            self._kept_tokens -= len(seq)
        self.outputs = {}
        for salt, seq in self._kept:
            self.outputs.setdefault(salt, NGrams()).add(seq)

    def reset(self) -> None:
        """Forget every remembered output (the cache was cleared)."""
        self.outputs, self._kept, self._kept_tokens = {}, collections.deque(), 0


def continuation(node: Node, tail: list[int], k: int) -> list[int]:
    """Up to `k` tokens that follow `tail` below `node` in its radix tree (the most recently used branch where it
    forks), or [] when `tail` does not continue a path from `node`. Reads only: no split, no LRU touch."""
    key, pos = [], 0  # `key`: the part of the current edge not yet matched
    for t in tail:
        if pos < len(key):
            if key[pos] != t:
                return []
            pos += 1
            continue
        child = node.children.get(t)
        if child is None:
            return []
        node, key, pos = child, child.key, 1
    out = list(key[pos:pos + k])
    while len(out) < k and node.children:
        node = max(node.children.values(), key=lambda c: c.last_access)
        out.extend(node.key[:k - len(out)])
    return out
