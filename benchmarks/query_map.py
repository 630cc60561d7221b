"""Few-shot QA as an LMQL query: kvql `map` over all questions vs one run at a time with the cache cleared.

The query (the workload of fewshot_qa.py, same ~290-token prefix and questions):

    "{PREFIX}Q: {question}\\nA:[ANSWER]" where STOPS_AT(ANSWER, "\\n") and len(TOKENS(ANSWER)) < 10
    return ANSWER.strip()

Systems, side by side in one process on SmolLM2-135M (CPU, fp32, 1 torch thread):
  1. one_at_a_time_uncached: each question run alone, `clear_cache()` before each (what LMQL does: it
     recomputes every prompt from scratch). Its answers are the reference.
  2. kvql_map: `answer.map(questions)`, all runs concurrent in the engine, cold cache.
  3. lmql_0.7.3 (with --lmql-python): the real LMQL in its own venv (see lmql_baseline.py), run as a
     subprocess in this same benchmark run: its sequential and asyncio.gather walls.
Reported: wall time, questions/s, speed-up vs one-at-a-time, answers equal, cache hit rate.

Usage: python benchmarks/query_map.py [--quick] [--lmql-python /work/lmql-venv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
import kvql  # noqa: E402
from fewshot_qa import PREFIX, QUESTIONS  # noqa: E402


@kvql.query
def answer(question):
    '''lmql
    "{PREFIX}Q: {question}\nA:[ANSWER]" where STOPS_AT(ANSWER, "\n") and len(TOKENS(ANSWER)) < 10
    return ANSWER.strip()
    '''


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 questions instead of 24")
    ap.add_argument("--lmql-python", help="python of a venv with lmql 0.7.3 (runs benchmarks/lmql_baseline.py)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    questions = [q for q, _ in QUESTIONS[:8 if args.quick else 24]]
    n = len(questions)
    m = kvql.model("smollm2-135m", dtype="float32")  # exact: batched answers equal one-at-a-time ones
    kvql.set_default_model(m)
    answer("warm-up?")

    t = time.perf_counter()
    reference = []
    for q in questions:
        m.clear_cache()
        reference.append(answer(q))
    base = time.perf_counter() - t

    m.clear_cache()
    before = m.stats()
    t = time.perf_counter()
    mapped = answer.map(questions, progress=False)
    wall = time.perf_counter() - t
    after = m.stats()
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    hit = (after["cached_tokens"] - before["cached_tokens"]) / prompt

    rows = [("one_at_a_time_uncached", base, n, None), ("kvql_map", wall, sum(a == b for a, b in zip(mapped, reference)), hit)]
    if args.lmql_python:
        out = HERE / "results" / "lmql_baseline.json"
        subprocess.run([args.lmql_python, str(HERE / "lmql_baseline.py"), "--out", str(out)]
                       + (["--quick"] if args.quick else []), check=True, capture_output=True)
        lm = json.loads(out.read_text())
        for key in ("lmql_sequential", "lmql_concurrent"):
            answers = [a[key].strip() for a in lm["answers"]]
            rows.append((f"{key}_0.7.3", lm["wall_s"][key], sum(a == b for a, b in zip(answers, reference)), None))

    print(f"few-shot QA query, {n} questions, prefix ~290 tokens, SmolLM2-135M, 1 torch thread")
    print(f"{'system':<28}{'wall s':>8}{'q/s':>8}{'speed-up':>10}{'equal':>8}{'hit rate':>10}")
    for name, w, eq, h in rows:
        print(f"{name:<28}{w:8.2f}{n / w:8.2f}{base / w:9.2f}x{f'{eq}/{n}':>8}{'' if h is None else f'{h:10.2f}'}")
    results = {"questions": n, "rows": [dict(system=a, wall_s=b, answers_equal=c, hit_rate=d) for a, b, c, d in rows],
               "answers": dict(zip(questions, reference))}
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "query_map.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
