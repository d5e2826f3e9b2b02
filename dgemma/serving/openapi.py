"""What the server answers, as OpenAPI response schemas, and the pages that publish the API.

The request bodies of /openapi.json are the models that validate them (protocol.py, chat_protocol.py); the
response models here only describe: the routes build their bodies as dicts (responses.ChunkWriter and app.py), and
the fuzz test (tests/test_server_fuzz.py) checks every response it provokes against these schemas.
Streams (`stream: true`) are documented as `text/event-stream`; each event is one of the chunk models below.

/docs is Swagger UI from the swagger-ui-bundle-v2 package, served from this server (no CDN: the server
works offline). It is a page without content of its own, like the playground: it loads /openapi.json and
sends "Try it out" requests with the API key the playground keeps in the browser (asking for one when the
schema answers 401).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# -- errors ---------------------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, rate_limit_error or server_error")
    param: str | None = Field(description="the request field at fault, when one is")
    code: str | None = Field(description="e.g. model_not_found, context_length_exceeded, unsupported_schema, "
                             "invalid_api_key, request_too_large, queue_full, invalid_image")


class ErrorResponse(BaseModel):
    """OpenAI's error shape; every 4xx and 5xx of this server has it."""

    error: ErrorDetail


ERRORS = {
    400: "bad input: a wrong type, a value out of range, malformed JSON, an unsupported field or schema, a prompt "
         "too long for the context, a bad image",
    401: "missing or wrong API key (when the server has one)",
    413: "the body is over --max-body-bytes",
    429: "the queue is full (a Retry-After header says when to retry)",
    500: "the engine failed while running the request",
    503: "the engine is not running",
}


def error_responses(*statuses: int) -> dict:
    return {status: {"model": ErrorResponse, "description": ERRORS[status]} for status in statuses}


# -- generation -----------------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int = Field(description="an image's soft tokens included")
    completion_tokens: int
    total_tokens: int


class Stats(BaseModel):
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
    choices: list[dict[str, Any]] | None = Field(None, description="n > 1: each choice's statistics")


class FunctionCallOut(BaseModel):
    name: str
    arguments: str = Field(description="a JSON object, in a string")


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the answer is only tool calls")
    reasoning_content: str | None = Field(None, description="the thoughts, with thinking on")
    tool_calls: list[ToolCallOut] | None = None


FinishReason = Literal["stop", "length", "tool_calls"]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    dgemma: Stats


class LegacyLogprobs(BaseModel):
    """Scoring: one entry per token (with echo, the prompt's; with max_tokens 1, the next token after)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: LegacyLogprobs | None
    finish_reason: FinishReason


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    dgemma: Stats


class Draft(BaseModel):
    """dgemma: the argmax canvas after a denoising step (stream_options.include_drafts)."""

    canvas: int
    step: int
    tokens: list[int]
    pieces: list[str]
    entropy: list[float]
    accepted: list[bool]


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: FinishReason | None
    dgemma_draft: Draft | None = None


class ChatCompletionChunk(BaseModel):
    """One `data:` event of a chat stream; the stream ends with `data: [DONE]`. The chunk with a
    finish_reason carries `dgemma`; with include_usage a last chunk has no choices and `usage`."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    dgemma: Stats | None = None


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    logprobs: None
    finish_reason: FinishReason | None
    dgemma_draft: Draft | None = None


