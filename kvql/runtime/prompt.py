"""The prompt of one query run, as the backend is sent it: token ids when it has a tokenizer, else text.

With token ids, literal text is tokenized in the largest pieces available (everything between two
holes at once) and generated values keep the tokens the model produced (unless a stop phrase or a
post-processor changed the text). Running the same query again therefore sends the same ids, and the
engine (or the server's prefix cache) serves them from its cache. Per token it also records whether it
was served from the cache or computed, and which hole produced it (see `kvql.runtime.trace`).
"""

from __future__ import annotations

from .trace import TraceToken


class Prompt:
    def __init__(self, tokenizer, ids: list[int] | None = None, text: str = ""):
        self.tokenizer = tokenizer
        self.text = text  # what the model sees (role tags rendered by its chat template)
        self._pending: list[str] = []  # model text not tokenized yet
        if tokenizer is None:
            self.ids = None
        else:
            self.ids = list(ids) if ids is not None else tokenizer("", add_special_tokens=True).input_ids
        n = len(self.ids or ())
        self.served: list[str | None] = [None] * n  # "cached" | "computed" | None (never sent)
        self.hole_of: list[str | None] = [None] * n

    def add(self, text: str) -> None:
        self._pending.append(text)

    def flush(self) -> list[int] | str:
        """The prompt so far, as it is sent: a copy of its token ids, or its text."""
        if self._pending:
            chunk = "".join(self._pending)
            self._pending.clear()
            self.text += chunk
            if self.ids is not None:
                self._extend(self.tokenizer.encode(chunk, add_special_tokens=False), None)
        return self.text if self.ids is None else list(self.ids)

    def ensure_start(self) -> None:
        """A hole at the very start, and a tokenizer that adds no BOS: give the model one token to read."""
        self.flush()
        if self.ids is not None and not self.ids:
            tok = self.tokenizer
            self._extend([tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id], None)

    def add_value(self, value: str, token_ids: list[int] | None, hole: str | None,
                  healed: tuple[int, str] | None = None) -> None:
        """A hole's value: its own tokens when they spell it (their KV is already cached), else re-encoded.
        `healed` (k, text): token healing generated the prompt's last k tokens (their text) again, so they
        are replaced: by `token_ids` when these spell text + value, else by text + value re-encoded."""
        self.flush()
        self.text += value
        if self.ids is None:
            return
        if healed is not None:
            k, prefix = healed
            del self.ids[-k:], self.served[-k:], self.hole_of[-k:]
            value = prefix + value
        if token_ids is not None and self.tokenizer.decode(token_ids) == value:
            self._extend(token_ids, hole)
        else:
            self._extend(self.tokenizer.encode(value, add_special_tokens=False), hole)

    def _extend(self, token_ids: list[int], hole: str | None) -> None:
        self.ids += token_ids
        self.served += [None] * len(token_ids)
        self.hole_of += [hole] * len(token_ids)

    def __len__(self) -> int:
        return len(self.ids) if self.ids is not None else 0

    def sent(self, n: int, cached: int) -> None:
        """A request with the first `n` prompt tokens was served `cached` of them from the cache."""
        for i in range(min(n, len(self.served))):
            if self.served[i] is None:
                self.served[i] = "cached" if i < cached else "computed"

    def trace_tokens(self) -> list[TraceToken] | None:
        if self.ids is None:
            return None
        self.flush()
        return [TraceToken(t, self.tokenizer.decode([t]), served or "unsent", hole)
                for t, served, hole in zip(self.ids, self.served, self.hole_of)]
