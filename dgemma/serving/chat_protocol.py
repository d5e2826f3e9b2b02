"""The body of POST /v1/chat/completions: messages, their content parts, tools and tool_choice.

Chat content may hold images: {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}} parts
in user messages (read by image_urls.py). The fields every generation request shares (sampler, stop,
response_format, ...) and their strict types are protocol.py's.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dgemma.serving.requests import (
    NO_LOGPROBS,
    GenerationFields,
    NonEmptyStr,
    StrictBool,
    StrictInt,
    StrictStr,
    TokenCount,
    strict,
)

Role = Literal["system", "developer", "user", "assistant", "tool"]
FunctionName = strict(str, pattern=r"^[A-Za-z0-9_.\-]{1,64}$")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="ignore")
    url: NonEmptyStr = Field(description="a data URL (data:image/png;base64,...), or an http(s) URL of a host "
                             "the server allows (--allowed-image-domains)")
    detail: StrictStr | None = Field(None, description="ignored: the model's processor settings size the image")


class ImagePart(BaseModel):
    """An image, for a model with a vision tower (user messages only)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["image_url"]
    image_url: ImageURL | NonEmptyStr = Field(description="{\"url\": URL}, or the URL alone")

    @property
    def url(self) -> str:
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


def _content_parts(value):
    """The shape of a content list, checked with messages that show it (the typed check follows)."""
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


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: StrictStr
    arguments: StrictStr = Field(description="a JSON object, in a string (as OpenAI sends it)")

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value):
        try:
            parsed = json.loads(value)
        except (ValueError, RecursionError):
            raise ValueError("expected a JSON object in a string") from None
        if not isinstance(parsed, dict):
            raise ValueError("expected a JSON object in a string")
        return value


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


