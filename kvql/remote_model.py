"""`kvql.RemoteModel`: an OpenAI-compatible server (`kvql.backends.remote.RemoteBackend`: kvql serve, vLLM,
SGLang) with LMQL's model methods (`kvql.llm.LLM`). `kvql.model("http://HOST:PORT/v1", name=...)` makes one."""

from __future__ import annotations

from .backends.remote import RemoteBackend
from .llm import LLM


class RemoteModel(RemoteBackend, LLM):
    """A served model (see `RemoteBackend` for its options, `LLM` for LMQL's methods)."""
