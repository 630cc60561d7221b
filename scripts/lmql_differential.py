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
}


def describe(value) -> dict:
    """What must be equal of a query's result (kvql's and LMQL's result classes differ in name only)."""
    def one(v):
        kind = type(v).__name__
        if kind == "LMQLResult":
            return {"type": "LMQLResult", "prompt": v.prompt, "variables": {k: repr(x) for k, x in v.variables.items()}}
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
            if how == "decorated":
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
                value = await asyncio.wait_for(mod.q(**kwargs), timeout)
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
    differ = [n for n in CASES if ours[n] != theirs[n]]
    print(f"{len(CASES) - len(differ)} equal, {len(differ)} differ")
    for n in differ:
        print(f"\n- {n}\n  kvql: {json.dumps(ours[n])}\n  LMQL: {json.dumps(theirs[n])}")


if __name__ == "__main__":
    main()
