"""Scheduler: continuous batching over the radix cache and the KV pool.

Each `schedule()` forms one batch: a decode step for every running request that has sampled a token,
prefill chunks for requests still reading their prompt, then new requests admitted from the waiting
queue, longest cached prefix first, until the token budget is spent.

Decisions and why:
- In-batch dedup: a waiting request whose uncached prefix (>= `dedup_min` tokens) is being computed
  by a request already prefilling waits; its prefix is in the tree a step later and is served from it.
- Prefill tokens are inserted into the tree after every chunk (`Memory.commit`), so concurrent
  requests hit each other's prompts, not only finished ones.
- Memory: every slot and lock change of a request is made by `Memory` (memory.py), with its state.
  Allocation evicts unlocked LRU leaves first. A decode that still finds no slot preempts
  the most recently admitted request: its computed tokens go into the tree (evictable, and reused if
  they survive), and it returns to the front of the queue keeping its generated tokens.
- Invariant 3: at most `len(tokens) - 1` tokens are served from the cache, so the last token is
  always computed and its logits exist (`Request.max_cached`).
- Jump-forward (engine.py) appends tokens a constraint forces; they are computed as one multi-token
  chunk of the running request, exactly like a prefill chunk. Pending forced tokens of a request
  that wants logprobs need the logits of every position from `Request.replay_from`: it is never
  served from the cache past there, and its segments return those rows.
- Speculative decoding (drafts.py; `drafter`, None when off): a decoding request's segment carries a draft
  after its last token while at most SPECULATE_MAX_RUNNING requests run (a step is memory-bound there, so
  verifying a few more tokens costs little), never for a seeded sampled request (its draws must not depend
  on its batch: same seed, same samples), and only into free slots (a draft never evicts cached tokens);
  outputs.py verifies it (greedy: exactly; sampled: by speculative sampling) and frees what it rejects.
- Disk tier (memory.py, disk_tier.py): a waiting request whose cached prefix continues in nodes on disk is
  not admitted while their KV is read back (others keep running); it is admitted once it is in the pool,
  served from there. Reads finished are installed at the start of each `schedule()`.
- Prompt logprobs need the logits of every prompt position, and cached positions have none: a request
  asking for them matches only the positions it already scored (none at first, some after a
  preemption mid-prompt), skips dedup, and still inserts its prompt into the tree for later requests.
"""

from __future__ import annotations

from collections import deque

from .decode.drafts import Drafter
from .cache.memory import Memory
from .decode.sampler import GREEDY_BELOW
from .segment import Segment
from .cache.radix_cache import common_prefix_len
from .request import Request, State


SPECULATE_MAX_RUNNING = 4
MASK_FAST = 0.001  # seconds per mask call: a request whose masks take longer is not drafted for
"""Draft only while this few requests run (module doc)."""


