"""A regular expression for tool calls in Gemma 4's notation whose arguments satisfy their JSON schemas.

`tool_choice: "required"` or a named function constrains the answer to this expression (the token
automaton and the canvas dynamic program do the rest), so every answer is a call to an allowed tool
with valid arguments, whatever the weights. Gemma's notation is not JSON (see tool_calls.py), so JSON
schema libraries' own expressions do not apply; this module writes the one for Gemma's syntax.

Supported schema subset (the one `response_format` supports): `type` (a name or a list), `properties`,
`required`, `additionalProperties` (only declared properties are written either way), `enum`, `const`,
`items`, `minItems`, `maxItems`, `minLength`, `maxLength`, nested objects, `anyOf`, and `nullable`
(OpenAPI's, which Google's tool declarations use). Annotations (`title`, `description`, `default`,
`examples`, `$schema`, `$comment`) are ignored. Anything else raises `SchemaError` naming the keyword.

Choices the expression makes (all valid Gemma output):
  * properties in sorted order, as Gemma 4's chat template writes earlier calls; no spaces;
  * a string bounded by minLength / maxLength holds no '<' (keeps the length count exact); an
    unbounded one may hold anything except the closing mark `<|"|>`;
  * a value without a type (or an object without properties, an array without items) is any value
    nested at most two levels deep, with keys of letters, digits and '_'.
"""

from __future__ import annotations

import re
from typing import Any

from dgemma.serving.tool_calls import CALL_END, CALL_START, QUOTE, format_value

ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$comment"}
SUPPORTED = {"type", "properties", "required", "additionalProperties", "enum", "const", "items", "minItems",
             "maxItems", "minLength", "maxLength", "anyOf", "nullable"} | ANNOTATIONS
TYPES = ("string", "integer", "number", "boolean", "null", "object", "array")
GENERIC_DEPTH = 2


class SchemaError(ValueError):
    """The schema uses something outside the supported subset, or is malformed (the message says which)."""


Q = re.escape(QUOTE)
# A string's body: any text without the closing mark <|"|>. No lookahead (automata libraries have none):
# after a '<', the loop X stays inside a partial match of the mark, Y leaves it with a character that
# breaks it; the optional tail ends inside a partial match. The mark has no border (its first
# character differs from its last), so the first mark after the body is the closing one.
_X = r'(?:<|\|<|\|"<|\|"\|<)'
_Y = r'(?:[^<|]|\|[^<"]|\|"[^<|]|\|"\|[^<>])'
STRING_BODY = rf'(?:[^<]|<{_X}*{_Y})*(?:<{_X}*(?:\||\|"|\|"\|)?)?'
INTEGER = r"-?(?:0|[1-9][0-9]*)"
NUMBER = INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
KEY = r"[A-Za-z_][A-Za-z0-9_]*"
SCALARS = {"string": Q + STRING_BODY + Q, "integer": INTEGER, "number": NUMBER, "boolean": "(?:true|false)",
           "null": "null"}


def calls_regex(tools: list[tuple[str, dict | None]], *, several: bool = True) -> str:
    """Calls to the given tools, (name, parameters schema or None): one call, or one or more back to back."""
    if not tools:
        raise SchemaError("no tools to call")
    one = _alternatives([re.escape(f"{CALL_START}call:{name}") + arguments_regex(params) + re.escape(CALL_END)
                         for name, params in tools])
    return f"(?:{one})+" if several else one


def arguments_regex(schema: dict | None) -> str:
    """The `{...}` after `call:NAME`: an object valid under `schema` (None or {} takes no arguments)."""
    if not schema:
        return r"\{\}"
    if not isinstance(schema, dict):
        raise SchemaError("parameters: expected a JSON schema object")
    types = _types(schema, "parameters")
    if types is not None and types != ["object"]:
        raise SchemaError(f"parameters: a function's parameters must be an object, not {types}")
    return _value({**schema, "type": "object"}, "parameters")


def _value(schema: Any, path: str) -> str:
    if schema is True or schema == {}:
        return _generic(GENERIC_DEPTH)
    if not isinstance(schema, dict):
        raise SchemaError(f"{path}: expected a schema object")
    unknown = sorted(set(schema) - SUPPORTED)
    if unknown:
        raise SchemaError(f"{path}: unsupported keyword {unknown[0]!r} (supported: "
                          f"{', '.join(sorted(SUPPORTED - ANNOTATIONS))})")
    if schema.get("nullable") is True:
        rest = {k: v for k, v in schema.items() if k != "nullable"}
        return _alternatives([_value(rest, path), "null"])
    if "const" in schema:
        return re.escape(format_value(schema["const"]))
    if "enum" in schema:
        values = schema["enum"]
        if not isinstance(values, list) or not values:
            raise SchemaError(f"{path}.enum: expected a non-empty list")
        return _alternatives([re.escape(format_value(v)) for v in values])
    if "anyOf" in schema:
        options = schema["anyOf"]
        if not isinstance(options, list) or not options:
            raise SchemaError(f"{path}.anyOf: expected a non-empty list")
        rest = {k: v for k, v in schema.items() if k != "anyOf"}
        return _alternatives([_value({**rest, **option} if isinstance(option, dict) else option, f"{path}.anyOf[{i}]")
                              for i, option in enumerate(options)])
    types = _types(schema, path)
    if types is None:
        return _generic(GENERIC_DEPTH)
    return _alternatives([_typed(t, schema, path) for t in types])


