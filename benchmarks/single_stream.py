"""Single-stream decode: one request decoding alone, next to the machine's memory-bandwidth limit (issue 27).

What is measured (one process, side by side, each model in --models and dtype in --dtypes)
-------------------------------------------------------------------------------------------
- bandwidth: this machine's read bandwidth, a torch sum over a 1 GiB float32 tensor (best of 5, the same
  threads as the models).
- limit: decoding one token reads every weight once, so one stream decodes at most bandwidth / weight bytes
  tokens per second (the unique parameter storage: a tied embedding counts once; the KV read, small at this
  context, is left out, so the limit is a little generous).
- kvql: `Model.generate` of one prompt, greedy, `ignore_eos`, N and 1 new tokens; decode tok/s =
  (N - 1) / (t_N - t_1): the prefill and the first token cancel out. The cache is cleared before each run.
  Speculative decoding is off (`speculate=False`; --speculate turns it on): this measures one decode step
  per token, what the step costs (benchmarks/speculation.py measures drafts; a repeated prompt is what they
  serve best).
- kvql module path: the same with the model runner's lean forward off (kvql.engine.model.lean_model): each step
  through transformers' modules, what the lean forward saves.
- transformers: a plain copy of the model as loaded, `generate(max_new_tokens=N, min_new_tokens=N, do_sample=False)`, the
  same subtraction.
- llama.cpp: `llama-cpp-python` in its own venv (--llama-python; it builds from source, so the benchmark does
  not install it: `python3 -m venv ~/.cache/kvql/llamacpp-venv && ~/.cache/kvql/llamacpp-venv/bin/pip install
  llama-cpp-python==0.3.36`), on the same weights converted to an F32 / BF16 GGUF (--gguf-dir, files
  `{model}-f32.gguf`, `{model}-bf16.gguf`, made by llama.cpp's `convert_hf_to_gguf.py` from the directory kvql
  converts the embedded model to), same threads, greedy with EOS banned, the same N - 1 subtraction; a column
  says why it is missing where it is. And llama.cpp on the embedded GGUF file itself, at the bits it ships in
  (SmolLM2: Q4_1, Gemma 3: Q4_K_M: what a CPU user runs; issue 44), its limit from the file's size, with the
  ratio of kvql's best dtype to it.
- kvql on quantized weights (--weights, default gguf: the file's own blocks; int8 / int4: kvql's quantization of the
  model; issue 44), at the default dtype (bf16 activations here), its limit from its weights' bytes, with its ratio
  to llama.cpp on the file and to kvql's bf16 figure.
Timings alternate the sides in each repeat; the best of --repeats is reported (decode speed is bounded above,
noise only slows it), with the fraction of the limit. The machine is shared and noisy: only ratios inside one
run mean much. Usage:
    .venv/bin/python benchmarks/single_stream.py [--models smollm2-135m,gemma3-270m] [--dtypes float32,bfloat16]
        [--tokens 96] [--repeats 3] [--threads 2] [--speculate] [--weights gguf,int8,int4]
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import kvql
from kvql.backends.dtype import resolve
from kvql.backends.loader import builtin_gguf, load_hf

PROMPT = "Write a long story about a robot who learns to paint. Once upon a time,"


def bandwidth(threads: int) -> float:
    """Bytes per second a torch sum reads (best of 5 over 1 GiB)."""
    torch.set_num_threads(threads)
    x = torch.ones(1 << 28, dtype=torch.float32)
    x.sum()
    best = min(_timed(x.sum) for _ in range(5))
    return x.numel() * x.element_size() / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def weight_bytes(tensors) -> int:
    """The bytes of `tensors` (a model's parameters, and buffers where quantized weights live:
    kvql.engine.model.quantized), each storage once (a tied embedding counts once)."""
    seen, total = set(), 0
    for p in tensors:
        key = p.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += p.untyped_storage().nbytes()
    return total


def kvql_decode(m, ids: list[int], tokens: int, lean: bool = True) -> float:
    """Seconds for `tokens - 1` decode steps of one stream (t_N - t_1, cache cleared before each); `lean=False`:
    the runner's lean forward off meanwhile."""
    runner = m.engine.runner
    kept = runner.lean

    def run(n):
        m.clear_cache()
        return _timed(lambda: m.generate([ids], max_tokens=n, temperature=0, ignore_eos=True))
    runner.lean = kept if lean else None
    try:
        return run(tokens) - run(1)
    finally:
        runner.lean = kept


def hf_decode(hf, ids: list[int], tokens: int) -> float:
    x = torch.tensor([ids])

    def run(n):
        with torch.inference_mode():
            return _timed(lambda: hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                              do_sample=False, pad_token_id=0))
    return run(tokens) - run(1)


LLAMA = """
import json, sys, time
from llama_cpp import Llama
path, prompt, n, threads, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=512, verbose=False)
ban = {llm.token_eos(): -1e9}

def run(k):
    llm.reset()
    t0 = time.perf_counter()
    llm.create_completion(prompt, max_tokens=k, temperature=0, logit_bias=ban)
    return time.perf_counter() - t0
run(2)
print(json.dumps(min(run(n) - run(1) for _ in range(repeats))))
"""


