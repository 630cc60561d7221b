"""A request's one constraint as the backend's generation options: `structured_outputs` (vLLM's: regex, choice,
grammar, json), `regex`, `json_schema` (an object or its JSON text), `response_format` (OpenAI's: a json_schema's
objects held closed as tools' are, kvql.server.closed_schema; or json_object). More than one is a 400."""

from __future__ import annotations

from .closed_schema import closed
from .protocol import RequestError, parse_json


def constraint_options(req) -> dict:
    """The one constraint of a request as `Model.generate` options (`{}` for none)."""
    found: dict = {}
    so = req.structured_outputs
    if so is not None:
        for key, value in (("regex", so.regex), ("choices", so.choice), ("grammar", so.grammar)):
            if value is not None:
                found[key] = value
        if so.json_ is not None:
            found["json_schema"] = _schema(so.json_, "structured_outputs.json")
    if req.regex is not None:
        found["regex"] = req.regex
    if req.json_schema is not None:
        found["json_schema"] = _schema(req.json_schema, "json_schema")
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise RequestError("response_format of type json_schema needs json_schema.schema",
                               "response_format.json_schema.schema")
        found["json_schema"] = closed(rf.json_schema.schema_)  # as OpenAI's strict mode: no made-up properties
    elif rf is not None and rf.type == "json_object":
        found["json_schema"] = {"type": "object"}
    if len(found) > 1:
        raise RequestError(f"give one constraint, got {sorted(found)}")
    return found


def _schema(value: dict | str, field: str) -> dict:
    """A JSON schema given as an object or as its JSON text (then parsed within this module's limits)."""
    if isinstance(value, str):
        value = parse_json(value, field, field)
    if not isinstance(value, dict):
        raise RequestError(f"{field} must be a JSON schema object", field)
    return value