# What `_fields_of_the_role` checks, for the schema: a tool message names its call; images are in user messages
# only; tool calls in assistant messages only
_ROLE_RULES = {"allOf": [
    {"if": {"properties": {"role": {"const": "tool"}}}, "then": {"required": ["tool_call_id"], "properties": {
        "tool_call_id": {"type": "string", "minLength": 1}}}},
    {"if": {"properties": {"role": {"not": {"const": "user"}}}}, "then": {"properties": {"content": {
        "anyOf": [{"type": "string"}, {"type": "null"},
                  {"type": "array", "items": {"properties": {"type": {"const": "text"}}}}]}}}},
    {"if": {"properties": {"role": {"not": {"const": "assistant"}}}}, "then": {"properties": {"tool_calls": {
        "anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]}}}},
]}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", json_schema_extra=_ROLE_RULES)
    role: Role = Field(description="\"developer\" is read as \"system\"")
    content: StrictStr | list[ContentPart] | None = Field(
        "", description="a string, or text and image_url parts (images: user messages only, for a model with a "
                        "vision tower); null is empty")
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="assistant: calls it made")
    tool_call_id: StrictStr | None = Field(None, description="tool: the call this message answers (required)")
    reasoning_content: StrictStr | None = Field(None, description="assistant: its thoughts, for templates that "
                                                "keep them")

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, value):
        return _content_parts(value)

    @field_validator("content", mode="after")
    @classmethod
    def _text_alone(cls, value):
        """Text parts alone are one string; null is ""; with images, the list of parts."""
        if value is None:
            return ""
        if isinstance(value, list) and all(isinstance(p, TextPart) for p in value):
            return "".join(p.text for p in value)
        return value

    @model_validator(mode="after")
    def _fields_of_the_role(self):
        if isinstance(self.content, list) and self.role != "user":
            raise ValueError("only user messages carry images")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: FunctionName
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments object (within the "
                                              "structured-output subset when tool_choice constrains the answer)")
    strict: StrictBool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: StrictStr


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(GenerationFields):
    """POST /v1/chat/completions: messages through the model's chat template, answered by the diffusion sampler."""

    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1})
    max_tokens: TokenCount | None = Field(None, description="absent: as many whole canvases as fit after the "
                                          "prompt, capped by the model's default")
    max_completion_tokens: TokenCount | None = Field(None, description="max_tokens' newer name; wins when both are "
                                                     "given")
    logprobs: StrictBool | None = Field(None, description="not available (a 400): a diffusion model's tokens have "
                                        "no left-to-right probabilities")
    top_logprobs: StrictInt | None = Field(None, description="not available (a 400)")
    tools: list[Tool] | None = Field(None, description="functions the model may call, declared to it by the chat "
                                     "template")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="auto (the default with tools): calls are parsed from the answer; required or a named "
                          "function: the answer is constrained to calls with valid arguments; none: nothing is parsed")
    parallel_tool_calls: StrictBool | None = Field(None, description="false: exactly one call when required")
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = Field(
        None, description="\"none\" turns thinking off, any other value on (chat_template_kwargs.enable_thinking "
                          "wins)")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="variables for the chat template, as vLLM: "
                                                        "e.g. {\"enable_thinking\": true}")

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, value):
        if not value:
            raise ValueError("messages is empty: send at least one message")
        return value

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def tool_mode(self) -> str:
        """"none" (calls stay text), "auto" (calls are parsed), "required" or "named" (constrained)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def allowed_tools(self) -> list[FunctionDefinition]:
        """The functions an answer may call: the named one, or all of them."""
        functions = [t.function for t in self.tools or []]
        if isinstance(self.tool_choice, NamedToolChoice):
            return [f for f in functions if f.name == self.tool_choice.function.name]
        return functions

    def template_kwargs(self) -> dict[str, Any]:
        """Variables for the chat template: tools, thinking (reasoning_effort: any value but "none" is on;
        an explicit chat_template_kwargs.enable_thinking wins), and the client's own."""
        kwargs: dict[str, Any] = {}
        if self.tools:
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in self.tools]
        if self.reasoning_effort is not None:
            kwargs["enable_thinking"] = self.reasoning_effort != "none"
        return {**kwargs, **(self.chat_template_kwargs or {})}

    def chat(self) -> list[dict]:
        """The messages as Hugging Face chat templates read them: "developer" is "system"; a call's arguments
        are a dict (as vLLM passes them); a tool result carries the name of the function it answers."""
        names: dict[str, str] = {}
        messages = []
        for m in self.messages:
            content = m.content if isinstance(m.content, str) else [  # the template writes its image placeholder
                {"type": "image"} if isinstance(p, ImagePart) else {"type": "text", "text": p.text} for p in m.content]
            message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
            if m.tool_calls:
                message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": json.loads(c.function.arguments)}} for c in m.tool_calls]
                names.update((c.id, c.function.name) for c in m.tool_calls)
            if m.role == "tool":
                message["tool_call_id"] = m.tool_call_id
                message["name"] = m.name or names.get(m.tool_call_id, "unknown")
            elif m.name is not None:
                message["name"] = m.name
            if m.reasoning_content is not None and m.role == "assistant":
                message["reasoning_content"] = m.reasoning_content
            messages.append(message)
        return messages

    def image_urls(self) -> list[str]:
        """The URLs of the image parts of all messages, in order (the order of the template's placeholders)."""
        return [p.url for m in self.messages if isinstance(m.content, list) for p in m.content
                if isinstance(p, ImagePart)]

    def unsupported(self):
        if self.logprobs or self.top_logprobs is not None:
            return "logprobs" if self.logprobs else "top_logprobs", NO_LOGPROBS
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) < len(names):
            return "tools", f"two tools are named {next(n for n in names if names.count(n) > 1)!r}"
        if (self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)) and not self.tools:
            return "tool_choice", "a required or named tool_choice needs tools"
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            return "tool_choice", (f"no tool is named {self.tool_choice.function.name!r} "
                                   f"(tools: {', '.join(map(repr, names))})")
        return super().unsupported()

