"""The HTTP side: OpenAI-compatible routes, the playground page, errors in OpenAI's shape.

Routes
  GET  /                      the playground (static files in ./static, no network needed)
  GET  /health                {"status": "ok", "active", "waiting", ...}; no API key needed
  GET  /v1/models             the one served model, with a `dgemma` field (task, canvas, defaults)
  POST /v1/completions        prompt -> text; stream: true for server-sent events
  POST /v1/chat/completions   messages -> reply, through the model's chat template

A request becomes one engine request (see worker.py); its committed canvases become text through
`TextAssembler`, its drafts (only when asked for) become `dgemma_draft` chunks (protocol.py).
Every failure a client can cause is a 4xx in OpenAI's error shape; the server keeps running.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from dgemma.config import ConfigError, SamplingConfig
from dgemma.serving.codec import Codec, PromptError, TextAssembler
from dgemma.serving.protocol import (
    APIError,
    ChatCompletionRequest,
    ChunkWriter,
    CompletionRequest,
    bad_request,
    error_body,
    parse,
    usage,
)
from dgemma.serving.worker import EngineWorker, QueueFull, RequestStream

STATIC = Path(__file__).parent / "static"
DEFAULT_MAX_BODY_BYTES = 4 << 20


@dataclass
class ServerState:
    worker: EngineWorker
    codec: Codec  # TextCodec, or a task's own (dgemma.tasks.task_codec)
    model_name: str
    sampling: SamplingConfig  # the model's defaults; requests override fields of it
    canvas_length: int
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    created: int = field(default_factory=lambda: int(time.time()))


def create_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.worker.start()
        yield
        state.worker.stop()

    # no /docs: the Swagger page loads its scripts from a CDN, and the server works offline
    app = FastAPI(title="dgemma", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.dgemma = state
    _add_error_handlers(app)

    @app.get("/", include_in_schema=False)
    async def playground():
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/health")
    async def health():
        ok = state.worker.alive
        return JSONResponse({"status": "ok" if ok else "unavailable", "model": state.model_name,
                             **state.worker.load()}, status_code=200 if ok else 503)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_api_key_check(state))])

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [_model_card(state)]}

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str):
        _check_model(state, model_id)
        return _model_card(state)

    @v1.post("/completions")
    async def completions(request: Request):
        body = parse(CompletionRequest, await _read_json(request, state.max_body_bytes))
        _check_model(state, body.model)
        if isinstance(body.prompt, str):
            prompt = _encode(state.codec.encode_text, body.prompt)
        else:
            prompt = _encode(state.codec.check_ids, body.prompt)
        return await _generate(state, request, body, prompt, body.max_tokens, chat=False)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        body = parse(ChatCompletionRequest, await _read_json(request, state.max_body_bytes))
        _check_model(state, body.model)
        prompt = _encode(state.codec.encode_chat, body.chat(), body.chat_template_kwargs or {})
        return await _generate(state, request, body, prompt, body.token_limit, chat=True)

    app.include_router(v1)
    return app


# -- checks -------------------------------------------------------------------------------------------

def _api_key_check(state: ServerState):
    def check(request: Request):
        if state.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise APIError(401, "no API key given: send the header 'Authorization: Bearer KEY'",
                           code="invalid_api_key")
        if not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
            raise APIError(401, "incorrect API key", code="invalid_api_key")

    return check


def _check_model(state: ServerState, name: str | None):
    if name is not None and name != state.model_name:
        raise bad_request(f"model {name!r} does not exist; this server serves {state.model_name!r}",
                          param="model", code="model_not_found")


async def _read_json(request: Request, limit: int):
    """The body as JSON, read at most `limit` bytes far: bigger bodies are refused (413) unread."""
    too_large = APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():  # also catches chunked bodies, which declare no length
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise bad_request("the request body is empty; expected a JSON object")
    try:
        return json.loads(raw, parse_constant=_no_constants)
    except (ValueError, RecursionError) as e:
        raise bad_request(f"malformed JSON: {e}") from None


def _no_constants(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _encode(encode, *args) -> list[int]:
    try:
        prompt = encode(*args)
    except PromptError as e:
        raise bad_request(str(e), param="prompt") from None
    if not prompt:
        raise bad_request("the prompt encodes to no tokens", param="prompt")
    return prompt


def _sampling_for(state: ServerState, body, prompt: list[int], max_tokens: int | None) -> SamplingConfig:
    """The model's sampling defaults with the request's overrides, and a length that fits the cache."""
    L, context, n = state.canvas_length, state.worker.max_length, len(prompt)
    fixed = state.codec.fixed_max_tokens
    if fixed is not None:
        if max_tokens not in (None, fixed):
            raise bad_request(f"max_tokens: a {state.codec.task} answer is exactly {fixed} tokens", param="max_tokens")
        max_tokens = fixed
    whole_canvases = (context - n) // L * L  # the engine reserves whole canvases
    if whole_canvases < 1:
        raise bad_request(f"the prompt is {n} tokens; the context holds {context}, and a canvas of {L} tokens "
                          f"must fit after the prompt", param="prompt", code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(state.sampling.max_new_tokens, whole_canvases)
    elif max_tokens > whole_canvases:
        raise bad_request(f"max_tokens {max_tokens} does not fit: the prompt is {n} tokens, the context holds "
                          f"{context}, and output is made in canvases of {L}, so at most {whole_canvases} tokens "
                          f"can follow this prompt", param="max_tokens", code="context_length_exceeded")
    try:
        return state.sampling.replace(max_new_tokens=max_tokens, max_denoising_steps=body.steps,
                                      entropy_bound=body.entropy_bound, t_min=body.t_min, t_max=body.t_max,
                                      fixed_steps=body.fixed_steps)
    except ConfigError as e:  # the fields are valid alone but not together, e.g. t_min > t_max
        raise bad_request(str(e)) from None


# -- generation ---------------------------------------------------------------------------------------

async def _constraint_for(state: ServerState, body):
    """The request's response_format as a token automaton (None for plain text); a schema outside the
    supported subset is a 400 that names the keyword."""
    from dgemma.structured import ConstraintError, SchemaError

    structured = body.structured
    if structured is None:
        return None
    if state.codec.task != "text":
        raise bad_request(f"response_format: a {state.codec.task} model writes its own answer format; "
                          f"only {{\"type\": \"text\"}} applies", param="response_format")
    kind, schema = structured
    try:  # the first request with a schema builds its automaton: seconds on a large vocabulary
        return await asyncio.to_thread(state.codec.constraint, kind, schema)
    except SchemaError as e:
        raise bad_request(f"response_format.json_schema.schema: {e}", param="response_format",
                          code="unsupported_schema") from None
    except ConstraintError as e:
        raise bad_request(f"response_format: {e}", param="response_format") from None


async def _generate(state: ServerState, request: Request, body, prompt: list[int], max_tokens: int | None,
                    *, chat: bool):
    sampling = _sampling_for(state, body, prompt, max_tokens)
    constraint = await _constraint_for(state, body)
    try:
        stream = state.worker.submit(prompt, sampling, seed=body.seed, want_drafts=body.include_drafts,
                                     constraint=constraint)
    except QueueFull as e:
        raise APIError(429, f"the server is busy ({e}); retry later", type="rate_limit_error", code="queue_full",
                       headers={"Retry-After": str(state.worker.retry_after())}) from None
    except ValueError as e:  # the engine's own length check
        raise bad_request(str(e), code="context_length_exceeded") from None
    except RuntimeError as e:
        raise APIError(503, str(e), type="server_error") from None
    writer = ChunkWriter(chat, state.model_name)
    assembler = TextAssembler(state.codec, body.stop or [])
    if body.stream:
        cancel = BackgroundTask(state.worker.cancel, stream)  # runs when the response ends or the client leaves
        return StreamingResponse(_stream_chunks(state, body, stream, writer, assembler, len(prompt)),
                                 media_type="text/event-stream", background=cancel,
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    watcher = asyncio.create_task(_cancel_on_disconnect(request, state.worker, stream))
    try:
        parts, reason = [], None
        async for kind, value in _outputs(state, stream, assembler):
            if kind == "text":
                parts.append(value)
            elif kind == "end":
                reason = value
    finally:
        watcher.cancel()
        state.worker.cancel(stream)
    counts = usage(len(prompt), len(assembler.tokens))
    return writer.response("".join(parts), reason, counts, _stats(state, stream, prompt, assembler))


async def _outputs(state: ServerState, stream: RequestStream, assembler: TextAssembler
                   ) -> AsyncIterator[tuple[str, object]]:
    """("draft", payload) / ("text", delta) / ("end", finish_reason), from the request's engine events."""
    while True:
        item = await stream.next()
        if item.kind == "error":
            raise APIError(500, item.message, type="server_error")
        if item.kind == "draft":
            yield "draft", _draft_payload(state.codec, item)
        elif item.kind == "canvas":
            text = assembler.add(item.tokens)
            if text:
                yield "text", text
            if assembler.stopped:  # a stop string: the rest is not wanted, free the row now
                state.worker.cancel(stream)
                yield "end", "stop"
                return
        elif item.kind == "finished":
            tail = assembler.flush()
            if tail:
                yield "text", tail
            yield "end", "length" if item.finish_reason == "length" else "stop"
            return


