"""Prints kvql's structure as measured from its source (tests/import_graph.py): import circles, upward
imports between layers, private names used across packages, the longest functions and files.
Run: `.venv/bin/python scripts/architecture.py`."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import import_graph as G  # noqa: E402


def main() -> None:
    graph = G.imports()
    print(f"modules: {len(graph)}, kvql imports: {sum(len(e) for e in graph.values())}")
    cs = G.circles(graph)
    print(f"import circles: {len(cs)}" + "".join(f"\n  {len(c)} modules: {', '.join(c)}" for c in cs))
    up = G.upward(graph)
    print(f"upward imports: {len(up)}" + "".join(f"\n  {m}:{line} -> {t}" for m, t, line in up))
    side = G.engine_side_doors()
    print(f"imports of the engine beneath its door: {len(side)}" + "".join(f"\n  {m}:{line} -> {t}" for m, t, line in side))
    priv = G.private_uses()
    print(f"kvql private names used across packages: {len(priv)}" + "".join(f"\n  {m}:{line} {n}" for m, n, line in priv))
    other = G.private_uses(kvql_names=False)
    print(f"other libraries' private names used: {len(other)}" + "".join(f"\n  {m}:{line} {n}" for m, n, line in other))
    print("longest functions:" + "".join(f"\n  {n:4d} {f}" for n, f in G.long_functions()))
    print("files over 400 lines:" + "".join(f"\n  {n:4d} {m}" for n, m in G.long_files()))


if __name__ == "__main__":
    main()
