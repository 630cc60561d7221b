"""Incremental detokenization with stop strings matched across token boundaries."""

from __future__ import annotations


class Detokenizer:
    """Turns generated token ids into text, one token at a time.

    `text` never contains a stop string: once one appears (possibly spanning several tokens), the
    text is cut before it and `stopped` is set. `pop_stream_delta()` returns only text that can no
    longer become part of a stop string or of an incomplete UTF-8 character.
    `skip`: text the first tokens spell before the text proper (token healing's backed-up prompt text):
    it is left out of `text`, so stop strings are searched, and text streamed, after it only.
    `after` (`min_tokens`, vLLM's meaning): no stop string is searched while at most `after` tokens are
    generated, and then only one that ends after the text of the first `after` tokens counts (one that
    straddles that point does).
    """

    def __init__(self, tokenizer, stop: list[str], skip: str = "", after: int = 0):
        self.tokenizer = tokenizer
        self._skip = skip
        self._after, self._after_text = after, 0
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended the text
        self._prefix_offset = 0
        self._read_offset = 0
        self._streamed = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def append(self, token_id: int) -> None:
        self.ids.append(token_id)
        # Decode a short window: the tokens before `read_offset` give context (leading spaces,
        # multi-byte characters) without being re-emitted.
        prefix = self._decode(self.ids[self._prefix_offset:self._read_offset])
        full = self._decode(self.ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return  # an incomplete character: wait for the next token
        searched_from = max(0, len(self.text) - self.hold)
        new = full[len(prefix):]
        if self._skip:  # whole characters on both sides: the skipped text is complete UTF-8
            cut = min(len(self._skip), len(new))
            self._skip, new = self._skip[cut:], new[cut:]
        self.text += new
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        if len(self.ids) <= self._after:
            self._after_text = len(self.text)
            return
        hits = [(i, s) for s in self.stop
                if (i := self.text.find(s, max(searched_from, self._after_text - len(s) + 1))) >= 0]
        if hits:
            cut, self.stop_string = min(hits)
            self.text = self.text[:cut]
            self.stopped = True

    def pop_stream_delta(self, final: bool) -> str:
        end = len(self.text) if final or self.stopped else max(self._streamed, len(self.text) - self.hold)
        delta = self.text[self._streamed:end]
        self._streamed = end
        return delta
