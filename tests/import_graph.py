"""kvql's import graph read from its source (every import, at module level or inside a function), its
layers, and what breaks them; tests/test_layers.py asserts the rules, scripts/architecture.py prints the
measurements (circles, upward imports, private names used across packages, long functions and files).

Layers, bottom to top (docs/architecture.md draws them): a module may import only from its own layer or
those below."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "kvql"

# (layer, module prefixes), bottom first; the longest matching prefix places a module
LAYERS = [
    ("data", ["kvql.completion"]),
    ("engine", ["kvql.engine"]),
    ("contract", ["kvql.backends.base", "kvql.backends.options", "kvql.backends.dtype"]),
    ("backends", ["kvql.backends"]),
    ("runtime", ["kvql.runtime", "kvql.lang"]),
    ("api", ["kvql.api", "kvql.query", "kvql.generations", "kvql.llm", "kvql.output", "kvql.certificate",
             "kvql.sync", "kvql.registry", "kvql.factory", "kvql.local_model", "kvql.remote_model", "kvql.algorithms"]),
    ("apps", ["kvql.server", "kvql.cli", "kvql.bench", "kvql.arguments", "kvql.__main__"]),
]


def layer(module: str) -> int | None:
    """The rank of a module's layer (0 lowest). `kvql` itself (its lazy public names) is the API."""
    if module == "kvql":
        return 5
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    return rank


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[:len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports(known: dict[str, Path] | None = None) -> dict[str, list[tuple[str, list[str], int]]]:
    """module -> [(imported kvql module, names taken from it, line)] (names: `from m import a, b`)."""
    known = known or modules()
    out: dict[str, list] = {}
    for module, path in known.items():
        edges = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges += [(a.name, [], node.lineno) for a in node.names if a.name.startswith("kvql")]
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(module, path, node)
                if not target.startswith("kvql"):
                    continue
                for a in node.names:  # `from kvql.engine import grammar` imports the module kvql.engine.grammar
                    sub = f"{target}.{a.name}"
                    edges.append((sub, [], node.lineno) if sub in known else (target, [a.name], node.lineno))
        out[module] = edges
    return out


def upward(graph=None) -> list[tuple[str, str, int]]:
    """(importer, imported, line) where the imported module sits in a higher layer."""
    graph = graph or imports()
    return [(m, t, line) for m, edges in graph.items() for t, _, line in edges
            if layer(t) is not None and layer(m) is not None and layer(t) > layer(m)]


def circles(graph=None) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph = graph or imports()
    adj = {m: sorted({t for t, _, _ in e if t in graph and t != m}) for m, e in graph.items()}
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in adj[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in adj:
        if v not in index:
            visit(v)
    return out


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def private_uses(known: dict[str, Path] | None = None, kvql_names: bool = True) -> list[tuple[str, str, int]]:
    """(module, `x._name` or imported `_name`, line) where code of one package uses a private name that is
    not its own: an attribute `obj._name` (not `self._name` / `cls._name`, not dunders) that another kvql
    package defines, or a `from m import _name` of another package's module. `kvql_names=False`: the
    private attributes of other libraries used instead (torch's, transformers')."""
    known = known or modules()
    trees = {m: ast.parse(p.read_text()) for m, p in known.items()}  # each file read and parsed once
    own = {m: {getattr(n, "name", None) or getattr(n, "id", None) for n in ast.walk(trees[m])
               if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or
               isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)} for m in known}
    by_package: dict[str, set] = {}
    for m, names in own.items():
        by_package.setdefault(_package(m), set()).update(names)
    for m in known:  # attributes set on self in a package are its own too
        for n in ast.walk(trees[m]):
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                by_package[_package(m)].add(n.attr)
    everywhere = set().union(*by_package.values())
    out = []
    for m, path in known.items():
        tree = trees[m]
        mine = by_package[_package(m)]
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__"):
                if isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                    continue
                if n.attr not in mine and (n.attr in everywhere) == kvql_names:
                    out.append((m, f"._{n.attr[1:]}", n.lineno))
            elif isinstance(n, ast.ImportFrom) and kvql_names:
                target = _resolve(m, path, n)
                if target.startswith("kvql") and _package(target) != _package(m):
                    out += [(m, f"{target}.{a.name}", n.lineno) for a in n.names
                            if a.name.startswith("_") and not a.name.startswith("__")]
    return out


def long_functions(top: int = 10) -> list[tuple[int, str]]:
    out = []
    for m, path in modules().items():
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((n.end_lineno - n.lineno + 1, f"{m}.{n.name}"))
    return sorted(out, reverse=True)[:top]


def long_files(limit: int = 400) -> list[tuple[int, str]]:
    return sorted(((len(p.read_text().splitlines()), m) for m, p in modules().items()
                   if len(p.read_text().splitlines()) > limit), reverse=True)


# The engine's rooms (docs/architecture.md), bottom first: a room imports only rooms below it and the engine's
# shared modules; no room imports the step loop above them.
ENGINE_ROOMS = ["kvql.engine.model", "kvql.engine.cache", "kvql.engine.decode"]
ENGINE_SHARED = {"kvql.engine", "kvql.engine.request", "kvql.engine.segment", "kvql.engine.detokenizer",
                 "kvql.engine.openmp"}


def _room(module: str) -> int | None:
    return next((i for i, r in enumerate(ENGINE_ROOMS) if module == r or module.startswith(r + ".")), None)


def engine_room_breaches(graph=None) -> list[tuple[str, str, int]]:
    """(importer, imported, line) where an engine room imports a room above its own or the step loop (an engine
    module outside the rooms and the shared ones), or a shared module imports any room or the loop."""
    graph = graph or imports()
    out = []
    for m, edges in graph.items():
        room = -1 if m in ENGINE_SHARED - {"kvql.engine"} else _room(m)
        if room is None:
            continue
        for t, _, line in edges:
            if not t.startswith("kvql.engine") or t in ENGINE_SHARED:
                continue
            other = _room(t)
            if other is None or other > room:
                out.append((m, t, line))
    return out


def engine_side_doors(graph=None) -> list[tuple[str, str, int]]:
    """(importer, imported, line) where a module outside the engine imports one beneath its door (`kvql.engine`'s
    own names are the door: kvql/engine/__init__.py)."""
    graph = graph or imports()
    return [(m, t, line) for m, edges in graph.items() if not m.startswith("kvql.engine")
            for t, _, line in edges if t.startswith("kvql.engine.")]
