"""What a step does with its logits, request by request: commit each segment's KV, score prompt tokens,
append the pending forced tokens a forward scored, sample the next token (forking a group's siblings after
the prompt), jump forward over the tokens a mask forces, and finish, stream or fail the request. Called by
`Engine.step` with the engine's state held; what the engine module doc says about jump-forward and the
error boundary is done here.

Rows of the logits are addressed by request, never by a running counter: a request that fails or
finishes while the step is being applied must not shift its neighbours' rows. Everything user-supplied
(masks, stop functions, grammar state, stream consumers) runs inside the request's own error boundary
(`_guarded`); the bookkeeping runs first, for every segment, so no failure can leave a segment's slots
unaccounted for.

Masks that are a function of the ids alone are computed off the engine thread (decode/mask_worker.py): a step
(of an engine on its own thread; one that a caller steps waits for every mask, so that its steps depend on no
clock) waits for them at most `MASK_WAIT_MIN` seconds or `MASK_WAIT_SHARE` of its forward's time, whichever is
longer, all requests together, and not at all for a request whose masks take longer than that. A mask asked
by jump-forward that is late lets the request's forward go on without it (its forced tokens, if any, are then
sampled one step each: the same tokens); a mask late at sampling time parks the request with its row of
logits (`parked`) until `resume` finds the mask computed. So a slow constraint slows its own request only;
outputs are the same as with every mask computed in place.
"""

from __future__ import annotations

import concurrent.futures
import time
import traceback

import torch

from .request import Request, RequestGroup, State
from .decode.mask_worker import PENDING, MaskWorker
from .decode.sampler import draw_forced, forced_logprob, forced_token, sample, token_logprobs
from .scheduler import Scheduler

MASK_WAIT_MIN = 0.002  # seconds a step waits for late masks at least (a grammar's mask takes ~0.1 ms) ...
MASK_WAIT_SHARE = 0.25  # ... or this share of its forward's time, if longer


