"""The OpenAI-compatible request bodies, validated: the fields every generation request shares,
/v1/completions' body, /v1/chat/completions' body (messages, their content parts, tools and tool_choice),
and the tokenizer routes' bodies. Errors, responses and stream chunks are responses.py's.

Request bodies are checked strictly: a wrong type is an error, never coerced ("5" is not 5, true is
not 1), numbers must be finite and inside the ranges below, and the message names the field.
OpenAI fields a diffusion sampler has no use for (temperature, top_p, penalties, user, ...) are
accepted and ignored, so existing clients work; fields whose meaning we cannot honour (logprobs of
denoised tokens, suffix, best_of) are rejected instead of silently ignored.

Scoring (/v1/completions with `logprobs` and max_tokens 0 or 1, what evaluation harnesses send): the
prompt's own log-probabilities, from the causal encoder, in OpenAI's legacy `logprobs` shape; with
`echo` the prompt's tokens come back, with max_tokens 1 the encoder's most likely next token follows.

response_format: {"type": "text"} (the default), {"type": "json_object"} (the answer is a JSON object),
or {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}} (the answer
validates against the schema; the supported subset is in dgemma.structured.schema and docs/serving.md).

Diffusion fields, as extra body fields (openai client: `extra_body={...}`):
  steps           int 1..1000     most denoising steps per canvas (the model's default otherwise)
  entropy_bound   float 0..1e6    accept positions until their summed entropy passes this
  accept_order    "entropy" | "margin" | "confidence"   which positions a step accepts first
  t_min, t_max    float 0.01..100 the temperature schedule, falling from t_max to t_min
  fixed_steps     bool            exactly `steps` per canvas, no early stop
  step_cache      bool            settled positions are not recomputed (dgemma.generation.step_cache)
  seed            int 0..2**63-1  (an OpenAI field too) same seed, same request -> same output
  stream_options.include_drafts   bool: stream the argmax canvas after every denoising step
  structured_outputs.regex        str: the answer matches this regex (outlines-core's syntax), as vLLM
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from dgemma.config import ACCEPT_ORDERS

MAX_STEPS = 1000
MAX_STOP_STRINGS = 16
MAX_CHOICES = 16
MAX_LOGPROBS = 20  # alternatives per position, as OpenAI caps them
NO_LOGPROBS = ("logprobs are not available: a diffusion model commits a whole canvas at once, chosen over many "
               "denoising steps, so its tokens have no left-to-right probabilities to report")


# -- request bodies ------------------------------------------------------------------------------------
# The models below validate the bodies (FastAPI hands each route its model) and are the OpenAPI schema's
# request bodies (/openapi.json): one definition for both. Validators that give friendlier messages run
# before the typed check; what they accept, the types below accept too.

def strict(tp, **constraints):
    """`tp` checked without coercion ("5" is not 5), inside `constraints` (Field's ge, le, min_length, ...)."""
    return Annotated[tp, Field(strict=True, **constraints)]


StrictInt = strict(int)
StrictBool = strict(bool)
StrictStr = strict(str)
NonEmptyStr = strict(str, min_length=1)
TokenCount = strict(int, ge=1)
Steps = strict(int, ge=1, le=MAX_STEPS)
Seed = strict(int, ge=0, le=2**63 - 1)
Temperature = strict(float, ge=0.01, le=100.0, allow_inf_nan=False)
EntropyBound = strict(float, ge=0.0, le=1e6, allow_inf_nan=False)
# several stop strings, or one; a list only once validated (see `_stop_strings`)
StopStrings = Annotated[NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP_STRINGS)], Field(
    description=f"up to {MAX_STOP_STRINGS} strings: the answer ends just before the first match")]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = Field(False, description="a last chunk with `usage` and no choices")
    include_drafts: StrictBool = Field(False, description="dgemma: after every denoising step, a chunk whose choice "
                                       "carries `dgemma_draft` (the canvas's argmax tokens, their pieces, entropies "
                                       "and which positions were accepted)")


