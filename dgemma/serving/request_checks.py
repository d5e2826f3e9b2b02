"""The checks a request body passes beyond its fields' types (requests.py attaches them to its models): the
limits, the pre-checks that read the raw JSON and say what shape was expected, the rules a chat message's role
sets, and the fields this server accepts but cannot honour.

Pre-checks run before the typed check, so a wrong shape gets a message that shows the right one; what they
accept, the types accept too. An unsupported field is valid alone but asks for something a diffusion model
or this server cannot do (logprobs of denoised tokens, suffix, best_of > 1, two shapes for one answer): a 400
that names it (`unsupported_field`, read by errors.py), never silently ignored.
"""

from __future__ import annotations

import json

from jsonschema import Draft202012Validator
from pydantic_core import PydanticCustomError

MAX_STEPS = 1000
MAX_STOP_STRINGS = 16
MAX_CHOICES = 16
MAX_LOGPROBS = 20  # alternatives per position, as OpenAI caps them
NO_LOGPROBS = ("logprobs are not available: a diffusion model commits a whole canvas at once, chosen over many "
               "denoising steps, so its tokens have no left-to-right probabilities to report")
UNSUPPORTED_FIELD = "unsupported_field"  # the pydantic error type of a field this server cannot honour


# -- pre-checks: the raw JSON's shape ------------------------------------------------------------------

def stop_strings(value):
    """`stop`: one string or a list of them, always a list once validated."""
    if value is None:
        return None
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) and v for v in values):
        raise ValueError("expected a non-empty string or a list of non-empty strings")
    if len(values) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
    return values


def response_format_shape(value):
    """`response_format`: one of the three types, a json_schema with its schema object."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("expected an object such as {\"type\": \"json_object\"}")
    kind = value.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise ValueError(f"type must be \"text\", \"json_object\" or \"json_schema\", got {kind!r}")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValueError("json_schema must be an object with a \"schema\" object: "
                             "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}")
        if "strict" in spec and spec["strict"] is not None and not isinstance(spec["strict"], bool):
            raise ValueError("json_schema.strict must be true or false")
    return value


def prompt_list(value):
    """/v1/completions' `prompt`: text, token ids, or a list of either (several prompts), always a list of
    prompts once validated."""
    if value == "" or value == []:
        raise ValueError("the prompt is empty")
    if isinstance(value, str) or (isinstance(value, list) and all(type(t) is int for t in value)):
        value = [value]
    if not isinstance(value, list):
        raise ValueError("expected a string, a list of token ids, or a list of either")
    kinds = {type(v) for v in value}
    if kinds not in ({str}, {list}):
        mixed = " (not both)" if kinds == {str, list} else ""
        raise ValueError(f"expected a string, a list of token ids, or a list of either{mixed}")
    for i, v in enumerate(value):
        if not v:
            raise ValueError(f"prompt {i} is empty")
        if isinstance(v, list) and not all(type(t) is int for t in v):
            raise ValueError(f"prompt {i}: expected a list of token ids (integers)")
    return value


def content_parts(value):
    """A message's `content`: a string, null (""), or a list of text and image_url parts."""
    if value is None or isinstance(value, str):
        return value or ""
    if not isinstance(value, list):
        raise ValueError("expected a string or a list of content parts")
    for part in value:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise ValueError('a text part is {"type": "text", "text": STRING}')
        elif kind == "image_url":
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            if not isinstance(url, str) or not url:
                raise ValueError('an image_url part is {"type": "image_url", "image_url": {"url": URL}}')
        else:
            raise ValueError(f"only text and image_url content parts are supported, got {kind!r}")
    return value


def json_object_string(value: str) -> str:
    """A tool call's `arguments`: a JSON object in a string, as OpenAI sends it."""
    try:
        parsed = json.loads(value)
    except (ValueError, RecursionError):
        raise ValueError("expected a JSON object in a string") from None
    if not isinstance(parsed, dict):
        raise ValueError("expected a JSON object in a string")
    return value


def not_empty(messages: list) -> list:
    if not messages:
        raise ValueError("messages is empty: send at least one message")
    return messages


