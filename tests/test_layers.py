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


@pytest.mark.parametrize("module", ["context", "program", "beam", "scoring", "constraints", "decoding", "prompt",
                                   "trace", "chat", "decorators", "result", "errors", "program_state"])
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