class StructuredOutputs(BaseModel):
    """vLLM's field: the answer matches `regex`. JSON answers come from response_format instead."""

    model_config = ConfigDict(extra="forbid")
    regex: NonEmptyStr = Field(description="outlines-core's syntax (the Rust regex crate's), matched against the "
                               "whole answer")


class ResponseFormatText(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]


class ResponseFormatJSONObject(BaseModel):
    """The answer is a JSON object (any keys; values nest up to three levels)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["json_object"]


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: dict[str, Any] = Field(alias="schema", description="a JSON schema within the supported subset "
                                    "(docs/serving.md); any other keyword is a 400 naming it")
    strict: StrictBool | None = Field(None, description="accepted; the schema is enforced either way")


class ResponseFormatJSONSchema(BaseModel):
    """The answer is a JSON document valid under `json_schema.schema`, by construction."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


ResponseFormat = Annotated[ResponseFormatText | ResponseFormatJSONObject | ResponseFormatJSONSchema,
                           Field(discriminator="type")]


class GenerationFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions. OpenAI fields a diffusion sampler has no
    use for (temperature, top_p, penalties, user, ...) are accepted and ignored."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = Field(None, description="optional; if given, the served model's id")
    stream: StrictBool = Field(False, description="server-sent events, one text chunk per committed canvas")
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    stop: StopStrings | None = None
    seed: Seed | None = Field(None, description="the same seed and request give the same output, whatever else is "
                              "in the batch (random when absent; choice i of n uses seed + i)")
    n: strict(int, ge=1, le=MAX_CHOICES) | None = Field(None, description="choices of one prompt, seeded seed, "
                                                        "seed + 1, ...")
    response_format: ResponseFormat | None = Field(None, description="text (the default), json_object, or "
                                                   "json_schema: the answer is constrained on the canvas")
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM's field: the answer matches a regex")
    # the diffusion sampler
    steps: Steps | None = Field(None, description="dgemma: most denoising steps per canvas (default: the model's "
                                "max_denoising_steps)")
    entropy_bound: EntropyBound | None = Field(None, description="dgemma: per step, accept positions by rising "
                                               "entropy until their sum passes this")
    accept_order: Literal[ACCEPT_ORDERS] | None = Field(
        None, description="dgemma: which positions a step accepts first: lowest entropy (the reference), widest "
        "top-2 probability margin, or highest top-1 probability; entropy_bound applies to each order's "
        "uncertainty (default: the model's, `entropy` unless its generation_config.json says otherwise)")
    t_min: Temperature | None = Field(None, description="dgemma: the temperature at the last step (the schedule "
                                      "falls linearly from t_max; t_min <= t_max)")
    t_max: Temperature | None = Field(None, description="dgemma: the temperature at the first step")
    fixed_steps: StrictBool | None = Field(None, description="dgemma: run exactly `steps` per canvas, no early stop")
    step_cache: StrictBool | None = Field(None, description="dgemma: run only the canvas positions that have not "
                                          "settled through the decoder (fewer decoder positions, an approximation; "
                                          "default: the server's --step-cache)")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, value):
        if value is None:
            return None
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, list) or not all(isinstance(v, str) and v for v in values):
            raise ValueError("expected a non-empty string or a list of non-empty strings")
        if len(values) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        return values

    @field_validator("response_format", mode="before")
    @classmethod
    def _response_format(cls, value):
        """The shape, checked with messages that show it; the typed check follows."""
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

    @model_validator(mode="after")
    def _supported(self):
        """Fields valid alone that this server cannot honour (together, or at all): a 400 naming the field."""
        problem = self.unsupported()
        if problem:
            raise PydanticCustomError("unsupported_field", "{field}: {reason}", {"field": problem[0],
                                                                              "reason": problem[1]})
        return self

    @property
    def structured(self) -> tuple[str, dict | str | None] | None:
        """("json_schema", schema) / ("json_object", None) / ("regex", pattern) when the answer is
        constrained, else None. A schema is enforced whether or not `strict` is set: a constrained answer
        is always valid."""
        if self.structured_outputs is not None:
            return "regex", self.structured_outputs.regex
        if isinstance(self.response_format, ResponseFormatJSONSchema):
            return "json_schema", self.response_format.json_schema.schema_
        return ("json_object", None) if isinstance(self.response_format, ResponseFormatJSONObject) else None

    def unsupported(self) -> tuple[str, str] | None:
        """(field, reason) for a field set to something this server cannot do, else None."""
        if self.structured_outputs is not None and self.response_format is not None and \
                not isinstance(self.response_format, ResponseFormatText):
            return "structured_outputs", "a regex and a response_format cannot both shape the answer"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed with stream: true"
        return None

    @property
    def choices(self) -> int:
        return self.n or 1

    @property
    def include_drafts(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_drafts)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


