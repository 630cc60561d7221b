"""`ServerTokenizer`: a served model's tokenizer, used through its server's `/tokenize` and `/detokenize`; and
`local_tokenizer`: the one found on this machine for a served model, which comes first.

The remote backend takes one when no local tokenizer is known for the served model (its name is no spec,
directory or cached hub id): prompts then still travel as token ids, so `distribution`, `score`, beam
search, token-id prompts and traces work as with a local tokenizer. The shapes are vLLM's, which kvql serve
and SGLang share: `POST /tokenize {"model", "prompt", "add_special_tokens"}` -> `{"tokens", "count",
"max_model_len"}`, `POST /tokenize {"model", "messages", "add_generation_prompt", "add_special_tokens"}`
(the chat template applied by the server; vLLM and kvql), `POST /detokenize {"model", "tokens"}` ->
`{"prompt"}` (SGLang answers `{"text"}`). Answers are read with bounds and checked field by field
(`kvql.backends.bounded_http`): a refusal (a status other than 200) raises `StatusError`, anything malformed,
too long or too slow a `BackendError` naming the server, the path and the field.

What a server tells of its special tokens: `GET /tokenizer_info` (kvql serve always; vLLM when started with
`--enable-tokenizer-info-endpoint`) gives `bos_token`, `eos_token`, `added_tokens_decoder` and
`chat_template`. Without it, the BOS token is the one `add_special_tokens` puts before an empty text (if
any), the EOS token is unknown (`eos_token_id` None: beam search cannot tell a finished beam by its last
token), and `skip_special_tokens` skips the BOS token only.

It offers the part of a Hugging Face tokenizer that kvql's query runtime uses (`encode`, `decode`, calling
it for `.input_ids`, `bos_token_id`, `eos_token_id`, `all_special_ids`, `chat_template`,
`apply_chat_template`), not the vocabulary: checks that need every token's bytes (a choice's fewest
tokens, the longest token) are skipped with it. Each call is one HTTP round trip (about a millisecond on
loopback) with a deadline (`timeout`), made on kvql's HTTP thread while the caller waits; answers are kept
(`CACHED` of each kind, least recently used dropped first), so a query that repeats its text asks once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from .bounded_http import INTEGERS, OBJECT, STRING, Reply, Server, StatusError, run_sync

CACHED = 4096
SERVER_RENDERED = "(rendered by the server)"  # `chat_template` when the server applies a template it does not show


@dataclass
class Encoding:
    input_ids: list[int]


class _Lru:
    def __init__(self):
        self.items: OrderedDict = OrderedDict()
        self.lock = threading.Lock()

    def get(self, key):
        with self.lock:
            if key in self.items:
                self.items.move_to_end(key)
                return self.items[key]
        return None

    def put(self, key, value) -> None:
        with self.lock:
            self.items[key] = value
            while len(self.items) > CACHED:
                self.items.popitem(last=False)


class ServerTokenizer:
    """The tokenizer of model `name` on the server at `root` (no `/v1`); `headers`: its API key; `timeout`:
    the seconds each request may take, answer included."""

    def __init__(self, root: str, name: str, headers: dict, timeout: float = 30.0):
        self.root, self.name, self.timeout = root, name, timeout
        self._server = Server(root, headers)
        self._encoded, self._decoded = _Lru(), _Lru()
        empty = self.encode("", add_special_tokens=True)  # StatusError when the server has no /tokenize
        info = self._info()
        self.bos_token_id = self._special_id(info, "bos_token")
        if self.bos_token_id is None:  # what the server adds before any text is its BOS token
            self.bos_token_id = empty[0] if len(empty) == 1 else None
        self.eos_token_id = self._special_id(info, "eos_token")
        specials = {self.bos_token_id, self.eos_token_id}
        for key, entry in info.get("added_tokens_decoder", {}).items():
            # tokenizer_config.json's shape ({"content", "special"}); vLLM flattens each entry to its content
            if key.isascii() and key.isdigit() and (not isinstance(entry, dict) or entry.get("special")):
                specials.add(int(key))
        self.all_special_ids = sorted(i for i in specials if i is not None)
        self._template = info.get("chat_template")
        self._renders: bool | None = None  # whether /tokenize takes messages; asked on first use

    def _post(self, path: str, body: dict) -> Reply:
        return run_sync(self._server.json("POST", path, {"model": self.name, **body}, seconds=self.timeout))

    def _info(self) -> dict:
        """`/tokenizer_info`'s fields that are used, checked; {} when the server refuses it."""
        try:
            reply = run_sync(self._server.json("GET", "/tokenizer_info", seconds=self.timeout))
        except StatusError:
            return {}
        template = reply.body.get("chat_template")
        if isinstance(template, list):  # named templates (tokenizer_config.json's other shape): rendered by the server
            template = None
        info = {"added_tokens_decoder": reply.get(reply.body, "added_tokens_decoder", OBJECT, default={}),
                "chat_template": reply.check(template, STRING, "chat_template") if template is not None else None}
        for key in ("bos_token", "eos_token"):  # a string, or tokenizer_config.json's {"content": ...}
            token = reply.body.get(key)
            info[key] = reply.get(token, "content", STRING, key) if isinstance(token, dict) else \
                reply.get(reply.body, key, STRING, default=None)
        return info

    def _special_id(self, info: dict, key: str) -> int | None:
        text = info.get(key)
        if not text:
            return None
        ids = self.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    # -- the Hugging Face tokenizer's methods the runtime calls ---------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        key = (text, add_special_tokens)
        found = self._encoded.get(key)
        if found is None:
            reply = self._post("/tokenize", {"prompt": text, "add_special_tokens": add_special_tokens})
            found = reply.get(reply.body, "tokens", INTEGERS)
            self._encoded.put(key, found)
        return list(found)

    def __call__(self, text: str, add_special_tokens: bool = True) -> Encoding:
        return Encoding(self.encode(text, add_special_tokens))

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens:  # skipped here: vLLM's /detokenize has no such field
            skip = set(self.all_special_ids)
            ids = [i for i in ids if i not in skip]
        if not ids:
            return ""
        key = tuple(ids)
        found = self._decoded.get(key)
        if found is None:
            reply = self._post("/detokenize", {"tokens": ids})
            found = reply.get(reply.body, "prompt" if "prompt" in reply.body else "text", STRING)  # SGLang: "text"
            self._decoded.put(key, found)
        return found

    @property
    def chat_template(self) -> str | None:
        """The template's text when the server shows it, `SERVER_RENDERED` when it only applies it
        (`/tokenize` with messages), None when it does neither."""
        if self._template is not None:
            return self._template
        if self._renders is None:
            try:
                self._render([{"role": "user", "content": "x"}], False)
                self._renders = True
            except StatusError:  # it refuses messages; any other failure is the server's error
                self._renders = False
        return SERVER_RENDERED if self._renders else None

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        reply = self._post("/tokenize", {"messages": messages, "add_generation_prompt": add_generation_prompt,
                                         "add_special_tokens": False})
        return reply.get(reply.body, "tokens", INTEGERS)

    def apply_chat_template(self, messages: list[dict], tokenize: bool = True, add_generation_prompt: bool = False):
        """The server's chat template applied to `messages`: its token ids, or (`tokenize=False`) their text."""
        ids = self._render(messages, add_generation_prompt)
        return ids if tokenize else self.decode(ids)

    def close(self) -> None:
        """Nothing to release: connections belong to kvql's HTTP thread (`bounded_http.run_sync`)."""

    def __repr__(self) -> str:
        return f"ServerTokenizer({self.name!r} at {self.root})"


def local_tokenizer(given, served_name: str):
    """The tokenizer to keep prompts as ids with: `given` (an object, or a spec / directory / hub id to
    load), else one found under the served model's name, else None (text prompts; `given=False`: always)."""
    if given is False:
        return None
    if given is not None and not isinstance(given, str):
        return given
    from .loader import ModelLoadError, load_tokenizer

    spec = given or served_name
    try:
        return load_tokenizer(spec)
    except ModelLoadError:
        pass
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(spec, local_files_only=True)
    except (OSError, ValueError) as e:
        if given is not None:
            raise ValueError(f"cannot load tokenizer {given!r}: {e}") from None
        return None
