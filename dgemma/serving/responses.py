"""Response bodies and stream chunks, in the shape of their endpoint (/v1/completions or /v1/chat/completions),
and the bodies of the model list and the tokenizer routes.

Each body is a pydantic model below, the one definition of its shape: the routes build their bodies with
these models (chunk_writer.py's `ChunkWriter` for the generation routes, app.py for the rest) and
/openapi.json publishes them (openapi.py). A body is sent as `Body.wire()`: the fields that were given, null
ones included, and none of the optional fields that were left out (a chunk has `usage` only when it is the
usage chunk). Errors are errors.py's, /health's body health.py's.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer


class Body(BaseModel):
    """A response body or a part of one."""

    def wire(self) -> dict:
        """The body as sent: the fields that were set (to None too), without the optional ones left out."""
        return self.model_dump(exclude_unset=True)


# -- generation -----------------------------------------------------------------------------------------

class PromptTokensDetails(Body):
    cached_tokens: int = Field(description="prompt tokens taken from the prefix cache instead of encoded")


class Usage(Body):
    prompt_tokens: int = Field(description="an image's soft tokens included")
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class Stats(Body):
    """dgemma: how the answer was made."""

    model_config = ConfigDict(extra="allow")  # a task adds its verdict under its name (sudoku: solved, problems)
    seed: int | None = Field(None, description="the seed used (random when none was sent)")
    canvases: int | None = None
    steps_per_canvas: list[int] | None = None
    denoising_steps: int | None = None
    tokens_per_forward: float | None = None
    decoder_positions: int | None = Field(None, description="canvas positions run through the decoder (fewer "
                                          "with step_cache)")
    time_to_first_canvas_s: float | None = None
    elapsed_s: float | None = None
    tokens_per_second: float | None = None
    rounds: int | None = Field(None, description="with a verifier: the rounds it took")
    accepted: bool | None = Field(None, description="with a verifier: its verdict on the answer")
    search: dict[str, Any] | None = Field(None, description="with a search: its candidates and cost")
    choices: list[dict[str, Any]] | None = Field(None, description="n > 1: each choice's statistics")

    @model_serializer(mode="wrap")
    def _choices_last(self, serialize):
        """A task's verdict (an extra field) sits with the figures it judges, before `choices`."""
        data = serialize(self)
        if "choices" in data:
            data["choices"] = data.pop("choices")
        return data


class FunctionCallOut(Body):
    name: str
    arguments: str = Field(description="a JSON object, in a string")


class ToolCallOut(Body):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class AssistantMessage(Body):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the answer is only tool calls")
    reasoning_content: str | None = Field(None, description="the thoughts, with thinking on")
    tool_calls: list[ToolCallOut] | None = None


FinishReason = Literal["stop", "length", "tool_calls"]


class ChatChoice(Body):
    index: int
    message: AssistantMessage
    logprobs: None
    finish_reason: FinishReason


class ChatCompletion(Body):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    dgemma: Stats


class LegacyLogprobs(Body):
    """Scoring: one entry per token (with echo, the prompt's; with max_tokens 1, the next token after)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Body):
    index: int
    text: str
    logprobs: LegacyLogprobs | None
    finish_reason: FinishReason


class Completion(Body):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    dgemma: Stats


class Draft(Body):
    """dgemma: the canvas after a denoising step, or after a DDIM corrector sweep (stream_options.include_drafts):
    the argmax tokens, or with block refinement and DDIM the tokens the canvas holds where it holds a prediction
    (`accepted`) and the argmax elsewhere."""

    canvas: int
    step: int
    tokens: list[int]
    pieces: list[str]
    entropy: list[float]
    accepted: list[bool] = Field(description="per position: the next canvas holds the model's prediction there")
    edited: list[bool] = Field(description="per position: block refinement replaced its committed token")
    corrected: list[bool] = Field(description="per position: a DDIM corrector sweep drew it again")
    phase: Literal["predictor", "corrector"] = Field(description="a denoising step, or a DDIM corrector sweep")
    settled: list[bool] | None = Field(None, description="with step_cache: the positions this step kept (their "
                                                         "logits and keys/values from an earlier step) instead of "
                                                         "running them through the decoder")


class ChatDelta(Body):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChunkChoice(Body):
    index: int
    delta: ChatDelta
    finish_reason: FinishReason | None
    dgemma_draft: Draft | None = None


class ChatCompletionChunk(Body):
    """One `data:` event of a chat stream; the stream ends with `data: [DONE]`. The chunk with a
    finish_reason carries `dgemma`; with include_usage a last chunk has no choices and `usage`."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    dgemma: Stats | None = None


class CompletionChunkChoice(Body):
    index: int
    text: str
    logprobs: None
    finish_reason: FinishReason | None
    dgemma_draft: Draft | None = None


class CompletionChunk(Body):
    """One `data:` event of a completion stream; the stream ends with `data: [DONE]`."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None
    dgemma: Stats | None = None


# -- models and the tokenizer ---------------------------------------------------------------------------


class ImagesCard(Body):
    accepted: bool
    max_per_request: int | None = None
    max_soft_tokens: int | None = None
    max_pixels: int | None = None
    remote_urls: bool | None = None


class Defaults(Body):
    sampler: str
    steps: int
    entropy_bound: float
    accept_order: str
    t_min: float
    t_max: float
    max_tokens: int


class ModelCardExtra(Body):
    task: str = Field(description="text, or a task's own (sudoku)")
    canvas_length: int
    images: ImagesCard
    vocab_size: int
    max_length: int
    max_batch: int
    max_queue: int
    defaults: Defaults


class ModelCard(Body):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    dgemma: ModelCardExtra


class ModelList(Body):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizerInfo(Body):
    tokenizer_class: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    chat_template: str | None
    model_max_length: int


class Tokens(Body):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: None


class Detokenized(Body):
    prompt: str
