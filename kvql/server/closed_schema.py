"""JSON schemas held closed: an object schema that declares `properties` and says nothing of other properties
gets `additionalProperties: false`, as OpenAI's strict mode requires. Used for tools' parameters
(kvql.server.tools) and `response_format` schemas (kvql.server.protocol): a small model otherwise pads an object
with properties it made up (SmolLM2 added `"userLocation"` to a `City` until the token cap cut it: JSON invalid
under the schema)."""

from __future__ import annotations

_LITERALS = ("const", "enum", "default", "examples")  # values, not schemas
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed(schema):
    """`schema` (recursively: nested objects, items, `$defs`, combinators) with every object that declares
    `properties` and says nothing of others (neither `additionalProperties` nor `patternProperties`) closed to
    others. Values (`const`, `enum`, ...) and property names are left alone; the input is not changed."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _LITERALS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):  # name -> schema: the names are no keywords
            out[key] = {name: closed(s) for name, s in value.items()}
        else:
            out[key] = closed(value)
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out
