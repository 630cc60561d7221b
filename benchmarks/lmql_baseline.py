"""Baseline: the few-shot QA workload of fewshot_qa.py run with the real LMQL 0.7.3 (local: transformers backend, CPU).

The query, per question (prompt = fewshot_qa.PREFIX + "Q: <question>\\nA:"):

    argmax "{prefix}Q: {question}\\nA:[ANSWER]" where STOPS_AT(ANSWER, "\\n") and len(TOKENS(ANSWER)) < 10

The answer is ANSWER up to the first "\\n", stripped. The questions run (a) one after another and (b) all at once
with asyncio.gather (LMQL's in-process LMTP scheduler batches concurrent calls); one untimed warm-up query first;
torch uses 1 thread. Then HF transformers greedy generation one prompt at a time (fewshot_qa.hf_one_at_a_time, max
10 new tokens, stop after a token containing "\\n") gives the reference answers. Results go to
benchmarks/results/lmql_baseline.json.

LMQL 0.7.3 needs transformers 4.x, so it runs in its own venv, outside the repo (no model hub: HF_HUB_OFFLINE=1):

    python3 -m venv /work/lmql-venv
    /work/lmql-venv/bin/pip install torch==2.13.0          # first: the CPU wheel on this machine's disk
    /work/lmql-venv/bin/pip install torch==2.13.0 lmql==0.7.3 "transformers>=4.40,<4.50"   # -> transformers 4.49.0

The model directory written by transformers 5.x (~/.cache/kvql/smollm2-135m) is not readable as is by 4.x
(config has `rope_parameters` instead of `rope_theta`; tokenizer_config names `TokenizersBackend`), so --model
defaults to a compatible copy that --make-model writes (/tmp/smollm2-lmql: weights symlinked, config and
tokenizer_config fixed, see make_model; tokenization and logits were checked identical to the 5.x originals).

Usage: HF_HUB_OFFLINE=1 /work/lmql-venv/bin/python benchmarks/lmql_baseline.py [--quick] [--make-model]
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")  # LMQL runs the model in a forked subprocess: threads via env too

import argparse
import asyncio
import json
import sys
import time
import types
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SRC_MODEL = Path("~/.cache/kvql/smollm2-135m").expanduser()

# fewshot_qa.py imports kvql (which needs transformers 5.x): stub it out, we only use the data and HF helpers.
for _name in ("kvql", "kvql.backends", "kvql.backends.loader"):
    sys.modules.setdefault(_name, types.ModuleType(_name))
sys.modules["kvql.backends.loader"].load_hf = None
sys.path.insert(0, str(HERE))
import fewshot_qa as fq  # noqa: E402

QUERY = r'''argmax
    "{prefix}Q: {question}\nA:[ANSWER]" where STOPS_AT(ANSWER, "\n") and len(TOKENS(ANSWER)) < 10
'''


def make_model(dst: Path) -> None:
    """Copy of the transformers-5.x model directory that transformers 4.x can read."""
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((SRC_MODEL / "config.json").read_text())
    rope = cfg.pop("rope_parameters", None) or {}
    cfg["rope_theta"], cfg["rope_scaling"] = rope.get("rope_theta", 10000.0), None
    cfg["torch_dtype"] = cfg.pop("dtype", "float32")
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    tcfg = json.loads((SRC_MODEL / "tokenizer_config.json").read_text())
    for k in ("backend", "is_local", "local_files_only"):
        tcfg.pop(k, None)
    tcfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tcfg["model_input_names"] = ["input_ids", "attention_mask"]  # else 4.x adds token_type_ids, generate() rejects them
    (dst / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2))
    for f in ("model.safetensors", "tokenizer.json", "generation_config.json"):
        if not (dst / f).exists():
            (dst / f).symlink_to(SRC_MODEL / f)


async def lmql_runs(model_dir: str, questions: list[str]):
    import lmql

    m = lmql.model(f"local:{model_dir}")
    q = lmql.query(QUERY, input_variables=["prefix", "question"], is_async=True)

    async def ask(question):
        return await q(prefix=fq.PREFIX, question=question, model=m)

    warm = await ask("What is the capital of Portugal?")  # untimed warm-up (loads the model)
    t = time.perf_counter()
    seq = [await ask(x) for x in questions]
    t_seq = time.perf_counter() - t
    t = time.perf_counter()
    conc = await asyncio.gather(*(ask(x) for x in questions))
    t_conc = time.perf_counter() - t
    # the prompt LMQL built must be exactly fewshot_qa's prompt followed by the answer
    prompt_ok = all(r.prompt == fq.PREFIX + fq.qa(x) + r.variables["ANSWER"] for r, x in zip(seq, questions))
    ans = lambda rs: [fq.answer(r.variables["ANSWER"]) for r in rs]  # noqa: E731
    return warm, ans(seq), t_seq, ans(conc), t_conc, prompt_ok, lmql.__version__ if hasattr(lmql, "__version__") else "?"


def hf_reference(model_dir: str, questions: list[str]):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    kw = fq.gen_kwargs(tok, fq.newline_token_ids(tok))
    prompts = [fq.PREFIX + fq.qa(x) for x in questions]
    fq.hf_one_at_a_time(model, tok, prompts[:1], kw)  # warm-up
    t = time.perf_counter()
    outs = fq.hf_one_at_a_time(model, tok, prompts, kw)
    return [fq.answer(o) for o in outs], time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 questions instead of 24")
    ap.add_argument("--model", default="/tmp/smollm2-lmql")
    ap.add_argument("--make-model", action="store_true", help="(re)write the transformers-4.x copy at --model")
    ap.add_argument("--out", default=str(HERE / "results" / "lmql_baseline.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.make_model or not Path(args.model, "config.json").exists():
        make_model(Path(args.model))
    questions = [x for x, _ in fq.QUESTIONS[: 8 if args.quick else 24]]
    n = len(questions)

    warm, seq, t_seq, conc, t_conc, prompt_ok, lmql_version = asyncio.run(lmql_runs(args.model, questions))
    ref, t_hf = hf_reference(args.model, questions)

    import transformers

    eq = lambda xs: sum(a == b for a, b in zip(xs, ref))  # noqa: E731
    print(f"lmql {lmql_version}, transformers {transformers.__version__}, torch {torch.__version__}, {n} questions")
    print(f"{'#':>2}  {'LMQL sequential':<22}{'LMQL concurrent':<22}HF one-at-a-time")
    for i in range(n):
        print(f"{i:>2}  {seq[i]:<22}{conc[i]:<22}{ref[i]}")
    print(f"LMQL sequential  {t_seq:7.2f} s  ({n / t_seq:.2f} q/s)  equal to HF: {eq(seq)}/{n}")
    print(f"LMQL concurrent  {t_conc:7.2f} s  ({n / t_conc:.2f} q/s)  equal to HF: {eq(conc)}/{n}")
    print(f"HF one-at-a-time {t_hf:7.2f} s  ({n / t_hf:.2f} q/s)   LMQL prompt == fewshot_qa prompt: {prompt_ok}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "config": {"questions": n, "model": args.model, "torch_threads": 1, "query": QUERY,
                   "lmql_version": lmql_version, "transformers_version": transformers.__version__,
                   "torch_version": torch.__version__},
        "wall_s": {"lmql_sequential": t_seq, "lmql_concurrent": t_conc, "hf_one_at_a_time": t_hf},
        "answers_equal_to_hf": {"lmql_sequential": eq(seq), "lmql_concurrent": eq(conc)},
        "lmql_prompt_matches_fewshot_qa": prompt_ok,
        "answers": [{"question": x, "lmql_sequential": a, "lmql_concurrent": b, "hf_one_at_a_time": c}
                    for x, a, b, c in zip(questions, seq, conc, ref)],
    }, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
