"""OpenAI-compatible request bodies, and how their constraint fields map onto `Model.generate` options.

Constraint fields accepted, named as vLLM and SGLang users know them:
- vLLM: `structured_outputs: {"regex" | "choice" | "json" | "grammar": ...}`; chat `response_format`
  (`{"type": "json_schema", "json_schema": {"schema": ...}}` or `{"type": "json_object"}`);
- SGLang: top-level `regex`, `json_schema`.
Any other field is refused with a 400 naming it: in particular the old `guided_*` fields, which
some servers ignore silently.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class RequestError(ValueError):
    """A bad request: answered with a 4xx and an OpenAI-style error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=64)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    user: str | None = None
    structured_outputs: dict | None = None
    regex: str | None = None
    json_schema: dict | str | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    return_token_ids: bool = False  # vLLM's name: each choice also carries its generated token ids


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    response_format: dict | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


def message_text(m: ChatMessage) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    parts = []
    for p in m.content:
        if p.get("type") != "text":
            raise RequestError(f"message content of type {p.get('type')!r} is not supported (text only)", "messages")
        parts.append(p.get("text", ""))
    return "".join(parts)


_STRUCTURED = {"regex": "regex", "choice": "choices", "json": "json_schema", "grammar": "grammar"}


def constraint_options(req: _Common) -> dict:
    """The one constraint of a request as `Model.generate` options (`{}` for none)."""
    found: dict = {}
    if req.structured_outputs is not None:
        unknown = set(req.structured_outputs) - set(_STRUCTURED)
        if unknown:
            raise RequestError(f"unknown structured_outputs field(s) {sorted(unknown)}; "
                               f"supported: {sorted(_STRUCTURED)}", "structured_outputs")
        for key, value in req.structured_outputs.items():
            if value is not None:
                found[_STRUCTURED[key]] = json.loads(value) if key == "json" and isinstance(value, str) else value
    if req.regex is not None:
        found["regex"] = req.regex
    if req.json_schema is not None:
        found["json_schema"] = json.loads(req.json_schema) if isinstance(req.json_schema, str) else req.json_schema
    rf = getattr(req, "response_format", None)
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_schema":
            schema = (rf.get("json_schema") or {}).get("schema")
            if schema is None:
                raise RequestError("response_format json_schema needs json_schema.schema", "response_format")
            found["json_schema"] = schema
        elif kind == "json_object":
            found["json_schema"] = {"type": "object"}
        elif kind != "text":
            raise RequestError(f"unknown response_format type {kind!r}", "response_format")
    if len(found) > 1:
        raise RequestError(f"give one constraint, got {sorted(found)}")
    if "choices" in found and (not isinstance(found["choices"], list) or not found["choices"]):
        raise RequestError("structured_outputs.choice must be a non-empty list of strings", "structured_outputs")
    return found
