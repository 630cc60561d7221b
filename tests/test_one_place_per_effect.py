"""Issue 54's structure rules, read from the source: one function writes a forward's K/V to the pool, one calls
the paged attention kernel from Python (the compiled step binds it in its own step type), and kvql writes no
`kvql_*` attribute onto another library's objects (its per-layer state lives in its own replacement modules)."""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kvql"

RULES = {
    # what, the pattern, the files (relative to the package) allowed to hold it
    "writes a forward's K/V into a pool layer": (r"\.[kv]\[[^\]]*\]\.index_(copy|put)_", {"engine/cache/kv_pool.py"}),
    "calls the paged attention kernel": (r"\.kvql_paged_attention\b",
                                         {"engine/model/kernels/paged_attention.py", "engine/model/step.py"}),
    "calls paged_attention.attend": (r"paged_attention\.attend\(", {"engine/model/step.py",
                                                                    "engine/model/pool_attention.py"}),
    "sets a kvql_* attribute on an object": (r"(\.kvql_\w+\s*=[^=])|(__dict__\[\s*[\"']kvql_)", set()),
}


def breaches(root: Path = PACKAGE) -> list[str]:
    """`file:line: rule` for each line of a `.py` file under `root` that matches a rule outside its allowed files."""
    out = []
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(root).as_posix()
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            for rule, (pattern, allowed) in RULES.items():
                if name not in allowed and re.search(pattern, code):
                    out.append(f"{name}:{i}: {rule}")
    return out


def test_each_effect_has_one_place():
    assert breaches() == []


def test_the_rules_can_fail(tmp_path):
    (tmp_path / "engine" / "model").mkdir(parents=True)
    (tmp_path / "engine" / "model" / "step.py").write_text("lib.kvql_paged_attention(q)\n")  # allowed here
    (tmp_path / "engine" / "model" / "own.py").write_text(
        "pool.k[layer].index_copy_(1, slots, k)\n"
        "lib.kvql_paged_attention(q)\n"
        "paged_attention.attend(q, k, v, out, segs, 1.0)\n"
        "layer.kvql_slice = 768  # a side attribute\n"
        "embed.__dict__['kvql_head'] = head\n"
        "ok = layer.kvql_slice == 768\n")
    assert breaches(tmp_path) == [
        "engine/model/own.py:1: writes a forward's K/V into a pool layer",
        "engine/model/own.py:2: calls the paged attention kernel",
        "engine/model/own.py:3: calls paged_attention.attend",
        "engine/model/own.py:4: sets a kvql_* attribute on an object",
        "engine/model/own.py:5: sets a kvql_* attribute on an object",
    ]
