"""Run the query examples of LMQL's documentation on kvql and count how many run (issue 9's measure).

Reads the ```lmql code blocks of an LMQL checkout's docs (release v0.7.3: `docs/docs/**/*.md`; nothing of
them is stored in this repository), runs each block as a kvql query on one local model (the `from`
clause of an example is overridden: no example reaches OpenAI), and prints one line per example:
ok, or the error's type and first line. Blocks that are fragments of a larger example fail here
as they would in LMQL; read the list, not only the count.

Usage: python scripts/lmql_docs_examples.py LMQL_DIR [--model smollm2-135m] [--max-len 1024] [--only NAME]
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kvql  # noqa: E402

lmql = kvql  # examples name `lmql.` in their scope, as code written `import kvql as lmql` does
sys.modules.setdefault("lmql", kvql)  # and some `import lmql` inside the query

FENCE = re.compile(r"^```(?:lmql|\{lmql\})\s*$")


def examples(root: Path):
    for md in sorted((root / "docs" / "docs").rglob("*.md")):
        lines, block, start = md.read_text().splitlines(), None, 0
        for i, line in enumerate(lines):
            if block is None and FENCE.match(line):
                block, start = [], i + 2
            elif block is not None and line.startswith("```"):
                if any(b.strip().startswith("model-output::") for b in block):  # the docs' rendered output follows
                    block = block[:next(i for i, b in enumerate(block) if b.strip().startswith("model-output::"))]
                text = "\n".join(b for b in block if not b.strip().startswith("name::"))
                yield f"{md.relative_to(root)}:{start}", text
                block = None
            elif block is not None:
                block.append(line)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("lmql_dir", type=Path)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--only", default=None, help="run only examples whose location contains this")
    args = ap.parse_args()
    model = kvql.model(args.model)
    ok = total = 0
    for where, source in examples(args.lmql_dir):
        if args.only and args.only not in where:
            continue
        total += 1
        t = time.perf_counter()
        try:
            q = kvql.query(source, is_async=False)
            q(model=model, max_len=args.max_len)
        except Exception as e:  # every failure is reported, whatever its kind
            first = (str(e).strip().splitlines() or [""])[0][:150]
            print(f"FAIL {where}: {type(e).__name__}: {first}")
        else:
            ok += 1
            print(f"ok   {where} ({time.perf_counter() - t:.1f} s)")
    print(f"{ok}/{total} documentation examples ran")
    model.close()


if __name__ == "__main__":
    main()
