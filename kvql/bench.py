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
Answers equal: kvql's answers against HF one-at-a-time's, where both decode the same thing (greedy and
unconstrained: fewshot, chat); tot samples, json and classify are constrained or sampled on one side only.
Repeats: each point (workload, size, system) is timed `repeats` times, kvql's from an empty cache each time;
queries/s and speed-ups are from the best (min) time, the median is kept beside it.
Noise: a busy machine makes any comparison meaningless, so each point records the share of the machine's
CPU time that other processes used while it ran (from /proc/stat less this process's own CPU time), and
its spread (median over min, less 1). A run whose others' share passes BUSY_SHARE, or a point past it or
past SPREAD, is flagged in the table (`!`) and in a warning line, and the figure says so in red.
Results go to `DIR/bench.json` and one figure `DIR/bench.png` (bench_report.py: the figure and the table).
Importing this module is light (no torch): the command line reads WORKLOADS before it loads anything.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from datetime import datetime
from pathlib import Path

from .backends.dtype import name as dtype_name
from .bench_report import plot

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
COMPARABLE = ("fewshot", "chat")  # greedy and unconstrained on both sides: answers should be equal


def cpu_sample() -> dict | None:
    """Now: wall clock, this process's CPU seconds (all its threads), the whole machine's busy CPU
    seconds (/proc/stat: all but idle and iowait; steal counts, a neighbour took it). None without
    /proc/stat (not Linux): noise is then not measured."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return None
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    return {"wall": time.perf_counter(), "own": time.process_time(), "busy": busy}


def others_share(before: dict | None, after: dict | None, cores: int) -> float | None:
    """The share of the machine's CPU capacity (`cores` for the wall time between two `cpu_sample`s) that
    other processes used; None when either sample is missing."""
    if before is None or after is None or after["wall"] <= before["wall"]:
        return None
    others = (after["busy"] - before["busy"]) - (after["own"] - before["own"])
    return max(0.0, others / ((after["wall"] - before["wall"]) * cores))


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


def _run_kvql(model, reqs) -> tuple[list[list[int]], list[list[int]], int, list[str]]:
    """Run the workload on kvql; -> (prompt ids sent, prompt + generated ids of each, queries answered,
    answers)."""
    tok = model.tokenizer
    if reqs and "turn" in reqs[0]:  # chat: the conversation grows by each answer
        convo, sent, histories, answers = "", [], [], []
        for r in reqs:
            convo += r["prompt"]
            ids = tok.encode(convo)
            (c,) = model.generate([ids], max_tokens=r["max_tokens"])
            sent.append(ids)
            histories.append(ids + c.token_ids)
            answers.append(tok.decode(c.token_ids, skip_special_tokens=True))
            convo += answers[-1] + "\n"  # as the baseline continues it
        return sent, histories, len(reqs), answers
    opts = {k: v for k, v in reqs[0].items() if k != "prompt"}
    ids = [tok.encode(r["prompt"]) for r in reqs]
    out = model.generate(ids, **opts)
    sent = [ids[c.index] for c in out]
    answers = [tok.decode(c.token_ids, skip_special_tokens=True) for c in out]
    return sent, [p + c.token_ids for p, c in zip(sent, out)], len(out), answers


def _run_hf(hf, tok, reqs, batch: bool) -> tuple[int, list[str] | None]:
    """Plain transformers: `generate` per request, or `generate_batch` for all of a step;
    -> (queries answered, answers: one per query, one at a time only)."""
    import torch
    from transformers import GenerationConfig

    def config(r):
        sample = r.get("temperature", 0) > 0
        return GenerationConfig(max_new_tokens=r["max_tokens"], do_sample=sample, temperature=r.get("temperature", 1.0),
                                num_return_sequences=r.get("n", 1), pad_token_id=tok.eos_token_id,
                                eos_token_id=tok.eos_token_id)

    with torch.inference_mode():  # (torch imported here: the module's import stays light)
        answers = []
        if reqs and "turn" in reqs[0]:
            convo = ""
            for r in reqs:
                convo += r["prompt"]
                ids = torch.tensor([tok.encode(convo)])
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config(r))
                answers.append(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
                convo += answers[-1] + "\n"
            return len(answers), answers
        if batch:
            from transformers.generation.configuration_utils import ContinuousBatchingConfig

            cb = ContinuousBatchingConfig(page_size=32, num_blocks=512, max_batch_tokens=512)
            ids = [tok.encode(r["prompt"]) for r in reqs for _ in range(reqs[0].get("n", 1))]
            cfg = config(reqs[0])
            cfg.num_return_sequences = 1
            return len(hf.generate_batch(ids, generation_config=cfg, continuous_batching_config=cb)), None
        for r in reqs:
            ids = torch.tensor([tok.encode(r["prompt"])])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config(r))
            answers += [tok.decode(row[ids.shape[1]:], skip_special_tokens=True) for row in out]
        return len(answers), answers


def _meta(model, repeats: int) -> dict:
    import torch
    import transformers

    return {"repeats": repeats, "model": getattr(model, "name", "model"),
            "device": str(getattr(model, "device", "cpu")),
            "dtype": dtype_name(model.hf_model.dtype), "threads": torch.get_num_threads(),
            "date": datetime.now().strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__,
            "transformers": transformers.__version__}


def _warm_up(model, hf_plain, hf_batch) -> None:
    """One small request per system before timing, so that no first point pays for one-time set-up."""
    reqs = requests("fewshot", 1)
    _run_kvql(model, reqs)
    _run_hf(hf_plain, model.tokenizer, reqs, batch=False)
    if hf_batch is not None:
        try:
            _run_hf(hf_batch, model.tokenizer, reqs, batch=True)
        except Exception:  # reported where it is measured
            pass
    model.clear_cache()


def _timed(fn, repeats: int, before_each=None) -> tuple[list[float], object]:
    """`fn()` timed `repeats` times (`before_each()` untimed before each); -> (seconds of each, last result)."""
    seconds = []
    for _ in range(repeats):
        if before_each is not None:
            before_each()
        t = time.perf_counter()
        result = fn()
        seconds.append(time.perf_counter() - t)
    return seconds, result


def _record(row: dict, system: str, seconds: list[float], answered: int) -> None:
    row["seconds"][system], row["median_seconds"][system] = min(seconds), statistics.median(seconds)
    row[system] = answered / min(seconds)
    spread = statistics.median(seconds) / min(seconds) - 1 if len(seconds) > 1 else None
    if spread is not None:
        row["spread"] = max(row.get("spread") or 0.0, spread)


def run(model, workloads=WORKLOADS, sizes=(2, 4, 8), out_dir: str | Path = "bench-results", progress: bool = True,
        batch_baseline: bool = True, repeats: int = 1, sample=cpu_sample) -> dict:
    """Run the suite on a kvql `Model` (the baselines run a plain copy of its `hf_model`); write JSON and PNG.
    Each row: `n`; per system its queries/s (`kvql`, `hf_one_at_a_time`, `hf_generate_batch`) from its best
    of `repeats` times, and wall seconds: the best (`seconds`) and the median (`median_seconds`);
    `kvql_vs_<system>` ratios of queries/s; kvql's `hit_rate` and the `optimal_hit_rate`; `answers_equal`
    [equal, total] against one at a time (None: not comparable); `spread` (the largest median / best - 1 of
    its systems; None with one repeat) and `others_share` (other processes' share of the CPU while the row
    ran; None unmeasured). `results["machine"]`: `cores` and the run's `others_share`. `sample`: what
    `cpu_sample` returns (tests pass their own)."""
    import copy

    from tqdm.auto import tqdm

    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    hf_plain = model.plain_copy()  # the baselines run plain transformers
    hf_batch = copy.deepcopy(hf_plain) if batch_baseline else None  # (continuous batching changes its model)
    systems = ["kvql", "hf_one_at_a_time"] + (["hf_generate_batch"] if batch_baseline else [])
    cores = os.cpu_count() or 1  # /proc/stat's first line sums every CPU of the machine
    results: dict = {"meta": _meta(model, repeats), "sizes": list(sizes), "systems": systems, "workloads": {}}
    _warm_up(model, hf_plain, hf_batch)
    bar = tqdm(total=len(workloads) * len(sizes) * len(systems), desc="kvql bench", disable=not progress)
    start = sample()
    for w in workloads:
        results["workloads"][w] = [_row(model, w, n, systems, (hf_plain, hf_batch), repeats, sample, cores, bar)
                                   for n in sizes]
    bar.close()
    results["machine"] = {"cores": cores, "others_share": others_share(start, sample(), cores)}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(results, indent=1))
    plot(results, out / "bench.png")
    return results


def _row(model, w: str, n: int, systems: list[str], baselines: tuple, repeats: int, sample, cores: int, bar) -> dict:
    """One point of `run`: workload `w` with `n` queries on every system (module doc)."""
    hf_plain, hf_batch = baselines
    reqs = requests(w, n)
    row = {"n": n, "seconds": {}, "median_seconds": {}, "spread": None}
    row_start = sample()
    before = model.stats()
    seconds, (sent, histories, answered, kvql_answers) = _timed(lambda: _run_kvql(model, reqs), repeats,
                                                                model.clear_cache)
    _record(row, "kvql", seconds, answered)
    after = model.stats()  # over every repeat, each from an empty cache: one run's rate
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    row["hit_rate"] = (after["cached_tokens"] - before["cached_tokens"]) / prompt if prompt else 0.0
    # forks of one prompt (tot) count it once, as the engine does
    unique = list({tuple(p): p for p in sent}.values()) if reqs[0].get("n", 1) > 1 else sent
    row["optimal_hit_rate"] = optimal_hit_rate(unique, None if unique is not sent else histories)
    row["answers_equal"] = None
    bar.update(1)
    for system in systems[1:]:
        batch = system == "hf_generate_batch"
        try:
            seconds, (answered, answers) = _timed(
                lambda: _run_hf(hf_batch if batch else hf_plain, model.tokenizer, reqs, batch=batch), repeats)
            _record(row, system, seconds, answered)
            row[f"kvql_vs_{system}"] = row["kvql"] / row[system]
            if system == "hf_one_at_a_time" and w in COMPARABLE and answers is not None:
                row["answers_equal"] = [sum(a == b for a, b in zip(kvql_answers, answers)), len(answers)]
        except Exception as e:  # a baseline that cannot run here is reported, not hidden
            row[system], row[f"{system}_error"] = None, f"{type(e).__name__}: {e}"[:300]
        bar.update(1)
    row["others_share"] = others_share(row_start, sample(), cores)
    return row