TokenIds = Annotated[list[StrictInt], Field(min_length=1)]
# /v1/completions without max_tokens writes this many, as OpenAI documents for the endpoint (and vLLM does);
# chat's absent max_tokens is the model's own default instead
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class CompletionRequest(GenerationFields):
    """POST /v1/completions: prompts continued by the diffusion sampler, or scored (`logprobs`)."""

    # always a list of prompts once validated (`_prompts`)
    prompt: NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)] | TokenIds | \
        Annotated[list[TokenIds], Field(min_length=1)] = Field(
            description="a string, a list of token ids, or a list of either (several prompts; choice i * n + j "
                        "is prompt i's choice j)")
    max_tokens: strict(int, ge=0) | None = Field(None, description="0: no completion (echo and/or scoring only); "
                                                 f"absent: {COMPLETIONS_DEFAULT_MAX_TOKENS}, OpenAI's default for "
                                                 "this endpoint (a task model writes its fixed answer length)")
    echo: StrictBool = Field(False, description="the answer's text starts with the prompt's")
    logprobs: strict(int, ge=0, le=MAX_LOGPROBS) | None = Field(
        None, description="score the prompts instead (max_tokens 0 or 1): the prompt's own log-probabilities from "
                          "the causal encoder, with this many alternatives per position")
    suffix: StrictStr | None = Field(None, description="not supported: a 400")
    best_of: StrictInt | None = Field(None, description="only 1 is supported")

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, value):
        """Text, token ids, or a list of either (several prompts): always a list of prompts."""
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

    @property
    def scoring(self) -> bool:
        """The prompts are scored (log-probabilities), not continued by the diffusion sampler."""
        return self.logprobs is not None

    def unsupported(self):
        if self.logprobs is not None:
            if self.max_tokens is None or self.max_tokens > 1:
                return "logprobs", (f"{NO_LOGPROBS}. The prompt's own log-probabilities are available: send "
                                    "echo: true with max_tokens 0 (or 1, which adds the causal encoder's most "
                                    "likely next token)")
            if self.stream:
                return "stream", "scoring (logprobs) answers at once; send stream: false"
            if self.choices > 1:
                return "n", "scoring (logprobs) is deterministic; n > 1 would repeat the same choice"
            if self.structured is not None:
                return "response_format", "scoring (logprobs) writes no answer to format"
        if self.suffix is not None:
            return "suffix", "suffix (insertion) is not supported"
        if self.best_of not in (None, 1):
            return "best_of", "only best_of=1 is supported"
        return super().unsupported()


# -- the chat body -------------------------------------------------------------------------------------
# Chat content may hold images: {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}} parts
# in user messages (read by image_urls.py).

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


# -- the tokenizer routes -------------------------------------------------------------------------------

class _TokenizerRequest(BaseModel):
    """/tokenize and /detokenize, as vLLM serves them (evaluation harnesses count tokens with them)."""

    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None


class TokenizeRequest(_TokenizerRequest):
    prompt: StrictStr
    add_special_tokens: StrictBool = Field(True, description="add the tokenizer's special tokens (Gemma's <bos>)")


class DetokenizeRequest(_TokenizerRequest):
    tokens: list[StrictInt]
