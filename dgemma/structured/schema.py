"""The JSON-schema subset whose every answer is guaranteed valid, and the check that enforces it.

Supported (each answer validates against the schema; tested with the `jsonschema` package):
  type (one name or a list), properties, required, additionalProperties (true/false, or a schema for
  an object without `properties`), enum, const, items (one schema), minItems, maxItems, minLength,
  maxLength, anyOf, nested objects and arrays, local $ref into $defs / definitions; annotations
  that do not constrain (title, description, default, examples, $schema, $id, $comment) are accepted.
Anything else (pattern, format, minimum, oneOf, allOf, uniqueItems, ...) is refused with a
SchemaError naming the keyword and where it is: the constraint library would ignore some of them
silently, and an answer that then fails the schema is what a strict schema promises never happens.

Objects are written with the declared properties only, in the declared order (outlines-core's
reading); that is a valid answer whether or not other properties would be allowed.
"""

from __future__ import annotations

import copy

TYPES = {"object", "array", "string", "integer", "number", "boolean", "null"}
ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment"}
KEYWORDS = {"type", "properties", "required", "additionalProperties", "enum", "const", "items", "minItems",
            "maxItems", "minLength", "maxLength", "anyOf", "$ref", "$defs", "definitions"} | ANNOTATIONS


class SchemaError(ValueError):
    """The schema is outside the supported subset, or malformed; `keyword` names the culprit if one."""

    def __init__(self, message: str, keyword: str | None = None):
        super().__init__(message)
        self.keyword = keyword


def check_schema(schema) -> dict:
    """Raise SchemaError unless `schema` is in the supported subset; return it ready for outlines-core
    (a copy: an object declared with `additionalProperties: false` and no properties gets `properties: {}`)."""
    if not isinstance(schema, dict):
        raise SchemaError(f"a JSON schema must be an object, got {type(schema).__name__}")
    schema = copy.deepcopy(schema)
    _check(schema, "schema", root=schema)
    return schema


def _unsupported(keyword: str, where: str, why: str = "") -> SchemaError:
    supported = ", ".join(sorted(KEYWORDS - ANNOTATIONS))
    return SchemaError(f"unsupported JSON schema keyword {keyword!r} at {where}{why}; supported: {supported}",
                       keyword=keyword)


def _check(node, where: str, *, root: dict):
    if not isinstance(node, dict):
        raise SchemaError(f"{where}: a schema must be an object, got {type(node).__name__}"
                          + (" (boolean schemas are not supported)" if isinstance(node, bool) else ""))
    for keyword in node:
        if keyword not in KEYWORDS:
            raise _unsupported(keyword, where)
    types = node.get("type")
    if types is not None:
        names = types if isinstance(types, list) else [types]
        if not names or not all(isinstance(t, str) and t in TYPES for t in names):
            raise SchemaError(f"{where}.type: expected one of {sorted(TYPES)} or a list of them, got {types!r}",
                              keyword="type")
    for keyword in ("minItems", "maxItems", "minLength", "maxLength"):
        value = node.get(keyword)
        if value is not None and (type(value) is not int or value < 0):
            raise SchemaError(f"{where}.{keyword}: expected a whole number >= 0, got {value!r}", keyword=keyword)
    for low, high in (("minItems", "maxItems"), ("minLength", "maxLength")):
        if node.get(low) is not None and node.get(high) is not None and node[low] > node[high]:
            raise SchemaError(f"{where}: {low} {node[low]} is more than {high} {node[high]}", keyword=low)
    if "enum" in node and (not isinstance(node["enum"], list) or not node["enum"]):
        raise SchemaError(f"{where}.enum: expected a non-empty list", keyword="enum")

    properties = node.get("properties")
    if properties is not None:
        if not isinstance(properties, dict):
            raise SchemaError(f"{where}.properties: expected an object", keyword="properties")
        for name, sub in properties.items():
            _check(sub, f"{where}.properties.{name}", root=root)
    required = node.get("required")
    if required is not None:
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise SchemaError(f"{where}.required: expected a list of property names", keyword="required")
        missing = [r for r in required if r not in (properties or {})]
        if missing:
            raise SchemaError(f"{where}.required: {missing[0]!r} is not among the declared properties "
                              f"(undeclared properties are never written)", keyword="required")
    extra = node.get("additionalProperties")
    if extra is not None:
        if isinstance(extra, dict):
            if properties:
                raise _unsupported("additionalProperties", where, " (a schema beside `properties`)")
            _check(extra, f"{where}.additionalProperties", root=root)
        elif not isinstance(extra, bool):
            raise SchemaError(f"{where}.additionalProperties: expected true, false or a schema",
                              keyword="additionalProperties")
        elif extra is False and properties is None:
            node["properties"] = {}  # "no properties at all": the library wants it spelled out
    items = node.get("items")
    if items is not None:
        if isinstance(items, list):
            raise _unsupported("items", where, " (a list of schemas, i.e. tuple validation)")
        _check(items, f"{where}.items", root=root)
    any_of = node.get("anyOf")
    if any_of is not None:
        if not isinstance(any_of, list) or not any_of:
            raise SchemaError(f"{where}.anyOf: expected a non-empty list of schemas", keyword="anyOf")
        for i, sub in enumerate(any_of):
            _check(sub, f"{where}.anyOf[{i}]", root=root)
    for group in ("$defs", "definitions"):
        defs = node.get(group)
        if defs is not None:
            if not isinstance(defs, dict):
                raise SchemaError(f"{where}.{group}: expected an object", keyword=group)
            for name, sub in defs.items():
                _check(sub, f"{where}.{group}.{name}", root=root)
    ref = node.get("$ref")
    if ref is not None and not (isinstance(ref, str) and ref.startswith("#")):
        raise _unsupported("$ref", where, " (only references inside the schema, '#/...', are supported)")
