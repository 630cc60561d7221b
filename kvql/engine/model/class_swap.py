"""A transformers module's class swapped for a kvql subclass and back (alibi_attention.py, latent_attention.py,
recurrent_mixers.py): the subclass overrides a few methods and names the class it replaces under a marker
attribute (`kvql_alibi_of`, ...), made once per (class, marker), so that a module is swapped back by reading it."""

from __future__ import annotations

_MADE: dict[tuple[type, str], type] = {}


def swap(module, marker: str, prefix: str, methods: dict) -> None:
    """`module`'s class becomes its subclass `prefix + name` overriding `methods`, marked `marker`; idempotent."""
    cls = type(module)
    if getattr(cls, marker, None) is not None:
        return
    if (cls, marker) not in _MADE:
        _MADE[cls, marker] = type(f"{prefix}{cls.__name__}", (cls,), {**methods, marker: cls})
    module.__class__ = _MADE[cls, marker]


def original(module, marker: str) -> type | None:
    """The class `module` had before a swap under `marker`; None where it has not been swapped."""
    return getattr(type(module), marker, None)


def restore(modules, marker: str) -> None:
    """Every module of `modules` swapped under `marker` back to its own class."""
    for module in modules:
        cls = original(module, marker)
        if cls is not None:
            module.__class__ = cls
