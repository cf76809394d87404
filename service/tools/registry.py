"""What a tool is and which tools exist.

A tool is any object with ``name``, ``description``, ``parameters`` (the JSON Schema of its
arguments object) and a synchronous ``run(arguments) -> str | None``; operators name such
objects by import path in ``TOOLS``. Only registered names can run: nothing is resolved from
model text.

Extra fields are refused. Wherever a schema describes an object (``properties``,
``patternProperties`` or ``type: object``) and says nothing about other properties (neither
``additionalProperties`` nor ``unevaluatedProperties``), the registry closes it with
``additionalProperties: false``, so ``{"key": "a", "path": "../secret"}`` never reaches a tool
whose schema only names ``key``. A schema that wants a free-form map says so explicitly; one
that composes object branches with ``allOf`` spells out ``additionalProperties: true`` in the
branches and ``unevaluatedProperties: false`` above them. The closed schema is the one
validated and the one advertised, so the model sees exactly what the gate accepts.
"""

from __future__ import annotations

import copy
import importlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from jsonschema.protocols import Validator
from jsonschema.validators import validator_for

NAME = re.compile(r"[a-z][a-z0-9_-]{0,63}")
_ENTRY = re.compile(r"(?P<module>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):(?P<attr>[A-Za-z_]\w*)")


class Tool(Protocol):
    name: str
    description: str
    parameters: dict[str, Any]

    def run(self, arguments: dict[str, Any]) -> str | None: ...


@dataclass(frozen=True)
class _Entry:
    tool: Tool
    schema: dict[str, Any]  # closed: see the module docstring
    validator: Validator


class ToolRegistry:
    def __init__(self, tools: Iterable[Tool]) -> None:
        self._entries: dict[str, _Entry] = {}
        for tool in tools:
            self._add(tool)

    def get(self, name: str) -> Tool | None:
        entry = self._entries.get(name)
        return entry.tool if entry else None

    def names(self) -> frozenset[str]:
        return frozenset(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def arguments_valid(self, name: str, arguments: Any) -> bool:
        """Whether ``arguments`` satisfy the closed schema of the registered tool ``name``."""
        try:
            return self._entries[name].validator.is_valid(arguments)
        except RecursionError:  # a recursive schema walking absurdly deep input
            return False

    def definitions(self) -> list[dict[str, Any]]:
        """The Responses API function tools; copies, so callers cannot alter what is validated."""
        return [
            {
                "type": "function",
                "name": name,
                "description": entry.tool.description,
                "parameters": copy.deepcopy(entry.schema),
                "strict": False,
            }
            for name, entry in self._entries.items()
        ]

    @classmethod
    def from_spec(cls, spec: str | None) -> ToolRegistry:
        """``TOOLS="pkg.mod:attr,pkg2.mod:attr2"``: module-level objects by import path."""
        registry = cls(())
        if spec is None or not spec.strip():
            return registry
        for entry in (part.strip() for part in spec.split(",")):
            try:
                registry._add(_import(entry))
            except ValueError as exc:
                raise ValueError(f"TOOLS entry {entry!r}: {exc}") from exc
        return registry

    def _add(self, tool: Tool) -> None:
        entry = _compile(tool)
        if tool.name in self._entries:
            raise ValueError(f"duplicate tool name {tool.name!r}")
        self._entries[tool.name] = entry


def _import(entry: str) -> Tool:
    match = _ENTRY.fullmatch(entry)
    if match is None:
        raise ValueError("expected 'package.module:attribute'")
    try:
        module = importlib.import_module(match["module"])
    except Exception as exc:  # ImportError, or the module's own code failed
        raise ValueError(f"cannot import {match['module']!r}: {exc}") from exc
    try:
        tool: Tool = getattr(module, match["attr"])
    except AttributeError:
        raise ValueError(f"module {match['module']!r} has no {match['attr']!r}") from None
    return tool


def _compile(tool: Tool) -> _Entry:
    if isinstance(tool, type):  # its run() would be unbound: every call a TOOL_ERROR
        raise ValueError(f"{tool.__name__} is a class; name an instance of it")
    name = getattr(tool, "name", None)
    if not isinstance(name, str) or NAME.fullmatch(name) is None:
        raise ValueError(f"tool name {name!r} does not match {NAME.pattern}")
    if not isinstance(getattr(tool, "description", None), str):
        raise ValueError(f"tool {name!r}: description must be a string")
    if not callable(getattr(tool, "run", None)):
        raise ValueError(f"tool {name!r}: run must be callable")
    parameters = getattr(tool, "parameters", None)
    if not isinstance(parameters, dict) or parameters.get("type") != "object":
        raise ValueError(f"tool {name!r}: parameters must be a JSON Schema with type 'object'")
    cls = validator_for(parameters, default=Draft202012Validator)
    try:
        cls.check_schema(parameters)
        schema = _closed(parameters)
        cls.check_schema(schema)
    except SchemaError as exc:
        message = f"tool {name!r}: parameters is not a valid JSON Schema: {exc.message}"
        raise ValueError(message) from exc
    return _Entry(tool, schema, cls(schema, format_checker=cls.FORMAT_CHECKER))


# Keywords whose value is a subschema, a list of subschemas, or a map of name -> subschema.
# Everything else (enum, const, default, examples, ...) is data and must not be rewritten.
_ONE = {"additionalProperties", "unevaluatedProperties", "additionalItems", "unevaluatedItems"}
_ONE |= {"items", "contains", "propertyNames", "not", "if", "then", "else"}
_MANY = {"allOf", "anyOf", "oneOf", "prefixItems", "items"}
_MAP = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
_MAP |= {"dependencies"}


def _closed(schema: Any) -> Any:
    """A copy of ``schema`` in which every object schema silent on extra properties forbids
    them."""
    if not isinstance(schema, dict):  # boolean schemas; draft-7 dependency lists
        return copy.deepcopy(schema)
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _MAP and isinstance(value, dict):
            out[key] = {k: _closed(v) for k, v in value.items()}
        elif key in _MANY and isinstance(value, list):
            out[key] = [_closed(v) for v in value]
        elif key in _ONE:
            out[key] = _closed(value)
        else:
            out[key] = copy.deepcopy(value)
    types = schema.get("type")
    describes_object = (
        "properties" in schema
        or "patternProperties" in schema
        or types == "object"
        or (isinstance(types, list) and "object" in types)
    )
    if describes_object and not {"additionalProperties", "unevaluatedProperties"} & schema.keys():
        out["additionalProperties"] = False
    return out