class Scheduler:
    """Owns the queues: `waiting` (WAITING and PREEMPTED requests, in admission order) and `running`
    (RUNNING ones, oldest first). Every memory change of a request goes through `memory`."""

    def __init__(self, memory: Memory, *, max_batch_tokens: int = 1024,
                 max_running: int = 64, dedup_min: int = 8, lookahead: int = 256, carries: bool = False):
        self.memory, self.tree = memory, memory.tree
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.dedup_min = dedup_min
        self.lookahead = lookahead
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.disk_tokens = 0
        self.preemptions = 0
        self.drafter: Drafter | None = None
        self.carries = carries  # segments carry their request's recurrent state (models with recurrent layers)

    # -- a request's life ------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def commit(self, req: Request, seg: Segment) -> None:
        """The batch's forward computed `seg`: its KV is valid (prompt tokens enter the tree). A draft is not
        the request's yet: outputs.py commits each drafted token it accepts (`accept`), then `discard`s."""
        self.memory.commit(req, len(seg.token_ids) - seg.drafted)

    def accept(self, req: Request) -> None:
        """The next drafted token of this step's segment is the request's now (its KV is valid)."""
        self.memory.commit(req, 1)

    def discard(self, req: Request) -> None:
        """Free the slots of the drafted tokens this step rejected (the request runs on); a recurrent state goes
        back to the one after its last accepted token."""
        self.memory.discard(req)
        if self.carries:
            req.carry.rewind(req.num_computed)

    def fork(self, parent: Request, child: Request) -> None:
        """Start sample `child` on `parent`'s computed prompt (it decodes from the next step)."""
        self.memory.fork(parent, child)
        if parent.carry.state is not None:  # the sample continues from the parent's state, as from its KV
            child.carry.state, child.carry.length = parent.carry.state.clone(), parent.carry.length
        self.running.append(child)

    def finish(self, req: Request, state: State, keep: bool) -> None:
        """End `req` in `state` (FINISHED, FAILED or CANCELLED) and release its memory; no-op if it
        already ended (a group ends all its samples; some may be done)."""
        if req.state is State.RUNNING:
            self.running.remove(req)
        elif req.state in (State.WAITING, State.PREEMPTED):
            self.waiting.remove(req)
        else:
            return
        self.memory.release(req, state, keep)
        req.draft = None  # its drafting index (drafts.py) is not needed past here

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.memory.preempt(req)
        self.waiting.appendleft(req)
        self.preemptions += 1

    # -- forming a batch -----------------------------------------------------------------------
    def schedule(self) -> list[tuple[Request, Segment]]:
        if self.memory.loads:
            self.memory.install_loads()
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
            draft = self._draft(req) if remaining == 1 else []
            if draft and self.memory.extend(req, 1 + len(draft)):
                start = req.num_computed
                batch.append((req, Segment([req.tokens[-1], *draft], start, req.kv_slots[:start],
                                           req.kv_slots[start:], needs_logits=True, drafted=len(draft),
                                           carry=req.carry if self.carries else None)))
                budget = max(0, budget - 1 - len(draft))
                i += 1
                continue
            ok = self.memory.extend(req, n)
            while not ok and req.state is State.RUNNING:
                self._preempt(self.running[-1])  # the newest; never one already in this batch
                ok = req.state is State.RUNNING and self.memory.extend(req, n)
            if not ok:
                continue  # `req` itself was preempted: running[i] is the next one
            batch.append((req, self._segment(req, n)))
            budget = max(0, budget - n)
            i += 1
        self._admit(batch, budget)
        return batch

    def _draft(self, req: Request) -> list[int]:
        """A draft for the decoding request `req`, or [] (module doc)."""
        if (self.drafter is None or len(self.running) > SPECULATE_MAX_RUNNING or req.needs_prompt_logits
                or req.mask_seconds > MASK_FAST or req.mask_pending is not None  # its masks would hold up the step
                or (req.params.seed is not None and req.params.temperature >= GREEDY_BELOW)
                or req.num_computed < len(req.prompt_ids)):
            return []
        # tokens one step may append past its own: what max_tokens leaves, and what the pool has free beside
        # a slot for every running request (a draft must not make a neighbour evict or be preempted)
        limit = min(req.params.max_tokens - len(req.output_ids) - 1,
                    self.memory.pool.num_free - len(self.running) - 1)
        return self.drafter.propose(req, limit) if limit > 0 else []

    def _segment(self, req: Request, n: int) -> Segment:
        start = req.num_computed
        tokens = req.tokens
        if self.carries:
            req.carry.tokens = tokens
        return Segment(tokens[start:start + n], start, req.kv_slots[:start], req.kv_slots[start:start + n],
                       needs_logits=start + n == req.num_tokens, all_logits=req.needs_prompt_logits,
                       logits_from=req.replay_from, carry=req.carry if self.carries else None)

    def _admit(self, batch: list, budget: int) -> None:
        if budget <= 0 or not self.waiting or len(self.running) >= self.max_running:
            return
        candidates = list(self.waiting)[:self.lookahead]
        matched = {r.rid: self.memory.cached_prefix(r)[0].numel() for r in candidates}
        candidates.sort(key=lambda r: -matched[r.rid])  # stable: FIFO among equal hits
        prefilling = [r for r in self.running if r.num_computed < len(r.prompt_ids)]
        for req in candidates:
            if budget <= 0 or len(self.running) >= self.max_running:
                break
            m = matched[req.rid]
            tokens = req.tokens
            # (fewer than dedup_min uncached tokens: no request can be computing that many of them)
            if not req.needs_prompt_logits and len(tokens) - m >= self.dedup_min:
                sharing = [(p, c) for p in prefilling if p.salt == req.salt
                           for c in [common_prefix_len(tokens, p.prompt_ids)] if c - m >= self.dedup_min]
                if sharing:
                    if self.carries:  # where it diverges, a snapshot of the state lets it resume
                        for p, c in sharing:
                            p.carry.marks.add(min(c, req.max_cached()))
                    continue  # another request is computing our prefix: hit it next step
            if self.memory.tier_policy is not None and self.memory.load_prefix(req, reserve=len(self.running)):
                continue  # its prefix is being read back from disk: admitted once it is in the pool
            n = self.memory.admit(req, budget, reserve=len(self.running))
            if n == 0:
                break
            if req.cached_tokens is None:
                req.cached_tokens = req.tree_len
                self.prompt_tokens += len(req.prompt_ids)
                self.cached_tokens += req.tree_len
                self.disk_tokens += req.disk_tokens
            self.waiting.remove(req)
            self.running.append(req)
            prefilling.append(req)
            batch.append((req, self._segment(req, n)))
            budget -= n