async def _stream_chunks(state, body, stream, writer: ChunkWriter, assembler, prompt_tokens: int):
    try:
        first = writer.first()
        if first is not None:
            yield _sse(first)
        async for kind, value in _outputs(state, stream, assembler):
            if kind == "draft":
                yield _sse(writer.draft(value))
            elif kind == "text":
                yield _sse(writer.text(value))
            else:
                yield _sse(writer.finish(value, _stats(state, stream, stream.request.prompt, assembler)))
                if body.include_usage:
                    yield _sse(writer.usage_chunk(usage(prompt_tokens, len(assembler.tokens))))
    except APIError as e:  # the headers are gone; the error travels as an event (the client raises it)
        yield _sse(e.body())
    finally:
        state.worker.cancel(stream)  # the client left mid-stream: free the row at once
    yield "data: [DONE]\n\n"


async def _cancel_on_disconnect(request: Request, worker: EngineWorker, stream: RequestStream):
    """After the body is read, the next message is the disconnect: a client that gave up frees its row."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            worker.cancel(stream)
            return


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _draft_payload(codec, event) -> dict:
    return {"canvas": event.canvas_index, "step": event.step + 1, "tokens": event.tokens,
            "pieces": [codec.piece(t) for t in event.tokens],
            "entropy": [round(e, 4) for e in event.entropy], "accepted": event.accepted}


def _stats(state: ServerState, stream: RequestStream, prompt: list[int], assembler: TextAssembler) -> dict:
    request = stream.request
    stats = {"seed": request.seed, **request.stats()}
    verdict = state.codec.check_answer(prompt, assembler.tokens)
    if verdict is not None:
        stats[state.codec.task] = verdict
    return stats


def _model_card(state: ServerState) -> dict:
    s = state.sampling
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "dgemma",
            "dgemma": {"task": state.codec.task, "canvas_length": state.canvas_length,
                       "vocab_size": state.codec.vocab_size, "max_length": state.worker.max_length,
                       "max_batch": state.worker.max_batch, "max_queue": state.worker.max_queue,
                       "defaults": {"steps": s.max_denoising_steps, "entropy_bound": s.entropy_bound,
                                    "t_min": s.t_min, "t_max": s.t_max, "max_tokens": s.max_new_tokens}}}


# -- errors in OpenAI's shape -------------------------------------------------------------------------

def _add_error_handlers(app: FastAPI):
    @app.exception_handler(APIError)
    async def api_error(request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, error: StarletteHTTPException):
        kind = "invalid_request_error" if error.status_code < 500 else "server_error"
        message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        return JSONResponse(error_body(message.get(error.status_code, str(error.detail)), kind),
                            status_code=error.status_code, headers=getattr(error, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {"msg": "invalid request"}
        return JSONResponse(error_body(str(first.get("msg"))), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(request, error: Exception):
        return JSONResponse(error_body(f"internal error: {type(error).__name__}", "server_error"), status_code=500)
