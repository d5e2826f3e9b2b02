"""The OpenAI-compatible request bodies (validated): the fields every generation request shares,
/v1/completions' body, and the tokenizer routes' bodies. The chat body is chat_protocol.py's, errors are
errors.py's, responses and stream chunks responses.py's.

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
  seed            int 0..2**63-1  (an OpenAI field too) same seed, same request -> same output
  stream_options.include_drafts   bool: stream the argmax canvas after every denoising step
  structured_outputs.regex        str: the answer matches this regex (outlines-core's syntax), as vLLM
"""

from __future__ import annotations

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


class CompletionRequest(GenerationFields):
    """POST /v1/completions: prompts continued by the diffusion sampler, or scored (`logprobs`)."""

    # always a list of prompts once validated (`_prompts`)
    prompt: NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)] | TokenIds | \
        Annotated[list[TokenIds], Field(min_length=1)] = Field(
            description="a string, a list of token ids, or a list of either (several prompts; choice i * n + j "
                        "is prompt i's choice j)")
    max_tokens: strict(int, ge=0) | None = Field(None, description="0: no completion (echo and/or scoring only); "
                                                 "absent: as many whole canvases as fit after the prompt, capped by "
                                                 "the model's default")
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


class _TokenizerRequest(BaseModel):
    """/tokenize and /detokenize, as vLLM serves them (evaluation harnesses count tokens with them)."""

    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None


class TokenizeRequest(_TokenizerRequest):
    prompt: StrictStr
    add_special_tokens: StrictBool = Field(True, description="add the tokenizer's special tokens (Gemma's <bos>)")


class DetokenizeRequest(_TokenizerRequest):
    tokens: list[StrictInt]
