"""Response bodies and stream chunks, in the shape of their endpoint (/v1/completions or /v1/chat/completions),
and errors in OpenAI's shape.

Each body is a pydantic model below, the one definition of its shape: the routes build their bodies with
these models (`ChunkWriter` for the generation routes, app.py for the rest) and /openapi.json publishes them
(openapi.py). A body is sent as `Body.wire()`: the fields that were given, null ones included, and none of
the optional fields that were left out (a chunk has `usage` only when it is the usage chunk).

Every 4xx and 5xx of the server is {"error": {"message", "type", "param", "code"}} (`APIError`); a request
body that fails validation gets the 400 that names the field it got wrong (`validation_error`).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer
from starlette.exceptions import HTTPException as StarletteHTTPException

from dgemma.chat.tool_calls import openai_tool_call
from dgemma.engine.scoring import PromptScores


class Body(BaseModel):
    """A response body or a part of one."""

    def wire(self) -> dict:
        """The body as sent: the fields that were set (to None too), without the optional ones left out."""
        return self.model_dump(exclude_unset=True)


# -- errors in OpenAI's shape ---------------------------------------------------------------------------

class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, rate_limit_error or server_error")
    param: str | None = Field(description="the request field at fault, when one is")
    code: str | None = Field(description="e.g. model_not_found, context_length_exceeded, unsupported_schema, "
                             "invalid_api_key, request_too_large, queue_full, invalid_image")


class ErrorResponse(BaseModel):
    """OpenAI's error shape; every 4xx and 5xx of this server has it."""

    error: ErrorDetail


class APIError(StarletteHTTPException):
    """Becomes an OpenAI error body: {"error": {"message", "type", "param", "code"}}. An HTTPException, so that
    FastAPI lets it through unchanged from anywhere, reading the body included."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(status_code=status, detail=message, headers=headers or {})
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return ErrorResponse(error=ErrorDetail(message=message, type=type, param=param, code=code)).model_dump()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def validation_error(errors: list[dict]) -> APIError:
    """A 400 for pydantic's (or FastAPI's) first error, naming the field: "messages.0.role: Input should be ..."."""
    error = errors[0] if errors else {"type": "value_error", "loc": (), "msg": "invalid request"}
    loc = list(error.get("loc", ()))
    if loc[:1] == ["body"]:  # FastAPI's prefix for the body
        loc = loc[1:]
    if error["type"] == "unsupported_field":
        field = error["ctx"]["field"]
        return bad_request(error["msg"], param=field)
    if not loc:
        if error["type"] == "missing":
            return bad_request("the request body is empty; expected a JSON object")
        if error["type"] in ("model_type", "model_attributes_type", "dict_type"):
            return bad_request("the request body must be a JSON object")
    param = ".".join(str(part) for part in loc) or None
    message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
    if error["type"] == "missing":
        message = "this field is required"
    return bad_request(f"{param}: {message}" if param else message, param=param)


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
    """dgemma: the argmax canvas after a denoising step (stream_options.include_drafts)."""

    canvas: int
    step: int
    tokens: list[int]
    pieces: list[str]
    entropy: list[float]
    accepted: list[bool]
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


# -- scoring: OpenAI's legacy completions logprobs ------------------------------------------------------
# Scored prompts as OpenAI's legacy completions `logprobs` object, the shape evaluation harnesses read.
#
#     {"tokens": [...], "token_logprobs": [null, ...], "top_logprobs": [null, {...}, ...], "text_offset": [...]}
#
# One entry per token: with `echo` the prompt's tokens (the first has no log-probability: nothing comes
# before it), then, for max_tokens 1, the causal encoder's most likely next token. `tokens` holds each
# token's own text (special tokens written out); `top_logprobs` the `logprobs` most likely tokens at that
# position, keyed by their text; `text_offset` where each token's text begins in the choice's `text`.

def scored_choice(codec, prompt: list[int], prompt_text: str, scores: PromptScores, *, echo: bool,
                  next_token: bool, top: int) -> dict:
    """The `text` and `logprobs` of one choice of a scoring request (max_tokens 0 or 1)."""
    T = len(prompt)
    ids, logprobs, alternatives = [], [], []
    if echo:
        ids += prompt
        logprobs += [None] + scores.token_logprobs.tolist()
        alternatives += [None] + [_top(codec, scores, t, top) for t in range(T - 1)]
    if next_token:
        ids.append(int(scores.top_ids[T - 1, 0]))
        logprobs.append(float(scores.top_logprobs[T - 1, 0]))
        alternatives.append(_top(codec, scores, T - 1, top))
    # decoded in context: the next token's text is what it adds after the prompt (a space, say)
    texts = codec.token_texts(prompt + ids[-1:] if next_token else prompt)[0 if echo else T:]
    text = (prompt_text if echo else "") + "".join(texts[T:] if echo else texts)
    offsets, at = [], 0
    for piece in texts:
        offsets.append(at)
        at += len(piece)
    return {"text": text, "logprobs": {"tokens": [codec.piece(t) for t in ids], "token_logprobs": logprobs,
                                       "top_logprobs": alternatives, "text_offset": offsets}}


def _top(codec, scores: PromptScores, position: int, top: int) -> dict[str, float]:
    """The `top` most likely tokens at a position, by text (of two tokens with one text, the likelier)."""
    out: dict[str, float] = {}
    for token, logprob in zip(scores.top_ids[position, :top].tolist(), scores.top_logprobs[position, :top].tolist()):
        out.setdefault(codec.piece(token), logprob)
    return out