def llama_decode(python: Path, gguf: Path, tokens: int, threads: int, repeats: int) -> float | str:
    """Best seconds for `tokens - 1` decode steps in llama.cpp (a subprocess of its own venv), or why not."""
    if not python.exists():
        return "no llama-cpp-python venv"
    if not gguf.exists():
        return f"no {gguf.name}"
    out = subprocess.run([str(python), "-c", LLAMA, str(gguf), PROMPT, str(tokens), str(threads), str(repeats)],
                         capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        return "failed: " + (out.stderr.strip().splitlines() or ["?"])[-1][:60]
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="smollm2-135m,gemma3-270m")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--speculate", action="store_true", help="kvql with speculative decoding (default: off)")
    p.add_argument("--weights", default="gguf", help="quantized weights to run kvql on, comma-separated ('' for none)")
    p.add_argument("--llama-python", type=Path, default=Path("~/.cache/kvql/llamacpp-venv/bin/python").expanduser())
    p.add_argument("--gguf-dir", type=Path, default=Path("~/.cache/kvql/gguf").expanduser())
    args = p.parse_args()
    bw = bandwidth(args.threads)
    print(f"memory read bandwidth: {bw / 1e9:.1f} GB/s ({args.threads} threads)")
    print(f"{'model':<14} {'dtype':<9} {'weights':>9} {'limit':>9} {'kvql':>14} {'kvql module path':>16} "
          f"{'transformers':>14} {'llama.cpp':>14}")
    for spec in args.models.split(","):
        kvql_best, kvql_rates = 0.0, {}
        for name in args.dtypes.split(","):
            m = kvql.model(spec, dtype=name, silent=True, speculate=args.speculate)
            hf, _ = load_hf(spec, dtype=resolve(name))  # a copy as loaded: the engine sets its own up for itself
            torch.set_num_threads(args.threads)
            ids = m.tokenizer.encode(PROMPT)
            size = weight_bytes(hf.parameters())
            limit = bw / size
            best = {"kvql": float("inf"), "kvql module path": float("inf"), "transformers": float("inf")}
            for _ in range(args.repeats):
                best["kvql"] = min(best["kvql"], kvql_decode(m, ids, args.tokens))
                best["kvql module path"] = min(best["kvql module path"], kvql_decode(m, ids, args.tokens, lean=False))
                best["transformers"] = min(best["transformers"], hf_decode(hf, ids, args.tokens))
            dtype = str(resolve(name)).removeprefix("torch.")
            m.close()
            del hf
            gguf = args.gguf_dir / f"{spec}-{'f32' if dtype == 'float32' else 'bf16'}.gguf"
            llama = llama_decode(args.llama_python, gguf, args.tokens, args.threads, args.repeats)
            rate = {k: (args.tokens - 1) / v for k, v in best.items()}
            kvql_best = max(kvql_best, rate["kvql"])
            kvql_rates[dtype] = rate["kvql"]
            cells = " ".join(f"{rate[k]:{w}.1f} ({rate[k] / limit:4.0%})"
                             for k, w in (("kvql", 6), ("kvql module path", 8), ("transformers", 6)))
            if isinstance(llama, float):
                r = (args.tokens - 1) / llama
                cells += f" {r:6.1f} ({r / limit:4.0%})"
            else:
                cells += f"  {llama}"
            print(f"{spec:<14} {dtype:<9} {size / 2**20:7.0f}MB {limit:6.1f}/s {cells}", flush=True)
        with tempfile.TemporaryDirectory() as staging:  # the file as shipped (joined from its chunks where split)
            shipped = builtin_gguf(spec, Path(staging))
            llama = llama_decode(args.llama_python, shipped, args.tokens, args.threads, args.repeats)
            size = shipped.stat().st_size
        line = f"{spec:<14} {'file':<9} {size / 2**20:7.0f}MB {bw / size:6.1f}/s llama.cpp on {shipped.name}: "
        llama_rate = None if isinstance(llama, str) else (args.tokens - 1) / llama
        if llama_rate is None:
            print(line + llama, flush=True)
        else:
            print(line + f"{llama_rate:6.1f} ({llama_rate / (bw / size):4.0%}); kvql's best dtype / it: "
                  f"{kvql_best / llama_rate:.2f}", flush=True)
        for weights in filter(None, args.weights.split(",")):
            m = kvql.model(spec, weights=weights, silent=True, speculate=args.speculate)
            torch.set_num_threads(args.threads)
            ids = m.tokenizer.encode(PROMPT)
            size = weight_bytes(itertools.chain(m.hf_model.parameters(), m.hf_model.buffers()))
            rate = (args.tokens - 1) / min(kvql_decode(m, ids, args.tokens) for _ in range(args.repeats))
            m.close()
            limit = bw / size
            cells = [f"kvql {rate:6.1f} ({rate / limit:4.0%})"]
            if llama_rate is not None:
                cells.append(f"/ llama.cpp on the file {rate / llama_rate:.2f}")
            if "bfloat16" in kvql_rates:
                cells.append(f"/ kvql bf16 {rate / kvql_rates['bfloat16']:.2f}")
            print(f"{spec:<14} {weights:<9} {size / 2**20:7.0f}MB {limit:6.1f}/s " + " ".join(cells), flush=True)
    print("tok/s of one stream's decode (fraction of the bandwidth limit); best of", args.repeats)


if __name__ == "__main__":
    main()
