"""`ServerTokenizer`: a served model's tokenizer, used through its server's `/tokenize` and `/detokenize`.

The remote backend takes one when no local tokenizer is known for the served model (its name is no spec,
directory or cached hub id): prompts then still travel as token ids, so `distribution`, `score`, beam
search, token-id prompts and traces work as with a local tokenizer. The shapes are vLLM's, which kvql serve
and SGLang share: `POST /tokenize {"model", "prompt", "add_special_tokens"}` -> `{"tokens", "count",
"max_model_len"}`, `POST /tokenize {"model", "messages", "add_generation_prompt", "add_special_tokens"}`
(the chat template applied by the server; vLLM and kvql), `POST /detokenize {"model", "tokens"}` ->
`{"prompt"}` (SGLang answers `{"text"}`).

What a server tells of its special tokens: `GET /tokenizer_info` (kvql serve always; vLLM when started with
`--enable-tokenizer-info-endpoint`) gives `bos_token`, `eos_token`, `added_tokens_decoder` and
`chat_template`. Without it, the BOS token is the one `add_special_tokens` puts before an empty text (if
any), the EOS token is unknown (`eos_token_id` None: beam search cannot tell a finished beam by its last
token), and `skip_special_tokens` skips the BOS token only.

It offers the part of a Hugging Face tokenizer that kvql's query runtime uses (`encode`, `decode`, calling
it for `.input_ids`, `bos_token_id`, `eos_token_id`, `all_special_ids`, `chat_template`,
`apply_chat_template`), not the vocabulary: checks that need every token's bytes (a choice's fewest
tokens, the longest token) are skipped with it. Each call is one blocking HTTP round trip (about a
millisecond on loopback) on the caller's thread; answers are kept (`CACHED` of each kind, least
recently used dropped first), so a query that repeats its text asks once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import httpx

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
    """The tokenizer of model `name` on the server at `root` (no `/v1`); `headers`: its API key."""

    def __init__(self, root: str, name: str, headers: dict, timeout: float = 30.0):
        self.root, self.name = root, name
        self._http = httpx.Client(headers=headers, timeout=timeout)
        self._encoded, self._decoded = _Lru(), _Lru()
        empty = self.encode("", add_special_tokens=True)  # ValueError when the server has no /tokenize
        info = self._info()
        self.bos_token_id = self._special_id(info.get("bos_token"))
        if self.bos_token_id is None:  # what the server adds before any text is its BOS token
            self.bos_token_id = empty[0] if len(empty) == 1 else None
        self.eos_token_id = self._special_id(info.get("eos_token"))
        specials = {self.bos_token_id, self.eos_token_id}
        for key, entry in (info.get("added_tokens_decoder") or {}).items():
            # tokenizer_config.json's shape ({"content", "special"}); vLLM flattens each entry to its content
            if str(key).isdigit() and (not isinstance(entry, dict) or entry.get("special")):
                specials.add(int(key))
        self.all_special_ids = sorted(i for i in specials if i is not None)
        self._template = info.get("chat_template") if isinstance(info.get("chat_template"), str) else None
        self._renders: bool | None = None  # whether /tokenize takes messages; asked on first use

    def _post(self, path: str, body: dict) -> dict:
        try:
            r = self._http.post(self.root + path, json={"model": self.name, **body})
        except httpx.TransportError as e:
            raise ValueError(f"cannot reach {self.root}{path}: {e}") from None
        if r.status_code != 200:
            raise ValueError(f"{self.root}{path} answered {r.status_code}: {r.text[:300]}")
        return r.json()

    def _info(self) -> dict:
        try:
            r = self._http.get(self.root + "/tokenizer_info")
        except httpx.TransportError:
            return {}
        if r.status_code != 200:
            return {}
        try:
            info = r.json()
        except ValueError:
            return {}
        return info if isinstance(info, dict) else {}

    def _special_id(self, token) -> int | None:
        text = token.get("content") if isinstance(token, dict) else token
        if not isinstance(text, str) or not text:
            return None
        ids = self.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    # -- the Hugging Face tokenizer's methods the runtime calls ---------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        key = (text, add_special_tokens)
        found = self._encoded.get(key)
        if found is None:
            found = self._post("/tokenize", {"prompt": text, "add_special_tokens": add_special_tokens})["tokens"]
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
            answer = self._post("/detokenize", {"tokens": ids})
            found = answer["prompt"] if "prompt" in answer else answer["text"]  # SGLang: "text"
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
            except ValueError:
                self._renders = False
        return SERVER_RENDERED if self._renders else None

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        return self._post("/tokenize", {"messages": messages, "add_generation_prompt": add_generation_prompt,
                                        "add_special_tokens": False})["tokens"]

    def apply_chat_template(self, messages: list[dict], tokenize: bool = True, add_generation_prompt: bool = False):
        """The server's chat template applied to `messages`: its token ids, or (`tokenize=False`) their text."""
        ids = self._render(messages, add_generation_prompt)
        return ids if tokenize else self.decode(ids)

    def close(self) -> None:
        self._http.close()

    def __repr__(self) -> str:
        return f"ServerTokenizer({self.name!r} at {self.root})"
