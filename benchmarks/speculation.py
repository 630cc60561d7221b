"""Speculative decoding on vs off (issue 27): one request at a time, the same outputs, how much faster.

What is measured (one process, side by side, each model in --models and dtype in --dtypes)
-------------------------------------------------------------------------------------------
Workloads, each a list of prompts run one after another (batch 1), greedy, up to --max-tokens new tokens:
- few-shot, new inputs: a 4-example few-shot prompt turning a sentence into JSON, then 6 new sentences (the
  answers repeat the examples' format and copy names from their own sentence);
- few-shot, seen inputs: the same 6 sentences asked again (a query run again: answers repeat exactly);
- extraction: a ~450-token document, asked to copy out its product lines and to quote a paragraph;
- free text: three open prompts (stories, an explanation): little to draft; speculation must not lose;
- batched: the few-shot prompts of 24 sentences (the 6 new ones, 4 times) submitted at once: drafting waits
  until at most 4 requests run, so it must cost nothing there.
Each workload runs with the engine's `speculate` off and on, alternating, on an empty cache each time
(the few-shot prefix is then shared within a run, as it is for users); wall time of the whole workload, the
best of --repeats; "decode off/on" is the same ratio over each request's decode (the seconds from its first token
to its end, summed; the prefill, the same on and off, left out; batched: the wall). Outputs are compared token for token; the drafted and accepted token counts are the
engine's stats. The ratio is off / on wall time (> 1: speculation helps). Prompts are plain text (the
chat template of SmolLM2-Instruct where --chat and the tokenizer has one; Gemma 3 270M is a base model).
The machine is shared and noisy: only ratios inside one run mean much. Usage:
    .venv/bin/python benchmarks/speculation.py [--models smollm2-135m,gemma3-270m] [--dtypes float32,bfloat16]
        [--max-tokens 96] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch

import kvql
from kvql.backends.dtype import resolve
from kvql.backends.loader import load_hf

EXAMPLES = [
    ("In 1998, Maria Lopez moved to Madrid to study architecture.", "Maria Lopez", "Madrid", 1998),
    ("The painter Jan Kowalski opened his first studio in Warsaw in 2004.", "Jan Kowalski", "Warsaw", 2004),
    ("Akira Tanaka won the Osaka marathon in 2011.", "Akira Tanaka", "Osaka", 2011),
    ("Back in 1975, Helen Brooks taught mathematics in Chicago.", "Helen Brooks", "Chicago", 1975),
]
INPUTS = [
    "In 2016, Pierre Dubois founded a bakery in Lyon.",
    "Sofia Rossi graduated from the university of Milan in 1989.",
    "The chemist Lars Nilsson moved to Stockholm in 2001.",
    "Amara Okafor gave her first concert in Lagos in 2019.",
    "In 1964, David Cohen started a newspaper in Boston.",
    "Elena Petrova painted the old harbour of Odessa in 1932.",
]


def few_shot(sentence: str) -> str:
    shots = "".join(f'Sentence: {s}\nJSON: {{"person": "{p}", "city": "{c}", "year": {y}}}\n\n'
                    for s, p, c, y in EXAMPLES)
    return f"Extract the person, the city and the year of each sentence as JSON.\n\n{shots}Sentence: {sentence}\nJSON:"


DOCUMENT = """Northwind Outfitters - spring catalogue, internal summary

Northwind Outfitters sells equipment for hiking, climbing and camping through its shops in Bergen, Tromso and
Oslo. This summary lists the products the buying team confirmed for the spring season, with their retail prices.

Product list:
- Fjellstav trekking pole, carbon, pair: 89 euros
- Bergen 40 rucksack, waterproof, 40 litres: 149 euros
- Polar Night sleeping bag, comfort rating minus 10 degrees: 229 euros
- Lysne headlamp, 400 lumen, rechargeable: 45 euros
- Tind climbing harness, adjustable leg loops: 79 euros
- Vidde two-person tent, 2.1 kilograms: 319 euros

Delivery: the rucksacks and the tents arrive from the warehouse in Hamburg in the second week of March; the
other products are already in stock in all three shops. The buying team expects the Polar Night sleeping bag
to sell out before April, as it did last year, and has ordered twice as many as in the previous season.

Returns: customers may return any product within 60 days with the receipt. Used tents and sleeping bags are
inspected in the Oslo workshop before a refund is made; the workshop answers within five working days.