class CompletionChunk(BaseModel):
    """One `data:` event of a completion stream; the stream ends with `data: [DONE]`."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None
    dgemma: Stats | None = None


STREAM_CHUNKS = (ChatCompletionChunk, CompletionChunk)  # put into the schema's components by `add_stream_chunks`


def generation_responses(body: type[BaseModel], chunk: type[BaseModel]) -> dict:
    """200 as JSON, or as server-sent events with `stream: true`; and the errors. As OpenAPI 3.1 reads an
    event stream's `schema`: one event ({"data": ...}), whose data is a JSON chunk, an error, or [DONE]."""
    event = {"type": "object", "required": ["data"], "properties": {"data": {
        "anyOf": [{"type": "string", "contentMediaType": "application/json",
                   "contentSchema": {"anyOf": [{"$ref": f"#/components/schemas/{chunk.__name__}"},
                                               {"$ref": "#/components/schemas/ErrorResponse"}]}},
                  {"const": "[DONE]"}],
        "description": f"a {chunk.__name__} as JSON; an error object if the engine fails mid-stream; the last "
                       "event's data is [DONE]"}}}
    return {200: {"model": body, "description": "the answer; with stream: true, server-sent events",
                  "content": {"text/event-stream": {"schema": event}}},
            **error_responses(400, 401, 413, 429, 500, 503)}


def add_stream_chunks(schema: dict) -> dict:
    """The chunk models that stream events refer to, added to the schema's components."""
    from pydantic.json_schema import models_json_schema

    _, defs = models_json_schema([(m, "serialization") for m in STREAM_CHUNKS],
                                 ref_template="#/components/schemas/{model}")
    schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
    return schema


# -- the rest -------------------------------------------------------------------------------------------


class ImagesCard(BaseModel):
    accepted: bool
    max_per_request: int | None = None
    max_soft_tokens: int | None = None
    max_pixels: int | None = None
    remote_urls: bool | None = None


class Defaults(BaseModel):
    steps: int
    entropy_bound: float
    t_min: float
    t_max: float
    max_tokens: int


class ModelCardExtra(BaseModel):
    task: str = Field(description="text, or a task's own (sudoku)")
    canvas_length: int
    images: ImagesCard
    vocab_size: int
    max_length: int
    max_batch: int
    max_queue: int
    defaults: Defaults


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    dgemma: ModelCardExtra


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
    model: str
    active: int
    waiting: int
    max_batch: int
    max_queue: int


class TokenizerInfo(BaseModel):
    tokenizer_class: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    chat_template: str | None
    model_max_length: int


class Tokens(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: None


class Detokenized(BaseModel):
    prompt: str


DOCS_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>dgemma API</title>
<link rel="stylesheet" href="/swagger-ui/swagger-ui.css"></head>
<body><div id="swagger-ui"></div>
<script src="/swagger-ui/swagger-ui-bundle.js"></script>
<script>
// the key the playground keeps (localStorage "dgemma-api-key"); asked for when the schema needs one
function key() { return localStorage.getItem("dgemma-api-key") || ""; }
async function start() {
  let answer = await fetch("/openapi.json", {headers: key() ? {Authorization: "Bearer " + key()} : {}});
  if (answer.status === 401) {
    const typed = prompt("This server wants an API key:") || "";
    localStorage.setItem("dgemma-api-key", typed);
    answer = await fetch("/openapi.json", {headers: {Authorization: "Bearer " + typed}});
  }
  SwaggerUIBundle({dom_id: "#swagger-ui", spec: await answer.json(), deepLinking: true,
    requestInterceptor: (request) => {
      if (key() && !request.headers.Authorization) request.headers.Authorization = "Bearer " + key();
      return request;
    }});
}
start();
</script></body></html>
"""


def swagger_ui_folder() -> str:
    import swagger_ui_bundle

    return str(swagger_ui_bundle.swagger_ui_path)


def without_422(schema: dict) -> dict:
    """FastAPI documents a 422 on every route that takes input; this server answers a bad body or parameter
    with a 400 in OpenAI's shape (http_plumbing.py's handler), already documented where it can happen."""
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            responses = operation.get("responses", {})
            if responses.pop("422", None) is not None and "400" not in responses:
                responses["400"] = {"description": ERRORS[400],
                                    "content": {"application/json": {"schema": {
                                        "$ref": "#/components/schemas/ErrorResponse"}}}}
    for name in ("HTTPValidationError", "ValidationError"):
        schema.get("components", {}).get("schemas", {}).pop(name, None)
    return schema
