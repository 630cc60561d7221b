"""What the server tells about its work: `/metrics` (Prometheus), one access-log line per request, and a
periodic throughput / hit-rate line while it is busy.

- `/metrics` is rendered by `prometheus_client` from a registry of this app's own (several apps may live
  in one process). Counters and gauges are read from the engine at scrape time (`kvql_prompt_tokens_total`,
  `kvql_cached_tokens_total`, `kvql_generated_tokens_total`, ... : kvql's remote backend reads those three);
  the cached ones split by where their KV was: `kvql_prompt_tokens_from_ram_total` (in the pool) and
  `kvql_prompt_tokens_from_disk_total` (read back from the disk tier); with a disk tier (`--disk-cache`) its
  `kvql_tier_*` metrics too (TIER), absent without one;
  histograms, per HTTP request that reached the engine: `kvql_time_to_first_token_seconds` (arrival to its
  first generated token), `kvql_e2e_request_latency_seconds` (arrival to its last), and
  `kvql_request_queue_time_seconds` (arrival until the engine admitted it; checked every `POLL_S`, and at
  most its time to first token).
- Access log (logger `kvql.access`, INFO; DEBUG for a 200 from /health and /metrics):
  `METHOD PATH STATUS prompt=P cached=C generated=G S.SSSs`; a request that did not finish (cancelled,
  its client gone) counts what it had generated when it ended.
- Throughput (logger `kvql.server`, INFO), every `interval` seconds when tokens moved: prompt and
  generated tokens per second, the hit rate over the interval (with a disk tier: the share read back from
  disk), running and waiting requests.
"""

from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

access_log = logging.getLogger("kvql.access")
server_log = logging.getLogger("kvql.server")

POLL_S = 0.01
BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
           40.0, 80.0, 160.0)

# name, kind, help, key in Model.stats() (or in the app's own counters, for the first two)
ENGINE = [
    ("kvql_requests", "counter", "Generation requests received", "requests"),
    ("kvql_request_errors", "counter", "Requests answered with an error", "errors"),
    ("kvql_prompt_tokens", "counter", "Prompt tokens of admitted requests", "prompt_tokens"),
    ("kvql_cached_tokens", "counter", "Prompt tokens served from the prefix cache", "cached_tokens"),
    ("kvql_prompt_tokens_from_ram", "counter", "Prompt tokens served from KV in the memory pool", "ram_tokens"),
    ("kvql_prompt_tokens_from_disk", "counter", "Prompt tokens served from KV read back from the disk tier",
     "disk_tokens"),
    ("kvql_computed_tokens", "counter", "Prompt tokens computed (not cached)", "computed_tokens"),
    ("kvql_generated_tokens", "counter", "Tokens generated", "generated_tokens"),
    ("kvql_forced_tokens", "counter", "Generated tokens a constraint forced (jump-forward)", "forced_tokens"),
    ("kvql_drafted_tokens", "counter", "Tokens drafted and verified (speculative decoding)", "drafted_tokens"),
    ("kvql_accepted_tokens", "counter", "Drafted tokens accepted (speculative decoding)", "accepted_tokens"),
    ("kvql_forward_seconds", "counter", "Seconds spent inside the model's forward", "forward_seconds"),
    ("kvql_cache_hit_rate", "gauge", "Cached / prompt tokens since start", "hit_rate"),
    ("kvql_queue_depth", "gauge", "Requests waiting for admission", "waiting"),
    ("kvql_running_requests", "gauge", "Requests in the running batch", "running"),
    ("kvql_preemptions", "counter", "Requests preempted under memory pressure", "preemptions"),
    ("kvql_evicted_tokens", "counter", "Cached tokens evicted", "evictions"),
    ("kvql_cache_bytes", "gauge", "KV cache bytes in use", "cache_bytes"),
    ("kvql_cache_budget_bytes", "gauge", "KV cache budget in bytes", "cache_budget_bytes"),
    ("kvql_locked_nodes", "gauge", "Radix-tree nodes locked by running requests", "locked_nodes"),
    ("kvql_free_slots", "gauge", "Free KV pool slots (tokens)", "free_slots"),
    ("kvql_pool_slots", "gauge", "KV pool size in slots (tokens)", "pool_slots"),
]
TIER = [  # only with a disk tier (`kvql serve --disk-cache`): Model.stats() has its keys then
    ("kvql_tier_tokens", "gauge", "Cached tokens whose KV is only on disk (disk tier)", "tier_tokens"),
    ("kvql_tier_bytes", "gauge", "Disk tier bytes in use", "tier_bytes"),
    ("kvql_tier_budget_bytes", "gauge", "Disk tier budget in bytes", "tier_budget_bytes"),
    ("kvql_tier_written_tokens", "counter", "Tokens of evicted KV written to the disk tier", "tier_written_tokens"),
    ("kvql_tier_read_tokens", "counter", "Tokens of KV read back from the disk tier", "tier_read_tokens"),
    ("kvql_tier_failed_reads", "counter", "Disk tier reads that failed their checks (computed instead)",
     "tier_failed_reads"),
    ("kvql_tier_reads_in_flight", "gauge", "Disk tier reads in flight", "tier_reads_in_flight"),
]


class _EngineCollector:
    def __init__(self, model, counters: dict):
        self.model, self.counters = model, counters

    def collect(self):
        s = {**self.model.stats(), **self.counters}
        for name, kind, help_, key in ENGINE + [t for t in TIER if t[3] in s]:
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(name, help_, value=s[key])

    def describe(self):
        return []