Contact: questions about this summary go to the buying team, Ingrid Solberg, at the Bergen office."""

EXTRACTION = [
    f"{DOCUMENT}\n\nCopy the product list of the document above exactly, one product per line.\n\nProduct list:\n-",
    f"{DOCUMENT}\n\nQuote the paragraph of the document above that is about returns, word for word.\n\nReturns:",
]
FREE = [
    "Write a short story about a robot who learns to paint. Once upon a time,",
    "Explain in simple words why the sky is blue.",
    "Here is a poem about the sea and the wind:\n",
]


def workloads() -> dict[str, list[str]]:
    return {"few-shot, new inputs": [few_shot(s) for s in INPUTS],
            "few-shot, seen inputs": [few_shot(s) for s in INPUTS],  # run after the first: see main()
            "extraction": EXTRACTION, "free text": FREE, "batched": [few_shot(s) for s in INPUTS * 4]}


def encode(tok, text: str, chat: bool) -> list[int]:
    if chat and getattr(tok, "chat_template", None):
        return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False)
    return tok(text)["input_ids"]


async def _one(m, prompt: list[int], options: dict) -> tuple[list[int], float]:
    """One prompt's tokens and the seconds from its first token to its end (its decode)."""
    first = []

    def on_update(*_):
        if not first:
            first.append(time.perf_counter())
    groups = await m.submit([prompt], on_update, **options)
    (done,) = await m.collect(groups)
    return done.token_ids, time.perf_counter() - first[0]


def run(m, prompts: list[list[int]], max_tokens: int, stop: tuple, warm: list[list[int]] | None, batched: bool):
    """(wall seconds, decode seconds, outputs, stats) of the prompts one after another, or all at once
    (`batched`: decode seconds = wall), after a cleared cache and `warm` run first, untimed."""
    options = dict(max_tokens=max_tokens, temperature=0, stop=list(stop))
    m.clear_cache()
    for p in warm or []:
        m.generate([p], **options)
    before = m.stats()
    t0 = time.perf_counter()
    if batched:
        out = [c.token_ids for c in m.generate(prompts, **options)]
        decode = None
    else:
        out, decode = [], 0.0
        for p in prompts:
            ids, seconds = asyncio.run(_one(m, p, options))
            out.append(ids)
            decode += seconds
    wall = time.perf_counter() - t0
    after = m.stats()
    counts = {k: after[k] - before[k] for k in ("drafted_tokens", "accepted_tokens", "generated_tokens")}
    return wall, wall if decode is None else decode, out, counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="smollm2-135m,gemma3-270m")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--chat", action="store_true", help="wrap prompts in the chat template where there is one")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    print(f"{'model':14} {'dtype':9} {'workload':22} {'tokens':>6} {'off s':>7} {'on s':>7} {'off/on':>7} "
          f"{'decode off/on':>13} {'accepted/drafted':>17} {'equal':>5}")
    for spec in a.models.split(","):
        for dtype_name in a.dtypes.split(","):
            dtype = resolve(dtype_name, "cpu")
            hf, tok = load_hf(spec, dtype=dtype)
            m = kvql.Model(hf, tok, name=spec, cache_budget="1GiB")
            try:
                jobs = {name: [encode(tok, t, a.chat) for t in texts] for name, texts in workloads().items()}
                for name, prompts in jobs.items():
                    stop = ("\n",) if name.startswith("few-shot") or name == "batched" else ()
                    warm = jobs["few-shot, new inputs"] if name == "few-shot, seen inputs" else None
                    best, decode, outs, counts = {}, {}, {}, {}
                    for _ in range(a.repeats):
                        for on in (False, True):
                            m.engine.speculate = on
                            wall, dec, out, c = run(m, prompts, a.max_tokens, stop, warm, name == "batched")
                            best[on] = min(best.get(on, wall), wall)
                            decode[on] = min(decode.get(on, dec), dec)
                            outs[on], counts[on] = out, c
                    c = counts[True]
                    tokens = c["generated_tokens"]
                    print(f"{spec:14} {str(dtype).split('.')[-1]:9} {name:22} {tokens:6d} {best[False]:7.2f} "
                          f"{best[True]:7.2f} {best[False] / best[True]:6.2f}x {decode[False] / decode[True]:12.2f}x "
                          f"{c['accepted_tokens']:>8}/{c['drafted_tokens']:<8} {str(outs[True] == outs[False]):>5}",
                          flush=True)
            finally:
                m.close()


if __name__ == "__main__":
    main()
