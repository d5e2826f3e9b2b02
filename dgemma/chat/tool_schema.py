"""A regular expression for tool calls in Gemma 4's notation whose arguments satisfy their JSON schemas.

`tool_choice: "required"` or a named function constrains the answer to this expression (the token
automaton and the canvas dynamic program do the rest), so every answer is a call to an allowed tool
with valid arguments, whatever the weights. Gemma's notation is not JSON (see tool_calls.py), so JSON
schema libraries' own expressions do not apply; this module writes the one for Gemma's syntax.

Supported schema subset (the one `response_format` supports): `type` (a name or a list), `properties`,
`required`, `additionalProperties`, `enum`, `const`, `items`, `minItems`, `maxItems`, `minLength`,
`maxLength`, nested objects and arrays, `anyOf`, local `$ref` into `$defs` / `definitions`.
Annotations (`title`, `description`, `default`, `examples`, `$schema`, `$id`, `$comment`) are ignored.
Anything else raises `SchemaError` naming the keyword.

Choices the expression makes (all valid Gemma output):
  * declared properties only, in sorted order, as Gemma 4's chat template writes earlier calls; no spaces;
  * a string bounded by minLength / maxLength holds no '<' (keeps the length count exact); an
    unbounded one may hold anything except the closing mark `<|"|>`;
  * a value without a type (or an object without properties, an array without items) is any value
    nested at most two levels deep, with keys of letters, digits and '_'.

Gemma's marks are special tokens. `CallGrammar()` writes them as their text (to match decoded text);
`calls_constraint` passes `special`, the regex its vocabulary gives each special token, and `exclude`,
the characters no text inside a call may hold (those same tokens).

With thinking on, the calls may follow a thought (`<|channel>thought\n...<channel|>`), any text.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from dgemma.chat.chat_output import THOUGHT_END, THOUGHT_LABEL, THOUGHT_START
from dgemma.chat.tool_calls import CALL_END, CALL_START, QUOTE, format_value
from dgemma.structured import SchemaError, TokenAutomaton, TokenVocabulary, regex_constraint
from dgemma.structured.vocabulary import MAX_SPECIAL, SPECIAL_BASE

MARKS = (QUOTE, CALL_START, CALL_END, THOUGHT_START, THOUGHT_END)  # special tokens a constrained answer writes
SPECIAL_CHARACTERS = f"{chr(SPECIAL_BASE)}-{chr(SPECIAL_BASE + MAX_SPECIAL - 1)}"  # how a vocabulary writes them

ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment"}
SUPPORTED = {"type", "properties", "required", "additionalProperties", "enum", "const", "items", "minItems",
             "maxItems", "minLength", "maxLength", "anyOf", "$ref", "$defs", "definitions"} | ANNOTATIONS
TYPES = ("string", "integer", "number", "boolean", "null", "object", "array")
GENERIC_DEPTH = 2
INTEGER = r"-?(?:0|[1-9][0-9]*)"
NUMBER = INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
KEY = r"[A-Za-z_][A-Za-z0-9_]*"


def calls_constraint(tokenizer, vocab_size: int, tools: list[tuple[str, dict | None]], *, several: bool,
                     thought: bool) -> TokenAutomaton:
    """The token automaton of `CallGrammar.calls` over this tokenizer (cached per tools and tokenizer).
    Raises SchemaError for a schema outside the subset, VocabularyError when a mark is not a token."""
    vocabulary = TokenVocabulary.from_tokenizer(tokenizer, size=vocab_size, special_tokens=MARKS)
    grammar = CallGrammar(special=lambda mark: re.escape(vocabulary.special(mark)), exclude=SPECIAL_CHARACTERS)
    return regex_constraint(grammar.calls(tools, several=several, thought=thought), vocabulary,
                            description="tool calls")


def text_without(mark: str, exclude: str = "") -> str:
    """Any text that does not contain `mark` (nor a character of the class fragment `exclude`).

    No lookahead (automata libraries have none): read as the automaton of "how much of the mark was
    just seen". From state 0 a character other than the mark's first stays at 0; after the first one,
    X loops back to state 1 (the first character again, after a partial match) and Y returns to 0 with
    a character that breaks the match; the optional tail ends inside a partial match. Correct when the
    mark's first character occurs nowhere else in it (then the mark has no border either, so the first
    mark after such a text is where the text ends).
    """
    head = mark[0]
    if head in mark[1:]:
        raise ValueError(f"{mark!r}: its first character occurs again in it")
    e = re.escape
    not_head = f"[^{e(head)}{exclude}]"
    loops = [e(mark[1:j]) + e(head) for j in range(1, len(mark))]
    leaves = [e(mark[1:j]) + f"[^{e(mark[j])}{e(head)}{exclude}]" for j in range(1, len(mark))]
    partial = "|".join(e(mark[1:j]) for j in range(2, len(mark)))
    x, y = f"(?:{'|'.join(loops)})", f"(?:{'|'.join(leaves)})"
    return f"(?:{not_head}|{e(head)}{x}*{y})*(?:{e(head)}{x}*(?:{partial})?)?"


class CallGrammar:
    def __init__(self, special: Callable[[str], str] = re.escape, exclude: str = ""):
        self.special, self.exclude = special, exclude
        quote = special(QUOTE)
        self.short_string = quote + "[^<" + exclude + "]{%d,%s}" + quote  # with minLength / maxLength
        self.scalars = {"string": quote + text_without(QUOTE, exclude) + quote, "integer": INTEGER,
                        "number": NUMBER, "boolean": "(?:true|false)", "null": "null"}
        self._root: dict = {}

    def calls(self, tools: list[tuple[str, dict | None]], *, several: bool = True, thought: bool = False) -> str:
        """Calls to the given tools, (name, parameters schema or None): one call, or one or more back to back;
        `thought`: an optional thought before them."""
        if not tools:
            raise SchemaError("no tools to call")
        one = _alternatives([self.special(CALL_START) + re.escape(f"call:{name}") + self.arguments(params)
                             + self.special(CALL_END) for name, params in tools])
        calls = f"(?:{one})+" if several else one
        if not thought:
            return calls
        text = text_without(THOUGHT_END, self.exclude)
        return (f"(?:{self.special(THOUGHT_START)}{re.escape(THOUGHT_LABEL)}{text}{self.special(THOUGHT_END)})?"
                + calls)

    def arguments(self, schema: dict | None) -> str:
        """The `{...}` after `call:NAME`: an object valid under `schema` (None or {} takes no arguments)."""
        if not schema:
            return r"\{\}"
        if not isinstance(schema, dict):
            raise SchemaError("parameters: expected a JSON schema object")
        types = _types(schema, "parameters")
        if types is not None and types != ["object"]:
            raise SchemaError(f"parameters: a function's parameters must be an object, not {types}")
        self._root = schema
        return self._value({**schema, "type": "object"}, "parameters", ())

    # -- one schema node ---------------------------------------------------------------------------
    def _value(self, schema: Any, path: str, refs: tuple[str, ...]) -> str:
        if schema == {}:
            return self._generic(GENERIC_DEPTH)
        if not isinstance(schema, dict):
            raise SchemaError(f"{path}: expected a schema object")
        unknown = sorted(set(schema) - SUPPORTED)
        if unknown:
            raise SchemaError(f"{path}: unsupported keyword {unknown[0]!r} (supported: "
                              f"{', '.join(sorted(SUPPORTED - ANNOTATIONS))})", keyword=unknown[0])
        if "$ref" in schema:
            target = self._resolve(schema["$ref"], path, refs)
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            return self._value({**target, **rest}, path, (*refs, schema["$ref"]))
        if "const" in schema:
            return re.escape(format_value(schema["const"])).replace(re.escape(QUOTE), self.special(QUOTE))
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise SchemaError(f"{path}.enum: expected a non-empty list")
            return _alternatives([self._value({"const": v}, path, refs) for v in values])
        if "anyOf" in schema:
            options = schema["anyOf"]
            if not isinstance(options, list) or not options:
                raise SchemaError(f"{path}.anyOf: expected a non-empty list")
            rest = {k: v for k, v in schema.items() if k != "anyOf"}
            return _alternatives([self._value({**rest, **option} if isinstance(option, dict) else option,
                                              f"{path}.anyOf[{i}]", refs) for i, option in enumerate(options)])
        types = _types(schema, path)
        if types is None:
            return self._generic(GENERIC_DEPTH)
        return _alternatives([self._typed(t, schema, path, refs) for t in types])

    def _resolve(self, ref: Any, path: str, refs: tuple[str, ...]) -> dict:
        if not isinstance(ref, str) or not re.fullmatch(r"#/(\$defs|definitions)/[^/]+", ref):
            raise SchemaError(f"{path}.$ref: only local references into $defs or definitions are supported, "
                              f"got {ref!r}")
        if ref in refs:
            raise SchemaError(f"{path}.$ref: {ref} refers to itself (recursive schemas are not supported)")
        section, name = ref[2:].split("/", 1)
        target = (self._root.get(section) or {}).get(name)
        if not isinstance(target, dict):
            raise SchemaError(f"{path}.$ref: {ref} is not defined")
        return target

    def _typed(self, kind: str, schema: dict, path: str, refs: tuple[str, ...]) -> str:
        if kind == "string":
            low, high = _bounds(schema, "minLength", "maxLength", path)
            if low == 0 and high is None:
                return self.scalars["string"]
            return self.short_string % (low, "" if high is None else high)
        if kind == "object":
            return self._object(schema, path, refs)
        if kind == "array":
            items = schema.get("items")
            item = self._generic(GENERIC_DEPTH - 1) if items is None else self._value(items, f"{path}.items", refs)
            low, high = _bounds(schema, "minItems", "maxItems", path)
            return _list(r"\[", item, r"\]", low, high)
        return self.scalars[kind]

    def _object(self, schema: dict, path: str, refs: tuple[str, ...]) -> str:
        properties = schema.get("properties")
        extra = schema.get("additionalProperties", True)
        if properties is None or properties == {}:
            if extra is False:
                return r"\{\}"
            if isinstance(extra, dict):  # any keys, each value under that schema
                value = self._value(extra, f"{path}.additionalProperties", refs)
                return _list(r"\{", f"{KEY}:(?:{value})", r"\}", 0, None)
            return self._generic_object(GENERIC_DEPTH)
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
        items = [(re.escape(name) + ":" + self._value(properties[name], f"{path}.properties.{name}", refs),
                  name in required) for name in names]
        # then[i]: the properties from i on once one was written (each present one starts with a comma);
        # first: the same from the start, when none was written yet (no comma before the first one).
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

    def _generic(self, depth: int) -> str:
        """Any value, objects and arrays nested at most `depth` levels."""
        options = list(self.scalars.values())
        if depth > 0:
            options += [_list(r"\[", self._generic(depth - 1), r"\]", 0, None), self._generic_object(depth)]
        return _alternatives(options)

    def _generic_object(self, depth: int) -> str:
        return _list(r"\{", f"{KEY}:(?:{self._generic(depth - 1)})", r"\}", 0, None)


def _types(schema: dict, path: str) -> list[str] | None:
    kind = schema.get("type")
    if kind is None:
        return None
    types = [kind] if isinstance(kind, str) else kind
    if not isinstance(types, list) or not types or any(t not in TYPES for t in types):
        raise SchemaError(f"{path}.type: expected one of {', '.join(TYPES)} or a list of them, got {kind!r}")
    return types


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


def _alternatives(options: list[str]) -> str:
    options = list(dict.fromkeys(options))
    return options[0] if len(options) == 1 else "(?:" + "|".join(options) + ")"