class Metrics:
    """The app's registry, its histograms, and the requests in flight (for queue time and shutdown)."""

    def __init__(self, model, counters: dict):
        self.model = model
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(model, counters))
        self.ttft = Histogram("kvql_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=BUCKETS, registry=self.registry)
        self.e2e = Histogram("kvql_e2e_request_latency_seconds", "Arrival to last generated token",
                             buckets=BUCKETS, registry=self.registry)
        self.queue = Histogram("kvql_request_queue_time_seconds", "Arrival until the engine admitted it",
                               buckets=BUCKETS, registry=self.registry)
        self.flights: set[Flight] = set()
        self._poller: asyncio.Task | None = None

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def flight(self, scope) -> Flight:
        """A flight for the HTTP request of `scope`, kept there too: the access log finishes it (`finish`)
        when the response ends before the request did."""
        f = scope["kvql.flight"] = Flight(self, scope)
        self.flights.add(f)
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll())
        return f

    def cancel_all(self) -> int:
        """Cancel every engine request in flight (at shutdown); -> how many HTTP requests had some."""
        for f in list(self.flights):
            f.cancelled = True
            for g in f.groups:
                self.model.cancel(g)
        return len(self.flights)

    async def _poll(self):
        """Note when each request in flight is first admitted (the engine sets `cached_tokens` then)."""
        while self.flights:
            now = time.perf_counter()
            for f in list(self.flights):
                if f.admitted is None and any(r.cached_tokens is not None for g in f.groups for r in list(g.requests)):
                    f.admitted = now
            await asyncio.sleep(POLL_S)


class Flight:
    """One HTTP request's engine work: its groups, when it arrived, was admitted, got its first token."""

    def __init__(self, metrics: Metrics, scope):
        self.metrics, self.scope = metrics, scope
        self.arrived = scope.get("kvql.arrived") or time.perf_counter()
        self.groups: list = []
        self.admitted = self.first = None
        self.cancelled = False

    def on_update(self, *_):
        if self.first is None:  # engine thread; a float store is atomic
            self.first = time.perf_counter()

    def finish(self, completions) -> None:
        """Record the request's timings and tokens (once; completions may be empty after a failure)."""
        if self not in self.metrics.flights:
            return
        self.metrics.flights.discard(self)
        m, end = self.metrics, time.perf_counter()
        if self.first is not None:
            m.ttft.observe(self.first - self.arrived)
            m.e2e.observe(end - self.arrived)
            admitted = self.admitted if self.admitted is not None else self.first
            m.queue.observe(max(0.0, min(admitted, self.first) - self.arrived))
        record = self.scope.get("kvql.record")
        if record is not None:
            for prompt, cached, generated in self._counts(completions):
                record["prompt"] += prompt
                record["cached"] += cached
                record["generated"] += generated

    def _counts(self, completions):
        """(prompt, cached, generated) tokens per sample: a finished sample's from its completion; one that
        did not finish (a cancelled stream, a client gone, a shutdown) from its engine request as far as it
        got, so that a stream cut after 395 tokens logs them. Prompt and cached count once per prompt."""
        done = {(c.index, c.sample) for c in completions}
        for c in completions:
            first = c.sample == 0
            yield c.prompt_tokens * first, c.cached_tokens * first, len(c.token_ids)
        for g in self.groups:
            for r in list(g.requests):  # (a copy: the engine thread may be adding a fork)
                if (g.index, r.sample) not in done:
                    first = r.sample == 0
                    yield len(g.prompt_ids) * first, (r.cached_tokens or 0) * first, len(r.output_ids)


class AccessLog:
    """ASGI middleware: one line per HTTP request, as the last chunk of its response is sent, or as the
    response ends without one (its client gone mid-stream, an error), counting what was generated."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        scope["kvql.arrived"] = start
        record = scope["kvql.record"] = {"prompt": 0, "cached": 0, "generated": 0}
        status, logged = [500], [False]

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                # logged before the last body chunk goes out: a client that has its whole response can
                # rely on the line being there
                logged[0] = True
                log(scope, status[0], record, start)
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            if not logged[0]:  # the response ended early (its client gone, an error): the line still comes
                flight = scope.get("kvql.flight")
                if flight is not None:  # counts what it generated so far; a no-op once it finished
                    flight.finish(())
                log(scope, status[0], record, start)


QUIET = ("/health", "/metrics")  # polled by monitors: their lines are DEBUG


def log(scope, status: int, record: dict, start: float) -> None:
    level = logging.DEBUG if scope["path"] in QUIET and status == 200 else logging.INFO
    if access_log.isEnabledFor(level):
        access_log.log(level, "%s %s %d prompt=%d cached=%d generated=%d %.3fs", scope["method"], scope["path"], status,
                        record["prompt"], record["cached"], record["generated"], time.perf_counter() - start)


async def throughput_lines(model, interval: float) -> None:
    """Every `interval` seconds in which tokens moved, one line of throughput and hit rate."""
    last, t = model.stats(), time.perf_counter()
    while True:
        await asyncio.sleep(interval)
        s, now = model.stats(), time.perf_counter()
        prompt, cached = s["prompt_tokens"] - last["prompt_tokens"], s["cached_tokens"] - last["cached_tokens"]
        generated = s["generated_tokens"] - last["generated_tokens"]
        if prompt or generated:
            dt = now - t
            disk = s.get("disk_tokens", 0) - last.get("disk_tokens", 0)
            server_log.info("throughput: prompt %.1f tokens/s, generated %.1f tokens/s, hit rate %.0f%%%s, "
                            "%d running, %d waiting, cache %d/%d tokens", prompt / dt, generated / dt,
                            100 * cached / prompt if prompt else 0.0,
                            f" ({100 * disk / prompt:.0f}% from disk)" if "tier_bytes" in s and prompt else "",
                            s["running"], s["waiting"], s["pool_slots"] - s["free_slots"], s["pool_slots"])
        last, t = s, now
