"""A tool's JSON schema -> which JSON types each parameter takes, and a raw parameter text -> the
value of that type (llama.cpp's rule: a string stays raw text; number, integer, boolean, null,
object and array are parsed, falling back to the raw text when they do not parse)."""
from __future__ import annotations

import json
from typing import Any

ANY = frozenset({"string", "number", "integer", "boolean", "null", "object", "array"})
STRING = frozenset({"string"})


def schema_types(schema: Any, depth: int = 0) -> frozenset[str]:
    """Every JSON type a schema admits (``ANY`` when it does not say)."""
    if not isinstance(schema, dict) or depth > 8:
        return ANY
    types: set[str] = set()
    t = schema.get("type")
    if isinstance(t, str):
        types.add(t)
    elif isinstance(t, list):
        types.update(x for x in t if isinstance(x, str))
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list):
            for sub in schema[key]:
                types |= schema_types(sub, depth + 1)
    if "enum" in schema and isinstance(schema["enum"], list) and not t:
        types.update(_json_type(v) for v in schema["enum"])
    if schema.get("nullable") is True:
        types.add("null")
    if not types:
        if isinstance(schema.get("properties"), dict):
            return frozenset({"object"})
        if "items" in schema:
            return frozenset({"array"})
        return ANY
    return frozenset(types)


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    return "array" if isinstance(v, list) else "object"


_PY_LITERALS = {"True": True, "False": False, "None": None}  # what Qwen3.5's template renders for Python values


def convert_value(raw: str, types: frozenset[str]) -> Any:
    """A parameter's raw text as the JSON type its schema asks for; raw text when it does not
    parse as one of them (never dropped)."""
    if types == STRING:
        return raw
    text = raw.strip()
    try:
        value = json.loads(text)
    except ValueError:
        if text not in _PY_LITERALS:
            return raw
        value = _PY_LITERALS[text]
    kind = _json_type(value)
    if kind == "integer" and "integer" not in types and "number" in types:
        return value
    if kind == "number" and "integer" in types and value.is_integer() and "number" not in types:
        return int(value)
    return value if kind in types and kind != "string" else raw


def tool_params(tools: list[dict] | None) -> dict[str, dict[str, frozenset[str]] | None]:
    """name -> {parameter: types} (None where the tool lists no properties)."""
    out: dict[str, dict[str, frozenset[str]] | None] = {}
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            continue
        props = fn.get("parameters", {}).get("properties") if isinstance(fn.get("parameters"), dict) else None
        out[fn["name"]] = ({k: schema_types(v) for k, v in props.items()}
                           if isinstance(props, dict) and props else None)
    return out


def json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
