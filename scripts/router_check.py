"""Scale-out check: kvql queries through vllm-router (cache-aware) in front of two `kvql serve` workers.

One run, all on loopback, each system on cold workers (workers are restarted between systems):
  1. reference: the query's `map` over the inputs on the local model in-process (`kvql.model("smollm2-135m")`);
  2. one worker: the same `map` against ONE `kvql serve` worker directly (`kvql.model(URL + "/v1", name=...)`);
  3. router: two `kvql serve` workers behind `vllm-router --policy cache_aware` (and, with --round-robin, also
     `--policy round_robin`), the same `map` through `kvql.model(ROUTER + "/v1", name=...)`.
Printed per workload and system: answers equal to the reference (x/N), wall time of the `map` call, the ratio
router wall / one-worker wall (same run), and per worker: requests, prompt tokens, cached tokens and prefix-cache
hit rate, from the worker's own /metrics (kvql_*_total counters read before and after the run).

Workloads (48 inputs each by default):
  shared    one few-shot prefix (~300 tokens), 48 different questions: the cache-aware policy keeps them all on
            one worker (that worker's cache holds the prefix); round robin splits them.
  two-task  two different few-shot prefixes (~300 tokens each), 24 inputs each, mixed: the case a
            cache-aware router is made for (each prefix family should stay on its own worker).
The query: "{prefix}Q: {item}\\nA:[A]" where STOPS_AT(A, "\\n") and len(TOKENS(A)) < 12, greedy.

Prompts: with SmolLM2's tokenizer found under the served name, `kvql.model(url, name=...)` sends token-id
prompts, which the router's cache_aware policy routes on directly; `--text-prompts` (`tokenizer=False`) sends
text, and the policy first asks the worker's `/v1/completions/render` for its token ids (vLLM's tokenize-only
endpoint, which kvql serve answers). Either way the router re-serializes each body and adds fields at its
defaults (`no_stop_trim: false`, `ignore_eos: false`, `skip_special_tokens: true`, `return_hidden_states:
false`), which kvql serve accepts at those values (kvql/server/protocol.py). The router's own decision
counters (`vllm_router_kv_routing_inputs_total{result="render" | "token_ids"}`, prefix hits and misses) are
printed under each router system.

Threads: each worker (and the in-process reference) runs torch on --threads threads (default 1), so "one
worker" is one core's worth and two workers are two: the machine this was written on has 2 cores, and the
router shares them too.

Usage:
    .venv/bin/python scripts/router_check.py [--n 48] [--workloads shared two-task] [--round-robin]
                                             [--text-prompts] [--vllm] [--threads 1] [--cache-budget 256MiB]

vllm-router is installed on first use into ${KVQL_ROUTER_VENV:-~/.cache/kvql/router-venv} (pip, PyPI).
--vllm: also two vLLM CPU workers (scripts/vllm_cpu_server.sh, ~2 GB each, one core each, started once; their
caches are emptied between systems with POST /reset_prefix_cache) behind the router, and one vLLM worker alone
(vllm:prefix_cache_queries / vllm:prefix_cache_hits give the hit rate).

kvql itself: the script and its workers import kvql from the venv (the editable install: this work tree).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROUTER_VERSION = "0.1.17"
ROUTER_VENV = Path(os.environ.get("KVQL_ROUTER_VENV", Path.home() / ".cache" / "kvql" / "router-venv"))
MODEL = "smollm2-135m"

# ------------------------------------------------------------------------------------------- workload
QA_PREFIX = "Answer each question with a short factual answer.\n\n" + "".join(
    f"Q: {q}\nA: {a}\n" for q, a in [
        ("What is the capital of France?", "Paris"), ("What is the capital of Japan?", "Tokyo"),
        ("How many legs does a spider have?", "Eight"),
        ("What is the largest planet in the solar system?", "Jupiter"),
        ("Who wrote the play Romeo and Juliet?", "William Shakespeare"),
        ("What is the chemical symbol for gold?", "Au"), ("How many days are there in a leap year?", "366"),
        ("What is the boiling point of water in degrees Celsius?", "100"),
        ("Which ocean is the largest on Earth?", "The Pacific Ocean"),
        ("What gas do plants absorb from the air?", "Carbon dioxide"), ("What is the capital of Italy?", "Rome"),
        ("How many continents are there?", "Seven"),
        ("What color do you get by mixing blue and yellow?", "Green"),
        ("Who painted the Mona Lisa?", "Leonardo da Vinci"), ("What is the square root of 81?", "9"),
        ("Which planet is known as the Red Planet?", "Mars"),
        ("What is the longest river in Africa?", "The Nile")])

WORD_PREFIX = "Give the opposite of each word, in one word.\n\n" + "".join(
    f"Q: {q}\nA: {a}\n" for q, a in [
        ("hot", "cold"), ("up", "down"), ("big", "small"), ("early", "late"), ("happy", "sad"),
        ("open", "closed"), ("fast", "slow"), ("light", "dark"), ("young", "old"), ("full", "empty"),
        ("win", "lose"), ("hard", "soft"), ("rich", "poor"), ("strong", "weak"), ("inside", "outside"),
        ("first", "last"), ("thick", "thin"), ("push", "pull"), ("wet", "dry"), ("loud", "quiet"),
        ("day", "night"), ("left", "right"), ("true", "false"), ("buy", "sell"), ("above", "below"),
        ("begin", "end"), ("friend", "enemy"), ("high", "low"), ("near", "far"), ("clean", "dirty"),
        ("cheap", "expensive"), ("heavy", "light"), ("long", "short"), ("ask", "answer"), ("north", "south"),
        ("love", "hate"), ("arrive", "leave"), ("give", "take"), ("sweet", "sour"), ("deep", "shallow")])

QUESTIONS = [
    "What is the capital of Germany?", "How many sides does a triangle have?", "What is the capital of Spain?",
    "Which planet is closest to the Sun?", "What is the largest mammal?", "How many hours are there in a day?",
    "What is the chemical symbol for water?", "Who was the first president of the United States?",
    "What is the capital of Canada?", "How many wheels does a bicycle have?",
    "What is the tallest mountain in the world?", "What is the currency of Japan?",
    "How many weeks are there in a year?", "Which bird is a symbol of peace?", "What is the capital of Egypt?",
    "What do bees make?", "What is 7 times 8?", "Which element has the chemical symbol O?",
    "What is the smallest prime number?", "What is the capital of Australia?",
    "How many strings does a standard guitar have?", "Who discovered penicillin?",
    "What is the largest desert in the world?", "In which country are the pyramids of Giza?",
    "What is the capital of Russia?", "How many minutes are in an hour?", "What is the freezing point of water?",
    "Which animal is known as the king of the jungle?", "What is the capital of China?",
    "How many players are on a soccer team?", "What is the hardest natural substance?",
    "Who wrote Hamlet?", "What is the capital of Brazil?", "How many legs does an insect have?",
    "What is the largest country by area?", "Which planet has rings?", "What is the capital of India?",
    "How many months have 31 days?", "What language is spoken in Mexico?", "What is 12 divided by 4?",
    "What is the capital of Greece?", "Which organ pumps blood?", "What is the main ingredient of bread?",
    "How many colors are in a rainbow?", "What is the capital of Kenya?", "Who invented the telephone?",
    "What is the fastest land animal?", "What is the capital of Norway?", "What do cows drink?",
    "What is the capital of Portugal?", "How many zeros are in one thousand?", "Which metal is liquid at room temperature?",
]
WORDS = ["tall", "good", "new", "rough", "wide", "warm", "noisy", "brave", "kind", "sharp", "asleep", "entrance",
         "simple", "always", "question", "winter", "laugh", "morning", "inside", "accept", "forget", "bottom",
         "empty", "fresh", "alive", "narrow", "polite", "smooth", "tight", "visible", "heavy", "public"]

QUERY_SOURCE = '''lmql
"{prefix}Q: {item}\\nA:[A]" where STOPS_AT(A, "\\n") and len(TOKENS(A)) < 12
return A.strip()
'''


def workload(name: str, n: int) -> list[tuple[str, str]]:
    if name == "shared":
        if n > len(QUESTIONS):
            raise SystemExit(f"--n {n}: the shared workload has {len(QUESTIONS)} questions")
        return [(QA_PREFIX, q) for q in QUESTIONS[:n]]
    if name == "two-task":
        half = n // 2
        if half > min(len(QUESTIONS), len(WORDS)):
            raise SystemExit(f"--n {n}: the two-task workload has {len(WORDS)} words")
        items = [(QA_PREFIX, q) for q in QUESTIONS[:half]] + [(WORD_PREFIX, w) for w in WORDS[:half]]
        # a fixed shuffle, not strict alternation: round robin over alternating tasks would give each worker
        # one task by accident
        random.Random(0).shuffle(items)
        return items
    raise SystemExit(f"unknown workload {name!r}")


# ------------------------------------------------------------------------------------------- processes
LOG_DIR = Path(tempfile.gettempdir())  # main() makes a fresh folder per run
_procs: list[subprocess.Popen] = []


def log(msg: str) -> None:
    print(f"[router_check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
    logf = open(LOG_DIR / f"{name}.log", "w")
    p = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                         env={**os.environ, **(env or {})}, start_new_session=True)
    p.name = name  # type: ignore[attr-defined]
    _procs.append(p)
    return p


def stop(p: subprocess.Popen) -> None:
    """SIGTERM to the process group this script started (start_new_session), then SIGKILL after 15 s."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(5)
    if p in _procs:
        _procs.remove(p)


