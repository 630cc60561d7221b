"""Engine: the step loop that ties scheduler, model runner and sampler together.

Requests are submitted from any thread; one engine thread runs `step()` while there is work, so
calls from many threads or asyncio tasks are batched together. All engine state is touched only
with `_state` held (the engine thread during a step; `stats()`, `clear_cache()`, `save_cache()` and
`check_integrity()` between steps).

Invariants (`check_integrity` asserts them between steps; tests call it):
1. a node's slots are never freed while a request locks the node or a descendant: a running
   request's `kv_slots[:tree_len]` are exactly the slots of its tree path, and every node's lock
   count is the number of running requests whose path passes through it;
2. free slots + slots held by the tree + running requests' own slots = pool size, no slot twice;
3. at most `len(prompt) - 1` prompt tokens are served from the cache, and a running request always
   has its last token left to compute (`Request.max_cached`), or holds that token's logits while its
   mask is computed (outputs.py: parked);
4. each request's positions continue from its own cached length: its tree path spells its own
   first `tree_len` tokens, and it has one slot per computed token;
5. greedy output with the cache is token-identical to the uncached reference (tests/test_exactness.py);
6. when no request is running, no node is locked; a finished, failed or cancelled request holds nothing.
Request states and every slot and lock transition: memory.py.

Jump-forward (`jump_forward`, on by default; for masks that opt in, `request.MaskFn`, as grammar
masks do): after each appended token, while the request's mask allows exactly one token, that token
is forced: it is appended at once (stop strings, `stop_fn`, `max_tokens`, EOS and streaming see it
exactly as if it had been sampled), and the forced run is computed in the request's next forward as
one chunk (scheduled like a prefill chunk), instead of one decode step per token. Outputs
are the same as without it, sampled ones included: `sample` would pick the only allowed token, and
`sampler.draw_forced` consumes the same random draw `sample` would. The mask is called once per
history, as without it (the call that finds a choice is handed on to `sample`). A request that wants
logprobs keeps its forced tokens pending (`Request.forced`) until the forward computed the rows
that score them; they are then appended, with the logprob `sample` would have given them, computed
from that forward's logits. Stops are then seen a forward later, so tokens after a stop may have been
computed (their KV is cached under their own ids, never shown). `Request.forced_tokens` and the stat
`forced_tokens` count the tokens appended this way (a forced EOS that ends the request included).

Speculative decoding (`speculate`, on by default; drafts.py, scheduler.py, outputs.py): while few requests
run, a decoding request's forward also scores tokens drafted from the tree, its own context and earlier
outputs; each drafted position is sampled as a decode step would sample it and the draft ends at the first
token that differs, so outputs are those without it (greedy: token for token; unseeded sampling: the same
distribution; seeded requests are not drafted). `stats()` counts `drafted_tokens` and `accepted_tokens`.

Disk tier (`disk_cache`, disk_tier.py; tier_policy.py and memory.py say how the tree and the scheduler use
it; persistence.py how it is opened and saved): KV evicted from the pool is written to files and read back
instead of computed again; at start the tree is rebuilt from the tier's files (every node on disk, read back
when a request needs it), and `save_cache` (when idle every `save_interval` seconds, and at `close`) writes
what is only in the pool there too, so the next start finds the whole cache. `stats()`: `disk_tokens` (prompt
tokens served from the cache that were read back from disk for the request), `tier_*`.

OpenMP workers (openmp.py): with more OpenMP threads alive than CPUs, GNU libgomp's workers sleep
between parallel regions, and every region of a forward then pays a wake-up (measured: docs/benchmarks.md,
Design measurements). So the engine thread releases its pool when it goes idle, and
a thread that loads the model, submits work or runs an entry point that computes on its own thread
(`clear_cache`, `save_cache`, `check_integrity`, `close`) releases its own afterwards.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import threading
import time
import traceback
import weakref

import torch  # noqa: F401 -- before the atexit registration below, so that ours runs before torch's

from .decode.drafts import Drafter
from .cache.kv_pool import KVPool
from .cache.memory import Memory
from .model.model_runner import ModelRunner
from .cache.radix_cache import RadixCache
from .cache.state_snapshots import StateSnapshots
from .request import Request, RequestGroup, SamplingParams
from .outputs import Outputs
from .cache.autosave import Autosave
from .cache.persistence import Persistence
from .scheduler import Scheduler
from .model import gguf_weights, quantized
from . import openmp, sizing
from .slow_notice import said_when_slow
from .request_builder import Built, RequestBuilder
from .turns import Turns


_engines: "weakref.WeakSet[Engine]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    # Join engine threads before the interpreter tears torch down under them (which aborts).
    for engine in list(_engines):
        engine.close()


class Engine:
    def __init__(self, hf_model, tokenizer, *, cache_budget: int | None = None, max_batch_tokens: int = 1024,
                 max_running: int = 64, background: bool = True, speculate: bool = True, disk_cache=None,
                 disk_budget: int = 0, save_interval: float = 300.0, weights: str | None = None, gguf=None):
        """`cache_budget`: bytes for the K/V pool and, for a model with recurrent layers, its states' snapshots and
        running states (sizing.py; default: `sizing.default_budget`); a model the engine cannot run raises
        `admission.UnsupportedModel`, saying why. `weights` ("gguf" with `gguf` the model's `GGUFFile`, "int8",
        "int4"): its linear layers on quantized weights first (model/quantized.py; `quantization` says what was
        done, one line), what the file's blocks did not take filled from the file. `disk_cache`: a directory for
        the disk tier (module doc), holding at most `disk_budget` bytes, written to every `save_interval` seconds
        when idle (0: at `close` only)."""
        config = hf_model.config
        self.tokenizer = tokenizer
        self.quantization = None if weights is None else quantized.apply(hf_model, weights, gguf).line()
        if gguf is not None:
            gguf_weights.fill(hf_model, gguf)  # what the loader left to the blocks and apply did not take
        self.device = next(hf_model.parameters()).device  # (the loader's blocks were on the meta device)
        budget = sizing.default_budget(self.device) if cache_budget is None else cache_budget
        sizes = sizing.size(hf_model, budget, max_running)
        geometry = sizes.geometry
        self.pool = KVPool(num_layers=len(geometry.layers), kv_heads=geometry.kv_heads, head_dim=geometry.head_dim,
                           v_dim=geometry.v_dim, num_slots=sizes.num_slots, dtype=hf_model.dtype, device=self.device)
        self.tree = RadixCache(self.pool.free, self.device)
        # a model with recurrent layers reuses a prefix from a snapshot of its state after it
        snapshots = StateSnapshots(sizes.snapshot_bytes) if geometry.recurrent else None
        self.memory = Memory(self.pool, self.tree, snapshots)
        self.scheduler = Scheduler(self.memory, max_batch_tokens=max_batch_tokens, max_running=sizes.max_running,
                                   carries=snapshots is not None)
        self.runner = ModelRunner(hf_model, self.pool, geometry, snapshots)
        with said_when_slow("checking the model's cached path against its own forward (the load check)"):
            self.runner.verify()
        eos = config.eos_token_id if config.eos_token_id is not None else tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
        text = config.get_text_config()
        # the model's own maximum: sliding-window layers read their window, the pool keeps every token
        self.requests = RequestBuilder(tokenizer, self.eos_ids, int(text.vocab_size),
                                       int(getattr(text, "max_position_embeddings", None) or 2048), self.pool)
        self.background = background  # False: the caller drives `step()` (tests, deterministic stagger)
        self.outputs = Outputs(self.scheduler, tokenizer, self.device, self.eos_ids, self._cancel_later,
                               bounded_masks=background)
        self._drafter = Drafter()
        self.speculate = speculate
        self.steps = 0
        self.mixed_steps = 0  # steps whose batch held both prefill chunks and decode steps
        self.max_batch_requests = 0
        self._state = Turns()  # fair to inspectors between steps (turns.py)
        self._wake = threading.Condition()
        self._inbox: list[RequestGroup] = []
        self._cancels: list[RequestGroup] = []
        self._thread: threading.Thread | None = None
        self._closed = False
        self.persistence = Persistence(self._state, self.tree, self.memory, self.pool, self.runner, tokenizer)
        opened = disk_cache is not None and self.persistence.open(disk_cache, disk_budget)
        self._autosave = Autosave(self, save_interval) if opened and save_interval > 0 else None
        _engines.add(self)
        self._release_caller_openmp()  # this thread loaded the model (and packed its weights)

    def _cancel_later(self, group: RequestGroup) -> None:
        with self._wake:
            self._cancels.append(group)

    @property
    def speculate(self) -> bool:
        """Speculative decoding without a draft model (drafts.py, scheduler.py): a decoding request verifies
        drafted tokens in its step while few requests run; outputs unchanged."""
        return self.scheduler.drafter is not None

    @speculate.setter
    def speculate(self, on: bool) -> None:
        # a recurrent state cannot be rolled back past a rejected draft: its mixers on the ragged path keep the
        # states after each drafted token (recurrent_mixers.Step); the own forward does not: never on there
        rewinds = not self.runner.geometry.recurrent or self.runner.mixers is not None
        self.scheduler.drafter = self._drafter if on and rewinds else None

    @property
    def jump_forward(self) -> bool:
        """Append the tokens a constraint forces without a decode step each (module doc); on by default."""
        return self.outputs.jump_forward

    @jump_forward.setter
    def jump_forward(self, on: bool) -> None:
        self.outputs.jump_forward = on

    def _release_caller_openmp(self) -> None:
        """The calling thread's OpenMP workers go, unless it is the one computing (module doc)."""
        if self.background and threading.current_thread() is not self._thread:
            openmp.release()

    # -- submission (any thread) ---------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, *, index: int = 0,
               on_update=None, cache_salt: str | None = None) -> RequestGroup:
        """Queue one prompt; returns its group, whose future only the engine resolves (cancel with
        `cancel`: the future itself cannot be cancelled, so no other thread changes a request's
        state in the middle of a step). `cache_salt` partitions the prefix cache: requests share
        cached tokens only with requests of the same salt (None: the shared default partition)."""
        group = RequestGroup(list(prompt_ids), params, index, on_update, cache_salt)
        self._release_caller_openmp()  # this thread now waits for the engine's
        with self._wake:
            if self._closed:
                raise RuntimeError("engine is closed")
            self._inbox.append(group)
            self._wake.notify_all()
            if self.background and (self._thread is None or not self._thread.is_alive()):
                # under the lock: concurrent first submits must not start two engine threads
                self._thread = threading.Thread(target=self._loop, name="kvql-engine", daemon=True)
                self._thread.start()
        return group

    def submit_all(self, built: Built, on_update=None) -> list[RequestGroup]:
        """Queue a request `self.requests` built: one group per prompt, in order."""
        return [self.submit(ids, built.params[i], index=i, on_update=on_update, cache_salt=built.cache_salt)
                for i, ids in enumerate(built.ids)]

    def cancel(self, group: RequestGroup) -> None:
        """Cancel a group; its future fails with CancelledError, its KV stays cached, locks are released."""
        with self._wake:
            self._cancels.append(group)
            self._wake.notify_all()

    def _loop(self) -> None:
        while True:
            with self._wake:
                if self._nothing_to_do():
                    openmp.release()  # idle: hold no OpenMP workers, which would slow other threads' (openmp.py)
                while self._nothing_to_do():
                    self._wake.wait()
                if self._closed:
                    return
            try:
                self.step()
            except Exception as e:  # a bug, not a request's fault: fail what is in flight, keep serving
                traceback.print_exc()
                with self._state:
                    for req in list(self.scheduler.running) + list(self.scheduler.waiting):
                        self.outputs.fail(req.group, e, keep=False)

    def _nothing_to_do(self) -> bool:  # (with `_wake` held)
        return not (self._inbox or self._cancels or self.has_work() or self._closed)

    @property
    def closed(self) -> bool:
        return self._closed

    @openmp.releases_caller
    def close(self) -> None:
        """Stop the engine thread after its current step; pending requests are cancelled."""
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        if self._autosave is not None:
            self._autosave.stop()  # before taking the engine: a save it runs takes it too
        with self._state:
            self._take_inbox()
            for req in list(self.scheduler.running) + list(self.scheduler.waiting):
                self.outputs.fail(req.group, concurrent.futures.CancelledError(), keep=True)
            self.outputs.masks.close()
            self.persistence.close()

    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def idle(self) -> bool:
        """True when nothing is queued, cancelled-but-unprocessed, waiting or running."""
        with self._wake:
            return not (self._inbox or self._cancels or self.has_work())

    def run_until_idle(self, max_steps: int = 100_000) -> None:
        """Drive the engine from the calling thread until every submitted request is done."""
        for _ in range(max_steps):
            self.step()
            if self.idle():
                return
        raise RuntimeError(f"engine still busy after {max_steps} steps")

    # -- one step --------------------------------------------------------------------------------
    def step(self) -> None:
        """One batch: schedule -> forward -> commit and process the outputs (outputs.py)."""
        with self._state.for_step():
            self._take_inbox()
            self.outputs.resume()  # requests whose late mask is computed now (outputs.py)
            batch = self.scheduler.schedule()
            if not batch:  # requests wait for KV read back from disk, or for their masks (no busy loop)
                if self.outputs.parked:
                    self.outputs.wait_parked(0.05)
                else:
                    self.memory.wait_loads(0.05)
                return
            self.steps += 1
            decodes = sum(1 for req, _ in batch if req.num_computed >= len(req.prompt_ids))
            self.mixed_steps += 0 < decodes < len(batch)
            self.max_batch_requests = max(self.max_batch_requests, len(batch))
            started = time.monotonic()
            try:
                outputs = self.runner.forward([seg for _, seg in batch])
            except Exception as e:  # the whole batch failed; its KV writes are discarded (slots freed)
                for req, seg in batch:
                    self.outputs.fail(req.group, e, keep=False)
                return
            self.outputs.apply(batch, outputs, time.monotonic() - started)

    def _take_inbox(self) -> None:
        with self._wake:
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
        for group in inbox:
            if group.cancelled:
                continue
            req = Request(group, 0, self.tokenizer, self.device)
            group.requests.append(req)
            self.scheduler.add(req)
        for group in cancels:
            group.cancelled = True
            self.outputs.fail(group, concurrent.futures.CancelledError(), keep=True)

    @openmp.releases_caller
    def save_cache(self) -> dict:
        """What only the pool holds written to the disk tier now (`Persistence.save_cache`)."""
        return self.persistence.save_cache()

    @property
    def saves(self) -> int:
        """`save_cache` calls done (autosaves and the one at `close` included)."""
        return self.persistence.saves

    # -- inspection (any thread; waits for the current step) -----------------------------------
    @openmp.releases_caller
    def clear_cache(self) -> int:
        with self._state:
            self._drafter.reset()
            if self.memory.snapshots is not None:
                self.memory.snapshots.clear()
            return self.tree.reset()

    def stats(self) -> dict:
        """Counters and gauges, every one >= 0: `disk_tokens <= cached_tokens <= prompt_tokens` (a token read back
        counts only where admission served it: memory.py), `computed_tokens = prompt_tokens - cached_tokens`,
        `hit_rate` in [0, 1]; idle (nothing waiting, running or read back), `cache_tokens + free_slots = pool_slots`
        and no node locked (tests/test_tier_snapshot_damage.py: check_stats)."""
        with self._state:
            s = self.scheduler
            slot_bytes = self.pool.bytes // self.pool.num_slots
            return {
                "prompt_tokens": s.prompt_tokens,
                "cached_tokens": s.cached_tokens,
                "disk_tokens": s.disk_tokens,
                "computed_tokens": s.prompt_tokens - s.cached_tokens,
                "generated_tokens": self.outputs.generated_tokens,
                "forced_tokens": self.outputs.forced_tokens,
                "drafted_tokens": self.outputs.drafted_tokens,
                "accepted_tokens": self.outputs.accepted_tokens,
                "forward_tokens": self.runner.forward_tokens,
                "hit_rate": s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
                "cache_tokens": self.tree.total_tokens,
                "cache_bytes": (self.pool.num_slots - self.pool.num_free) * slot_bytes,
                "cache_budget_bytes": self.pool.bytes,
                "pool_slots": self.pool.num_slots,
                "free_slots": self.pool.num_free,
                "evictions": self.tree.evicted_tokens,
                "preemptions": s.preemptions,
                "locked_nodes": self.tree.num_locked_nodes(),
                "tree_nodes": self.tree.num_nodes(),
                "waiting": len(s.waiting),
                "running": len(s.running),
                "steps": self.steps,
                "mixed_steps": self.mixed_steps,
                "max_batch_requests": self.max_batch_requests,
                "forward_seconds": self.runner.forward_seconds,
                **self._tier_stats(),
                **self._snapshot_stats(),
            }

    @property
    def tier(self):
        """The disk tier (`cache.disk_tier.DiskTier`) behind the cache, or None: memory only."""
        policy = self.memory.tier_policy
        return None if policy is None else policy.disk

    def _tier_stats(self) -> dict:
        tier = self.tier
        if tier is None:
            return {}
        return {"tier_tokens": self.tree.disk_tokens, "tier_bytes": tier.bytes, "tier_budget_bytes": tier.budget,
                "tier_written_tokens": tier.written_tokens, "tier_read_tokens": tier.read_tokens,
                "tier_failed_reads": tier.failed_reads, "tier_reads_in_flight": len(self.memory.loads)}

    def _snapshot_stats(self) -> dict:
        snapshots = self.memory.snapshots
        if snapshots is None:
            return {}
        return {"snapshots": len(snapshots), "snapshot_bytes": snapshots.bytes, "snapshot_budget_bytes":
                snapshots.budget, "snapshots_taken": snapshots.puts, "snapshot_resumes": snapshots.hits,
                # the running requests' states, reserved from the cache budget for `max_running` of them
                "running_state_bytes": self.runner.geometry.state_bytes * self.scheduler.max_running}

    @openmp.releases_caller
    def check_integrity(self, full: bool = True) -> None:
        """Assert the invariants (module docstring). `full=False` checks only slot counts and the
        running requests' own fields (O(running requests), cheap enough for a health probe);
        `full=True` also walks the tree, every slot, every lock and every request's tree path."""
        with self._state:
            s = self.scheduler
            if full:
                self.tree.check_integrity()
            self.memory.check_integrity(s.running, s.waiting, full, parked=self.outputs.parked.keys())
