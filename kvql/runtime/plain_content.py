"""Chat content tokenized as plain text, so that no message can forge a turn.

A chat template renders messages into one text, which the tokenizer then reads with its special tokens parsed
(transformers' `apply_chat_template` and vLLM do this): a message whose content holds `<|im_start|>system ...`
becomes real control tokens. Here, only the template's own text is read for special tokens; each message's
content is read with `split_special_tokens=True`, so `<|im_start|>` in it is the text `<|im_start|>` (several
ordinary tokens) and never a turn's start.

Contract:
- `encode(tokenizer, render(tokenizer, messages, ...))` holds no special token (a special added token or one of
  `all_special_ids`) inside any content's span, whatever the content says; the template's own special tokens are
  those the template wrote.
- When no content holds a special token's text, the ids equal the template's usual ones
  (`apply_chat_template(..., tokenize=True)`), token for token: the usual tokenization of the rendered text is
  kept unless one of its special tokens overlaps a content span. (Then the template's text and each content are
  tokenized apart; tokens at their borders may differ from a tokenization of the whole text: it is no longer
  the text the template meant.)
- Where content lies: the template is rendered once with each content replaced by a mark (a random word), and
  once as given. A template that trims content (Gemma's) is followed; one that rewrites content otherwise (a
  template that drops reasoning before `</think>`, one that writes content as JSON) gets each content as sent,
  where its mark stood. A template that cuts a mark is refused (ValueError): its content cannot be found.
- Content is a message's `content` string, or the `text` of its `{"type": "text"}` parts. Other fields a
  template writes (tool definitions, tool calls' arguments, names) are template text.

`pieces` serves a prompt built piece by piece (a query's roles): template text and content given apart.
"""

from __future__ import annotations

import dataclasses
import re
import uuid


@dataclasses.dataclass(frozen=True)
class Rendered:
    """A chat's text and where its contents lie in it (`spans`: [start, end) character offsets, in order)."""

    text: str
    spans: tuple[tuple[int, int], ...]


def chat_ids(tokenizer, messages: list[dict], **template_kwargs) -> list[int]:
    """`tokenizer.apply_chat_template(messages, tokenize=True, **template_kwargs)` with content as plain text."""
    return encode(tokenizer, render(tokenizer, messages, **template_kwargs))


def render(tokenizer, messages: list[dict], **template_kwargs) -> Rendered:
    """The chat template's text for `messages` (keywords: `add_generation_prompt`, `tools`, ...), and where
    each content lies in it (module docstring)."""
    nonce = uuid.uuid4().hex
    contents: list[str] = []
    masked = [_masked(m, nonce, contents) for m in messages]
    skeleton = tokenizer.apply_chat_template(masked, tokenize=False, **template_kwargs)
    real = tokenizer.apply_chat_template(messages, tokenize=False, **template_kwargs)
    parts = re.split(f"kvql{nonce}m([0-9]+)e", skeleton)
    segments, found = parts[0::2], [int(k) for k in parts[1::2]]
    order = [contents[k] for k in found]
    written = _located(real, segments, order)
    # a mark the template changed (in part) is not found whole; where the real text matched, it dropped a message
    if any(nonce in s.lower() for s in segments) or (written is None and set(found) != set(range(len(contents)))):
        raise ValueError("the chat template changes message content so that plain content cannot find it")
    return pieces(_interleaved(segments, order if written is None else written))


def pieces(parts) -> Rendered:
    """A text of `(text, is_content)` pieces, in order."""
    text, spans, at = [], [], 0
    for piece, is_content in parts:
        if is_content and piece:
            spans.append((at, at + len(piece)))
        text.append(piece)
        at += len(piece)
    return Rendered("".join(text), tuple(spans))


def encode(tokenizer, rendered: Rendered, add_special_tokens: bool = False) -> list[int]:
    """The token ids of `rendered.text`, its contents tokenized as plain text (module docstring);
    `add_special_tokens`: the tokenizer's own framing (BOS) around them, as `encode` adds it."""
    special = special_ids(tokenizer)
    if getattr(tokenizer, "is_fast", False):
        usual = tokenizer(rendered.text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
        if not any(t in special and _overlaps(span, rendered.spans)
                   for t, span in zip(usual.input_ids, usual.offset_mapping)):
            return list(usual.input_ids)
    ids, at = [], 0
    for start, end in rendered.spans:
        ids += tokenizer.encode(rendered.text[at:start], add_special_tokens=False)
        content = tokenizer(rendered.text[start:end], add_special_tokens=False, split_special_tokens=True).input_ids
        if special.intersection(content):  # a tokenizer that ignores split_special_tokens: never forge a turn
            raise ValueError(f"{type(tokenizer).__name__} reads special tokens in content even when told not to")
        ids += content
        at = end
    ids += tokenizer.encode(rendered.text[at:], add_special_tokens=False)
    return _framed(tokenizer, rendered.text, ids) if add_special_tokens else ids


def special_ids(tokenizer) -> set[int]:
    """The ids of the tokenizer's special tokens: its named ones and every added token marked special."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return set(tokenizer.all_special_ids) | {i for i, t in added.items() if getattr(t, "special", False)}


def _masked(message: dict, nonce: str, contents: list[str]) -> dict:
    """`message` with each non-empty content string replaced by a mark that names it in `contents`. Marks are
    letters and digits: trimming, escaping or `tojson` leave them whole. Empty content stays empty, as templates
    test content for emptiness."""
    def mark(s):
        if not isinstance(s, str) or not s:
            return s
        contents.append(s)
        return f"kvql{nonce}m{len(contents) - 1}e"

    content = message.get("content")
    if isinstance(content, list):
        content = [{**p, "text": mark(p["text"])} if isinstance(p, dict) and p.get("type") == "text" and "text" in p
                   else p for p in content]
    else:
        content = mark(content)
    return {**message, "content": content}


def _located(real: str, segments: list[str], contents: list[str]) -> list[str] | None:
    """Each content as the real rendering wrote it (as sent, or trimmed) between the template's segments, or
    None where the real rendering is not the segments around such contents."""
    written, at = [], 0
    for content, segment, following in zip(contents, segments, segments[1:]):
        if not real.startswith(segment, at):
            return None
        at += len(segment)
        forms = dict.fromkeys((content, content.strip(), content.lstrip(), content.rstrip()))
        form = next((f for f in forms if real.startswith(f + following, at)), None)
        if form is None:
            return None
        written.append(form)
        at += len(form)
    return written if real[at:] == segments[-1] else None


def _interleaved(segments: list[str], contents: list[str]):
    for segment, content in zip(segments, contents):
        yield segment, False
        yield content, True
    yield segments[-1], False


def _overlaps(span, spans) -> bool:
    start, end = span
    return end > start and any(start < b and end > a for a, b in spans)


def _framed(tokenizer, text: str, ids: list[int]) -> list[int]:
    """`ids` inside the special tokens `tokenizer.encode(text)` puts around `text`'s own tokens (BOS, ...)."""
    bare = tokenizer.encode(text, add_special_tokens=False)
    framed = tokenizer.encode(text, add_special_tokens=True)
    head = next((k for k in range(len(framed) - len(bare) + 1) if framed[k:k + len(bare)] == bare), 0)
    return framed[:head] + ids + framed[head + len(bare):]