def stop_all() -> None:
    for p in list(reversed(_procs)):
        stop(p)




def http_get(url: str, timeout: float = 5.0):
    import httpx
    return httpx.get(url, timeout=timeout)


def wait_healthy(url: str, p: subprocess.Popen, timeout: float = 180.0) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if p.poll() is not None:
            tail = (LOG_DIR / f"{p.name}.log").read_text()[-3000:]  # type: ignore[attr-defined]
            raise RuntimeError(f"{p.name} exited with {p.returncode} during start-up; log tail:\n{tail}")
        try:
            if http_get(url + "/health", 2).status_code == 200:
                return time.perf_counter() - t0
        except Exception:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{p.name} not healthy at {url} after {timeout:.0f} s")


def start_kvql_workers(tag: str, n: int, args) -> list[str]:
    """n `kvql serve` workers, started together (each loads the model: ~6 s), then waited for."""
    kvql_bin = ROOT / ".venv" / "bin" / "kvql"
    started = []
    for i in range(n):
        port = free_port()
        p = spawn(f"{tag}-w{i + 1}", [str(kvql_bin), "serve", "--model", MODEL, "--host", "127.0.0.1",
                                      "--port", str(port), "--cache-budget", args.cache_budget, "--dtype", "float32"],
                  env={"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
                       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
        started.append((p, f"http://127.0.0.1:{port}"))
    for p, url in started:
        dt = wait_healthy(url, p)
        log(f"{p.name}: kvql serve on {url} healthy after {dt:.1f} s (torch threads {args.threads})")
    return [url for _, url in started]


def ensure_router() -> Path:
    exe = ROUTER_VENV / "bin" / "vllm-router"
    if exe.exists():
        return exe
    log(f"installing vllm-router=={ROUTER_VERSION} into {ROUTER_VENV} (first use only)")
    subprocess.run(["python3", "-m", "venv", str(ROUTER_VENV)], check=True)
    r = subprocess.run([str(ROUTER_VENV / "bin" / "pip"), "install", "-q", "--disable-pip-version-check",
                        f"vllm-router=={ROUTER_VERSION}"], capture_output=True, text=True)
    if r.returncode != 0 or not exe.exists():
        raise RuntimeError(f"pip install vllm-router=={ROUTER_VERSION} failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return exe


def start_router(name: str, workers: list[str], policy: str) -> tuple[str, str]:
    exe = ensure_router()
    port, prom = free_port(), free_port()
    p = spawn(name, [str(exe), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
                     "--policy", policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom),
                     "--worker-startup-check-interval", "1", "--log-level", "warning"])
    url = f"http://127.0.0.1:{port}"
    dt = wait_healthy(url, p, 120)
    log(f"{name}: vllm-router {policy} on {url} over {workers}, ready after {dt:.1f} s")
    return url, f"http://127.0.0.1:{prom}"


# ------------------------------------------------------------------------------------------- metrics
def scrape(url: str) -> dict[str, float]:
    """Prometheus text -> {name{labels}: value} (kvql's and vLLM's counters)."""
    out: dict[str, float] = {}
    for line in http_get(url + "/metrics", 10).text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            out[key.strip()] = float(value)
        except ValueError:
            pass
    return out


def _sum(m: dict[str, float], name: str) -> float:
    """A counter's value summed over its labels (vLLM labels its counters by model and engine)."""
    return sum(v for k, v in m.items() if k == name or k.startswith(name + "{"))


def counters(url: str, kind: str) -> dict[str, float]:
    m = scrape(url)
    if kind == "kvql":
        return {"requests": _sum(m, "kvql_requests_total"), "prompt": _sum(m, "kvql_prompt_tokens_total"),
                "cached": _sum(m, "kvql_cached_tokens_total")}
    return {"requests": _sum(m, "vllm:request_success_total"), "prompt": _sum(m, "vllm:prefix_cache_queries_total")
            or _sum(m, "vllm:prefix_cache_queries"),
            "cached": _sum(m, "vllm:prefix_cache_hits_total") or _sum(m, "vllm:prefix_cache_hits")}


def delta(after: dict, before: dict) -> dict:
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    d["hit_rate"] = d["cached"] / d["prompt"] if d["prompt"] else 0.0
    return d


def router_decisions(prom_url: str) -> str:
    try:
        m = scrape(prom_url)
    except Exception as e:  # the router's own metrics are informative only
        return f"(router metrics unavailable: {e})"
    parts = []
    for k, v in sorted(m.items()):
        if k.startswith(("vllm_router_policy_decisions_total", "vllm_router_prefix_routing_decisions_total",
                         "vllm_router_kv_routing_inputs_total")):
            label = re.sub(r'policy="[^"]*",?', "", k.split("{", 1)[1].rstrip("}"))
            parts.append(f"{label}: {v:.0f}")
    return "; ".join(parts) or "(no decisions recorded)"


# ------------------------------------------------------------------------------------------- runs
def make_query():
    import kvql
    return kvql.Query(QUERY_SOURCE, name="router_check")


def run_map(model, items) -> tuple[list | None, float, str | None]:
    q = make_query()
    t0 = time.perf_counter()
    try:
        out = q.map([{"prefix": p, "item": x} for p, x in items], model=model)
        return list(out), time.perf_counter() - t0, None
    except Exception as e:  # reported, not hidden: the remote backend is being rewritten concurrently
        return None, time.perf_counter() - t0, f"{type(e).__name__}: {str(e)[:400]}"


def equal_count(ref: list, got: list | None) -> int:
    return 0 if got is None else sum(a == b for a, b in zip(ref, got))


def system_kvql(label: str, items, ref, args, n_workers: int, policy: str | None) -> dict:
    tag = label.replace(" ", "-")
    workers = start_kvql_workers(tag, n_workers, args)
    prom = None
    if policy is None:
        front = workers[0]
    else:
        front, prom = start_router(f"{tag}-router", workers, policy)
    return finish_system(label, items, ref, front, workers, "kvql", prom, lambda: remote(front, args))


def remote(front: str, args):
    """The client model: token-id prompts (SmolLM2's tokenizer, found under the served name), or text."""
    import kvql
    return kvql.model(front + "/v1", name=MODEL, tokenizer=False if args.text_prompts else None)


def finish_system(label, items, ref, front, workers, kind, prom, make_model) -> dict:
    before = [counters(w, kind) for w in workers]
    try:
        model = make_model()
    except Exception as e:
        return {"label": label, "error": f"kvql.model({front}/v1): {type(e).__name__}: {e}", "wall": None,
                "equal": 0, "workers": [], "answers": None}
    answers, wall, error = run_map(model, items)
    time.sleep(0.3)
    after = [counters(w, kind) for w in workers]
    res = {"label": label, "front": front, "wall": wall, "error": error, "answers": answers,
           "equal": equal_count(ref, answers),
           "workers": [dict(url=w, **delta(a, b)) for w, a, b in zip(workers, after, before)],
           "router": router_decisions(prom) if prom else None}
    stop_all()
    return res


# CPU attention needs blocks of a multiple of 32 tokens (16 fails at start-up); --enable-scale-out serves
# /v1/completions/render, which vllm-router's cache_aware policy asks for token ids (else: 403, and the policy
# routes without them, outcome "missing_tokens").
VLLM_ARGS = "--block-size 32 --max-num-seqs 64 --enable-scale-out"


class VllmWorkers:
    """Two vLLM CPU workers (scripts/vllm_cpu_server.sh), started once and reused: before each system their
    prefix caches are emptied with POST /reset_prefix_cache (VLLM_SERVER_DEV_MODE=1), so each system starts
    cold without paying vLLM's start-up again. Worker i is bound to CPU i (one core each)."""

    def __init__(self, n: int):
        self.script = ROOT / "scripts" / "vllm_cpu_server.sh"
        self.env = {**os.environ, "VLLM_RUN_DIR": str(LOG_DIR / "vllm"), "VLLM_SERVER_DEV_MODE": "1",
                    "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                    "VLLM_EXTRA_ARGS": os.environ.get("VLLM_EXTRA_ARGS", VLLM_ARGS)}
        self.ports = [free_port() for _ in range(n)]
        self.urls: list[str] = []
        cpus = os.cpu_count() or 1
        t0 = time.perf_counter()
        starts = [subprocess.Popen(["bash", str(self.script), "start", str(port)],
                                   env={**self.env, "VLLM_CPU_OMP_THREADS_BIND": str(i % cpus)},
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                  for i, port in enumerate(self.ports)]
        errors = []
        for port, p in zip(self.ports, starts):
            out, _ = p.communicate()
            if p.returncode != 0:
                errors.append(f"vllm_cpu_server.sh start {port} failed:\n{out[-3000:]}")
            else:
                self.urls.append(f"http://127.0.0.1:{port}")
        if errors:
            self.close()
            raise RuntimeError("\n".join(errors))
        log(f"vLLM workers {self.urls} healthy after {time.perf_counter() - t0:.0f} s")

    def reset(self) -> None:
        import httpx
        for url in self.urls:
            r = httpx.post(url + "/reset_prefix_cache", timeout=30)
            if r.status_code != 200:
                raise RuntimeError(f"{url}/reset_prefix_cache answered {r.status_code}: {r.text[:200]}")

    def close(self) -> None:
        for port in self.ports:
            subprocess.run(["bash", str(self.script), "stop", str(port)], env=self.env, capture_output=True)


def system_vllm(label: str, items, ref, vllm: VllmWorkers, n_workers: int, policy: str | None, args) -> dict:
    vllm.reset()
    workers = vllm.urls[:n_workers]
    prom = None
    front = workers[0]
    if policy is not None:
        front, prom = start_router(f"{label.replace(' ', '-')}-router", workers, policy)
    return finish_system(label, items, ref, front, workers, "vllm", prom, lambda: remote(front, args))


def report(name: str, n: int, ref_wall: float, results: list[dict]) -> None:
    print(f"\n=== workload {name}: {n} inputs ===")
    print(f"  reference: local in-process model, map wall {ref_wall:.2f} s")
    base = {}
    for r in results:
        if r["label"].endswith("one worker") and r["wall"] is not None and not r["error"]:
            base[r["label"].split()[0]] = r["wall"]
    for r in results:
        if r["wall"] is None:
            print(f"  {r['label']:<28} ERROR {r['error']}")
            continue
        one = base.get(r["label"].split()[0])
        ratio = (f"= {r['wall'] / one:.2f}x the one-worker wall" if one and not r["error"]
                 and not r["label"].endswith("one worker") else "")
        print(f"  {r['label']:<28} answers equal {r['equal']}/{n}, wall {r['wall']:.2f} s {ratio}")
        if r["error"]:
            print(f"    ERROR {r['error']}")
        for i, w in enumerate(r["workers"]):
            print(f"    worker {i + 1} {w['url']}: requests {w['requests']:.0f}, prompt tokens {w['prompt']:.0f}, "
                  f"cached {w['cached']:.0f}, hit rate {w['hit_rate']:.2f}")
        if r.get("router"):
            print(f"    router decisions: {r['router']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=48, help="inputs per workload (default 48)")
    ap.add_argument("--workloads", nargs="+", default=["shared", "two-task"], choices=["shared", "two-task"])
    ap.add_argument("--round-robin", action="store_true", help="also the router with --policy round_robin")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker and for the reference")
    ap.add_argument("--cache-budget", default="256MiB", help="each kvql worker's --cache-budget")
    ap.add_argument("--text-prompts", action="store_true",
                    help="send text prompts (tokenizer=False): the router asks the workers' /v1/completions/render")
    ap.add_argument("--vllm", action="store_true", help="also two vLLM CPU workers behind the router")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()

    import torch

    import kvql

    global LOG_DIR
    LOG_DIR = Path(tempfile.mkdtemp(prefix="kvql-router-check-"))
    atexit.register(stop_all)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    torch.set_num_threads(args.threads)
    log(f"logs in {LOG_DIR}")
    loads = {name: workload(name, args.n) for name in args.workloads}
    local = kvql.model(MODEL)
    refs = {}
    for name, items in loads.items():
        make_query().map([{"prefix": items[0][0], "item": "warm-up?"}], model=local)
        local.clear_cache()
        answers, wall, error = run_map(local, items)
        if error:
            raise SystemExit(f"the local reference failed: {error}")
        refs[name] = (answers, wall)
        log(f"reference {name}: {wall:.2f} s")
    local.close()
    del local

    systems = [("kvql one worker", 1, None), ("kvql router cache_aware", 2, "cache_aware")]
    if args.round_robin:
        systems.append(("kvql router round_robin", 2, "round_robin"))
    if args.vllm:
        systems += [("vllm one worker", 1, None), ("vllm router cache_aware", 2, "cache_aware")]
        if args.round_robin:
            systems.append(("vllm router round_robin", 2, "round_robin"))
    all_results = {}
    vllm = None
    try:
        for name, items in loads.items():
            ref, ref_wall = refs[name]
            results = []
            for label, n_workers, policy in systems:
                log(f"{name}: {label}")
                try:
                    if label.startswith("vllm"):
                        if vllm is None:
                            vllm = VllmWorkers(2)
                        results.append(system_vllm(label, items, ref, vllm, n_workers, policy, args))
                    else:
                        results.append(system_kvql(label, items, ref, args, n_workers, policy))
                except Exception as e:
                    stop_all()
                    results.append({"label": label, "wall": None, "error": f"{type(e).__name__}: {e}",
                                    "equal": 0, "workers": [], "answers": None})
            report(name, len(items), ref_wall, results)
            mismatches = [(r["label"], items[i][1], ref[i], r["answers"][i]) for r in results if r["answers"]
                          for i in range(len(ref)) if r["answers"][i] != ref[i]]
            for label, item, want, got in mismatches[:10]:
                print(f"    differs ({label}): {item!r}: local {want!r}, remote {got!r}")
            all_results[name] = {"reference": {"wall": ref_wall, "answers": ref}, "systems": results}
    finally:
        if vllm is not None:
            vllm.close()
    if args.json:
        Path(args.json).write_text(json.dumps(all_results, indent=1))
    print(f"\nlogs: {LOG_DIR}")


if __name__ == "__main__":
    main()
