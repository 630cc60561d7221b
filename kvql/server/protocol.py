"""OpenAI-compatible request and error bodies: raw bytes -> a validated request, or a `RequestError`.

Every way a body can be wrong is a `RequestError` (answered 4xx with OpenAI's error shape), never an
exception that would become a 500: malformed or non-UTF-8 JSON, `NaN` / `Infinity` (which Python's
`json` accepts), JSON nested deeper than `MAX_DEPTH` (also inside a JSON schema sent as a string),
lone surrogates (`"\\ud800"`, not encodable as UTF-8), wrong types (one short line naming the field,
never a pydantic dump).

Constraint fields accepted, named as vLLM and SGLang users know them:
- vLLM: `structured_outputs: {"regex" | "choice" | "json" | "grammar": ...}`; chat `response_format`
  (`{"type": "json_schema", "json_schema": {"schema": ...}}`, its objects held closed as tools' are:
  kvql.server.closed_schema; or `{"type": "json_object"}`);
- SGLang: top-level `regex`, `json_schema`.
At most one per request, read by request_constraint.py.
vLLM's other fields, with vLLM 0.32's meaning: `min_tokens` (kvql.engine.decode.masks), `ignore_eos`,
`return_token_ids` (also streamed: each chunk's new ids; `prompt_token_ids` in the first),
`return_tokens_as_token_ids`, `prompt_logprobs` (logprobs.py), and on /v1/completions `echo` with
`logprobs` (the prompt's log-probabilities first) and `max_tokens: 0` with `echo` (the prompt scored,
nothing generated).
Fields other servers' clients and routers send (vllm-router re-serializes every body with its own request
type and adds them at its defaults), accepted only at values meaning what kvql does, else a 400 naming the
field (`NO_OP_VALUES`): SGLang's `no_stop_trim` (false: a stop string is cut from the text) and
`return_hidden_states` (false); vLLM's `skip_special_tokens` (true: special tokens left out of the text); on
chat, vLLM's `continue_final_message` (false: the template opens a new assistant turn) and
`include_reasoning` (true: nothing is left out), and SGLang's `separate_reasoning` and `stream_reasoning`
(either value: they act on a reasoning parser's split, and kvql has none, like SGLang started without one).
Fields the `openai` client, LangChain and LiteLLM send, with OpenAI's meaning: `frequency_penalty`,
`presence_penalty` (0: off), `top_k` (vLLM's: -1 / 0 / none: off), `max_completion_tokens` (an alias of
`max_tokens`), `stream_options.include_usage` (a last chunk with `choices: []` and the usage) and vLLM's
`stream_options.continuous_usage_stats`, chat `reasoning_effort` (to the chat template), chat `tools`,
`tool_choice`, `parallel_tool_calls` and messages' `tool_calls` / `tool_call_id` (kvql.server.tools);
`user`, `metadata`, `store`, `service_tier` change nothing and are accepted unused (`ACCEPTED_UNUSED`);
completions' `best_of` only equal to `n`, `suffix` only empty. `logit_bias` (token id -> bias in [-100, 100],
OpenAI's): the value is added to the token's logit (after the penalties); the two values OpenAI documents as
absolute are exact, as a mask (kvql.engine.decode.masks): -100 bans the token, 100 restricts sampling to the
tokens given 100; `{}` is no bias; a key that is no token id or a value outside [-100, 100] is a 400 naming the
field. `min_p` (vLLM's and SGLang's, in [0, 1]; 0 / null: off): when sampling,
tokens whose probability is below min_p times the most likely token's are removed (kvql.engine.decode.sampler).
The fields that are generation options reach the model as `kvql.backends.options.GenerateOptions` says
(`kvql.server.served.Served.options`).
Any other field is refused with a 400 naming it: in particular the old `guided_*` fields, which
some servers ignore silently (the message names the spelling kvql takes, `RENAMED`).
"""

from __future__ import annotations

import json
import logging
import math
import re
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..backends.options import CACHE_SALT_MAX

# Containers (objects, arrays) nested deeper than this are refused. Python's json parser and the
# grammar compiler recurse; a limit far below theirs keeps them from failing (RecursionError) or
# crashing. Real JSON schemas nest a few levels; a schema of ~30 nested objects fits.
MAX_DEPTH = 64
MAX_MESSAGE = 500  # characters of an error message (some echo the whole input)
logger = logging.getLogger("kvql.server")


