"""vLLM's tokenizer endpoints on kvql serve, in vLLM's shapes, so that a client without the model's tokenizer
(kvql's remote backend: `kvql.backends.server_tokenizer`) uses the server's:

- `POST /tokenize {"model", "prompt", "add_special_tokens": true, "return_token_strs": false}` or
  `{"model", "messages", "add_generation_prompt": true, "add_special_tokens": false}` (the chat template
  applied; its content as plain text on a server with `--plain-content`, as its chats are fed) ->
  `{"count", "max_model_len", "tokens", "token_strs"}`;
- `POST /detokenize {"model", "tokens"}` -> `{"prompt"}` (special tokens kept, as vLLM);
- `GET /tokenizer_info` -> the tokenizer's configuration as `tokenizer_config.json` has it (`bos_token`,
  `eos_token`, `added_tokens_decoder` with each token's `special` flag, `chat_template`, ...) and
  `tokenizer_class` (vLLM serves it only with `--enable-tokenizer-info-endpoint`).

`model` may be left out or name the served model (else 404, as the other routes). Errors are OpenAI's
shape (a 400 names the field). The tokenizer is the model's public `tokenizer`.
"""

from __future__ import annotations

import jinja2
from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..runtime import plain_content
from .protocol import RequestError, parse_json


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None


class TokenizeRequest(_Body):
    prompt: str | None = None
    messages: list[dict] | None = None
    add_special_tokens: bool | None = None  # vLLM's defaults: True for a prompt, False for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    tokens: list[int] = Field(max_length=1 << 20)


def tokenization_routes(app: FastAPI, s) -> None:
    """Register the three routes on `app` for `s` (the app's `Served`)."""
    tok = s.model.tokenizer

    async def read(request: Request, cls):
        body = parse_json(await s.body(request), "the request body")
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        try:
            req = cls.model_validate(body)
        except ValidationError as e:
            first = e.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or None
            raise RequestError(f"{field}: {first['msg']}" if field else first["msg"], field) from None
        if req.model is not None and req.model not in s.served:
            raise RequestError(f"model {req.model!r} is not served here; this server serves {s.name!r}",
                               "model", 404, "model_not_found")
        return req

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = await read(request, TokenizeRequest)
        if (req.prompt is None) == (req.messages is None):
            raise RequestError("give either prompt or messages", "prompt")
        if req.prompt is not None:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
        else:
            if not getattr(tok, "chat_template", None):
                raise RequestError("this model has no chat template", "messages")
            try:
                ids = _chat_ids(tok, req, s.plain_content)
            except (jinja2.TemplateError, TypeError, KeyError, ValueError) as e:  # templates refuse some messages
                raise RequestError(f"the model's chat template refused these messages: {e}", "messages") from None
        return {"count": len(ids), "max_model_len": s.model.context_length, "tokens": ids,
                "token_strs": tok.convert_ids_to_tokens(ids) if req.return_token_strs else None}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = await read(request, DetokenizeRequest)
        bad = next((t for t in req.tokens if not 0 <= t < len(tok)), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is not in the vocabulary (0 to {len(tok) - 1})", "tokens")
        return {"prompt": tok.decode(req.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        added = {str(i): {"content": t.content, "special": t.special} for i, t in tok.added_tokens_decoder.items()}
        info = {"tokenizer_class": type(tok).__name__, "bos_token": tok.bos_token, "eos_token": tok.eos_token,
                "pad_token": tok.pad_token, "unk_token": tok.unk_token, "model_max_length": s.model.context_length,
                "added_tokens_decoder": added}
        if getattr(tok, "chat_template", None):
            info["chat_template"] = tok.chat_template
        return info


def _chat_ids(tok, req: TokenizeRequest, plain: bool) -> list[int]:
    """The chat template applied to `req.messages`, then tokenized; `plain`: their content as plain text (as
    a server with `--plain-content` feeds its chats: kvql.runtime.plain_content)."""
    framed, template = bool(req.add_special_tokens), {"add_generation_prompt": req.add_generation_prompt}
    if plain:
        return plain_content.encode(tok, plain_content.render(tok, req.messages, **template), framed)
    return tok.encode(tok.apply_chat_template(req.messages, tokenize=False, **template), add_special_tokens=framed)
