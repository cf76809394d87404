"""A JSON document valid against a JSON Schema, for the fake provider's structured outputs and
tool arguments: the smallest one the schema allows, strings filled with the reply's text."""

from __future__ import annotations

from typing import Any

_DEPTH = 32  # a schema that recurses without end gets nulls past this


def instance(schema: dict[str, Any], text: str) -> Any:
    return _of(schema, schema, text, 0)


def _of(schema: Any, root: dict[str, Any], text: str, depth: int) -> Any:
    if not isinstance(schema, dict) or depth > _DEPTH:
        return None
    if "$ref" in schema:
        return _of(_resolve(root, schema["$ref"]), root, text, depth + 1)
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if schema.get(key):
            choices = [
                c for c in schema[key] if not (isinstance(c, dict) and c.get("type") == "null")
            ]
            return _of((choices or schema[key])[0], root, text, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object" or (kind is None and "properties" in schema):
        properties = schema.get("properties") or {}
        names = schema.get("required") or list(properties)
        return {name: _of(properties.get(name, {}), root, text, depth + 1) for name in names}
    if kind == "array":
        count = int(schema.get("minItems", 0))
        return [_of(schema.get("items", {}), root, text, depth + 1) for _ in range(count)]
    if kind == "string":
        padded = text.ljust(int(schema.get("minLength", 0)), "-")
        most = schema.get("maxLength")
        return padded[: int(most)] if most is not None else padded
    if kind in ("integer", "number"):
        low: float = schema.get("minimum", schema.get("exclusiveMinimum", 0)) or 0
        if "exclusiveMinimum" in schema and "minimum" not in schema:
            low += 1
        return int(low) if kind == "integer" else float(low)
    if kind == "boolean":
        return False
    return None


def _resolve(root: dict[str, Any], ref: Any) -> Any:
    """A local reference (``#/$defs/Name``, ``#/definitions/Name``, ``#``)."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return {}
    node: Any = root
    for part in filter(None, ref[1:].split("/")):
        node = (
            node.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(node, dict) else None
        )
    return node if isinstance(node, dict) else {}


def _is_null(schema: Any) -> bool:
    return isinstance(schema, dict) and schema.get("type") == "null"
