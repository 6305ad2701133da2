"""A small JSON-schema check for the structured-output tests (the keywords their schemas use:
type, properties, required, additionalProperties, enum, maxLength, minimum, maximum, items), so
that a reply is judged by the schema it was asked for rather than by its shape alone."""
from __future__ import annotations

from typing import Any

_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def problems(value: Any, schema: dict, where: str = "$") -> list[str]:
    """Every way ``value`` breaks ``schema`` (empty: it matches)."""
    out: list[str] = []
    kind = schema.get("type")
    if kind == "integer":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "number":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = kind is None or isinstance(value, _TYPES[kind]) and not (kind != "boolean" and isinstance(value, bool))
    if not ok:
        return [f"{where}: {value!r} is not of type {kind}"]
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{where}: {value!r} is not one of {schema['enum']}")
    if isinstance(value, str) and len(value) > schema.get("maxLength", len(value)):
        out.append(f"{where}: longer than {schema['maxLength']}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < schema.get("minimum", value) or value > schema.get("maximum", value):
            out.append(f"{where}: {value} is out of range")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        out += [f"{where}: '{k}' is required" for k in schema.get("required", []) if k not in value]
        if schema.get("additionalProperties") is False:
            out += [f"{where}: '{k}' is not allowed" for k in value if k not in props]
        for k, v in value.items():
            if k in props:
                out += problems(v, props[k], f"{where}.{k}")
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(value):
            out += problems(v, schema["items"], f"{where}[{i}]")
    return out
