"""Tool calling on /v1/chat/completions, done as a constrained-decoding engine can do it: every call kvql
returns names one of the request's tools and carries arguments valid under that tool's parameter schema.

- The tools reach the model through its chat template (`apply_chat_template(tools=...)`). A template that
  ignores them (SmolLM2's) gets kvql's own description of them in the system message, which asks
  for calls in the Hermes format that Qwen's, Hermes' and SmolLM3's templates use:
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.
- `tool_choice`:
  - a named function (`{"type": "function", "function": {"name": ...}}`): the output is that function's
    arguments, constrained by its parameter schema (as vLLM does);
  - `"required"`: one or more calls in the Hermes format (one with `parallel_tool_calls: false`), each a
    tool's name and arguments valid under its schema;
  - `"auto"` (the default when tools are sent): text that does not start with `<tool_call>`, or calls as
    under "required";
  - `"none"`: as if no tools were sent (nothing offered, nothing read back).
  An object schema that declares `properties` and says nothing of `additionalProperties` is held closed
  (false), as OpenAI's strict mode requires (kvql.server.closed_schema): a call carries the arguments its
  function declares. Under every
  tool_choice a tool's parameters are compiled as a schema of their own: its local references (`#`,
  `#/$defs/City`, `#/properties/v`) resolve against them, recursion included.
- The answer carries OpenAI's `tool_calls` (`{"id", "type": "function", "function": {"name", "arguments"}}`,
  arguments as JSON text) and `content: null`; `finish_reason` is `"tool_calls"`, or `"stop"` for a named
  function (as OpenAI answers a forced call), or `"length"` when the token cap cut the output (then the calls
  completed before the cut are returned, and a text answer as text). A stream holds back what may be a call
  and sends each call whole, in one delta, when the sample ends; text streams as it comes.
- Earlier turns: an assistant message's `tool_calls` and `tool` messages reach a template that takes tools
  as transformers' templates expect them (arguments as objects); a template that does not gets them written
  out: the calls in the Hermes format, each tool result as a user turn in `<tool_response>` tags.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid

from ..backends.options import JSON_SPACING
from .closed_schema import closed
from .protocol import RequestError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)
_ANY_OBJECT = {"type": "object"}
_PROBE = [{"role": "user", "content": "x"}]
_PROBE_TOOL = [{"type": "function", "function": {"name": "kvql_probe", "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}]


def template_takes_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders `tools` (else kvql describes them itself)."""
    try:
        render = lambda **kw: tokenizer.apply_chat_template(_PROBE, add_generation_prompt=True,  # noqa: E731
                                                            tokenize=False, **kw)
        return render(tools=_PROBE_TOOL) != render()
    except Exception:  # a template that refuses the probe takes no tools we could rely on
        return False


