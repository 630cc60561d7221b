"""Type constraints (`type(V) is T`): a type's JSON schema (`type_schema`), and a parsed value as that type
(`from_json`): str, int, float, bool, list[...] of these, or dataclasses of them."""

from __future__ import annotations

import dataclasses
import typing

from .errors import ConstraintError

_SCALARS = {str: {"type": "string"}, int: {"type": "integer"}, float: {"type": "number"}, bool: {"type": "boolean"}}


def type_name(t) -> str:
    return getattr(t, "__name__", None) or repr(t)


def type_schema(t) -> dict:
    """The JSON schema of `t`: str, int, float, bool, list[...] of these, or a dataclass of them
    (every field required, in declaration order, no other keys); ConstraintError otherwise."""
    if t in _SCALARS:
        return dict(_SCALARS[t])
    if typing.get_origin(t) is list and len(typing.get_args(t)) == 1:
        return {"type": "array", "items": type_schema(typing.get_args(t)[0])}
    if isinstance(t, type) and dataclasses.is_dataclass(t):
        try:
            hints = typing.get_type_hints(t)  # resolves string annotations (from __future__ import annotations)
        except Exception as e:
            raise ConstraintError(f"cannot read the field types of {type_name(t)}: {e}") from None
        fields = [f.name for f in dataclasses.fields(t)]
        props = {}
        for f in fields:
            try:
                props[f] = type_schema(hints[f])
            except ConstraintError as e:
                raise ConstraintError(f"{type_name(t)}.{f}: {e}") from None
        return {"type": "object", "properties": props, "required": fields, "additionalProperties": False}
    raise ConstraintError(f"type {type_name(t)} is not supported: a type constraint takes str, int, float, bool, "
                          "list[...] or a dataclass of these")


def from_json(t, data):
    """`data` (parsed JSON valid under `type_schema(t)`) as a `t`: dataclasses built field by field."""
    if isinstance(t, type) and dataclasses.is_dataclass(t):
        hints = typing.get_type_hints(t)
        return t(**{f.name: from_json(hints[f.name], data[f.name]) for f in dataclasses.fields(t)})
    if typing.get_origin(t) is list:
        (item,) = typing.get_args(t)
        return [from_json(item, d) for d in data]
    return float(data) if t is float else data
