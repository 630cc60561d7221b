"""Chat roles (`{:system}`, `{:user}`, `{:assistant}`) rendered through the model's own chat template."""

from __future__ import annotations

_SENTINEL = "\x00kvql\x00"


def role_wrapper(tokenizer, role: str, first: bool) -> tuple[str, str]:
    """The text the chat template puts before and after a message of `role`.

    For the first message, the prefix includes whatever the template adds at the start of a
    conversation (e.g. a default system prompt when the first message is not a system message).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template, so {:role} tags cannot be rendered")

    def render(messages):
        return tokenizer.apply_chat_template(messages, tokenize=False)

    message = {"role": role, "content": _SENTINEL}
    if first:
        full = render([message])
        base = ""
    else:
        opener = [{"role": "user", "content": "x"}] if role != "user" else [
            {"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        base = render(opener)
        full = render(opener + [message])
        if not full.startswith(base):
            raise ValueError(f"the chat template renders a {role} message differently depending on what follows")
    before, after = full[len(base):].split(_SENTINEL)
    return before, after
