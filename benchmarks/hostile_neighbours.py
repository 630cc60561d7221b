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


INNOCENT = {"prompt": "Q: What is the capital of France?\nA: Paris\nQ: What is the capital of Japan?\nA:",
            "max_tokens": 16, "temperature": 0}
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
    big = "lorem ipsum dolor sit amet " * (1 << 20 // 27)
    return {
        "slow regex (x{1000}){300}": (1, [{"prompt": "x", "max_tokens": 48, "regex": "(x{1000}){300}"}], {}),
        "prompts x n past the caps": (1, [{"prompt": ["Hi"] * 2000, "n": 64, "max_tokens": 1}], {}),
        "the most the caps take (256 prompts)": (1, [{"prompt": [f"Hi {i}" for i in range(256)],
                                                      "max_tokens": 16}], {}),
        "logit_bias over the whole vocabulary": (1, [{"prompt": "Once upon a time", "max_tokens": 64,
                                                      "logit_bias": {str(t): 0.5 for t in range(vocab)}}], {}),
        "eight 1 MB prompts": (8, [{"prompt": big + str(i), "max_tokens": 1} for i in range(8)], {}),
        "eight slow constraints to compile": (8, [{"prompt": "x", "max_tokens": 4, "regex": f"(x{{1000}}){{{100 + i}}}"}
                                                  for i in range(8)], {"regex": " [A-Z][a-z]+( [A-Z][a-z]+)?"}),
    }


async def timed(client, path: str, body: dict | None = None) -> tuple[float, httpx.Response]:
    started = time.perf_counter()
    r = await (client.post(path, json=body) if body is not None else client.get(path))
    return time.perf_counter() - started, r


async def innocent(client, extra: dict, repeat: int) -> tuple[float, str]:
    times, texts = [], set()
    for _ in range(repeat):
        t, r = await timed(client, "/v1/completions", INNOCENT | extra)
        r.raise_for_status()
        times.append(t)
        texts.add(r.json()["choices"][0]["text"])
    assert len(texts) == 1, texts
    return statistics.median(times), texts.pop()


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
    model = kvql.model(args.model)
    url, server = serve(create_app(model, max_body_bytes=2 << 20))
    rows = hostiles(model.vocab_size)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            await innocent(client, {}, 1)  # warm: the prompt is cached from here on, as in every row
            alone = {(): await innocent(client, {}, args.repeat)}
            await innocent(client, rows["eight slow constraints to compile"][2], 1)
            alone[("regex",)] = await innocent(client, rows["eight slow constraints to compile"][2], args.repeat)
            health, _ = await timed(client, "/health")
            print(f"kvql {args.model}: innocent alone {alone[()][0]:.2f} s ({alone[()][1]!r}), "
                  f"with its own regex {alone[('regex',)][0]:.2f} s; /health alone {health * 1000:.0f} ms")
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
