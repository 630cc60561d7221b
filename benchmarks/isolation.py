"""Isolation under hostile load: `kvql serve` (SmolLM2-135M, a small cache) with good, failing, cancelled and
disconnecting clients at once; prints counts, not times.

1. Solo answers: each good prompt alone (greedy, 16 tokens), one at a time.
2. The same good prompts all at once, mixed with: failing requests (n=3 with a regex that llguidance
   gives up on after the samples forked, an impossible grammar), clients that time out or disconnect
   mid-generation, and streams closed after a few chunks; under a KV budget small enough to force
   eviction and preemption. Every good answer must equal its solo answer.
3. Payloads that crashed or stalled the process before (deep grammars, deep JSON): the server must
   answer a normal request after each.
Then the engine's integrity check and its lock count.

Usage: ./dev bench isolation [--quick] [--budget 24MiB]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kvql  # noqa: E402
from kvql.server.app import create_app  # noqa: E402

TOPICS = ["France", "Italy", "Japan", "Peru", "Kenya", "Canada", "Norway", "Egypt", "India", "Chile",
          "Spain", "Greece", "Mexico", "Poland", "Vietnam", "Ghana", "Brazil", "Sweden", "Turkey", "Nepal"]


def serve(model) -> tuple[str, uvicorn.Server]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(model, max_tokens_cap=512), host="127.0.0.1", port=port,
                                           log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server


async def good(client, prompt: str) -> list[int]:
    r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 16, "temperature": 0,
                                                   "return_token_ids": True})
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


async def failing(client, i: int) -> int:
    constraint = {"regex": "a{1000000}"} if i % 2 else {"grammar": "start: A\nA: /a+/ & /b+/"}
    r = await client.post("/v1/completions", json={"prompt": "Tell me about " + TOPICS[i % 20], "n": 3,
                                                   "max_tokens": 8, "temperature": 0.8,
                                                   "structured_outputs": constraint})
    return r.status_code


async def impatient(url: str, i: int) -> str:
    try:
        async with httpx.AsyncClient(base_url=url, timeout=0.05 + 0.05 * (i % 6)) as own:
            await own.post("/v1/completions", json={"prompt": f"Write a long story about {TOPICS[i % 20]}.",
                                                    "max_tokens": 300})
    except httpx.TimeoutException:
        return "gone"
    return "finished"


async def early_close(client, i: int) -> int:
    chunks = 0
    async with client.stream("POST", "/v1/completions", json={"prompt": f"List facts about {TOPICS[i % 20]}:",
                                                              "max_tokens": 200, "stream": True}) as r:
        async for line in r.aiter_lines():
            chunks += line.startswith("data:")
            if chunks >= 3:
                break
    return chunks


def wait_idle(model, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if model.engine.idle():
            return True
        time.sleep(0.05)
    return False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="12 good prompts instead of 40")
    ap.add_argument("--budget", default="24MiB", help="KV cache budget (small: forces eviction and preemption)")
    args = ap.parse_args()
    n_good = 12 if args.quick else 40
    model = kvql.model("smollm2-135m", dtype="float32", cache_budget=args.budget)  # exact: alone == under load
    print(f"{model!r}, budget {args.budget}")
    url, server = serve(model)
    prompts = [f"Q: What is the capital of {TOPICS[i % 20]}?\nA:" + " Let me think." * (i // 20) for i in range(n_good)]

    async def solo():
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            return [await good(client, p) for p in prompts]

    async def hostile():
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            async def later(delay, job):
                await asyncio.sleep(delay)
                return await job
            n_bad = n_good // 2
            jobs = [later(0.01 * i, good(client, p)) for i, p in enumerate(prompts)]
            jobs += [later(0.015 * i, failing(client, i)) for i in range(n_bad)]
            jobs += [later(0.02 * i, impatient(url, i)) for i in range(n_bad)]
            jobs += [later(0.02 * i, early_close(client, i)) for i in range(n_bad)]
            results = await asyncio.gather(*jobs)
            return results, n_bad

    t = time.perf_counter()
    alone = asyncio.run(solo())
    print(f"solo: {n_good} answers, one at a time ({time.perf_counter() - t:.1f} s)")
    model.clear_cache()
    t = time.perf_counter()
    results, n_bad = asyncio.run(hostile())
    answers = results[:n_good]
    fails = results[n_good:n_good + n_bad]
    gone = results[n_good + n_bad:n_good + 2 * n_bad]
    closed = results[n_good + 2 * n_bad:]
    equal = sum(a == b for a, b in zip(answers, alone))
    print(f"hostile: {n_good} good + {n_bad} failing + {n_bad} disconnecting + {n_bad} early-closed streams "
          f"({time.perf_counter() - t:.1f} s)")
    print(f"  good answers equal to solo: {equal}/{n_good}")
    print(f"  failing requests answered 4xx: {sum(400 <= s < 500 for s in fails)}/{n_bad}")
    print(f"  disconnecting clients: {gone.count('gone')} gone, {gone.count('finished')} finished first; "
          f"early-closed streams: {len(closed)}")
    idle = wait_idle(model)
    s = model.stats()
    print(f"  engine idle afterwards: {idle}; preemptions {s['preemptions']}, evicted tokens {s['evictions']}")

    nested = '{"type": "object", "properties": {"a": ' * 600 + '{"type": "string"}' + "}}" * 600
    chain = "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(3000)) + 'r3000: "a"\n'
    refs = {"$ref": "#/$defs/d0", "$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(3000)}
            | {"d3000": {"type": "string", "maxLength": 3}}}
    payloads = {"3,000 chained Lark rules": {"structured_outputs": {"grammar": chain}},
                "3,000-long $ref chain": {"structured_outputs": {"json": refs}},
                "schema nested 600 deep": b'{"prompt": "hi", "structured_outputs": {"json": ' + nested.encode() + b"}}",
                "JSON body nested 100k deep": b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"}
    up = 0
    with httpx.Client(base_url=url, timeout=120) as client:
        for name, extra in payloads.items():
            if isinstance(extra, bytes):  # too deep for Python's own JSON encoder: sent as text
                r = client.post("/v1/completions", content=extra, headers={"content-type": "application/json"})
            else:
                r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, **extra})
            alive = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
            up += alive
            print(f"  payload {name}: {r.status_code}, server still answering: {alive}")
    print(f"crash payloads: {len(payloads)}, server still up after: {up}/{len(payloads)}")
    model.check_integrity()
    s = model.stats()
    print(f"check_integrity: ok; locked nodes {s['locked_nodes']}, running {s['running']}, waiting {s['waiting']}")
    print(json.dumps({"good_equal": equal, "good": n_good, "failing_4xx": sum(400 <= x < 500 for x in fails),
                      "failing": n_bad, "crash_payloads_survived": up, "crash_payloads": len(payloads)}))
    server.should_exit = True
    model.close()


if __name__ == "__main__":
    main()
