"""kvql: LMQL-style queries on local transformers models, served from a token-granular radix KV cache.

Public names are resolved on first use (PEP 562), so `import kvql` is quick and a remote-only user
never imports torch or the engine.
"""

from __future__ import annotations

import importlib
import sys
import types

from . import registry

_PUBLIC = {
    "model": "factory", "tokenizer": "factory", "get_model": "registry", "set_default_model": "registry",
    "Model": "local_model", "LocalModel": "local_model", "RemoteModel": "remote_model",
    "StreamChunk": "backends.base", "Backend": "backends.base", "Unsupported": "backends.base",
    "ModelLoadError": "backends.loader", "load_hf": "backends.loader", "load_tokenizer": "backends.loader",
    "random_model": "backends.loader",
    "Completion": "completion", "TokenLogprob": "completion",
    "QuerySyntaxError": "lang.compiler",
    "InferenceCertificate": "certificate", "LLM": "llm",
    "headless": "output", "printing": "output", "silent": "output", "stream": "output",
    **{name: "query" for name in ("F", "LMQLResult", "Query", "QueryError", "ScoreResult", "ScoringResult",
                                  "UnmetConstraint", "main", "query", "run", "run_sync")},
    **{name: "generations" for name in ("generate", "generate_sync", "score", "score_sync")},
    "ConstraintError": "runtime.constraints", "decorators": "runtime.decorators", "algorithms": "algorithms",
}
_MODULES = ("decorators", "algorithms")  # public names that are modules themselves

__all__ = ["model", "Model", "LocalModel", "LLM", "RemoteModel", "Backend", "Unsupported", "Completion", "TokenLogprob",
           "StreamChunk", "ModelLoadError", "query", "run", "run_sync", "F", "main", "generate", "generate_sync",
           "score", "score_sync", "set_default_model", "get_model", "Query", "LMQLResult", "ScoringResult",
           "ScoreResult", "QueryError", "UnmetConstraint", "QuerySyntaxError", "ConstraintError",
           "InferenceCertificate", "decorators", "algorithms", "printing", "stream", "headless", "silent", "tokenizer"]


def _load(spec: str):
    """The registry's loader: `kvql.model(spec)`. Set here, above both, because the registry cannot import the
    factory (the factory's models run queries, and queries ask the registry: kvql.registry's docstring)."""
    from .factory import model

    return model(spec)


registry.load = _load


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'kvql' has no attribute {name!r}")
    mod = importlib.import_module(f".{module}", __name__)
    value = mod if name in _MODULES else getattr(mod, name)
    globals()[name] = value  # resolved once
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value) -> None:
        # Importing the submodule kvql/query.py binds it here as `kvql.query`; the public name is the
        # `query` decorator (LMQL's `lmql.query`), so the module never replaces it.
        if name == "query" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
