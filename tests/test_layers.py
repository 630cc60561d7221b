"""The layers of kvql import only downwards: a remote client never loads torch or the engine, and the
query runtime knows the backends only through their contract (kvql.backends.base)."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "kvql.engine", "kvql.backends.local", "kvql.lang", "kvql.query")


def imported_after(statement: str) -> set[str]:
    code = f"import sys\n{statement}\nprint(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return set(out.stdout.split())


@pytest.mark.parametrize("statement", ["import kvql.backends.remote", "from kvql import RemoteModel",
                                       "import kvql.backends.base"])
def test_the_remote_backend_imports_neither_torch_nor_the_engine(statement):
    modules = imported_after(statement)
    assert not modules & {"torch", "kvql.engine", "kvql.backends.local", "kvql.query", "kvql.lang"}


@pytest.mark.parametrize("module", ["context", "holes", "nested", "program", "beam", "scoring", "constraints",
                                   "hole_plan", "json_types", "value_check", "decoding", "prompt", "trace", "chat",
                                   "decorators", "result", "errors", "program_state", "plain_content"])
def test_the_runtime_imports_no_engine_language_or_query_layer(module):
    modules = imported_after(f"import kvql.runtime.{module}")
    assert not modules & set(HEAVY), sorted(modules & set(HEAVY))


def test_importing_kvql_loads_its_public_names_lazily():
    modules = imported_after("import kvql")
    assert not modules & set(HEAVY)
    modules = imported_after("import kvql; kvql.query")
    assert "kvql.query" in modules and "kvql.engine" not in modules  # queries alone do not need the engine


def test_the_runtime_has_no_remote_branches():
    from pathlib import Path

    import kvql.runtime

    for path in Path(kvql.runtime.__file__).parent.glob("*.py"):
        source = path.read_text()
        assert ".remote" not in source and "RemoteModel" not in source, f"{path.name} branches on remote backends"
        assert ".engine" not in source, f"{path.name} reaches into the engine"


def test_kvql_query_stays_the_decorator_after_its_module_is_imported():
    out = subprocess.run([sys.executable, "-c", "import kvql.query, kvql\nprint(callable(kvql.query), "
                          "type(kvql.query).__name__)"], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["True", "function"]


# -- the rules on the import graph read from the source (tests/import_graph.py; docs/architecture.md) --
def test_no_module_imports_from_a_layer_above_its_own():
    import import_graph as G

    assert G.upward() == []


def test_the_backend_contract_imports_nothing_of_kvql_but_completion():
    import import_graph as G

    assert {t for t, _, _ in G.imports()["kvql.backends.base"]} <= {"kvql.completion"}


def test_the_server_uses_the_backend_through_public_names_only():
    import import_graph as G

    graph = G.imports()
    server = [m for m in graph if m.startswith("kvql.server")]
    assert server, "no server modules found"
    assert [(m, t) for m in server for t, _, _ in graph[m] if t.startswith("kvql.engine")] == []
    assert [u for u in G.private_uses() if u[0].startswith("kvql.server")] == []


def test_no_package_uses_another_packages_private_names():
    import import_graph as G

    assert G.private_uses() == []


def test_the_graph_reader_sees_what_it_must(tmp_path, monkeypatch):
    """The checks above can fail: an upward import and a private use planted in a copy are found."""
    import shutil

    import import_graph as G

    root = tmp_path / "kvql"
    shutil.copytree(G.ROOT, root)
    (root / "backends" / "base.py").write_text((root / "backends" / "base.py").read_text()
                                               + "\n\ndef _late():\n    from ..query import Query\n")
    (root / "server" / "app.py").write_text((root / "server" / "app.py").read_text()
                                            + "\n\ndef _peek(model):\n    return model._submit\n")
    monkeypatch.setattr(G, "ROOT", root)
    assert ("kvql.backends.base", "kvql.query") in [(m, t) for m, t, _ in G.upward()]
    assert any(m == "kvql.server.app" and n == "._submit" for m, n, _ in G.private_uses())


def test_the_server_routes_are_short_functions():
    import import_graph as G

    server = [(n, f) for n, f in G.long_functions(top=10_000) if f.startswith("kvql.server.")]
    assert server and max(n for n, _ in server) <= 80, server[:3]


def test_no_file_over_400_lines_and_no_function_over_60():
    import import_graph as G

    assert G.long_files(400) == []
    sources = (G.ROOT / "engine" / "model" / "kernels").glob("*.[ch]")
    kernels = [(len(p.read_text().splitlines()), p.name) for p in sources]
    assert kernels and [k for k in kernels if k[0] > 400] == []
    assert [f for f in G.long_functions(top=10_000) if f[0] > 60] == []


def test_engine_rooms_import_only_rooms_below_them_and_never_the_step_loop():
    import import_graph as G

    assert G.engine_room_breaches() == []


def test_the_engine_room_rule_can_fail(tmp_path, monkeypatch):
    import shutil

    import import_graph as G

    root = tmp_path / "kvql"
    shutil.copytree(G.ROOT, root)
    sampler = root / "engine" / "decode" / "sampler.py"
    sampler.write_text(sampler.read_text() + "\n\ndef _late():\n    from ..scheduler import Scheduler\n")
    pool = root / "engine" / "cache" / "kv_pool.py"
    pool.write_text(pool.read_text() + "\n\ndef _late():\n    from ..decode import masks\n")
    runner = root / "engine" / "model" / "model_runner.py"
    runner.write_text(runner.read_text() + "\n\ndef _late():\n    from ..cache import kv_pool\n")
    request = root / "engine" / "request.py"
    request.write_text(request.read_text() + "\n\ndef _late():\n    from .decode import sampler\n")
    monkeypatch.setattr(G, "ROOT", root)
    found = {(m, t) for m, t, _ in G.engine_room_breaches()}
    assert ("kvql.engine.decode.sampler", "kvql.engine.scheduler") in found
    assert ("kvql.engine.cache.kv_pool", "kvql.engine.decode.masks") in found
    assert ("kvql.engine.model.model_runner", "kvql.engine.cache.kv_pool") in found  # the model room: no cache
    assert ("kvql.engine.request", "kvql.engine.decode.sampler") in found  # shared data: no room


def test_the_engine_is_entered_through_its_door_only():
    import import_graph as G

    assert G.engine_side_doors() == []


def test_the_door_rule_can_fail(tmp_path, monkeypatch):
    import shutil

    import import_graph as G

    root = tmp_path / "kvql"
    shutil.copytree(G.ROOT, root)
    local = root / "backends" / "local.py"
    local.write_text(local.read_text() + "\n\ndef _late():\n    from ..engine.decode import masks\n")
    monkeypatch.setattr(G, "ROOT", root)
    assert [(m, t) for m, t, _ in G.engine_side_doors()] == [("kvql.backends.local", "kvql.engine.decode.masks")]


def test_every_name_of_the_door_is_there():
    import kvql.engine

    assert all(getattr(kvql.engine, name) is not None for name in kvql.engine.__all__)


# -- circles and the engine's importers (docs/architecture.md, "Circles") --
def _wide_circles(graph=None) -> list[list[str]]:
    """The import circles over four modules or spanning two packages (the first two dotted components)."""
    import import_graph as G

    return [c for c in G.circles(graph) if len(c) > 4 or len({G._package(m) for m in c}) > 1]


def _engine_importers(graph=None) -> list[tuple[str, str, int]]:
    """(importer, engine module, line) for every import of kvql.engine from above the backends."""
    import import_graph as G

    graph = graph or G.imports()
    return [(m, t, line) for m, edges in graph.items() if not m.startswith(("kvql.engine", "kvql.backends"))
            for t, _, line in edges if t == "kvql.engine" or t.startswith("kvql.engine.")]


def test_every_import_circle_is_small_and_inside_one_package():
    assert _wide_circles() == []


def test_only_the_backends_import_the_engine():
    """Everything above them (API, CLI, bench, server) reaches the engine through a backend's public methods."""
    assert _engine_importers() == []


def test_the_circle_and_engine_rules_can_fail(tmp_path, monkeypatch):
    import shutil

    import import_graph as G

    root = tmp_path / "kvql"
    shutil.copytree(G.ROOT, root)
    (root / "registry.py").write_text((root / "registry.py").read_text()
                                      + "\n\ndef _late():\n    from .factory import model\n")
    (root / "bench.py").write_text((root / "bench.py").read_text()
                                   + "\n\ndef _late():\n    from .engine.model import cpu_linear\n")
    monkeypatch.setattr(G, "ROOT", root)
    assert any({"kvql.registry", "kvql.factory", "kvql.query"} <= set(c) for c in _wide_circles())
    assert ("kvql.bench", "kvql.engine.model.cpu_linear") in [(m, t) for m, t, _ in _engine_importers()]


def test_the_registry_loads_specs_with_the_factory_it_does_not_import():
    out = subprocess.run([sys.executable, "-c", "import kvql, kvql.registry, sys\n"
                          "print(kvql.registry.load.__module__, 'kvql.factory' in sys.modules)"],
                         capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["kvql", "False"]
