"""Run the test functions of LMQL's own test suite on kvql and count how many pass (issue 9's measure).

Reads `src/lmql/tests/test_*.py` from an LMQL checkout (release v0.7.3; nothing of it is stored in this
repository) with `lmql` aliased to kvql, and calls every `test_*` function, sync or async, one by one.
Hosted models these tests name (`openai/...`, `local:gpt2`, ...) cannot run here: they are served by
`lmql.model("random")`, kvql's seeded random-weights model. Tests that assert the exact text of
LMQL's random-token sampler fail for that reason alone; each failure is printed with its first line
so the reasons can be read, not only counted. Files about backends kvql does not have are skipped.

Usage: python scripts/lmql_tests.py LMQL_DIR [--only FILE_SUBSTRING]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import inspect
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kvql  # noqa: E402
import kvql.registry  # noqa: E402

SKIP = ("azure", "openai_backend", "lmtp", "langchain", "multi_tokenizer", "multibyte_local", "tiktoken")


def alias_lmql(root: Path) -> None:
    """`import lmql` gives kvql; `lmql.tests.*` are LMQL's own test helpers, loaded from the checkout."""
    sys.modules["lmql"] = kvql
    tests = types.ModuleType("lmql.tests")
    tests.__path__ = [str(root / "src" / "lmql" / "tests")]
    sys.modules["lmql.tests"] = kvql.tests = tests
    utils = types.ModuleType("lmql.tests.expr_test_utils")
    utils.run_all_tests = lambda *a, **k: None
    sys.modules["lmql.tests.expr_test_utils"] = utils
    load = kvql.registry.load  # what the model registry (get_model) loads a spec with

    def registry_load(spec):
        if not spec.startswith(("random", "smollm2")):
            spec = "random"  # a hosted or hub model this machine cannot reach
        return load(spec)

    kvql.registry.load = registry_load
    make = kvql.model

    def model(spec="smollm2-135m", **kw):
        if isinstance(spec, str) and not spec.startswith(("random", "smollm2", "http")):
            spec, kw = "random", {"seed": kw.get("seed", 0)}
        return make(spec, **{k: v for k, v in kw.items() if k in ("seed", "silent")} if spec == "random" else kw)

    kvql.model = model
    tokenizer = kvql.tokenizer
    kvql.tokenizer = lambda spec="random": tokenizer(spec if spec.startswith(("random", "smollm2")) else "random")
    sys.path.insert(0, str(root / "src" / "lmql" / "tests"))  # some import their helpers by bare name


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("lmql_dir", type=Path)
    ap.add_argument("--only", default=None)
    args = ap.parse_args()
    alias_lmql(args.lmql_dir)
    passed = total = 0
    tests = args.lmql_dir / "src" / "lmql" / "tests"
    for path in sorted([*tests.glob("test_*.py"), *(tests / "queryargs").glob("test_*.py")]):
        if any(s in path.name for s in SKIP) or (args.only and args.only not in path.name):
            continue
        try:
            package = "lmql.tests." + ("queryargs." if path.parent.name == "queryargs" else "")
            spec = importlib.util.spec_from_file_location(package + path.stem, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
        except Exception as e:  # the whole file fails to load: each of its tests counts as failed
            names = [line.split("def ", 1)[1].split("(")[0] for line in path.read_text().splitlines()
                     if line.lstrip().startswith(("def test_", "async def test_"))]
            total += len(names)
            print(f"FAIL {path.name}: {len(names)} tests, the file does not load: {type(e).__name__}: {e}"[:220])
            continue
        for name, fn in list(vars(module).items()):
            if not name.startswith("test_") or not callable(fn) or getattr(fn, "__module__", spec.name) != spec.name:
                continue
            total += 1
            t = time.perf_counter()
            try:
                result = fn()
                if inspect.isawaitable(result):
                    asyncio.run(_awaited(result))
            except Exception as e:  # every failure is reported, whatever its kind
                first = (str(e).strip().splitlines() or [""])[0][:140]
                print(f"FAIL {path.name}::{name}: {type(e).__name__}: {first}")
            else:
                passed += 1
                print(f"ok   {path.name}::{name} ({time.perf_counter() - t:.1f} s)")
    print(f"{passed}/{total} LMQL test functions passed")


async def _awaited(result):
    return await result


if __name__ == "__main__":
    main()