@dataclasses.dataclass(frozen=True)
class ToolCalling:
    """One request's tools (OpenAI function objects: name, description, parameters) and how it may call them:
    `mode` "auto", "required" or "named" (`named`: the function's name); `parallel`: more than one call."""

    functions: tuple
    mode: str
    named: str | None = None
    parallel: bool = True

    @classmethod
    def of(cls, req) -> ToolCalling | None:
        """The request's tool calling, or None (no tools, or tool_choice "none"); a RequestError when
        tool_choice names no tool given."""
        choice = req.tool_choice
        if not req.tools:
            if choice not in (None, "none"):
                raise RequestError("tool_choice needs tools", "tool_choice")
            return None
        functions = tuple(t.function.model_dump(exclude_none=True) for t in req.tools)
        names = [f["name"] for f in functions]
        if len(set(names)) != len(names):
            raise RequestError(f"tools: two tools have the same name ({sorted(n for n in set(names) if names.count(n) > 1)})",
                               "tools")
        if choice == "none":
            return None
        if choice in (None, "auto", "required"):
            return cls(functions, choice or "auto", None, req.parallel_tool_calls)
        if choice.function.name not in names:
            raise RequestError(f"tool_choice names {choice.function.name!r}, which is not one of the tools {names}",
                               "tool_choice")
        return cls(functions, "named", choice.function.name, False)

    # -- the prompt ----------------------------------------------------------------------------------
    def messages(self, messages: list[dict], takes_tools: bool) -> tuple[list[dict], dict]:
        """The chat's messages and the template's extra arguments: `tools` for a template that takes them,
        else kvql's description of them prepended to the system message."""
        if takes_tools:
            return messages, {"tools": [{"type": "function", "function": f} for f in self.functions]}
        described = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False)
                              for f in self.functions)
        text = ("You can call functions (tools). Their descriptions, as JSON:\n<tools>\n" + described + "\n</tools>\n"
                "To call one, answer with a JSON object of its name and arguments between tags:\n"
                f'{OPEN}\n{{"name": "<function name>", "arguments": {{"<argument>": "<value>"}}}}\n{CLOSE}')
        if messages and messages[0]["role"] == "system":
            return [{**messages[0], "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]], {}
        return [{"role": "system", "content": text}, *messages], {}

    # -- the constraint ------------------------------------------------------------------------------
    def constraint(self) -> dict:
        """The output's constraint, as `Model.generate` options."""
        if self.mode == "named":
            return {"json_schema": self._arguments_schema(self.named)}  # written with JSON_SPACING, as every json_schema
        # Each tool's arguments are their own `%json` sub-grammar, compiled as the tool's own schema: its local
        # references ("#", "#/$defs/City") resolve against its parameters, as under a named tool_choice. (Inside
        # one schema of every call they resolved against that schema: refused, or recursing into a call.) Each
        # tool's rule is one line whose start holds its name: a compile error quotes that line, so it names the tool.
        tools = [f"tool_{i}: {json.dumps(_call_head(f['name']))} %json "
                 f"{json.dumps({**self._arguments_schema(f['name']), 'x-guidance': JSON_SPACING})} \"}}\""
                 for i, f in enumerate(self.functions)]
        calls = 'call ("\\n" call)*' if self.parallel else "call"
        start = "calls" if self.mode == "required" else "calls | TEXT"
        lark = (f"start: {start}\ncalls: {calls}\n"
                f"call: {json.dumps(OPEN + chr(10))} ({' | '.join(f'tool_{i}' for i in range(len(tools)))}) "
                f"{json.dumps(chr(10) + CLOSE)}\n" + "".join(t + "\n" for t in tools))
        if self.mode == "auto":
            lark += f"TEXT: /(.|\\n)*/ & ~/{re.escape(OPEN)}(.|\\n)*/\n"
        return {"grammar": lark}

    def _arguments_schema(self, name: str) -> dict:
        schema = next(f for f in self.functions if f["name"] == name).get("parameters")
        return closed(schema) if isinstance(schema, dict) and schema else _ANY_OBJECT

    # -- the answer ----------------------------------------------------------------------------------
    def read(self, text: str, finish_reason: str) -> tuple[str | None, list[dict], str]:
        """The output as (content, tool_calls, finish_reason)."""
        if self.mode == "named":
            calls = [_call(self.named, text)]
        else:
            calls = [_call(c["name"], json.dumps(c["arguments"], ensure_ascii=False))
                     for c in map(_parsed, _CALL.findall(text)) if c is not None]
            if not calls or not text.lstrip().startswith(OPEN):
                return text, [], finish_reason
        if finish_reason == "stop":
            finish_reason = "stop" if self.mode == "named" else "tool_calls"
        return None, calls, finish_reason

    def stream(self) -> CallStream:
        return CallStream(self)


def _call_head(name: str) -> str:
    """A call's text up to its arguments, written as `json.dumps` writes `{"name": name, "arguments": ...}`."""
    return '{"name": ' + json.dumps(name) + ', "arguments": '


def _parsed(text: str) -> dict | None:
    try:
        call = json.loads(text)
    except ValueError:
        return None  # cut by the token cap: not a call
    return call if isinstance(call, dict) and "name" in call and "arguments" in call else None


def _call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


class CallStream:
    """One streamed sample of a request with tools: `delta(text, completion)` -> the chunk's delta fields.
    Text that may still become a call is held back; calls are sent whole when the sample ends."""

    def __init__(self, calling: ToolCalling):
        self.calling, self.held, self.is_text = calling, "", False

    def delta(self, text: str, completion) -> tuple[dict, str | None]:
        """-> (the delta, the finish reason when `completion` ends the sample)."""
        self.held += text
        if not self.is_text and self.calling.mode == "auto":
            start = self.held.lstrip()[:len(OPEN)]
            self.is_text = bool(start) and not OPEN.startswith(start)  # it can no longer become a call
        if self.is_text:
            out, self.held = self.held, ""
            return {"content": out}, completion and completion.finish_reason
        if completion is None:
            return {"content": None}, None
        content, calls, finish = self.calling.read(self.held, completion.finish_reason)
        if not calls:
            return {"content": content}, finish
        return {"content": None, "tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}, finish


def message_text(m, i: int) -> str:
    """The text of message `m` (the `i`-th): its content string, or its text parts joined (a RequestError for
    any other part)."""
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    parts = []
    for j, p in enumerate(m.content):
        if p.type != "text" or p.text is None:
            raise RequestError(f"messages.{i}.content.{j}: only text parts are supported "
                               f"(type 'text' with a string 'text'), got type {p.type!r}", f"messages.{i}.content")
        parts.append(p.text)
    return "".join(parts)


def message_dicts(messages, takes_tools: bool, text_of) -> list[dict]:
    """The request's messages as the chat template's dicts (`text_of(message, i)`: its text content), with
    earlier tool calls and results in the template's terms (module docstring)."""
    out: list[dict] = []
    for i, m in enumerate(messages):
        role, content = ("system" if m.role == "developer" else m.role), text_of(m, i)
        calls = [{"name": c.function.name, "arguments": _arguments(c.function.arguments, i, j), "id": c.id}
                 for j, c in enumerate(m.tool_calls or ())]
        if takes_tools:
            d = {"role": role, "content": content}
            if calls:
                d["tool_calls"] = [{"id": c.pop("id"), "type": "function", "function": c} for c in calls]
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                d["name"] = m.name
            out.append(d)
        elif role == "tool":
            turn = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("kvql_tool_results"):  # the results of one turn's calls: one user turn
                out[-1]["content"] += "\n" + turn
            else:
                out.append({"role": "user", "content": turn, "kvql_tool_results": True})
        else:
            written = [f"{OPEN}\n{json.dumps({'name': c['name'], 'arguments': c['arguments']}, ensure_ascii=False)}"
                       f"\n{CLOSE}" for c in calls]
            out.append({"role": role, "content": "\n".join(filter(None, [content, *written]))})
    for d in out:
        d.pop("kvql_tool_results", None)
    return out


def _arguments(text: str, i: int, j: int):
    try:
        return json.loads(text)
    except ValueError:
        raise RequestError(f"messages.{i}.tool_calls.{j}.function.arguments: not JSON",
                           f"messages.{i}.tool_calls") from None