# -- the rules a message's role sets -------------------------------------------------------------------
# One definition: JSON Schema, published under ChatMessage in /openapi.json (`ROLE_RULES_SCHEMA`) and run on
# every validated message (`broken_role_rule`), in this order, each with the message a request breaking it gets.

ROLE_RULES = (
    ({"if": {"properties": {"role": {"not": {"const": "user"}}}}, "then": {"properties": {"content": {
        "anyOf": [{"type": "string"}, {"type": "null"},
                  {"type": "array", "items": {"properties": {"type": {"const": "text"}}}}]}}}},
     "only user messages carry images"),
    ({"if": {"properties": {"role": {"not": {"const": "assistant"}}}}, "then": {"properties": {"tool_calls": {
        "anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]}}}},
     "only assistant messages carry tool_calls"),
    ({"if": {"properties": {"role": {"const": "tool"}}}, "then": {"required": ["tool_call_id"], "properties": {
        "tool_call_id": {"type": "string", "minLength": 1}}}},
     "a tool message needs the tool_call_id of the call it answers"),
)
ROLE_RULES_SCHEMA = {"allOf": [rule for rule, _ in ROLE_RULES]}
_ROLE_CHECKS = tuple((Draft202012Validator(rule), broken) for rule, broken in ROLE_RULES)


def broken_role_rule(message: dict) -> str | None:
    """What is wrong with `message` (a validated ChatMessage as a dict), by the first rule it breaks; None if
    nothing is."""
    return next((broken for rule, broken in _ROLE_CHECKS if not rule.is_valid(message)), None)


# -- fields this server cannot honour ------------------------------------------------------------------
# Each returns (field, reason) for the first such field of a validated body, else None.

def unsupported_field_error(problem: tuple[str, str]) -> PydanticCustomError:
    field, reason = problem
    return PydanticCustomError(UNSUPPORTED_FIELD, "{field}: {reason}", {"field": field, "reason": reason})


def unsupported_generation(body) -> tuple[str, str] | None:
    """The fields both generation routes share."""
    if body.structured_outputs is not None and body.response_format is not None and \
            body.response_format.type != "text":
        return "structured_outputs", "a regex and a response_format cannot both shape the answer"
    if body.stream_options is not None and not body.stream:
        return "stream_options", "stream_options is only allowed with stream: true"
    return None


def unsupported_completion(body) -> tuple[str, str] | None:
    """/v1/completions: scoring (`logprobs`) takes max_tokens 0 or 1, no stream, one choice, no format."""
    if body.logprobs is not None:
        if body.max_tokens is None or body.max_tokens > 1:
            return "logprobs", (f"{NO_LOGPROBS}. The prompt's own log-probabilities are available: send "
                                "echo: true with max_tokens 0 (or 1, which adds the causal encoder's most "
                                "likely next token)")
        if body.stream:
            return "stream", "scoring (logprobs) answers at once; send stream: false"
        if body.choices > 1:
            return "n", "scoring (logprobs) is deterministic; n > 1 would repeat the same choice"
        if body.structured is not None:
            return "response_format", "scoring (logprobs) writes no answer to format"
    if body.suffix is not None:
        return "suffix", "suffix (insertion) is not supported"
    if body.best_of not in (None, 1):
        return "best_of", "only best_of=1 is supported"
    return unsupported_generation(body)


def unsupported_chat(body) -> tuple[str, str] | None:
    """/v1/chat/completions: no logprobs; tools named once; a required or named tool_choice among the tools."""
    if body.logprobs or body.top_logprobs is not None:
        return "logprobs" if body.logprobs else "top_logprobs", NO_LOGPROBS
    names = [t.function.name for t in body.tools or []]
    if len(set(names)) < len(names):
        return "tools", f"two tools are named {next(n for n in names if names.count(n) > 1)!r}"
    if (body.tool_choice == "required" or body.named_tool is not None) and not body.tools:
        return "tool_choice", "a required or named tool_choice needs tools"
    if body.named_tool is not None and body.named_tool not in names:
        return "tool_choice", f"no tool is named {body.named_tool!r} (tools: {', '.join(map(repr, names))})"
    return unsupported_generation(body)
