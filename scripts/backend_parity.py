"""The same LMQL queries on every backend, side by side: the local engine, `kvql serve`, a vLLM server.

Each query exercises one feature (decoders, distribution, score, roles, guarded stops, constraint
combinations, length bounds, types, nested queries, ...) and has a check of what LMQL specifies for its
result. A backend passes a query when it runs and the check holds; `=local` counts results equal to the
local engine's (greedy queries only: sampled ones differ between processes by design).

    python scripts/backend_parity.py [--kvql URL] [--vllm URL] [--tokenizer-free]

Without URLs it starts what it needs on loopback: a `kvql serve` subprocess, and a vLLM CPU server
through scripts/vllm_cpu_server.sh (skipped with --no-vllm). `--tokenizer-free` adds columns for the
remote backends without a tokenizer (text prompts).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import kvql  # noqa: E402


@dataclasses.dataclass
class Person:
    name: str
    age: int


@kvql.query
async def inner(topic):
    '''lmql
    "A word about {topic}:[W]" where STOPS_BEFORE(W, "\\n") and len(TOKENS(W)) < 6
    return W.strip()
    '''


Q = "Q: What is the capital of France?\\nA:"
CASES = [
    # name, query source, check(result) -> bool, greedy
    ("argmax + STOPS_AT", f'"{Q}[A]" where STOPS_AT(A, "\\n") and len(TOKENS(A)) < 12\nreturn A',
     lambda a: a.endswith("\n") or len(a) > 0, True),
    ("STOPS_BEFORE", f'"{Q}[A]" where STOPS_BEFORE(A, ".") and len(TOKENS(A)) < 12\nreturn A',
     lambda a: "." not in a, True),
    ("choices", f'"{Q}[A]" where A in [" Paris", " London", " Rome"]\nreturn A',
     lambda a: a in (" Paris", " London", " Rome"), True),
    ("int", '"Q: How many legs does a spider have?\\nA: [N]" where INT(N) and len(TOKENS(N)) < 4\nreturn N',
     lambda n: isinstance(n, int), True),
    ("regex", '"Today\'s date: [D]" where REGEX(D, r"[0-9]{2}/[0-9]{2}/[0-9]{4}")\nreturn D',
     lambda d: re.fullmatch(r"[0-9]{2}/[0-9]{2}/[0-9]{4}", d) is not None, True),
    ("len(X) < n", '"Say something:[A]" where len(A) < 12\nreturn A', lambda a: len(a) < 12, True),
    ("startswith", '"Color:[A]" where A.startswith(" b") and len(TOKENS(A)) < 4\nreturn A',
     lambda a: a.startswith(" b"), True),
    ("and not in (& ~)", '"Word:[A]" where REGEX(A, " [a-z]+") and not A in [" the", " a"] and len(TOKENS(A)) < 4\n'
     'return A', lambda a: re.fullmatch(" [a-z]+", a) is not None and a not in (" the", " a"), True),
    ("guarded stop", '"Count: one, two,[A]" where STOPS_AT(A, ",") and len(TOKENS(A)) > 3 and len(TOKENS(A)) < 12\n'
     'return A', lambda a: a.count(",") >= 1, True),
    ("or of stops", f'"{Q}[A]" where (STOPS_AT(A, ".") or STOPS_AT(A, "\\n")) and len(TOKENS(A)) < 12\nreturn A',
     lambda a: isinstance(a, str), True),
    ("roles", '"{:user}Say hello.{:assistant}[A]" where len(TOKENS(A)) < 8 and STOPS_AT(A, ".")\nreturn A',
     lambda a: isinstance(a, str) and len(a) > 0, True),
    ("distribution", 'argmax "Q: Is the sky blue? Answer yes or no.\\nA:[A]" distribution A in [" yes", " no"]',
     lambda r: r.variables["A"] in (" yes", " no") and abs(sum(p for _, p in r.variables["P(A)"]) - 1) < 1e-6, True),
    ("beam(n=2)", 'beam(n=2) "Q: Name a color.\\nA:[A]" where len(TOKENS(A)) < 5\nreturn A',
     lambda r: isinstance(r, list) and len(r) == 2, True),
    ("sample(n=2)", 'sample(n=2, temperature=0.8) "Once upon a time[A]" where len(TOKENS(A)) < 6\nreturn A',
     lambda r: isinstance(r, list) and len(r) == 2, False),
    ("typed (dataclass)", '"A person as JSON: [P]" where type(P) is Person and len(TOKENS(P)) < 40\nreturn P',
     lambda p: isinstance(p, Person), True),
    ("nested query", '"Topic: cats. [W: inner(\'cats\')]"\nreturn W', lambda w: isinstance(w, str), True),
]


def score_case(model):
    r = kvql.score_sync("Q: Is the sky blue?\nA:", [" yes", " no"], model=model)
    return [round(float(x), 3) for x in r.logprobs("sum")]


def run(model, source: str):
    return kvql.run_sync(source, model=model)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_kvql() -> tuple[str, subprocess.Popen]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvql.cli", "serve", "--model", "smollm2-135m", "--port",
                             str(port), "--cache-budget", "256MB", "--dtype", "float32"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    for _ in range(1200):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return f"http://127.0.0.1:{port}/v1", proc
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("kvql serve did not start")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvql", help="URL of a running kvql serve /v1 (default: start one)")
    ap.add_argument("--vllm", help="URL of a running vLLM /v1 (default: start one with scripts/vllm_cpu_server.sh)")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--tokenizer-free", action="store_true", help="also the remote backends with text prompts")
    args = ap.parse_args()
    stop = []
    kvql_url = args.kvql
    if kvql_url is None:
        kvql_url, proc = start_kvql()
        stop.append(proc.terminate)
    vllm_url = args.vllm
    if vllm_url is None and not args.no_vllm:
        port = free_port()
        subprocess.run(["bash", str(ROOT / "scripts" / "vllm_cpu_server.sh"), "start", str(port)], check=True)
        vllm_url = f"http://127.0.0.1:{port}/v1"
        stop.append(lambda: subprocess.run(["bash", str(ROOT / "scripts" / "vllm_cpu_server.sh"), "stop", str(port)]))
    try:
        backends = {"local": kvql.model("smollm2-135m", cache_budget="512MB"),
                    "kvql serve": kvql.model(kvql_url, name="smollm2-135m")}
        if vllm_url:
            backends["vLLM"] = kvql.model(vllm_url, name="smollm2-135m")
        if args.tokenizer_free:
            backends["kvql serve (text)"] = kvql.model(kvql_url, name="smollm2-135m", tokenizer=False)
            if vllm_url:
                backends["vLLM (text)"] = kvql.model(vllm_url, name="smollm2-135m", tokenizer=False)
        table = {name: {} for name in backends}
        for case, source, check, greedy in CASES + [("score", None, lambda r: len(r) == 2, True)]:
            for name, model in backends.items():
                try:
                    result = score_case(model) if source is None else run(model, source)
                    ok = bool(check(result))
                    table[name][case] = ("pass" if ok else "FAIL(check)", result)
                except Exception as e:  # each backend's error is reported, not raised
                    table[name][case] = (f"ERROR {type(e).__name__}: {str(e)[:90]}", None)
        names = list(backends)
        print(f"{'query':22}" + "".join(f"{n:>22}" for n in names))
        for case, *_ in CASES + [("score",)]:
            local = table["local"][case][1]
            greedy = next((g for c, _, _, g in CASES if c == case), True)
            row = []
            for n in names:
                status, result = table[n][case]
                mark = status if status != "pass" else \
                    ("pass =local" if greedy and _same(result, local) else "pass" if not greedy or n == "local" else "pass ≠local")
                row.append(f"{mark[:21]:>22}")
            print(f"{case:22}" + "".join(row))
        total = len(CASES) + 1
        print(f"{'passed':22}" + "".join(f"{sum(v[0] == 'pass' for v in table[n].values()):>18}/{total:<3}" for n in names))
        for n in names:
            for case, (status, _) in table[n].items():
                if status != "pass":
                    print(f"  {n} / {case}: {status}")
        for n in names[1:]:
            s = backends[n].stats()
            print(f"  {n} stats: prompt {s.get('prompt_tokens')}, cached {s.get('cached_tokens')}, "
                  f"hit rate {s.get('hit_rate', 0):.2f}")
    finally:
        for f in stop:
            f()


def _same(a, b) -> bool:
    if isinstance(a, kvql.LMQLResult) and isinstance(b, kvql.LMQLResult):
        return a.variables.get("A") == b.variables.get("A")
    if isinstance(a, list) and a and isinstance(a[0], float):
        return all(abs(x - y) < 0.02 for x, y in zip(a, b))
    return a == b


if __name__ == "__main__":
    main()
