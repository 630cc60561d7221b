"""`kvql serve` vs vLLM (CPU build, prefix caching on) over HTTP: the same client, model and dtype, per workload.

For each dtype (float32, bfloat16), one after the other in this one run:
  1. the reference: `kvql.model(dtype=D)` in this process, every request alone with the cache cleared
     before it (uncached, one at a time); in float32 that is the exact answer (tests prove it equals plain
     transformers), in bfloat16 the rounding of a solo forward;
  2. a fresh `kvql serve --dtype D` (torch on --threads threads), then a fresh vLLM (`--dtype D`,
     scripts/vllm_cpu_server.sh, the same number of OpenMP threads), each measured on the workloads below,
     the same requests sent the same way (httpx, all 24 at once, raw /v1/completions bodies).
Workloads (24 concurrent greedy requests each; --quick: 8):
  fewshot_cold   a ~290-token few-shot prefix + one question each, 10 new tokens, stop "\\n" (fresh server)
  fewshot_warm   the same requests again
  unshared       ~330-token prompts of differently shuffled facts: no common prefix beyond a few tokens
  long_doc       one ~1,500-token document shared by all, a different question each, 10 new tokens
  long_answers   the few-shot prefix, 96 new tokens each (ignore_eos)
  json           the few-shot prefix, a JSON schema (structured_outputs.json on both servers), <= 48 tokens
With `--llama-server PATH` (llama.cpp's own server, built from the llama.cpp sources; issue 44), also llama.cpp
on the model's GGUF file as shipped (SmolLM2: Q4_1, Gemma 3: Q4_K_M: the bits a CPU user runs), once: --parallel
24, one KV cache shared by the slots (--kv-unified), its prompt cache on (each slot keeps its prompt; a request
goes to the slot whose prompt it shares most), the same threads and requests (the JSON schema as its
`json_schema` field); its answers come from other arithmetic (4-bit weights), so they are counted, not required
equal. Its ratio is llama.cpp time / kvql time for each dtype.
Printed per dtype and workload: each server's wall seconds, vLLM time / kvql time (> 1: kvql faster),
answers equal to the reference (per server), and kvql's overhead: wall / seconds inside its model forward
(from /metrics; the server's overlapping requests make it a whole-workload figure). A figure
(vs_vllm.png: the ratios, one bar per workload and dtype) and vs_vllm.json go to benchmarks/results/.

With `--weights gguf,int8,int4`, also `kvql serve --weights W` (bf16 activations) against its own solo reference
and against llama.cpp (vLLM runs the dtypes only).

Usage: python benchmarks/vs_vllm.py [--quick] [--dtypes float32,bfloat16] [--threads 2] [--no-vllm]
    [--llama-server PATH] [--weights gguf]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))
from fewshot_qa import PREFIX, QUESTIONS, SHOTS, answer, no_sharing_prompts, qa  # noqa: E402
from serve_http import free_port, wait_healthy  # noqa: E402

NAME = "smollm2-135m"
WORKLOADS = ("fewshot_cold", "fewshot_warm", "unshared", "long_doc", "long_answers", "json")
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 24},
                                           "confident": {"type": "boolean"}},
          "required": ["answer", "confident"], "additionalProperties": False}
DOC = "Reference notes.\n" + "".join(
    "".join(qa(q, a) for q, a in random.Random(seed).sample(SHOTS + QUESTIONS, len(SHOTS + QUESTIONS)))
    for seed in range(2)) + "".join(qa(q, a) for q, a in (SHOTS + QUESTIONS)[:len(SHOTS + QUESTIONS) // 3])


def requests(tok, n: int) -> dict[str, list[dict]]:
    """The request bodies of each workload (without `model`); fewshot_warm repeats fewshot_cold."""
    questions = [q for q, _ in QUESTIONS]
    short = {"max_tokens": 10, "temperature": 0, "stop": ["\n"]}
    fewshot = [{"prompt": PREFIX + qa(questions[j % len(questions)]), **short} for j in range(n)]
    return {
        "fewshot_cold": fewshot,
        "fewshot_warm": fewshot,
        "unshared": [{"prompt": p, **short} for p in no_sharing_prompts(tok, n, 330)],
        "long_doc": [{"prompt": DOC + "\nAnswer from the notes.\n" + qa(questions[(j + 7) % len(questions)]), **short}
                     for j in range(n)],
        "long_answers": [{"prompt": PREFIX + qa(questions[(j + 3) % len(questions)]), "max_tokens": 96,
                          "temperature": 0, "ignore_eos": True} for j in range(n)],
        "json": [{"prompt": PREFIX + qa(questions[(j + 5) % len(questions)]) + " As JSON:", "max_tokens": 48,
                  "temperature": 0, "structured_outputs": {"json": SCHEMA}} for j in range(n)],
    }


def same(workload: str, a: str, b: str) -> bool:
    return answer(a) == answer(b) if workload in ("fewshot_cold", "fewshot_warm", "unshared", "long_doc") else a == b


def reference(dtype: str, reqs: dict, weights: str | None = None) -> dict[str, list[str]]:
    """Every request alone on an empty cache, in this process."""
    import kvql

    m = kvql.model(NAME, dtype=dtype, weights=weights)
    out = {}
    for w, bodies in reqs.items():
        if w == "fewshot_warm":
            out[w] = out["fewshot_cold"]
            continue
        texts = []
        for b in bodies:
            m.clear_cache()
            kw = {"max_tokens": b["max_tokens"], "stop": b.get("stop"), "ignore_eos": b.get("ignore_eos", False)}
            if "structured_outputs" in b:
                kw["json_schema"] = b["structured_outputs"]["json"]
            [c] = m.generate(b["prompt"], **kw)
            texts.append(c.text)
        out[w] = texts
    m.close()
    return out


async def _fire(url: str, bodies: list[dict]) -> tuple[float, list[str]]:
    async with httpx.AsyncClient(timeout=1200, limits=httpx.Limits(max_connections=len(bodies) + 4)) as client:
        async def one(body):
            r = await client.post(url + "/v1/completions", json={"model": NAME, **body})
            if r.status_code != 200:
                raise RuntimeError(f"{url}: {r.status_code} {r.text[:300]}")
            return r.json()["choices"][0]["text"]

        t = time.perf_counter()
        texts = await asyncio.gather(*(one(b) for b in bodies))
        return time.perf_counter() - t, list(texts)


def _forward_seconds(url: str) -> float | None:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("kvql_forward_seconds_total "):
            return float(line.split()[1])
    return None


def measure(label: str, url: str, reqs: dict, ref: dict) -> dict:
    rows = {}
    for w in WORKLOADS:
        before = _forward_seconds(url)
        wall, texts = asyncio.run(_fire(url, reqs[w]))
        after = _forward_seconds(url)
        equal = sum(same(w, a, b) for a, b in zip(texts, ref[w]))
        rows[w] = {"wall_s": wall, "answers_equal": [equal, len(texts)]}
        if before is not None and after is not None and after > before:
            rows[w]["overhead"] = wall / (after - before)
        extra = f"  wall/forward {rows[w]['overhead']:.2f}" if "overhead" in rows[w] else ""
        print(f"  {label:<5} {w:<13} {wall:7.2f} s  answers equal {equal}/{len(texts)}{extra}", flush=True)
    return rows


def _served(label: str, argv: list[str], port: int, reqs: dict, ref: dict, env=None) -> dict:
    """Start the server `argv` (listening on `port`), measure it once healthy, stop it."""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
        return measure(label, f"http://127.0.0.1:{port}", reqs, ref)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def run_kvql(dtype: str, threads: int, reqs: dict, ref: dict, weights: str | None = None) -> dict:
    port = free_port()
    quantized = ["--weights", weights] if weights else []
    return _served("kvql", [sys.executable, "-m", "kvql.cli", "serve", "--model", NAME, "--port", str(port),
                            "--dtype", dtype, "--cache-budget", "1GiB", "--log-level", "warning", *quantized],
                   port, reqs, ref, env={**os.environ, "OMP_NUM_THREADS": str(threads)})


def run_vllm(dtype: str, threads: int, reqs: dict, ref: dict) -> dict:
    port = free_port()
    script = str(ROOT / "scripts" / "vllm_cpu_server.sh")
    from kvql.backends.loader import resolve

    env = {**os.environ, "VLLM_DTYPE": dtype, "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
           "VLLM_SERVED_NAME": NAME, "VLLM_MODEL_DIR": str(resolve(NAME))}
    subprocess.run(["bash", script, "start", str(port)], env=env, check=True)
    try:
        return measure("vLLM", f"http://127.0.0.1:{port}", reqs, ref)
    finally:
        subprocess.run(["bash", script, "stop", str(port)], check=False)


def run_llama_server(binary: Path, threads: int, reqs: dict, ref: dict) -> dict:
    """llama.cpp's server on the model's GGUF file as shipped (module doc)."""
    import tempfile

    from kvql.backends.loader import builtin_gguf

    port, n = free_port(), len(reqs["fewshot_cold"])
    bodies = {w: [{k: v for k, v in b.items() if k != "structured_outputs"}
                  | ({"json_schema": b["structured_outputs"]["json"]} if "structured_outputs" in b else {})
                  for b in bs] for w, bs in reqs.items()}
    with tempfile.TemporaryDirectory() as staging:
        gguf = builtin_gguf(NAME, Path(staging))
        print(f"  llama.cpp on {gguf.name} ({gguf.stat().st_size / 2**20:.0f} MiB)", flush=True)
        return _served("llama", [str(binary), "-m", str(gguf), "--port", str(port), "-t", str(threads), "-tb",
                                 str(threads), "--parallel", str(n), "--kv-unified", "-c", str(2048 * n),
                                 "--alias", NAME, "--no-webui"], port, bodies, ref)


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = [d for d in results if "vllm" in results[d]]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / max(1, len(dtypes))
    for i, d in enumerate(dtypes):
        ratios = [results[d]["vllm"][w]["wall_s"] / results[d]["kvql"][w]["wall_s"] for w in WORKLOADS]
        bars = ax.bar([x + i * width for x in range(len(WORKLOADS))], ratios, width, label=d)
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks([x + width * (len(dtypes) - 1) / 2 for x in range(len(WORKLOADS))], WORKLOADS)
    ax.set_ylabel("vLLM time / kvql time (> 1: kvql faster)")
    ax.set_title("kvql serve vs vLLM CPU, SmolLM2-135M, same client and dtype")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    global NAME
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 requests per workload instead of 24")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads of each server")
    ap.add_argument("--no-vllm", action="store_true", help="kvql serve only (no ratios)")
    ap.add_argument("--model", default=NAME, help="a built-in model: smollm2-135m or gemma3-270m")
    ap.add_argument("--llama-server", type=Path, default=None, metavar="PATH",
                    help="llama.cpp's llama-server: also run it on the model's GGUF file as shipped")
    ap.add_argument("--weights", default="", help="also kvql serve --weights W (bf16 activations) for each W of this "
                    "comma-separated list (gguf, int8, int4); vLLM runs the dtypes only")
    args = ap.parse_args()
    NAME = args.model
    from kvql.backends.loader import load_tokenizer

    tok = load_tokenizer(NAME)
    reqs = requests(tok, 8 if args.quick else 24)
    results: dict = {}
    runs = [(d, d, None) for d in filter(None, args.dtypes.split(","))]
    runs += [(f"{w} weights", "bfloat16", w) for w in filter(None, args.weights.split(","))]
    for label, dtype, weights in runs:
        print(f"\n== {label}: reference (each request alone, uncached) ...", flush=True)
        t = time.perf_counter()
        ref = reference(dtype, reqs, weights)
        print(f"   reference took {time.perf_counter() - t:.0f} s", flush=True)
        results[label] = {"kvql": run_kvql(dtype, args.threads, reqs, ref, weights)}
        if not args.no_vllm and weights is None:
            results[label]["vllm"] = run_vllm(dtype, args.threads, reqs, ref)
    llama = run_llama_server(args.llama_server, args.threads, reqs, ref) if args.llama_server else None
    if llama is not None:
        print("\nllama.cpp (the GGUF file's own bits) time / kvql time (> 1: kvql faster), per kvql dtype or weights")
        for w in WORKLOADS:
            print(f"{w:<14}" + "".join(f"{d:>14} {llama[w]['wall_s'] / r['kvql'][w]['wall_s']:5.2f}x"
                                       for d, r in results.items()))
        results["llama.cpp"] = llama
    print("\nvLLM time / kvql time (> 1: kvql faster); answers equal to the uncached solo reference, kvql | vLLM")
    dtypes = [d for d in results if d != "llama.cpp"]
    print(f"{'workload':<14}" + "".join(f"{d:>30}" for d in dtypes))
    for w in WORKLOADS:
        cells = []
        for d, r in ((d, results[d]) for d in dtypes):
            k = r["kvql"][w]
            v = r.get("vllm", {}).get(w)
            ratio = f"{v['wall_s'] / k['wall_s']:.2f}x" if v else "-"
            eq = f"{k['answers_equal'][0]}|{v['answers_equal'][0] if v else '-'}/{k['answers_equal'][1]}"
            over = f"{k['overhead']:.2f}" if "overhead" in k else "-"
            cells.append(f"{ratio:>8} {eq:>10} ovh {over:>5}")
        print(f"{w:<14}" + "".join(f"{c:>30}" for c in cells))
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    stem = "vs_vllm" if NAME == "smollm2-135m" else f"vs_vllm_{NAME}"
    (out / f"{stem}.json").write_text(json.dumps(results, indent=2))
    if not args.no_vllm:
        plot(results, out / f"{stem}.png")
    print(f"wrote {out / (stem + '.json')}" + ("" if args.no_vllm else f" and {out / (stem + '.png')}"))


if __name__ == "__main__":
    main()
