"""`kvql bench`: workloads run by kvql and by plain transformers side by side, in one process.

Workloads (each a list of *steps*; the requests of one step are independent, a step may depend on the
answers of the previous one):
- fewshot:  N questions after one shared few-shot prefix, greedy, <= 8 tokens.
- chat:     one conversation growing turn by turn, N turns, each prompt = the conversation so far.
- tot:      tree of thought: one problem, N sampled branches of 16 tokens (kvql: `n=N` forks).
- json:     N extractions with a JSON schema (kvql: enforced by the grammar; HF: unconstrained).
- classify: N texts labelled with one of 4 choices (kvql: exact choices; HF: a few free tokens).
Systems: kvql (all requests of a step at once), HF `generate` one request at a time, HF `generate_batch`
(continuous batching). Reported per workload and size: queries/s, ratios to HF one-at-a-time, kvql's
cache hit rate and the optimal hit rate (share of prompt tokens that an earlier prompt already held).
Results go to `DIR/bench.json` and a plot `DIR/bench.png` (throughput vs number of queries per system).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

PREFIX = "".join(f"Q: {q}\nA: {a}\n" for q, a in [
    ("What is the capital of France?", "Paris"), ("How many legs does a spider have?", "Eight"),
    ("What color is the sky?", "Blue"), ("What is 2 + 2?", "4"), ("Which animal barks?", "Dog")] * 3)
TOPICS = ["Italy", "Japan", "Egypt", "Peru", "Canada", "Kenya", "Norway", "India", "Chile", "Spain", "Ghana",
          "Nepal", "Cuba", "Iran", "Laos", "Mali"]
LABELS = ["positive", "negative", "neutral", "mixed"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def _topic(i: int) -> str:
    return TOPICS[i % len(TOPICS)] + ("" if i < len(TOPICS) else f" #{i}")


def requests(workload: str, n: int):
    """-> (kind, list of request dicts); `chat` is sequential: each prompt extends the previous answer."""
    if workload == "fewshot":
        return [dict(prompt=f"{PREFIX}Q: What is the capital of {_topic(i)}?\nA:", max_tokens=8) for i in range(n)]
    if workload == "tot":
        return [dict(prompt=f"{PREFIX}Problem: plan a trip to {_topic(0)}. Thought:", max_tokens=16, n=n,
                     temperature=1.0, seed=0)]
    if workload == "json":
        return [dict(prompt=f"{PREFIX}Extract as JSON: {_topic(i)} is a person aged {20 + i}.\nJSON:",
                     max_tokens=24, json_schema=SCHEMA) for i in range(n)]
    if workload == "classify":
        return [dict(prompt=f"{PREFIX}Review: the trip to {_topic(i)} was fine.\nSentiment:", max_tokens=3,
                     choices=LABELS) for i in range(n)]
    if workload == "chat":
        return [dict(prompt=f"User: tell me about {_topic(i)}.\nAssistant:", max_tokens=8, turn=i) for i in range(n)]
    raise ValueError(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")


WORKLOADS = ("fewshot", "chat", "tot", "json", "classify")


def optimal_hit_rate(prompts: list[list[int]], histories: list[list[int]] | None = None) -> float:
    """Share of prompt tokens that appeared earlier as a prefix (the last token is always computed).
    `histories[i]`: what request i left behind (its prompt and generated tokens), default the prompts."""
    histories = prompts if histories is None else histories
    hit = total = 0
    for i, p in enumerate(prompts):
        best = 0
        for q in histories[:i]:
            k = 0
            while k < min(len(p) - 1, len(q)) and p[k] == q[k]:
                k += 1
            best = max(best, k)
        hit, total = hit + best, total + len(p)
    return hit / total if total else 0.0


def _run_kvql(model, reqs) -> tuple[list[list[int]], list[list[int]], int]:
    """Run the workload on kvql; -> (prompt ids sent, prompt + generated ids of each, queries answered)."""
    tok = model.tokenizer
    if reqs and "turn" in reqs[0]:  # chat: the conversation grows by each answer
        convo, sent, histories = "", [], []
        for r in reqs:
            convo += r["prompt"]
            ids = tok.encode(convo)
            (c,) = model.generate([ids], max_tokens=r["max_tokens"])
            sent.append(ids)
            histories.append(ids + c.token_ids)
            convo += c.text + "\n"
        return sent, histories, len(reqs)
    opts = {k: v for k, v in reqs[0].items() if k != "prompt"}
    ids = [tok.encode(r["prompt"]) for r in reqs]
    out = model.generate(ids, **opts)
    sent = [ids[c.index] for c in out]
    return sent, [p + c.token_ids for p, c in zip(sent, out)], len(out)


@torch.inference_mode()
def _run_hf(hf, tok, reqs, batch: bool) -> int:
    """Plain transformers: `generate` per request, or `generate_batch` for all of a step."""
    from transformers import GenerationConfig

    def config(r):
        sample = r.get("temperature", 0) > 0
        return GenerationConfig(max_new_tokens=r["max_tokens"], do_sample=sample, temperature=r.get("temperature", 1.0),
                                num_return_sequences=r.get("n", 1), pad_token_id=tok.eos_token_id,
                                eos_token_id=tok.eos_token_id)

    answered = 0
    if reqs and "turn" in reqs[0]:
        convo = ""
        for r in reqs:
            convo += r["prompt"]
            ids = torch.tensor([tok.encode(convo)])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config(r))
            convo += tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True) + "\n"
            answered += 1
        return answered
    if batch:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        cb = ContinuousBatchingConfig(page_size=32, num_blocks=512, max_batch_tokens=512)
        ids = [tok.encode(r["prompt"]) for r in reqs for _ in range(reqs[0].get("n", 1))]
        cfg = config(reqs[0])
        cfg.num_return_sequences = 1
        return len(hf.generate_batch(ids, generation_config=cfg, continuous_batching_config=cb))
    for r in reqs:
        ids = torch.tensor([tok.encode(r["prompt"])])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config(r))
        answered += out.shape[0]
    return answered


def run(model, workloads=WORKLOADS, sizes=(2, 4, 8), out_dir: str | Path = "bench-results", progress: bool = True,
        batch_baseline: bool = True) -> dict:
    """Run the suite on a kvql `Model` (its `hf_model` is the baseline's model); write JSON and PNG."""
    import copy

    from tqdm.auto import tqdm

    hf_batch = copy.deepcopy(model.hf_model) if batch_baseline else None
    if hf_batch is not None:
        hf_batch.set_attn_implementation("sdpa")
    systems = ["kvql", "hf_one_at_a_time"] + (["hf_generate_batch"] if batch_baseline else [])
    results: dict = {"sizes": list(sizes), "workloads": {}}
    bar = tqdm(total=len(workloads) * len(sizes) * len(systems), desc="kvql bench", disable=not progress)
    for w in workloads:
        rows = []
        for n in sizes:
            reqs = requests(w, n)
            row = {"n": n}
            model.clear_cache()
            before = model.stats()
            t = time.perf_counter()
            sent, histories, answered = _run_kvql(model, reqs)
            row["kvql"] = answered / (time.perf_counter() - t)
            after = model.stats()
            prompt = after["prompt_tokens"] - before["prompt_tokens"]
            row["hit_rate"] = (after["cached_tokens"] - before["cached_tokens"]) / prompt if prompt else 0.0
            # forks of one prompt (tot) count it once, as the engine does
            unique = list({tuple(p): p for p in sent}.values()) if reqs[0].get("n", 1) > 1 else sent
            row["optimal_hit_rate"] = optimal_hit_rate(unique, None if unique is not sent else histories)
            bar.update(1)
            for system in systems[1:]:
                t = time.perf_counter()
                try:
                    answered = _run_hf(hf_batch if system == "hf_generate_batch" else model.hf_model,
                                       model.tokenizer, reqs, batch=system == "hf_generate_batch")
                    row[system] = answered / (time.perf_counter() - t)
                    row[f"kvql_vs_{system}"] = row["kvql"] / row[system]
                except Exception as e:  # a baseline that cannot run here is reported, not hidden
                    row[system], row[f"{system}_error"] = None, f"{type(e).__name__}: {e}"[:300]
                bar.update(1)
            rows.append(row)
        results["workloads"][w] = rows
    bar.close()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(results, indent=1))
    _plot(results, systems, out / "bench.png")
    return results


def _plot(results: dict, systems: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["workloads"])
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.2), squeeze=False)
    for ax, w in zip(axes[0], names):
        rows = results["workloads"][w]
        for system in systems:
            points = [(r["n"], r[system]) for r in rows if r.get(system) is not None]
            if points:
                ax.plot(*zip(*points), marker="o", label=system)
        ax.set_title(w)
        ax.set_xlabel("queries")
        ax.set_ylabel("queries / s")
        ax.set_xscale("log", base=2)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def print_table(results: dict) -> None:
    for w, rows in results["workloads"].items():
        for r in rows:
            others = "  ".join(f"vs {k[8:]} {v:5.2f}x" for k, v in r.items() if k.startswith("kvql_vs_"))
            print(f"{w:<9} n={r['n']:<3} kvql {r['kvql']:7.2f} q/s  {others}  hit {r['hit_rate']:.2f} "
                  f"(optimal {r['optimal_hit_rate']:.2f})")
