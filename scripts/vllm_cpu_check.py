"""Check and measure a vLLM server started by scripts/vllm_cpu_server.sh (run it with .vllm-venv/bin/python).

Usage: .vllm-venv/bin/python scripts/vllm_cpu_check.py [PORT [WARM_RUNS]]   (defaults 8765, 1)

Run it on a freshly started server: the few-shot workload goes first, so that its first run is cold.
Prints one JSON object of facts; exits non-zero if a check fails.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from fewshot_qa import PREFIX, QUESTIONS, qa  # noqa: E402  (imports torch and kvql; both import in .vllm-venv)

PORT = int(sys.argv[1]) if len(sys.argv) > 1 else 8765
WARM_RUNS = int(sys.argv[2]) if len(sys.argv) > 2 else 1
BASE = f"http://127.0.0.1:{PORT}/v1"
MODEL = "smollm2-135m"
client = openai.OpenAI(base_url=BASE, api_key="none")
facts: dict = {}
failures: list[str] = []


def check(name: str, ok: bool, detail=None) -> None:
    facts.setdefault("checks", {})[name] = {"ok": bool(ok), "detail": detail}
    if not ok:
        failures.append(name)


def cached(usage) -> int:
    d = getattr(usage, "prompt_tokens_details", None)
    return (d.cached_tokens or 0) if d is not None else 0


async def fewshot(label: str) -> None:
    aclient = openai.AsyncOpenAI(base_url=BASE, api_key="none")
    prompts = [PREFIX + qa(q) for q, _ in QUESTIONS]  # qa(q) == f"Q: {q}\nA:"
    t0 = time.perf_counter()
    rs = await asyncio.gather(*(aclient.completions.create(
        model=MODEL, prompt=p, max_tokens=10, temperature=0, stop=["\n"]) for p in prompts))
    wall = time.perf_counter() - t0
    await aclient.close()
    answers = [r.choices[0].text.split("\n")[0].strip() for r in rs]
    entry = {"wall_s": round(wall, 3), "answers": answers,
             "prompt_tokens": sum(r.usage.prompt_tokens for r in rs),
             "cached_tokens": sum(cached(r.usage) for r in rs)}
    ref_path = ROOT / "benchmarks" / "results" / "fewshot_qa.json"
    if ref_path.is_file():
        ref = json.loads(ref_path.read_text()).get("answers", {}).get("reference")
        if ref:
            entry["equal_to_reference"] = sum(a == b for a, b in zip(answers, ref))
            entry["differences"] = [(i, a, b) for i, (a, b) in enumerate(zip(answers, ref)) if a != b]
    facts[f"fewshot_{label}"] = entry


def main() -> int:
    # 1. few-shot workload, 24 concurrent requests: cold, then warm.
    asyncio.run(fewshot("cold"))
    asyncio.run(fewshot("warm"))
    if WARM_RUNS > 1:
        walls = [facts["fewshot_warm"]["wall_s"]]
        for _ in range(WARM_RUNS - 1):
            asyncio.run(fewshot("warm"))
            walls.append(facts["fewshot_warm"]["wall_s"])
        facts["fewshot_warm_walls_s"] = walls

    # 2. /v1/models
    models = client.models.list()
    check("models", [m.id for m in models.data] == [MODEL], [m.id for m in models.data])

    # 3. greedy completion, max_tokens 8, twice: same text.
    a = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    b = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    check("greedy_repeatable", a.choices[0].text == b.choices[0].text,
          {"text": a.choices[0].text, "usage": a.usage.model_dump()})

    # 4. prefix cache: a prompt of more than one block, sent twice.
    long_prompt = "Here is a list of fruits: " + ", ".join(f"fruit number {i}" for i in range(120)) + ". The last"
    r1 = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=4, temperature=0)
    r2 = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=4, temperature=0)
    check("prefix_cache_hit", cached(r2.usage) > 0,
          {"prompt_tokens": r2.usage.prompt_tokens, "cached_first": cached(r1.usage),
           "cached_second": cached(r2.usage)})
    short = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=1, temperature=0)
    facts["short_prompt_cached_tokens_on_repeat"] = cached(short.usage)

    # 5. structured outputs (vLLM's own field), through extra_body.
    rx = client.completions.create(model=MODEL, prompt="Pick a number: ", max_tokens=8, temperature=0,
                                   extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
    t = rx.choices[0].text
    check("structured_regex", len(t) == 3 and t.isdigit(), {"text": t, "finish_reason": rx.choices[0].finish_reason})
    ch = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=8, temperature=0,
                                   extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    check("structured_choice", ch.choices[0].text in ("yes", "no"), {"text": ch.choices[0].text})
    # the removed field: accepted (200) and ignored
    old = client.completions.create(model=MODEL, prompt="Pick a number: ", max_tokens=8, temperature=0,
                                    extra_body={"guided_regex": "[0-9]{3}"})
    facts["guided_regex_old_field"] = {"text": old.choices[0].text,
                                       "constrained": len(old.choices[0].text) == 3 and old.choices[0].text.isdigit()}

    # 6. chat completions, plain and with a choice constraint.
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is 2+2?"}],
                                       max_tokens=16, temperature=0)
    check("chat", bool(c.choices[0].message.content), {"content": c.choices[0].message.content,
                                                       "usage": c.usage.model_dump()})
    cc = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Is fire hot?"}],
                                        max_tokens=4, temperature=0,
                                        extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    check("chat_choice", cc.choices[0].message.content in ("yes", "no"), cc.choices[0].message.content)

    # 7. streaming: completions and chat.
    pieces = [ev.choices[0].text for ev in client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True) if ev.choices]
    check("stream_completions", "".join(pieces) == a.choices[0].text, {"chunks": len(pieces), "pieces": pieces})
    chunks = [ev.choices[0].delta.content or "" for ev in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is 2+2?"}], max_tokens=16, temperature=0,
        stream=True) if ev.choices]
    check("stream_chat", "".join(chunks) == c.choices[0].message.content, {"chunks": len(chunks)})

    facts["failures"] = failures
    print(json.dumps(facts, indent=1, ensure_ascii=False))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
