"""The OpenAI-compatible request bodies, validated: the fields every generation request shares,
/v1/completions' body, /v1/chat/completions' body (messages, their content parts, tools and tool_choice),
and the tokenizer routes' bodies: the one definition of each body's shape, which FastAPI validates the body
with and /openapi.json publishes. The checks beyond the types (the limits, pre-checks, the role rules, the
fields accepted but not honoured) are request_checks.py's; what a request becomes for the engine (sampling,
constraint, seeds, the chat template's input) is engine_inputs.py's; responses are responses.py's.

Request bodies are checked strictly: a wrong type is an error, never coerced ("5" is not 5, true is
not 1), numbers must be finite and inside the ranges below, and the message names the field.
OpenAI fields a diffusion sampler has no use for (top_p, penalties, user, ...; temperature with the entropy
bound) are accepted and ignored, so existing clients work; fields whose meaning we cannot honour (logprobs of
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
  sampler         "entropy-bound" | "block-refinement" | "ddim"   what turns each step's logits into the canvas
  temperature     float 0..100    (an OpenAI field too) block-refinement and ddim draw at it; the entropy bound
                                  ignores it (its temperature is the t_max -> t_min schedule)
  commit_threshold, editing_threshold   float 0..1   block-refinement's
  corrector_steps int 0..1000, corrector_k int 1..4096, corrector_selection, corrector_selection_tau   ddim's
  A setting of a sampler other than the request's is a 400 that names it (temperature aside).
  seed            int 0..2**63-1  (an OpenAI field too) same seed, same request -> same output
  stream_options.include_drafts   bool: stream the argmax canvas after every denoising step
  structured_outputs.regex        str: the answer matches this regex (outlines-core's syntax), as vLLM
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dgemma.config import ACCEPT_ORDERS, CORRECTOR_SELECTIONS, SAMPLERS
from dgemma.serving.request_checks import (MAX_CHOICES, MAX_LOGPROBS, MAX_STEPS, MAX_STOP_STRINGS, ROLE_RULES_SCHEMA,
                                           broken_role_rule, content_parts, json_object_string, not_empty,
                                           prompt_list, response_format_shape, stop_strings, unsupported_chat,
                                           unsupported_completion, unsupported_field_error, unsupported_generation)


# -- request bodies ------------------------------------------------------------------------------------
# The models below validate the bodies (FastAPI hands each route its model) and are the OpenAPI schema's
# request bodies (/openapi.json): one definition for both. The checks they attach (request_checks.py) give
# friendlier messages before the typed check, and reject what the types allow but the server cannot do.

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
SamplingTemperature = Annotated[float, Field(ge=0.0, le=100.0, allow_inf_nan=False)]  # OpenAI's: 0 and 0.7 alike
Probability = strict(float, ge=0.0, le=1.0, allow_inf_nan=False)
# several stop strings, or one; a list only once validated (request_checks.stop_strings)
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
    use for (top_p, penalties, user, ...; temperature with the entropy bound) are accepted and ignored."""

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
    sampler: Literal[SAMPLERS] | None = Field(
        None, description="dgemma: what turns each step's logits into the next canvas: entropy-bound (the model's "
        "own), block-refinement (commit the most confident predictions, an even share of the canvas per step) or "
        "ddim (ancestral steps from the exact posterior, optionally with corrector sweeps); `steps` is each one's "
        "decoder forwards per canvas (default: the server's --sampler, else the model's generation_config.json)")
    temperature: SamplingTemperature | None = Field(
        None, description="block-refinement and ddim: the temperature their predictions are drawn at (0: the "
        "argmax, their default); the entropy bound ignores it (its temperature falls from t_max to t_min)")
    commit_threshold: Probability | None = Field(None, description="dgemma, block-refinement: also commit every "
                                                 "position more confident than this (default 0.95)")
    editing_threshold: Probability | None = Field(None, description="dgemma, block-refinement: replace a committed "
                                                  "token the model now predicts otherwise with more confidence than "
                                                  "this (default 0: no editing)")
    corrector_steps: strict(int, ge=0, le=MAX_STEPS) | None = Field(
        None, description="dgemma, ddim: Gibbs corrector sweeps after each of the first predictor steps, out of "
        "`steps` (default 0)")
    corrector_k: strict(int, ge=1, le=4096) | None = Field(None, description="dgemma, ddim: positions one sweep "
                                                           "draws again (default 1)")
    corrector_selection: Literal[CORRECTOR_SELECTIONS] | None = Field(
        None, description="dgemma, ddim: how a sweep picks its positions, least confident first (default "
        "lowest_log_margin)")
    corrector_selection_tau: strict(float, gt=0.0, le=100.0, allow_inf_nan=False) | None = Field(
        None, description="dgemma, ddim: temperature of that choice's Gumbel-top-k (default 1)")

    _stop = field_validator("stop", mode="before")(stop_strings)
    _response_format = field_validator("response_format", mode="before")(response_format_shape)

    @model_validator(mode="after")
    def _supported(self):
        """Fields valid alone that this server cannot honour (together, or at all): a 400 naming the field."""
        problem = self.unsupported()
        if problem:
            raise unsupported_field_error(problem)
        return self

    def unsupported(self) -> tuple[str, str] | None:
        """(field, reason) for a field set to something this server cannot do, else None."""
        return unsupported_generation(self)

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

    # always a list of prompts once validated (request_checks.prompt_list)
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

    _prompts = field_validator("prompt", mode="before")(prompt_list)

    @property
    def scoring(self) -> bool:
        """The prompts are scored (log-probabilities), not continued by the diffusion sampler."""
        return self.logprobs is not None

    def unsupported(self):
        return unsupported_completion(self)


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


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: StrictStr
    arguments: StrictStr = Field(description="a JSON object, in a string (as OpenAI sends it)")

    _arguments = field_validator("arguments")(json_object_string)


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", json_schema_extra=ROLE_RULES_SCHEMA)  # the role rules, published
    role: Role = Field(description="\"developer\" is read as \"system\"")
    content: StrictStr | list[ContentPart] | None = Field(
        "", description="a string, or text and image_url parts (images: user messages only, for a model with a "
                        "vision tower); null is empty")
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="assistant: calls it made")
    tool_call_id: StrictStr | None = Field(None, description="tool: the call this message answers (required)")
    reasoning_content: StrictStr | None = Field(None, description="assistant: its thoughts, for templates that "
                                                "keep them")

    _parts = field_validator("content", mode="before")(content_parts)

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
        broken = broken_role_rule(self.model_dump())
        if broken:
            raise ValueError(broken)
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

    _not_empty = field_validator("messages")(not_empty)

    @property
    def named_tool(self) -> str | None:
        """The function a named tool_choice names."""
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    @property
    def tool_mode(self) -> str:
        """"none" (calls stay text), "auto" (calls are parsed), "required" or "named" (constrained)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if self.named_tool is not None:
            return "named"
        return self.tool_choice or "auto"

    def unsupported(self):
        return unsupported_chat(self)


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
