"""Scheduler: continuous batching over the radix cache and the KV pool.

Each `schedule()` forms one batch: a decode step for every running request that has sampled a token,
prefill chunks for requests still reading their prompt, then new requests admitted from the waiting
queue, longest cached prefix first, until the token budget is spent.

Decisions and why:
- In-batch dedup: a waiting request whose uncached prefix (>= `dedup_min` tokens) is being computed
  by a request already prefilling waits; its prefix is in the tree a step later and is served from it.
- Prefill tokens are inserted into the tree after every chunk (`cache_computed`), so concurrent
  requests hit each other's prompts, not only finished ones.
- Memory: allocation evicts unlocked LRU leaves first. A decode that still finds no slot preempts
  the most recently admitted request: its computed tokens go into the tree (evictable, and reused if
  they survive), and it returns to the front of the queue keeping its generated tokens.
- Invariant 3: at most `len(tokens) - 1` tokens are served from the cache, so the last token is
  always computed and its logits exist (`Request.max_cached`).
- Prompt logprobs need the logits of every prompt position, and cached positions have none: a request
  asking for them matches only the positions it already scored (none at first, some after a
  preemption mid-prompt), skips dedup, and still inserts its prompt into the tree for later requests.
"""

from __future__ import annotations

from collections import deque

import torch

from .kv_pool import KVPool
from .model_runner import Segment
from .radix_cache import RadixCache, common_prefix_len
from .request import Request


class Scheduler:
    def __init__(self, pool: KVPool, tree: RadixCache, *, max_batch_tokens: int = 1024,
                 max_running: int = 64, dedup_min: int = 8, lookahead: int = 256):
        self.pool, self.tree = pool, tree
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.dedup_min = dedup_min
        self.lookahead = lookahead
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.preemptions = 0

    # -- memory transitions of one request -----------------------------------------------------
    def _alloc(self, n: int, reserve: int = 0) -> torch.Tensor | None:
        short = n + reserve - self.pool.num_free
        if short > 0:
            self.tree.evict(short)
        if self.pool.num_free < n + reserve:
            return None
        return self.pool.alloc(n)

    def _admit_prefix(self, req: Request) -> None:
        slots, node = self.tree.match_prefix(req.tokens[:req.max_cached()], req.salt)
        self.tree.lock(node)
        req.kv_slots, req.node, req.tree_len = slots, node, slots.numel()

    def cache_computed(self, req: Request) -> None:
        """Hand the request's computed tokens to the tree and lock them there (it keeps reading them)."""
        tokens = req.tokens[:req.num_computed]
        existing = self.tree.insert(tokens, req.kv_slots, req.salt)
        self.pool.free(req.kv_slots[req.tree_len:existing])  # computed twice: the tree's copy wins
        slots, node = self.tree.match_prefix(tokens, req.salt)
        self.tree.lock(node)
        if req.node is not None:
            self.tree.unlock(req.node)
        req.kv_slots, req.node, req.tree_len = slots, node, len(tokens)

    def release(self, req: Request, keep: bool) -> None:
        """Drop the request's hold on memory. `keep`: its KV is valid, leave it in the tree for reuse."""
        if keep and req.num_computed > req.tree_len:
            self.cache_computed(req)
        else:
            self.pool.free(req.kv_slots[req.tree_len:])
        if req.node is not None:
            self.tree.unlock(req.node)
        req.kv_slots, req.node, req.tree_len = req.kv_slots[:0], None, 0

    def remove(self, req: Request, keep: bool) -> None:
        if req in self.running:
            self.running.remove(req)
            self.release(req, keep)
        elif req in self.waiting:
            self.waiting.remove(req)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.release(req, keep=True)
        self.waiting.appendleft(req)
        self.preemptions += 1

    # -- forming a batch -----------------------------------------------------------------------
    def schedule(self) -> list[tuple[Request, Segment]]:
        batch: list[tuple[Request, Segment]] = []
        budget = self.max_batch_tokens
        i = 0
        while i < len(self.running):
            req = self.running[i]
            remaining = req.num_tokens - req.num_computed
            n = 1 if remaining == 1 else min(remaining, budget)
            if n == 0:
                i += 1
                continue
            slots = self._alloc(n)
            while slots is None:
                self._preempt(self.running[-1])  # the newest; never one already in this batch
                if req not in self.running:
                    break
                slots = self._alloc(n)
            if slots is None:
                continue
            batch.append((req, self._segment(req, n, slots)))
            budget = max(0, budget - n)
            i += 1
        self._admit(batch, budget)
        return batch

    def _segment(self, req: Request, n: int, slots: torch.Tensor) -> Segment:
        start = req.num_computed
        return Segment(req.tokens[start:start + n], start, req.kv_slots, slots,
                       needs_logits=start + n == req.num_tokens, all_logits=req.needs_prompt_logits)

    def _admit(self, batch: list, budget: int) -> None:
        if budget <= 0 or not self.waiting or len(self.running) >= self.max_running:
            return
        candidates = list(self.waiting)[:self.lookahead]
        matched = {r.rid: self.tree.match_prefix(r.tokens[:r.max_cached()], r.salt)[0].numel() for r in candidates}
        candidates.sort(key=lambda r: -matched[r.rid])  # stable: FIFO among equal hits
        prefilling = [r for r in self.running if r.num_computed < len(r.prompt_ids)]
        for req in candidates:
            if budget <= 0 or len(self.running) >= self.max_running:
                break
            m = matched[req.rid]
            if not req.needs_prompt_logits and any(
                    p.salt == req.salt and common_prefix_len(req.tokens, p.prompt_ids) - m >= self.dedup_min
                    for p in prefilling):
                continue  # another request is computing our prefix: hit it next step
            self._admit_prefix(req)
            n = min(req.num_tokens - req.num_computed, budget)
            slots = self._alloc(n, reserve=len(self.running))
            if slots is None:
                self.tree.unlock(req.node)
                req.kv_slots, req.node, req.tree_len = req.kv_slots[:0], None, 0
                break
            if req.cached_tokens is None:
                req.cached_tokens = req.tree_len
                self.prompt_tokens += len(req.prompt_ids)
                self.cached_tokens += req.tree_len
            self.waiting.remove(req)
            self.running.append(req)
            prefilling.append(req)
            batch.append((req, self._segment(req, n, slots)))
            budget -= n

    # -- inspection ----------------------------------------------------------------------------
    def held_slots(self) -> torch.Tensor:
        parts = [r.kv_slots[r.tree_len:] for r in self.running]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long, device=self.pool.device)
