"""Soak: `kvql serve` under streamed, cancelled and `n >= 2` requests for a long time, its RSS sampled.

Clients (threads, one `httpx` client each) loop over four kinds of request on few-shot prompts with a varied
question (so the radix tree keeps growing and evicting under the cache budget):
- `stream`: a streamed completion read to its end;
- `cancel`: a streamed completion closed after its first 1-3 events (the server cancels it);
- `n`: a non-streamed completion with n = 2 or 3 (greedy or sampled; speculation drafts on greedy ones);
- `stream_n`: a streamed chat completion with n = 2.
The server's RSS (/proc/PID/status VmRSS) and its /health are sampled every `--every` seconds. The report:
requests and errors per kind, RSS over the first and the last `--window` minutes after the warm-up (`--warmup`,
10 minutes: the KV pool's pages and the drafter's index of earlier outputs fill first), and the slope of a
least-squares line over the time after the warm-up (MiB per 10 minutes). A server whose RSS keeps growing shows
a positive slope well above the noise of a flat one (a few MiB).

Usage: python benchmarks/soak.py [--minutes 30] [--model smollm2-135m] [--dtype float32] [--clients 6]
       [--cache-budget 256MB] [--no-speculate] [--out soak.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from serve_http import free_port, wait_healthy  # noqa: E402

PREFIX = ("Q: What is the capital of France?\nA: Paris\nQ: What is the capital of Japan?\nA: Tokyo\n"
          "Q: What is the capital of Kenya?\nA: Nairobi\n")
WORDS = "river stone cloud garden mountain letter window harbor forest lantern signal orchard".split()
KINDS = ("stream", "cancel", "n", "stream_n")


def prompt(rng: random.Random) -> str:
    return PREFIX + f"Q: What is the capital of the {' '.join(rng.sample(WORDS, 3))} country?\nA:"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


class Counts:
    def __init__(self):
        self.lock = threading.Lock()
        self.done = {k: 0 for k in KINDS}
        self.errors: dict[str, list[str]] = {k: [] for k in KINDS}

    def add(self, kind: str, error: str | None) -> None:
        with self.lock:
            self.done[kind] += 1
            if error is not None:
                self.errors[kind].append(error)


def one(client: httpx.Client, url: str, kind: str, rng: random.Random) -> str | None:
    """Send one request of `kind`; -> None when it went as it should, else what went wrong."""
    if kind in ("stream", "cancel"):
        body = {"prompt": prompt(rng), "max_tokens": 24, "stream": True, "temperature": rng.choice([0, 0.8])}
        with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return f"{kind}: HTTP {r.status_code}"
            events, stop_after = 0, rng.randint(1, 3)
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    if '"error"' in line:
                        return f"{kind}: error event {line[:200]}"
                    events += 1
                    if kind == "cancel" and events >= stop_after:
                        return None  # leaving the block closes the connection: the server cancels
                elif line == "data: [DONE]":
                    return None
            return f"{kind}: the stream ended without [DONE]"
    if kind == "n":
        n = rng.choice([2, 3])
        body = {"prompt": prompt(rng), "max_tokens": 16, "n": n, "temperature": rng.choice([0, 0.8])}
        r = client.post(url + "/v1/completions", json=body)
        if r.status_code != 200:
            return f"n: HTTP {r.status_code} {r.text[:200]}"
        return None if len(r.json()["choices"]) == n else f"n: {len(r.json()['choices'])} choices for n={n}"
    body = {"messages": [{"role": "user", "content": prompt(rng)}], "max_tokens": 16, "n": 2, "stream": True,
            "temperature": rng.choice([0, 0.8])}
    with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return f"stream_n: HTTP {r.status_code}"
        lines = [line for line in r.iter_lines() if line]
    if any('"error"' in line for line in lines):
        return "stream_n: error event"
    return None if lines and lines[-1] == "data: [DONE]" else "stream_n: no [DONE]"


def client_loop(url: str, seed: int, until: float, counts: Counts) -> None:
    rng = random.Random(seed)
    with httpx.Client(timeout=300) as client:
        i = seed
        while time.monotonic() < until:
            kind = KINDS[i % len(KINDS)]
            i += 1
            try:
                error = one(client, url, kind, rng)
            except httpx.HTTPError as e:
                error = f"{kind}: {type(e).__name__} {e}"
            counts.add(kind, error)


def summary(samples: list[tuple[float, float]], warmup: float, window: float) -> dict:
    """RSS (MiB) over the first and last `window` seconds after `warmup`, and the slope after the warm-up."""
    after = [(t, r) for t, r in samples if t >= warmup]
    if len(after) < 3:
        return {"note": "too few samples after the warm-up"}
    end = after[-1][0]
    first = [r for t, r in after if t < warmup + window]
    last = [r for t, r in after if t > end - window]
    ts, rs = [t for t, _ in after], [r for _, r in after]
    mt, mr = statistics.fmean(ts), statistics.fmean(rs)
    slope = sum((t - mt) * (r - mr) for t, r in after) / max(1e-9, sum((t - mt) ** 2 for t in ts))
    stat = lambda xs: {"median": round(statistics.median(xs), 1), "min": round(min(xs), 1), "max": round(max(xs), 1)}  # noqa: E731
    return {"first_window": stat(first), "last_window": stat(last),
            "growth_mib": round(statistics.median(last) - statistics.median(first), 1),
            "slope_mib_per_10min": round(slope * 600, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--cache-budget", default="256MB")
    ap.add_argument("--every", type=float, default=10.0, help="seconds between RSS samples")
    ap.add_argument("--warmup", type=float, default=10.0, help="minutes left out of the comparison")
    ap.add_argument("--window", type=float, default=5.0, help="minutes compared at the start and at the end")
    ap.add_argument("--no-speculate", action="store_true", help="serve without speculative decoding (its drafter keeps "
                    "an index of earlier outputs, up to 32k tokens)")
    ap.add_argument("--out", default="soak.json")
    args = ap.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "kvql.cli", "serve", "--model", args.model, "--dtype", args.dtype,
                               "--port", str(port), "--cache-budget", args.cache_budget,
                               *(["--no-speculate"] if args.no_speculate else [])],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(url, server, timeout=600)
        counts = Counts()
        start = time.monotonic()
        until = start + args.minutes * 60
        threads = [threading.Thread(target=client_loop, args=(url, seed, until, counts), daemon=True)
                   for seed in range(args.clients)]
        for t in threads:
            t.start()
        samples, health = [], {"ok": 0, "failed": 0}
        while time.monotonic() < until:
            time.sleep(args.every)
            at = time.monotonic() - start
            samples.append((at, rss_mib(server.pid)))
            try:
                ok = httpx.get(url + "/health", timeout=30).status_code == 200
            except httpx.HTTPError:
                ok = False
            health["ok" if ok else "failed"] += 1
            with counts.lock:
                done = sum(counts.done.values())
            print(f"[soak] {at / 60:5.1f} min  RSS {samples[-1][1]:7.1f} MiB  requests {done}", flush=True)
        for t in threads:
            t.join(timeout=600)
        metrics = httpx.get(url + "/metrics", timeout=30).text
        locked = [line for line in metrics.splitlines() if line.startswith(("kvql_locked_nodes", "kvql_running"))]
    finally:
        server.terminate()
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            server.kill()
    report = {"args": vars(args), "requests": counts.done,
              "errors": {k: (len(v), v[:3]) for k, v in counts.errors.items()}, "health": health,
              "after": locked, "rss": summary(samples, args.warmup * 60, args.window * 60),
              "samples": [(round(t, 1), round(r, 1)) for t, r in samples]}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}, indent=1))


if __name__ == "__main__":
    main()
