"""The same LMQL programs on kvql and on LMQL 0.7.3 itself, compared: return value types and shapes, values,
the prompt text each run ends with, and errors (accepted / rejected).

kvql runs here (`import kvql as lmql`, SmolLM2-135M, float32); LMQL 0.7.3 runs in its own venv on the same
weights (`benchmarks/lmql_baseline.py` says how to make both: the venv at /work/lmql-venv, the
transformers-4.x copy of the model at /tmp/smollm2-lmql). Greedy decoding on both sides: values may still
differ where the two tokenize a prompt differently, and each difference is listed.

Usage: .venv/bin/python scripts/lmql_differential.py [--lmql-python /work/lmql-venv/bin/python]
Prints `N equal, M differ` and, for each difference, both sides' outcome.
"""

from __future__ import annotations

import argparse
import builtins
import importlib.util
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

LMQL_MODEL = "local:/tmp/smollm2-lmql"
KVQL_MODEL = "smollm2-135m"

# name -> (the query's source, how it is defined, call keywords): "decorated" makes `def q(PARAMS)` with the
# source as its docstring (PARAMS: the call's keywords); "string" is `lmql.run(source, **kwargs)`
CASES = {
    "no hole, decorated, returns a value": ("return x + 1", "decorated", {"x": 1}),
    "no hole, string query, returns a value": ('"no holes"\nreturn 5', "string", {}),
    "text only, no return": ('"no holes at all"', "string", {}),
    "one hole, stop phrase": ('"Q: What is the capital of France?\\nA:[A]" where STOPS_AT(A, "\\n") and '
                              'len(TOKENS(A)) < 8\nreturn A', "string", {}),
    "one hole, choices": ('"Is Paris in France? Answer:[A]" where A in [" yes", " no"]\nreturn A', "string", {}),
    "one hole, INT": ('"Two plus two is[N]" where INT(N) and len(TOKENS(N)) < 4\nreturn N', "string", {}),
    "two holes, tuple": ('"Name a color:[C]" where STOPS_AT(C, ".") and len(TOKENS(C)) < 5\n'
                         '"Name a fruit:[F]" where STOPS_AT(F, ".") and len(TOKENS(F)) < 5\nreturn C, F', "string", {}),
    "result object without return": ('"Say hi:[X]" where len(TOKENS(X)) < 4', "string", {}),
    "input variable in the prompt": ('"Q: What is {a} plus {b}?\\nA:[X]" where len(TOKENS(X)) < 4\nreturn X',
                                     "decorated", {"a": 2, "b": 3}),
    "blank line inside a multi-line prompt string": ('"""Line one.\n\nLine two.[X]""" where len(TOKENS(X)) < 3', "string",
                                                     {}),
    "a later hole's list filled between holes": ('opts = []\n"First:[A]" where len(TOKENS(A)) < 3\n'
                                                 'opts.append(" yes")\nopts.append(" no")\n'
                                                 '"Second:[B]" where B in opts\nreturn B', "string", {}),
    "sample(n=2): one result per sample": ('sample(n=2, temperature=1.0)\n"Say:[X]" where len(TOKENS(X)) < 3\nreturn X',
                                          "string", {}),
    # prompt strings' whitespace (item 2 of issue 24)
    "two blank lines": ('"""A\n\n\nB[X]""" where len(TOKENS(X)) < 3', "string", {}),
    "a whitespace-only line": ('"""A\n   \nB[X]""" where len(TOKENS(X)) < 3', "string", {}),
    "escaped blank line": ('"A\\n\\nB[X]" where len(TOKENS(X)) < 3', "string", {}),
    "indentation inside a prompt string": ('"""A\n    B\n  C[X]""" where len(TOKENS(X)) < 3', "string", {}),
    "leading and trailing newline": ('"""\nA\nB\n[X]""" where len(TOKENS(X)) < 3', "string", {}),
    "blank line before a hole": ('"""Q: What is 2+2?\n\nA:[X]""" where len(TOKENS(X)) < 4\nreturn X', "string", {}),
    # a later hole's condition, evaluated when that hole is generated (item 3)
    "global where on a list filled between holes": ('argmax\n    "First:[A]\\n"\n    opts.append(" yes")\n'
                                                    '    opts.append(" no")\n    "Second:[B]"\n    return A, B\n'
                                                    'where len(TOKENS(A)) < 3 and B in opts',
                                                    "decorated", {"opts": []}),
    # call keywords (items 4, 5)
    "a parameter named model": ('"Describe {description}:[D]" where len(TOKENS(D)) < 3\nreturn description, model, D',
                                "decorated", {"description": "a cat", "model": "gpt-4"}),
    "an unknown runtime keyword (stop=None)": ('"Q: {question} A:[A]" where len(TOKENS(A)) < 3\nreturn A',
                                               "decorated+stop", {"question": "Why?"}),
    # clause keywords by position (item 6)
    "where less indented than the decoder": ('    argmax\n        "Hello[X]"\nwhere len(TOKENS(X)) < 3', "decorated", {}),
    # decorators: order of calls, streamed values and their diffs (item 7)
    "decorator call order": ('log = []\n@lmql.decorators.pre\ndef a(v):\n    log.append("pre a")\n    return v\n'
                             'def b(v):\n    log.append("post b")\n    return v\n'
                             'def c(v):\n    log.append("post c")\n    return v\n'
                             '"Say:[@c @b @a X]" where len(TOKENS(X)) < 3\nreturn log', "string", {}),
    "streaming decorator sees values and diffs": (
        'log = []\n@lmql.decorators.streaming\ndef w(v, context):\n    log.append((v, context.get_diff("X")))\n'
        '"Say:[@w X]" where len(TOKENS(X)) < 4\nreturn log', "string", {}),
    # stop phrases inside a fixed value (item 8)
    "stop phrase inside an equality": ('"Say:[X]" where STOPS_BEFORE(X, "b") and X == "abc"\nreturn X', "string", {}),
    "stop phrase overlapping an equality": ('"Say:[X]" where STOPS_BEFORE(X, \'",\') and X == \'abc",\'\nreturn X',
                                            "string", {}),
    # types, distributions, errors
    "int hole": ('"Two plus two is [N: int]" where len(TOKENS(N)) < 3\nreturn N', "string", {}),
    "distribution": ('"Is the sky blue? Answer:[A]" distribution A in [" yes", " no"]', "string", {}),
    "unclosed prompt string is rejected": ('"Hello [X]', "string", {}),
    "unknown constraint is rejected": ('"Hi[X]" where FOO(X)', "string", {}),
}