class Outputs:
    """`apply(batch, logits)` after each forward; `fail(group, error, keep)` ends a group. `cancel_later(group)`:
    how a group whose stream consumer is gone gets cancelled (by the engine, at its next step)."""

    def __init__(self, scheduler: Scheduler, tokenizer, device, eos_ids: set[int], cancel_later,
                 bounded_masks: bool = True):
        self.scheduler, self.tokenizer, self.device, self.eos_ids = scheduler, tokenizer, device, eos_ids
        self.cancel_later = cancel_later
        self.jump_forward = True  # append tokens a constraint forces without a decode step each (engine doc)
        self.generated_tokens = 0
        self.forced_tokens = 0
        self.drafted_tokens = 0  # speculative decoding: tokens drafted and verified, and those accepted
        self.accepted_tokens = 0
        self.masks = MaskWorker()
        self.parked: dict[Request, torch.Tensor] = {}  # requests whose mask was late, with their row of logits
        self._deadline = 0.0  # until when this step waits for late masks (module doc)
        self.bounded_masks = bounded_masks  # False: wait for every mask (steps then depend on no clock)

    def _wait(self, req: Request) -> float | None:
        """How long to wait for `req`'s mask now: what is left of the step's budget, or nothing where its masks
        are known to take longer than that (module doc); None: as long as it takes."""
        if not self.bounded_masks:
            return None
        left = self._deadline - time.monotonic()
        return left if req.mask_seconds <= left else 0.0

    def apply(self, batch: list, outputs: list, forward_seconds: float = 0.0) -> None:
        """`batch`: (request, segment) pairs of a step; `outputs`: each segment's logits (or None);
        `forward_seconds`: how long the step's forward took (what late masks may add: module doc)."""
        self._deadline = time.monotonic() + max(MASK_WAIT_MIN, MASK_WAIT_SHARE * forward_seconds)
        rows = {}
        for (req, seg), logits in zip(batch, outputs):
            self.scheduler.commit(req, seg)
            if seg.all_logits:
                self._score_prompt(req, seg, logits)
            if logits is not None:
                rows[req] = (seg, logits)
        for req, (seg, logits) in rows.items():
            if not req.group.closed:  # a sibling may have failed it earlier in this loop
                self._guarded(req, lambda: self._advance(req, seg, logits))

    def resume(self) -> None:
        """Sample the parked requests whose mask is computed now (module doc); drop those that ended or were
        preempted (a preempted one is computed again and gets a new row)."""
        self._deadline = time.monotonic() + MASK_WAIT_MIN
        for req, row in list(self.parked.items()):
            if req.state is not State.RUNNING or req.num_computed < req.num_tokens:
                del self.parked[req]
            elif req.mask_pending is None or req.mask_pending[1].done():
                del self.parked[req]
                self._guarded(req, lambda: self._sample(req, row))

    def wait_parked(self, timeout: float) -> None:
        """Wait until a parked request's mask is computed, at most `timeout` seconds."""
        futures = [r.mask_pending[1] for r in self.parked if r.mask_pending is not None]
        if futures:
            concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    @staticmethod
    def _score_prompt(req: Request, seg, logits: torch.Tensor) -> None:
        """Append the prompt logprobs this segment's logits give: row j (position `start + j`) scores
        prompt token `start + j + 1`; rows for entries already present (recomputed after a
        preemption) are skipped."""
        have, prompt = len(req.prompt_logprobs), req.prompt_ids
        first = have - 1 - seg.start
        assert first >= 0, "a prompt position without logits was served from the cache"
        end = min(len(seg.token_ids), len(prompt) - 1 - seg.start)
        if end > first:
            targets = prompt[seg.start + first + 1:seg.start + end + 1]
            req.prompt_logprobs.extend(token_logprobs(logits[first:end], targets, req.params.prompt_logprobs))

    def _advance(self, req: Request, seg, logits: torch.Tensor) -> None:
        """Use one segment's logits: append the pending forced tokens they score, then, at the end
        of the request's tokens, sample its next token (and fork its `n - 1` siblings after the
        prompt)."""
        if req.forced:
            self._replay(req, seg, logits)
        if seg.drafted and req.state is State.RUNNING:
            self._verify(req, seg, logits)
        elif seg.needs_logits and req.state is State.RUNNING:
            self._sample(req, logits[-1])

    def _guarded(self, req: Request, run) -> None:
        """The request's error boundary: whatever the caller supplied raises in `run()` fails this group
        alone, with its KV kept in the tree (the forward was valid), and never the step."""
        group = req.group
        try:
            run()
        except BaseException as e:  # even SystemExit from a callback must not end the engine thread
            e.add_note(f"kvql: request {req.rid} failed while sampling:\n{traceback.format_exc(limit=3)}")
            if not isinstance(e, Exception):  # asyncio and thread pools treat those as "stop the program"
                wrapped = RuntimeError(f"a callback of request {req.rid} raised {e!r}")
                wrapped.__cause__, e = e, wrapped
            self.fail(group, e, keep=True)

    def _sample(self, req: Request, row: torch.Tensor) -> None:
        """Sample `req`'s next token from `row` (forking its siblings after the prompt), then jump forward."""
        group = req.group
        self.parked.pop(req, None)
        req.vocab_size = row.numel()
        mask = req.params.mask
        known = req.next_allowed
        if getattr(mask, "jump_forward", False) and (known is None or known[0] != len(req.output_ids)):
            allowed = self.masks.ask(req, req.output_ids, self._wait(req))
            if allowed is PENDING:  # late: park the row (module doc)
                self.parked[req] = row.clone()
                return
            known = req.next_allowed = (len(req.output_ids), allowed)
        token, logprob = sample(row, req)
        forks = []
        if not req.forked:
            req.forked = True
            for i in range(1, req.params.n):
                sib = Request(group, i, self.tokenizer, self.device)
                sib.vocab_size = row.numel()
                sib.next_allowed = known  # the same history (none yet): the same mask result
                forks.append((sib, *sample(row, sib)))
        for sib, _, _ in forks:  # share the prompt's KV: it is in the tree, each sibling locks it
            sib.cached_tokens, sib.disk_tokens = req.cached_tokens, req.disk_tokens
            sib.prompt_logprobs = req.prompt_logprobs
            group.requests.append(sib)
            self.scheduler.fork(req, sib)
        self._append(req, token, logprob)
        self._jump(req)
        for sib, tok, lp in forks:
            if not group.closed:
                self._append(sib, tok, lp)
                self._jump(sib)

    def _verify(self, req: Request, seg, logits: torch.Tensor) -> None:
        """Speculative decoding: row i of `logits` follows the segment's i-th drafted position; sample from
        each in turn as a decode step would (mask, penalties, stops, max_tokens, jump-forward; sampled
        requests by speculative sampling, `sampler.sample`'s `draft`), keep each drafted token the sample
        equals (its KV is valid), and stop at the first that differs: that sample is the step's last token.
        So greedy outputs are those of one decode step per token, and sampled ones have their distribution.
        The rejected drafted tokens' slots are freed. Any append may end the request (a stop, `max_tokens`, a
        forced end): `scheduler.finish` then releases its memory and drops `req.draft`, so the drafting state
        this step reports to is taken first and nothing below touches the request's memory once it ended."""
        state = req.draft
        draft = seg.token_ids[-seg.drafted:]
        req.vocab_size = logits.shape[-1]
        req.drafted_tokens += seg.drafted  # now: an append below may finish the request (its completion made)
        self.drafted_tokens += seg.drafted
        accepted = 0
        for i in range(seg.drafted + 1):
            token, logprob = sample(logits[i], req, draft[i] if i < seg.drafted else None)
            self._append(req, token, logprob)
            if req.state is not State.RUNNING:
                break
            hit = i < seg.drafted and token == draft[i]
            if hit:
                self.scheduler.accept(req)
                accepted += 1
                req.accepted_at.append(len(req.output_ids) - 1)
            length = req.num_tokens
            self._jump(req)
            # a miss ends the draft; so do tokens the constraint forced after a hit (computed next step, a chunk)
            if not hit or req.num_tokens != length or req.state is not State.RUNNING:
                break
        self.accepted_tokens += accepted
        state.record(seg.drafted, accepted)
        if req.state is State.RUNNING:
            self.scheduler.discard(req)

    def _jump(self, req: Request) -> None:
        """Jump-forward: while the mask allows exactly one token after `req`'s tokens, take it (module
        doc). The mask result that leaves a choice is kept for `sample` (`Request.next_allowed`)."""
        p = req.params
        if not self.jump_forward or not getattr(p.mask, "jump_forward", False):
            return
        keep_pending = p.logprobs is not None  # its forced tokens wait for the rows that score them
        while req.state is State.RUNNING and len(req.output_ids) + len(req.forced) < p.max_tokens:
            history = req.output_ids + req.forced
            allowed = self.masks.ask(req, history, self._wait(req))
            if allowed is PENDING:  # late: the forward goes on; sampling waits for it (module doc)
                return
            token = forced_token(allowed, req.vocab_size)
            ends = token in self.eos_ids and not p.ignore_eos
            if token is None or (ends and req.forced):  # a choice, or an end that waits for its turn
                req.next_allowed = (len(history), allowed)
                return
            draw_forced(req, token, req.vocab_size)
            self.forced_tokens += 1
            req.forced_tokens += 1
            if not ends or p.ignore_eos:
                req.forced_at.append(len(history))
            if keep_pending and not ends:
                req.forced.append(token)
            else:  # needs no logits: appended now, exactly as `sample` would have returned it
                self._append(req, token, None)

    def _replay(self, req: Request, seg, logits: torch.Tensor) -> None:
        """Append the pending forced tokens whose scoring rows (the logits of the position before
        each) this segment computed, with the logprob entry `sample` would have given them."""
        end = seg.start + len(seg.token_ids)
        first = end - logits.shape[0]  # the position of the first row
        while req.forced and req.state is State.RUNNING:
            at = req.replay_from  # the row that scores the first pending token
            if not first <= at < end:
                return
            token = req.forced[0]
            entry = forced_logprob(logits[at - first], req, token)
            req.forced.pop(0)  # into output_ids: `tokens` stays the same sequence
            self._append(req, token, entry)
        # the run ended at a choice (its mask result waits in `next_allowed`) or at max_tokens

    def _append(self, req: Request, token: int, logprob) -> None:
        p = req.params
        self.generated_tokens += 1
        if token in self.eos_ids and not p.ignore_eos:
            req.finish_reason = "stop"
        else:
            req.output_ids.append(token)
            if logprob is not None:
                req.logprobs.append(logprob)
            req.detok.append(token)
            if req.detok.stopped or (p.stop_fn is not None and p.stop_fn(req.output_ids, req.detok.text)):
                req.finish_reason = "stop"
            elif len(req.output_ids) >= p.max_tokens:
                req.finish_reason = "length"
        done = req.finish_reason is not None
        group = req.group
        if done:
            self.scheduler.finish(req, State.FINISHED, keep=True)
            group.completions[req.sample] = req.completion()
            if self.scheduler.drafter is not None:
                self.scheduler.drafter.remember(req.salt, req.prompt_ids, req.output_ids)
        if group.on_update is not None:
            try:
                group.on_update(req.sample, req.detok.pop_stream_delta(done), token,
                                group.completions[req.sample] if done else None)
            except Exception:  # the consumer is gone (e.g. its event loop closed): stop generating
                self.cancel_later(group)
        if done and all(c is not None for c in group.completions):
            group.close()
            group.future.set_result(list(group.completions))

    def fail(self, group: RequestGroup, error: BaseException, keep: bool) -> None:
        """End every request of the group (idempotent; CANCELLED for a CancelledError, else FAILED)
        and resolve its future with `error`."""
        state = State.CANCELLED if isinstance(error, concurrent.futures.CancelledError) else State.FAILED
        for req in group.requests:
            self.scheduler.finish(req, state, keep=keep)
        if not group.closed:
            group.close()
            group.future.set_exception(error)
