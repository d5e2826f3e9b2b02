"""Response bodies and stream chunks, in the shape of their endpoint (/v1/completions or /v1/chat/completions).

Each body is a pydantic model below, the one definition of its shape: the routes build their bodies with
these models (`ChunkWriter` for the generation routes, app.py for the rest) and /openapi.json publishes them
(openapi.py). A body is sent as `Body.wire()`: the fields that were given, null ones included, and none of
the optional fields that were left out (a chunk has `usage` only when it is the usage chunk).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from dgemma.chat.tool_calls import openai_tool_call


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
    """dgemma: the argmax canvas after a denoising step (stream_options.include_drafts)."""

    canvas: int
    step: int
    tokens: list[int]
    pieces: list[str]
    entropy: list[float]
    accepted: list[bool]


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


class PrefixCacheStats(Body):
    """The engine's prefix cache (dgemma.engine.prefix_cache.PrefixCacheStats)."""

    blocks: int = Field(description="blocks held now")
    bytes: int = Field(description="their bytes")
    budget_bytes: int
    lookups: int = Field(description="requests that looked their prompt up")
    hits: int = Field(description="requests that took at least one block")
    cached_tokens: int = Field(description="prompt tokens taken from the cache, all requests")
    inserted: int = Field(description="blocks stored")
    evictions: int = Field(description="blocks dropped for room")


class Health(Body):
    status: Literal["ok", "draining", "unavailable"]
    model: str
    step: Literal["eager", "compiling", "compiled"]  # compiling: the eager step answers meanwhile
    active: int
    waiting: int
    max_batch: int
    max_queue: int
    prefix_cache: PrefixCacheStats | None = Field(description="null when the prefix cache is off")


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


# -- building the generation bodies ---------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
    """OpenAI's usage; `cached_tokens`: prompt tokens the engine's prefix cache gave instead of the encoder."""
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class ChunkWriter:
    """Builds the bodies and stream chunks of one request, in the shape of its endpoint.

    Drafts ride in ordinary chunks: the choice has empty text / an empty delta and carries an extra
    field `dgemma_draft`, so the official client parses them like any chunk (extra fields are kept,
    readable as `choice.dgemma_draft`) and code that concatenates the text sees nothing.
    """

    def __init__(self, chat: bool, model: str):
        self.chat = chat
        self.model = model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _chunk(self, choices: list, **extra) -> dict:
        if self.chat:
            chunk = ChatCompletionChunk(id=self.id, object="chat.completion.chunk", created=self.created,
                                        model=self.model, choices=choices, **extra)
        else:
            chunk = CompletionChunk(id=self.id, object="text_completion", created=self.created, model=self.model,
                                    choices=choices, **extra)
        return chunk.wire()

    def _delta(self, index: int, delta: dict, finish_reason=None, *, draft: dict | None = None, **extra) -> dict:
        """A chunk of one choice: `delta` is a chat delta's fields (a completion chunk takes its content)."""
        drafted = {} if draft is None else {"dgemma_draft": Draft(**draft)}
        if self.chat:
            choice = ChatChunkChoice(index=index, delta=ChatDelta(**delta), finish_reason=finish_reason, **drafted)
        else:
            choice = CompletionChunkChoice(index=index, text=delta.get("content", ""), logprobs=None,
                                           finish_reason=finish_reason, **drafted)
        return self._chunk([choice], **extra)

    def first(self, index: int = 0) -> dict | None:
        """Chat streams open each choice with the assistant role; completion streams have no such chunk."""
        return self._delta(index, {"role": "assistant", "content": ""}) if self.chat else None

    def text(self, text: str, index: int = 0) -> dict:
        return self._delta(index, {"content": text})

    def reasoning(self, text: str, index: int = 0) -> dict:
        return self._delta(index, {"reasoning_content": text})

    def tool_call(self, call: dict, position: int, index: int = 0) -> dict:
        """One whole call (id, name and arguments in one delta), `position` in the answer's list of calls."""
        return self._delta(index, {"tool_calls": [openai_tool_call(call, position)]})

    def draft(self, draft: dict, index: int = 0) -> dict:
        return self._delta(index, {}, draft=draft)

    def finish(self, reason: str, stats: dict, index: int = 0) -> dict:
        return self._delta(index, {}, reason, dgemma=Stats(**stats))

    def usage_chunk(self, counts: Usage) -> dict:
        return self._chunk([], usage=counts)

    def response(self, answers: list[tuple[dict | str, str]], counts: Usage, stats: dict,
                 logprobs: list[dict] | None = None) -> dict:
        """answers: (chat message or completion text, finish reason) per choice; logprobs: each choice's
        (scoring)."""
        common = dict(id=self.id, created=self.created, model=self.model, usage=counts, dgemma=Stats(**stats))
        if self.chat:
            choices = [ChatChoice(index=i, message=AssistantMessage(**message), logprobs=None, finish_reason=reason)
                       for i, (message, reason) in enumerate(answers)]
            return ChatCompletion(object="chat.completion", choices=choices, **common).wire()
        choices = [CompletionChoice(index=i, text=text, logprobs=LegacyLogprobs(**logprobs[i]) if logprobs else None,
                                    finish_reason=reason) for i, (text, reason) in enumerate(answers)]
        return Completion(object="text_completion", choices=choices, **common).wire()