def _types(schema: dict, path: str) -> list[str] | None:
    kind = schema.get("type")
    if kind is None:
        return None
    types = [kind] if isinstance(kind, str) else kind
    if not isinstance(types, list) or not types or any(t not in TYPES for t in types):
        raise SchemaError(f"{path}.type: expected one of {', '.join(TYPES)} or a list of them, got {kind!r}")
    return types


def _typed(kind: str, schema: dict, path: str) -> str:
    if kind == "string":
        low, high = _bounds(schema, "minLength", "maxLength", path)
        if low == 0 and high is None:
            return SCALARS["string"]
        return Q + f"[^<]{{{low},{'' if high is None else high}}}" + Q
    if kind == "object":
        return _object(schema, path)
    if kind == "array":
        items = schema.get("items")
        item = _generic(GENERIC_DEPTH - 1) if items is None else _value(items, f"{path}.items")
        low, high = _bounds(schema, "minItems", "maxItems", path)
        return _list(r"\[", item, r"\]", low, high)
    return SCALARS[kind]


def _bounds(schema: dict, low_key: str, high_key: str, path: str) -> tuple[int, int | None]:
    low, high = schema.get(low_key, 0), schema.get(high_key)
    for key, value in ((low_key, low), (high_key, high)):
        if value is not None and (type(value) is not int or value < 0):
            raise SchemaError(f"{path}.{key}: expected a whole number >= 0, got {value!r}")
    if high is not None and high < low:
        raise SchemaError(f"{path}: {high_key} {high} is less than {low_key} {low}")
    return low, high


def _list(open_: str, item: str, close: str, low: int, high: int | None) -> str:
    """`open item,item,... close` with low..high items (high None: no limit)."""
    if high == 0:
        return open_ + close
    more = f"{{{max(low - 1, 0)},{'' if high is None else high - 1}}}"
    body = f"(?:{item})(?:,(?:{item})){more}"
    return open_ + (body if low > 0 else f"(?:{body})?") + close


def _object(schema: dict, path: str) -> str:
    properties = schema.get("properties")
    extra = schema.get("additionalProperties", True)
    if not isinstance(extra, bool):
        raise SchemaError(f"{path}.additionalProperties: only true or false is supported, not a schema")
    if properties is None or properties == {}:
        return r"\{\}" if extra is False else _generic_object(GENERIC_DEPTH)
    if not isinstance(properties, dict):
        raise SchemaError(f"{path}.properties: expected an object")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise SchemaError(f"{path}.required: expected a list of property names")
    missing = sorted(set(required) - set(properties))
    if missing:
        raise SchemaError(f"{path}.required: {missing[0]!r} is not among the properties")
    names = sorted(properties)
    for name in names:
        if not re.fullmatch(r"[\w\-.]+", name):
            raise SchemaError(f"{path}.properties: {name!r} cannot be a bare key in Gemma's notation")
    items = [(re.escape(name) + ":" + _value(properties[name], f"{path}.properties.{name}"), name in required)
             for name in names]
    # first(i): the properties from i on when none was written yet (no comma before the first one);
    # then(i): the same once one was written (each present property starts with a comma).
    then = [""] * (len(items) + 1)
    for i in range(len(items) - 1, -1, -1):
        item, needed = items[i]
        then[i] = (f",{item}" if needed else f"(?:,{item})?") + then[i + 1]
    first = ""
    for i in range(len(items) - 1, -1, -1):
        item, needed = items[i]
        if needed:
            first = item + then[i + 1]
        else:
            first = _alternatives([item + then[i + 1], first]) if first else f"(?:{item + then[i + 1]})?"
    return r"\{" + first + r"\}"


def _generic(depth: int) -> str:
    """Any value, objects and arrays nested at most `depth` levels."""
    options = list(SCALARS.values())
    if depth > 0:
        inner = _generic(depth - 1)
        options += [_list(r"\[", inner, r"\]", 0, None), _generic_object(depth)]
    return _alternatives(options)


def _generic_object(depth: int) -> str:
    return _list(r"\{", f"{KEY}:(?:{_generic(depth - 1)})", r"\}", 0, None)


def _alternatives(options: list[str]) -> str:
    options = list(dict.fromkeys(options))
    return options[0] if len(options) == 1 else "(?:" + "|".join(options) + ")"