# differences kvql keeps on purpose, with why (see docs/lmql.md, "Differences from LMQL")
INTENDED = {
    "no hole, decorated, returns a value": "LMQL's main branch returns the value itself (its test_return_value.py); "
                                           "the 0.7.3 release on PyPI wraps it in a one-element list",
    "no hole, string query, returns a value": "as above",
    "text only, no return": "as above (the LMQLResult itself)",
    "distribution": "0.7.3 takes a query whose one hole is a distribution's for one without holes and returns it "
                    "unevaluated, in a list; LMQL's main branch computes the distribution there too (postprocess)",
}


def describe(value) -> dict:
    """What must be equal of a query's result (kvql's and LMQL's result classes differ in name only; of a
    distribution, its values and the structure of their probabilities, not the numbers)."""
    def one(v):
        kind = type(v).__name__
        if kind == "LMQLResult":
            variables = {k: repr(x) if not k.startswith("P(") else [(c, type(p).__name__) for c, p in x]
                         for k, x in v.variables.items()}
            return {"type": "LMQLResult", "prompt": v.prompt, "variables": variables}
        return {"type": kind, "repr": repr(v)}
    if isinstance(value, list):
        return {"type": "list", "len": len(value), "items": [one(v) for v in value]}
    return one(value)


async def run_cases(lmql, model_spec: str, timeout: float = 300) -> dict:
    """Every case in one event loop (LMQL's model client belongs to the loop that made it)."""
    model = lmql.model(model_spec)
    out = {}
    for name, (source, how, kwargs) in CASES.items():
        try:
            if how.startswith("decorated"):
                params = ", ".join(kwargs)
                body = "\n".join("    " + line for line in ["'''lmql", *source.split("\n"), "'''"])
                # a real file: LMQL reads a decorated query's source with inspect
                path = Path(tempfile.mkdtemp()) / "case.py"
                path.write_text(f"import builtins\n@builtins.lmql.query(model=builtins.kvql_case_model)\n"
                                f"async def q({params}):\n{body}\n")
                builtins.lmql, builtins.kvql_case_model = lmql, model
                spec = importlib.util.spec_from_file_location(f"case_{abs(hash(name))}", path)
                mod = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(mod)
                extra = {"stop": None} if how == "decorated+stop" else {}
                value = await asyncio.wait_for(mod.q(**kwargs, **extra), timeout)
            else:
                value = await asyncio.wait_for(lmql.run(source, model=model, **kwargs), timeout)
            got = describe(value)
            if name.startswith("sample"):  # sampled values differ between implementations: the shape only
                got = {k: v for k, v in got.items() if k != "items"}
            out[name] = {"ok": True, **got}
        except Exception as e:  # noqa: BLE001 -- an error (a timeout included) is an outcome to compare
            out[name] = {"ok": False, "error": type(e).__name__, "message": str(e)[:200]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lmql-python", default="/work/lmql-venv/bin/python")
    ap.add_argument("--side", action="store_true", help=argparse.SUPPRESS)  # this script, inside LMQL's venv
    args = ap.parse_args()
    if args.side:
        import lmql

        print(json.dumps(asyncio.run(run_cases(lmql, LMQL_MODEL))))
        return
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([args.lmql_python, __file__, "--side"], capture_output=True, text=True, env=env,
                          cwd="/tmp", timeout=3600)
    if done.returncode:
        sys.exit(f"LMQL's side failed:\n{done.stderr[-3000:]}")
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import kvql

    ours = asyncio.run(run_cases(kvql, KVQL_MODEL))
    def same(a, b):  # both rejected counts as equal: the two name their errors differently
        return a == b or (not a["ok"] and not b["ok"])

    differ = [n for n in CASES if not same(ours[n], theirs[n])]
    intended = [n for n in differ if n in INTENDED]
    print(f"{len(CASES) - len(differ)} equal, {len(differ)} differ ({len(intended)} of them on purpose)")
    for n in differ:
        why = f"\n  on purpose: {INTENDED[n]}" if n in INTENDED else ""
        print(f"\n- {n}\n  kvql: {json.dumps(ours[n])}\n  LMQL: {json.dumps(theirs[n])}{why}")
    rejected = [n for n in CASES if not ours[n]["ok"] and not theirs[n]["ok"]]
    for n in rejected:
        print(f"\n(rejected by both) {n}\n  kvql: {ours[n]['error']}: {ours[n]['message']}\n"
              f"  LMQL: {theirs[n]['error']}: {theirs[n]['message']}")


if __name__ == "__main__":
    main()
