"""An innocent client's latency beside each hostile request, against `kvql serve` (SmolLM2-135M by default), side
by side in one run: the same greedy request alone, then while each hostile request runs; its answer must not
change. Also `/health`'s latency under the hostile load. Prints one row per hostile request: its own status,
the innocent's latency and its ratio to alone (goal: within 2x), /health's.

Hostile requests (issue 51): a regex whose masks are slow (`(x{1000}){300}`: ~0.1 s per token), a prompt
list past the caps (`["Hi"] * 2000` with n=64), the largest prompt list the caps take, a `logit_bias` over
the whole vocabulary, eight 1 MB prompts at once, eight distinct slow-to-compile constraints at once (the
innocent then brings a new constraint of its own).

Usage: ./dev bench hostile_neighbours [--model smollm2-135m] [--repeat 3] [--only TEXT]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kvql  # noqa: E402
from kvql.server.app import create_app  # noqa: E402


FEW_SHOT = "Q: What is the capital of France?\nA: Paris\nQ: What is the capital of Japan?\nA: Tokyo\n"
COUNTRIES = ["Italy", "Spain", "Peru", "Kenya", "Norway"]  # one innocent request each, alone and in every row
SETTLE = 0.5  # seconds a hostile request gets to start before the innocent one is sent


def serve(app) -> tuple[str, uvicorn.Server]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server


def hostiles(vocab: int) -> dict:
    """name -> (how many concurrent copies, the body of each; the innocent's own extra fields)."""
    big = "lorem ipsum dolor sit amet " * ((1 << 20) // 27)
    return {
        "slow regex (x{1000}){300}": (1, [{"prompt": "x", "max_tokens": 48, "regex": "(x{1000}){300}"}], {}),
        "prompts x n past the caps": (1, [{"prompt": ["Hi"] * 2000, "n": 64, "max_tokens": 1}], {}),
        "the most the caps take (256 prompts)": (1, [{"prompt": [f"Hi {i}" for i in range(256)],
                                                      "max_tokens": 16}], {}),
        "logit_bias over the whole vocabulary": (1, [{"prompt": "Once upon a time", "max_tokens": 64,
                                                      "logit_bias": {str(t): 0.5 for t in range(vocab)}}], {}),
        "eight 1 MB prompts": (8, [{"prompt": big + str(i), "max_tokens": 1} for i in range(8)], {}),
        "eight slow constraints to compile": (8, [{"prompt": "x", "max_tokens": 4, "regex": f"(x{{1000}}){{{100 + i}}}"}
                                                  for i in range(8)], {"regex": True}),
    }


async def timed(client, path: str, body: dict | None = None) -> tuple[float, httpx.Response]:
    started = time.perf_counter()
    r = await (client.post(path, json=body) if body is not None else client.get(path))
    return time.perf_counter() - started, r


_fresh = iter(range(1, 1 << 30))


def innocent_body(country: str, extra: dict) -> dict:
    body = {"prompt": f"{FEW_SHOT}Q: What is the capital of {country}?\nA:", "max_tokens": 16, "temperature": 0}
    if extra.get("regex"):  # a constraint this server has not compiled yet (the same language every time)
        body["regex"] = f" [A-Z][a-z]+( [A-Z][a-z]+)?|@{{{next(_fresh)}}}"
    return body


async def innocent(client, extra: dict, repeat: int) -> tuple[float, list[str]]:
    """The median latency of one request per country (sequential), and their answers."""
    times, texts = [], []
    for country in COUNTRIES[:repeat]:
        t, r = await timed(client, "/v1/completions", innocent_body(country, extra))
        r.raise_for_status()
        times.append(t)
        texts.append(r.json()["choices"][0]["text"])
    return statistics.median(times), texts


async def row(client, name: str, copies: int, bodies: list, extra: dict, alone: dict, repeat: int) -> str:
    hostile = [asyncio.create_task(timed(client, "/v1/completions", b)) for b in bodies[:copies]]
    await asyncio.sleep(SETTLE)
    health, _ = await timed(client, "/health")
    seconds, text = await innocent(client, extra, repeat)
    base_seconds, base_text = alone[tuple(extra)]
    results = await asyncio.gather(*hostile)
    statuses = sorted({r.status_code for _, r in results})
    return (f"| {name} | {'/'.join(map(str, statuses))} ({max(t for t, _ in results):.1f} s) | {seconds:.2f} s | "
            f"{seconds / base_seconds:.2f}x | {'same' if text == base_text else 'DIFFERENT'} | {health * 1000:.0f} ms |")


async def main(args) -> None:
    model = kvql.model(args.model, speculate=False)  # no drafts: each innocent token is a step of the batch
    url, server = serve(create_app(model, max_body_bytes=2 << 20))
    rows = hostiles(model.vocab_size)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            constrained = {"regex": True}
            await innocent(client, {}, args.repeat)  # warm: the prompts are cached from here on, as in every row
            await innocent(client, constrained, args.repeat)
            alone = {(): await innocent(client, {}, args.repeat),
                     ("regex",): await innocent(client, constrained, args.repeat)}
            health, _ = await timed(client, "/health")
            print(f"kvql {args.model} (speculation off): innocent alone {alone[()][0]:.2f} s, answers "
                  f"{alone[()][1]!r}; with a constraint of its own {alone[('regex',)][0]:.2f} s; "
                  f"/health alone {health * 1000:.0f} ms")
            print("| hostile request | its status (its time) | innocent | vs alone | answer | /health |")
            print("|---|---|---|---|---|---|")
            for name, (copies, bodies, extra) in rows.items():
                if args.only and args.only not in name:
                    continue
                print(await row(client, name, copies, bodies, extra, alone, args.repeat), flush=True)
    finally:
        server.should_exit = True
        model.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--repeat", type=int, default=3, help="innocent requests per row (the median is shown)")
    p.add_argument("--only", default=None, metavar="TEXT", help="only the rows whose name holds TEXT")
    asyncio.run(main(p.parse_args()))