class RequestError(ValueError):
    """A bad request: answered with a 4xx and an OpenAI-style error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.status, self.code, self.kind = param, status, code, kind


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   kind: str = "invalid_request_error", headers: dict | None = None) -> JSONResponse:
    """OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}`."""
    if len(message) > MAX_MESSAGE:
        message = message[:MAX_MESSAGE] + "..."
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StructuredOutputs(_Strict):
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    json_: dict | str | None = Field(default=None, alias="json")
    grammar: str | None = None


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: every chunk carries the usage so far


class _Common(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)  # vLLM's: -1, 0 or none: every token
    min_p: float | None = Field(default=None, ge=0, le=1)  # vLLM's and SGLang's; 0 / none: off
    logit_bias: dict[str, float] | None = None  # token id -> added to its logit; -100 / 100 exact; see above
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float = Field(default=1.0, gt=0)  # CTRL / transformers; 1: none (vLLM: any > 0)
    n: int = Field(default=1, ge=1, le=64)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, not used
    # accepted, not used: they do not change the answer (ACCEPTED_UNUSED)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=CACHE_SALT_MAX)  # vLLM's name: a cache partition
    structured_outputs: StructuredOutputs | None = None
    regex: str | None = None
    json_schema: dict | str | None = None
    # vLLM's names (see kvql.engine.decode.masks and logprobs.py for their meaning)
    min_tokens: int = Field(default=0, ge=0)  # no EOS, no stop string, before this many generated tokens
    ignore_eos: bool = False
    return_token_ids: bool = False  # each choice also carries its token ids (a stream: each chunk's new ones)
    return_tokens_as_token_ids: bool | None = None  # logprobs' tokens spelled "token_id:{id}"
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)  # logprobs of the prompt's tokens, top k
    # accepted at their no-op values only (NO_OP_VALUES)
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    return_hidden_states: bool = False


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0)  # 0 only with echo: the prompt scored, nothing generated
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)  # only n (the default): kvql returns every sample it makes
    suffix: str | None = None  # only none or "": kvql does not insert text


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")  # other part types (image_url, ...) are refused by name below

    type: str
    text: str | None = None


class CalledFunction(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI returns it


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls (kvql.server.tools)
    tool_call_id: str | None = None  # a tool message's: the call it answers
    refusal: str | None = None  # the openai client sends its own messages back with these: not used
    annotations: list | None = None


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # either value: kvql always holds the arguments to the schema


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    response_format: ResponseFormat | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None  # to the chat template
    continue_final_message: bool = False
    include_reasoning: bool = True
    separate_reasoning: bool = True  # either value: no reasoning parser, nothing to separate
    stream_reasoning: bool = True  # either value: likewise


# field -> (the value kvql accepts, what kvql does instead of the other value)
NO_OP_VALUES = {
    "no_stop_trim": (False, "a stop string is always cut from the text"),
    "skip_special_tokens": (True, "special tokens are always left out of the text"),
    "return_hidden_states": (False, "hidden states are not returned"),
    "continue_final_message": (False, "the chat template always opens a new assistant turn "
                                      "(to continue a message, render it yourself and use /v1/completions)"),
    "include_reasoning": (True, "the whole output is returned as content: kvql has no reasoning parser "
                                "that could leave the reasoning out"),
}


# fields other servers take, and kvql's spelling of them
RENAMED = {
    "guided_regex": "structured_outputs.regex",
    "guided_json": "structured_outputs.json",
    "guided_choice": "structured_outputs.choice",
    "guided_grammar": "structured_outputs.grammar",
    "guided_decoding_backend": None,
    "guided_whitespace_pattern": None,
    "functions": "tools",  # OpenAI's deprecated spelling
    "function_call": "tool_choice",
}

# fields accepted with no effect on the answer: logged once per process at debug level
ACCEPTED_UNUSED = ("user", "metadata", "store", "service_tier")
_logged: set[str] = set()


def parse_request(raw: bytes, cls: type[_Common]) -> _Common:
    """The request `cls` in the body `raw`, or a `RequestError` saying what is wrong and where."""
    body = parse_json(raw, "the request body")
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    for field, spelling in RENAMED.items():
        if field in body:
            instead = (f"use {spelling} (the current spelling)" if spelling else
                       "kvql serve compiles every constraint with llguidance; leave it out")
            raise RequestError(f"{field} is not supported: {instead}", field)
    for field in ACCEPTED_UNUSED:
        if field in body and field not in _logged:
            _logged.add(field)
            logger.debug("accepted %s: it does not change the answer, and kvql serve does not use it", field)
    try:
        req = cls.model_validate(body)
    except ValidationError as e:
        raise _summary(e, body) from None
    for field, (accepted, instead) in NO_OP_VALUES.items():
        value = getattr(req, field, accepted)
        if value != accepted:
            raise RequestError(f"{field}: {json.dumps(value)} is not supported; kvql serve takes only "
                               f"{json.dumps(accepted)} ({instead})", field)
    if req.stream_options is not None and not req.stream:
        raise RequestError("stream_options is only allowed with stream: true", "stream_options")
    if getattr(req, "best_of", None) not in (None, req.n):
        raise RequestError(f"best_of {req.best_of} is not supported: kvql returns every sample it makes "
                           f"(best_of must be n, {req.n}, or left out)", "best_of")
    if getattr(req, "suffix", None):
        raise RequestError("suffix is not supported: kvql does not insert text (leave it out, or null)", "suffix")
    return req


def parse_json(text: str | bytes, what: str, param: str | None = None) -> Any:
    """JSON text -> value, within the limits in this module's docstring."""
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise RequestError(f"{what}: JSON nested deeper than {MAX_DEPTH} levels", param) from None
    except RequestError as e:
        raise RequestError(f"{what}: {e}", param) from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer over Python's 4300 digits
        raise RequestError(f"malformed JSON in {what}: {e}", param) from None
    _check_tree(value, param)
    return value


def _no_constant(name: str):
    raise RequestError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise RequestError(f"{text} is out of range")
    return value


def _check_tree(value: Any, root: str | None) -> None:
    """Refuse nesting over `MAX_DEPTH` and strings UTF-8 cannot encode (lone surrogates), naming the
    field. Iterative: it must not recurse on what it is checking."""
    stack = [(value, 1, root)]
    while stack:
        v, depth, where = stack.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    raise RequestError(f"{where or 'the request'}: a string holds a lone surrogate "
                                       "(invalid Unicode)", where) from None
            continue
        if not isinstance(v, (dict, list)):
            continue
        if depth > MAX_DEPTH:
            field = root or where.split(".")[0]  # not the whole path: it is as long as the nesting
            raise RequestError(f"{field or 'the request body'}: JSON nested deeper than {MAX_DEPTH} levels", field)
        items = v.items() if isinstance(v, dict) else enumerate(v)
        for key, item in items:
            path = f"{where}.{key}" if where else str(key)
            if isinstance(key, str):
                stack.append((key, depth, where))  # a key is checked like a string value
            stack.append((item, depth + 1, path))


def _summary(e: ValidationError, body: dict) -> RequestError:
    """One short line for a pydantic error: the field's path in the body and what is wrong with it."""
    errors = e.errors(include_url=False, include_input=False)
    if not errors:
        return RequestError("invalid request")
    paths = [_body_path(body, err["loc"], err["type"]) for err in errors]
    path = max(paths, key=len)  # the most specific: for a union, the member that got furthest in
    # a value matching no member of a union gets one error per member: say them all, briefly
    msgs = list(dict.fromkeys(re.sub(r"a valid dictionary( or instance of \w+)?", "an object", err["msg"])
                              for err, p in zip(errors, paths) if p == path))
    where = ".".join(map(str, path))
    return RequestError(f"{where}: {'; or '.join(msgs[:4])}" if where else msgs[0], where or None)


def _body_path(body: Any, loc: tuple, kind: str) -> tuple:
    """`loc` with pydantic's union-member tags (e.g. `'list[int]'`) left out: the segments found in
    the body, and a missing field's name."""
    path, node = [], body
    for i, seg in enumerate(loc):
        if isinstance(node, dict) and seg in node:
            node = node[seg]
        elif isinstance(node, list) and isinstance(seg, int) and 0 <= seg < len(node):
            node = node[seg]
        elif kind == "missing" and i == len(loc) - 1:
            pass
        else:
            continue  # a union tag
        path.append(seg)
    return tuple(path)
