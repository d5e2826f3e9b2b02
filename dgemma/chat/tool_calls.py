"""Gemma 4's tool-call syntax: calls in the model's output to OpenAI `tool_calls`, and back.

A call is written `<|tool_call>call:NAME{key:value,...}<tool_call|>`. Values are Gemma's own notation,
not JSON: keys are bare, strings sit between `<|"|>` marks (one token in Gemma's vocabulary) and are
never escaped, numbers, `true`, `false` and `null` are bare, objects and arrays nest with `{}` / `[]`.
Several calls are written back to back; after the last one the model writes `<|tool_response>` and
stops, waiting for the results.

`parse_call` turns one call's text into (name, JSON arguments); what does not parse stays text for
the caller to keep as content. `format_value` writes a Python value in the notation (as Gemma 4's chat
template does for earlier calls: keys sorted, no spaces).
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

CALL_START, CALL_END = "<|tool_call>", "<tool_call|>"
QUOTE = '<|"|>'
RESPONSE_START = "<|tool_response>"
NAME = re.compile(r"[\w\-.]+")  # what follows "call:"; OpenAI allows [a-zA-Z0-9_-] (64 at most), Gemma dots too
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_BARE_END = ",}]"
_CONSTANTS = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


class SyntaxProblem(ValueError):
    """The text is not a well-formed value in Gemma's notation."""


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def parse_call(text: str) -> tuple[str, str]:
    """`call:NAME{...}` (the text between the call marks) -> (NAME, arguments as a JSON object string)."""
    body = text.strip()
    if not body.startswith("call:"):
        raise SyntaxProblem("a call starts with 'call:'")
    name = NAME.match(body, 5)
    if name is None:
        raise SyntaxProblem("no function name after 'call:'")
    parser = _Parser(body, name.end())
    if parser.peek() != "{":
        raise SyntaxProblem("the arguments must be an object {...}")
    arguments = parser.value()
    parser.skip_space()
    if parser.pos != len(body):
        raise SyntaxProblem(f"unexpected text after the arguments: {body[parser.pos:parser.pos + 20]!r}")
    return name.group(), json.dumps(arguments, ensure_ascii=False)


def parse_value(text: str) -> Any:
    """One whole value in Gemma's notation -> the Python value it means."""
    parser = _Parser(text, 0)
    value = parser.value()
    parser.skip_space()
    if parser.pos != len(text):
        raise SyntaxProblem(f"unexpected text after the value: {text[parser.pos:parser.pos + 20]!r}")
    return value


class _Parser:
    """Recursive descent over one string. Lenient where models are: spaces between items, keys in
    `<|"|>` marks, and bare words (`city:Paris`) read as strings."""

    def __init__(self, text: str, pos: int):
        self.text, self.pos, self.depth = text, pos, 0

    def skip_space(self):
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def peek(self) -> str:
        self.skip_space()
        return self.text[self.pos : self.pos + 1]

    def expect(self, char: str):
        if self.peek() != char:
            found = self.text[self.pos : self.pos + 10] or "the end"
            raise SyntaxProblem(f"expected {char!r} at {self.pos}, found {found!r}")
        self.pos += 1

    def value(self) -> Any:
        char = self.peek()
        if self.text.startswith(QUOTE, self.pos):
            return self.string()
        if char in "{[":
            self.depth += 1
            if self.depth > 64:
                raise SyntaxProblem("nested too deeply")
            value = self.object() if char == "{" else self.array()
            self.depth -= 1
            return value
        return self.bare()

    def string(self) -> str:
        start = self.pos + len(QUOTE)
        end = self.text.find(QUOTE, start)
        if end < 0:
            raise SyntaxProblem("a string is not closed with <|\"|>")
        self.pos = end + len(QUOTE)
        return self.text[start:end]

    def sequence(self, open_: str, close: str, item) -> list:
        """`open item,item,... close`, each item read by `item()`."""
        self.expect(open_)
        items: list[Any] = []
        if self.peek() == close:
            self.pos += 1
            return items
        while True:
            items.append(item())
            if self.peek() != ",":
                self.expect(close)
                return items
            self.pos += 1

    def object(self) -> dict:
        return dict(self.sequence("{", "}", self.pair))

    def pair(self) -> tuple[str, Any]:
        key = self.key()
        self.expect(":")
        return key, self.value()

    def array(self) -> list:
        return self.sequence("[", "]", self.value)

    def key(self) -> str:
        self.skip_space()
        if self.text.startswith(QUOTE, self.pos):
            return self.string()
        end = self.pos
        while end < len(self.text) and self.text[end] not in ':{}[],"<':
            end += 1
        key = self.text[self.pos : end].strip()
        if not key:
            raise SyntaxProblem(f"expected a key at {self.pos}")
        self.pos = end
        return key

    def bare(self) -> Any:
        end = self.pos
        while end < len(self.text) and self.text[end] not in _BARE_END and not self.text.startswith(QUOTE, end):
            end += 1
        word = self.text[self.pos : end].strip()
        if not word or any(c in word for c in "{[:"):
            raise SyntaxProblem(f"expected a value at {self.pos}")
        self.pos = end
        if word in _CONSTANTS:
            return _CONSTANTS[word]
        if _NUMBER.fullmatch(word):
            return float(word) if any(c in word for c in ".eE") else int(word)
        return word  # a string the model left unquoted


def format_value(value: Any) -> str:
    """A JSON-like Python value in Gemma's notation (bare keys, sorted as Gemma 4's template sorts them)."""
    if isinstance(value, str):
        return QUOTE + value + QUOTE
    if value is True or value is False:
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return json.dumps(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{format_value(v)}" for k, v in sorted(value.items())) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(format_value(v) for v in value) + "]"
    raise TypeError(f"cannot write a {type(value).__name__} in Gemma's notation")


def openai_tool_call(call: dict, index: int | None = None) -> dict:
    """{"id", "name", "arguments"} as an entry of OpenAI's `message.tool_calls` (with `index`: a stream delta)."""
    entry = {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}
    return entry if index is None else {"index": index, **entry}
