"""The HTTP side: OpenAI-compatible routes, the playground page, errors in OpenAI's shape.

Routes
  GET  /                      the playground (static files in ./static, no network needed)
  GET  /health                {"status": "ok", "active", "waiting", ...}; no API key needed
  GET  /openapi.json          the API's schema: request bodies are the models that validate them (protocol.py),
                              responses are described in openapi.py; the API key applies
  GET  /docs                  Swagger UI over /openapi.json (served from here, no CDN)
  GET  /v1/models             the one served model, with a `dgemma` field (task, canvas, defaults)
  POST /v1/completions        prompt(s) -> text; stream: true for server-sent events; with `logprobs`
                              (max_tokens 0 or 1) the prompts are scored instead (engine/scoring.py)
  POST /v1/chat/completions   messages -> reply, through the model's chat template; user messages may
                              hold images (image_url parts) when the model has a vision tower

A request becomes one engine request per prompt and choice (`n`, see worker.py); its committed canvases
become text through `TextAssembler`, a chat answer's text becomes reasoning, content and tool calls through
`ChatOutput` (chat_output.py), its drafts (only when asked for) become `dgemma_draft` chunks (protocol.py).
A constraint (response_format, structured_outputs.regex, a required or named tool_choice) is a token
automaton that rides along with the engine request.
Every failure a client can cause is a 4xx in OpenAI's error shape; the server keeps running.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from fastapi.security import HTTPBearer
from fastapi.staticfiles import StaticFiles
from starlette.background import BackgroundTask
from starlette.convertors import Convertor, register_url_convertor
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from dgemma.config import ConfigError, SamplingConfig
from dgemma.serving.chat_output import ChatOutput
from dgemma.serving.codec import Codec, PromptError, TextAssembler
from dgemma.serving import openapi
from dgemma.serving.image_urls import ImageReader
from dgemma.serving.chat_protocol import ChatCompletionRequest
from dgemma.serving.errors import APIError, bad_request, error_body, validation_error
from dgemma.serving.protocol import CompletionRequest, DetokenizeRequest, TokenizeRequest
from dgemma.serving.responses import ChunkWriter, usage
from dgemma.serving.scores import scored_choice
from dgemma.serving.tool_schema import calls_constraint
from dgemma.serving.worker import EngineWorker, QueueFull, RequestStream
from dgemma.structured import ConstraintError, SchemaError, VocabularyError

STATIC = Path(__file__).parent / "static"
log = logging.getLogger("dgemma.serve")
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
    images: ImageReader | None = None  # None: the model reads no images
    created: int = field(default_factory=lambda: int(time.time()))


def create_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.worker.start()
        yield
        state.worker.stop()

    # /openapi.json and /docs are routes of their own below: they follow the API key, and /docs is served
    # without a CDN
    app = FastAPI(title="dgemma", summary="OpenAI-compatible serving of DiffusionGemma, a block-diffusion model",
                  version=_version(), lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.dgemma = state
    _add_error_handlers(app)
    key = Depends(_api_key_check(state))

    @app.get("/", include_in_schema=False)
    async def playground():
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    app.mount("/swagger-ui", StaticFiles(directory=openapi.swagger_ui_folder()), name="swagger-ui")

    @app.get("/health", response_model=None, responses={200: {"model": openapi.Health},
                                                        503: {"model": openapi.Health, "description": "stopped"}})
    async def health():
        """Whether the engine runs, and its load. No API key needed."""
        ok = state.worker.alive
        return JSONResponse({"status": "ok" if ok else "unavailable", "model": state.model_name,
                             **state.worker.load()}, status_code=200 if ok else 503)

    @app.get("/openapi.json", include_in_schema=False, dependencies=[key])
    async def openapi_schema():
        return JSONResponse(_openapi(app))

    @app.get("/docs", include_in_schema=False)
    async def docs():
        return HTMLResponse(openapi.DOCS_PAGE, headers={"Cache-Control": "no-cache"})

    v1 = APIRouter(prefix="/v1", dependencies=[key], route_class=JSONBodyRoute)

    @v1.get("/models", response_model=None, responses={200: {"model": openapi.ModelList},
                                                       **openapi.error_responses(401)})
    async def models():
        """The one served model, with a `dgemma` field: task, canvas, images, limits and sampler defaults."""
        return {"object": "list", "data": [_model_card(state)]}

    @v1.get("/models/{model_id:any_text}", response_model=None,
            responses={200: {"model": openapi.ModelCard}, **openapi.error_responses(400, 401)})
    async def model(model_id: str):
        """The served model's card; another id is a 400 (model_not_found)."""
        _check_model(state, model_id)
        return _model_card(state)

    @v1.post("/completions", response_model=None,
             responses=openapi.generation_responses(openapi.Completion, openapi.CompletionChunk))
    async def completions(body: CompletionRequest, request: Request):
        """Prompts continued by the diffusion sampler, or scored (`logprobs` with max_tokens 0 or 1)."""
        _check_model(state, body.model)
        prompts = [_encode(state.codec.encode_text if isinstance(p, str) else state.codec.check_ids, p)
                   for p in body.prompt]
        # echo: the prompt as sent, or decoded from its ids
        echoes = [p if isinstance(p, str) else state.codec.decode(ids) for p, ids in zip(body.prompt, prompts)]
        if body.scoring:
            return await _score(state, request, body, prompts, echoes)
        if body.max_tokens == 0:
            return _echo_only(state, body, prompts, echoes)
        return await _generate(state, request, body, prompts, body.max_tokens, chat=False,
                               echoes=echoes if body.echo else None)

    @v1.post("/chat/completions", response_model=None,
             responses=openapi.generation_responses(openapi.ChatCompletion, openapi.ChatCompletionChunk))
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        """Messages through the model's chat template (images, tools, thinking), answered by the sampler."""
        _check_model(state, body.model)
        template_kwargs = body.template_kwargs()
        images = await _images(state, body)
        prompt = _encode(state.codec.encode_chat, body.chat(), template_kwargs)
        if images is not None:
            prompt = state.images.expand(prompt, images)
        constraint = await _tool_constraint(state, body, template_kwargs)
        return await _generate(state, request, body, [prompt], body.token_limit, chat=True,
                               parse_tools=body.tool_mode != "none", constraint=constraint, images=images)

    # the tokenizer, as vLLM serves it: lm-eval's local-completions finds these and counts with them
    tokenizer = APIRouter(dependencies=[key], route_class=JSONBodyRoute)

    @tokenizer.get("/tokenizer_info", response_model=None,
                   responses={200: {"model": openapi.TokenizerInfo}, **openapi.error_responses(401)})
    async def tokenizer_info():
        """The tokenizer's special tokens and chat template (text models; 404 otherwise)."""
        tok = _text_tokenizer(state)
        return {"tokenizer_class": "dgemma", "bos_token": tok.bos_token, "eos_token": tok.eos_token,
                "pad_token": tok.backend.id_to_token(state.sampling.pad_token_id), "chat_template": tok.chat_template,
                "model_max_length": state.worker.max_length}

    @tokenizer.post("/tokenize", response_model=None,
                    responses={200: {"model": openapi.Tokens}, **openapi.error_responses(400, 401, 413)})
    async def tokenize(body: TokenizeRequest):
        """Text to token ids, as vLLM's route."""
        _check_model(state, body.model)
        tokens = _text_tokenizer(state).encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": state.worker.max_length, "tokens": tokens, "token_strs": None}

    @tokenizer.post("/detokenize", response_model=None,
                    responses={200: {"model": openapi.Detokenized}, **openapi.error_responses(400, 401, 413)})
    async def detokenize(body: DetokenizeRequest):
        """Token ids to text, special tokens written out."""
        _check_model(state, body.model)
        tok = _text_tokenizer(state)
        ids = _encode(state.codec.check_ids, body.tokens) if body.tokens else []
        return {"prompt": tok.decode(ids, skip_special_tokens=False)}

    app.include_router(v1)
    app.include_router(tokenizer)
    return app


class AnyText(Convertor):
    """A path parameter that is any text, "/" and line breaks included (Starlette's `path` stops at a line
    break, so an id holding one found no route: a 404 instead of the model_not_found every other id gets)."""

    regex = "(?s:.+)"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("any_text", AnyText())


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dgemma")
    except PackageNotFoundError:
        return "0"


def _openapi(app: FastAPI) -> dict:
    """The schema, built once: request bodies from protocol.py's models, responses from openapi.py's."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes,
                             description="dgemma's extensions ride in the OpenAI bodies: the diffusion sampler's "
                                         "`steps`, `entropy_bound`, `t_min`, `t_max`, `fixed_steps`; "
                                         "`stream_options.include_drafts`; a `dgemma` object in every answer. "
                                         "See docs/serving.md.")
        app.openapi_schema = openapi.without_422(openapi.add_stream_chunks(schema))
    return app.openapi_schema


class JSONBodyRequest(Request):
    """A request whose body is read at most --max-body-bytes far (413 past that, declared or counted while
    reading a chunked body) and parsed as JSON whatever its Content-Type says (curl -d calls it a form),
    NaN and Infinity refused; FastAPI then validates it with the route's model."""

    @property
    def headers(self) -> Headers:
        if not hasattr(self, "_json_headers"):
            raw = [(k, v) for k, v in self.scope["headers"] if k != b"content-type"]
            self._json_headers = Headers(raw=[*raw, (b"content-type", b"application/json")])
        return self._json_headers

    async def body(self) -> bytes:
        if not hasattr(self, "_body"):
            limit = self.app.state.dgemma.max_body_bytes
            too_large = APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
            declared = super().headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise too_large
            chunks, size = [], 0
            async for chunk in self.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
            self._body = b"".join(chunks)
        return self._body

    async def json(self):
        if not hasattr(self, "_json"):
            raw = await self.body()
            if not raw.strip():
                raise bad_request("the request body is empty; expected a JSON object")
            try:
                self._json = json.loads(raw, parse_constant=_no_constants)
            except (ValueError, RecursionError) as e:
                raise bad_request(f"malformed JSON: {e}") from None
        return self._json


class JSONBodyRoute(APIRoute):
    def get_route_handler(self):
        handler = super().get_route_handler()

        async def with_json_body(request: Request):
            return await handler(JSONBodyRequest(request.scope, request.receive))

        return with_json_body


def _text_tokenizer(state: ServerState):
    if state.codec.task != "text":
        raise APIError(404, f"a {state.codec.task} model has no tokenizer to serve")
    return state.codec.tokenizer


# -- checks -------------------------------------------------------------------------------------------

def _api_key_check(state: ServerState):
    bearer = HTTPBearer(auto_error=False, description="the server's --api-key, when it has one")

    def check(request: Request, credentials=Security(bearer)):  # read below from the header; here for the schema
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


async def _images(state: ServerState, body: ChatCompletionRequest):
    """The request's images as the model reads them (dgemma.images.ImageInputs), or None without images."""
    urls = body.image_urls()
    if not urls:
        return None
    if state.images is None:
        raise bad_request("messages: this model has no vision tower: it does not accept images", param="messages",
                          code="images_not_supported")
    return await state.images.read(urls)


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
    eos = tuple(dict.fromkeys([*state.sampling.eos_token_ids, *sorted(state.codec.answer_ends)]))
    try:
        return state.sampling.replace(max_new_tokens=max_tokens, max_denoising_steps=body.steps,
                                      entropy_bound=body.entropy_bound, t_min=body.t_min, t_max=body.t_max,
                                      fixed_steps=body.fixed_steps, eos_token_ids=eos)
    except ConfigError as e:  # the fields are valid alone but not together, e.g. t_min > t_max
        raise bad_request(str(e)) from None


async def _tool_constraint(state: ServerState, body: ChatCompletionRequest, template_kwargs: dict):
    """tool_choice "required" or a named function: the answer must be calls with valid arguments."""
    if body.tool_mode not in ("required", "named"):
        return None
    if state.codec.task != "text":
        raise bad_request(f"tool_choice: a {state.codec.task} model does not call tools", param="tool_choice")
    tools = [(f.name, f.parameters) for f in body.allowed_tools()]
    try:  # built once per set of tools (cached), off the event loop: seconds on a large vocabulary
        return await asyncio.to_thread(
            calls_constraint, state.codec.tokenizer, state.codec.vocab_size, tools,
            several=body.tool_mode == "required" and body.parallel_tool_calls is not False,
            thought=bool(template_kwargs.get("enable_thinking")))
    except SchemaError as e:
        raise bad_request(f"tools: {e}", param="tools", code="unsupported_schema") from None
    except (VocabularyError, ConstraintError) as e:
        raise bad_request(f"tool_choice: this model cannot be constrained to Gemma 4's tool calls: {e}",
                          param="tool_choice") from None


# -- generation ---------------------------------------------------------------------------------------

async def _constraint_for(state: ServerState, body):
    """The request's response_format as a token automaton (None for plain text); a schema outside the
    supported subset is a 400 that names the keyword."""
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
        field = "structured_outputs" if kind == "regex" else "response_format"
        raise bad_request(f"{field}: {e}", param=field) from None


@dataclass
class Choice:
    """One answer of a request (n > 1: one per seed) and what turns its tokens into output."""

    index: int
    stream: RequestStream
    assembler: TextAssembler  # tokens -> text deltas, stop strings
    output: ChatOutput | None  # chat: text -> reasoning, content, tool calls
    echo: str = ""  # a completion with echo: the prompt's text, sent first


async def _generate(state: ServerState, request: Request, body, prompts: list[list[int]], max_tokens: int | None,
                    *, chat: bool, parse_tools: bool = False, constraint=None, echoes: list[str] | None = None,
                    images=None):
    """Every prompt gets n choices, indexed prompt * n + choice (OpenAI's order); `echoes`: each prompt's
    text, to send before its choices' own; `images`: a chat prompt's ImageInputs."""
    samplings = [_sampling_for(state, body, prompt, max_tokens) for prompt in prompts]
    answer_format = await _constraint_for(state, body)
    if answer_format is not None and constraint is not None:
        raise bad_request("tool_choice: a required or named tool_choice writes the answer itself; send "
                          "tool_choice \"auto\" or \"none\" with a response_format", param="tool_choice")
    streams = _submit(state, body, prompts, samplings, constraint or answer_format, images)
    decode = state.codec.decode_chat if chat else state.codec.decode
    choices = [Choice(i, stream, TextAssembler(decode, body.stop or [], state.codec.unsettled),
                      ChatOutput(parse_tools) if chat else None, echoes[i // body.choices] if echoes else "")
               for i, stream in enumerate(streams)]
    writer = ChunkWriter(chat, state.model_name)
    prompt_tokens = sum(len(p) for p in prompts)
    if body.stream:
        cancel = BackgroundTask(_cancel_all, state.worker, streams)  # runs when the response ends or the client leaves
        return StreamingResponse(_stream_chunks(state, body, choices, writer, prompt_tokens),
                                 media_type="text/event-stream", background=cancel,
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    watcher = asyncio.create_task(_cancel_on_disconnect(request, state.worker, streams))
    try:
        answers = await asyncio.gather(*(_answer(state, choice) for choice in choices))
    finally:
        watcher.cancel()
        _cancel_all(state.worker, streams)
    counts = usage(prompt_tokens, sum(len(c.assembler.tokens) for c in choices))
    stats = _stats(state, choices[0])
    if len(choices) > 1:
        stats["choices"] = [_stats(state, c) for c in choices]
    return writer.response(answers, counts, stats)


def _submit(state: ServerState, body, prompts: list[list[int]], samplings: list[SamplingConfig], constraint,
            images=None) -> list[RequestStream]:
    """One engine request per prompt and choice, a prompt's choices seeded seed, seed+1, ... (random when
    none is given); all or none."""
    n = body.choices
    if n * len(prompts) > state.worker.max_queue:
        raise bad_request(f"at most {state.worker.max_queue} prompts times n choices fit this server's queue",
                          param="n" if len(prompts) == 1 else "prompt")
    base = body.seed if body.seed is not None else secrets.randbits(63)
    streams: list[RequestStream] = []
    with _engine_errors(state):
        try:
            for prompt, sampling in zip(prompts, samplings):
                for i in range(n):
                    streams.append(state.worker.submit(prompt, sampling, seed=(base + i) % 2**63,
                                                       constraint=constraint, want_drafts=body.include_drafts,
                                                       images=images))
        except BaseException:
            _cancel_all(state.worker, streams)
            raise
    return streams


@contextlib.contextmanager
def _engine_errors(state: ServerState):
    """What submitting to the engine raises, as the client's errors: queue full, too long, not running."""
    try:
        yield
    except QueueFull as e:
        raise APIError(429, f"the server is busy ({e}); retry later", type="rate_limit_error", code="queue_full",
                       headers={"Retry-After": str(state.worker.retry_after())}) from None
    except ValueError as e:  # the engine's own length check
        raise bad_request(str(e), code="context_length_exceeded") from None
    except RuntimeError as e:
        raise APIError(503, str(e), type="server_error") from None


async def _score(state: ServerState, request: Request, body: CompletionRequest, prompts: list[list[int]],
                 echoes: list[str]):
    """Score the prompts together (engine/scoring.py): one choice per prompt, in OpenAI's logprobs shape."""
    too_long = [len(p) for p in prompts if len(p) > state.worker.max_length]
    if too_long:
        raise bad_request(f"a prompt of {too_long[0]} tokens does not fit: the context holds "
                          f"{state.worker.max_length}", param="prompt", code="context_length_exceeded")
    if len(prompts) > state.worker.max_queue:
        raise bad_request(f"at most {state.worker.max_queue} prompts fit this server's queue", param="prompt")
    with _engine_errors(state):
        streams = state.worker.submit_scoring(prompts, body.logprobs)
    watcher = asyncio.create_task(_cancel_on_disconnect(request, state.worker, streams))
    try:
        for stream in streams:
            while (item := await stream.next()).kind != "finished":
                if item.kind == "error":
                    raise APIError(500, item.message, type="server_error")
            if item.finish_reason != "scored":
                raise APIError(500, "the request was cancelled", type="server_error")
    finally:
        watcher.cancel()
        _cancel_all(state.worker, streams)
    writer = ChunkWriter(False, state.model_name)
    choices = [scored_choice(state.codec, prompt, echo, stream.request.scores, echo=body.echo,
                             next_token=body.max_tokens == 1, top=body.logprobs)
               for prompt, echo, stream in zip(prompts, echoes, streams)]
    counts = usage(sum(len(p) for p in prompts), len(prompts) * body.max_tokens)
    stats = {"elapsed_s": time.perf_counter() - streams[0].request.t_submit}
    return writer.response([(c["text"], "length") for c in choices], counts, stats,
                           logprobs=[c["logprobs"] for c in choices])


def _echo_only(state: ServerState, body: CompletionRequest, prompts: list[list[int]], echoes: list[str]):
    """max_tokens 0 without logprobs: nothing to generate; the prompts themselves when echoed."""
    if body.stream:
        raise bad_request("max_tokens 0 writes nothing to stream; send stream: false", param="stream")
    texts = [echo if body.echo else "" for echo in echoes for _ in range(body.choices)]
    counts = usage(sum(len(p) for p in prompts), 0)
    return ChunkWriter(False, state.model_name).response([(t, "length") for t in texts], counts, {})


def _cancel_all(worker: EngineWorker, streams: list[RequestStream]):
    for stream in streams:
        worker.cancel(stream)


async def _outputs(state: ServerState, choice: Choice) -> AsyncIterator[tuple[str, object]]:
    """("draft", payload) / ("content" | "reasoning", text) / ("tool_call", call) / ("end", finish_reason)."""
    stream, assembler, output = choice.stream, choice.assembler, choice.output
    while True:
        item = await stream.next()
        if item.kind == "error":
            raise APIError(500, item.message, type="server_error")
        if item.kind == "draft":
            yield "draft", _draft_payload(state.codec, item)
            continue
        if item.kind not in ("canvas", "finished"):
            continue
        ended = item.kind == "finished"
        text = assembler.flush() if ended else assembler.add(item.tokens)
        if assembler.stopped:  # a stop string: the rest is not wanted, free the row now
            state.worker.cancel(stream)
            ended = True
        if output is None:
            if text:
                yield "content", text
        else:
            for part in output.add(text) + (output.finish() if ended else []):
                yield part
        if ended:
            reason = "stop" if assembler.stopped or item.finish_reason != "length" else "length"
            yield "end", "tool_calls" if output is not None and output.calls else reason
            return


async def _answer(state: ServerState, choice: Choice) -> tuple[dict | str, str]:
    """A whole answer: (chat message or completion text, finish reason)."""
    texts, reason = [choice.echo], None
    async for kind, value in _outputs(state, choice):
        if kind == "content":
            texts.append(value)
        elif kind == "end":
            reason = value
    return (choice.output.message() if choice.output is not None else "".join(texts)), reason


async def _merged(iterators: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """(i, item) from several async iterators as their items come."""
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    pending = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.get):
                i = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(iterators[i]))] = i
                yield i, item
    finally:
        for task in pending:
            task.cancel()


async def _stream_chunks(state, body, choices: list[Choice], writer: ChunkWriter, prompt_tokens: int):
    try:
        for choice in choices:
            first = writer.first(choice.index)
            if first is not None:
                yield _sse(first)
            if choice.echo:
                yield _sse(writer.text(choice.echo, choice.index))
        calls = [0] * len(choices)  # tool calls sent so far, per choice
        async for i, (kind, value) in _merged([_outputs(state, choice) for choice in choices]):
            if kind == "draft":
                yield _sse(writer.draft(value, i))
            elif kind == "content":
                yield _sse(writer.text(value, i))
            elif kind == "reasoning":
                yield _sse(writer.reasoning(value, i))
            elif kind == "tool_call":
                yield _sse(writer.tool_call(value, calls[i], i))
                calls[i] += 1
            else:
                yield _sse(writer.finish(value, _stats(state, choices[i]), i))
        if body.include_usage:
            completion = sum(len(c.assembler.tokens) for c in choices)
            yield _sse(writer.usage_chunk(usage(prompt_tokens, completion)))
    except APIError as e:  # the headers are gone; the error travels as an event (the client raises it)
        yield _sse(e.body())
    finally:
        _cancel_all(state.worker, [c.stream for c in choices])  # the client left mid-stream: free the rows at once
    yield "data: [DONE]\n\n"


async def _cancel_on_disconnect(request: Request, worker: EngineWorker, streams: list[RequestStream]):
    """After the body is read, the next message is the disconnect: a client that gave up frees its rows."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            _cancel_all(worker, streams)
            return


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _draft_payload(codec, event) -> dict:
    return {"canvas": event.canvas_index, "step": event.step + 1, "tokens": event.tokens,
            "pieces": [codec.piece(t) for t in event.tokens],
            "entropy": [round(e, 4) for e in event.entropy], "accepted": event.accepted}


def _stats(state: ServerState, choice: Choice) -> dict:
    request = choice.stream.request
    stats = {"seed": request.seed, **request.stats()}
    verdict = state.codec.check_answer(request.prompt, choice.assembler.tokens)
    if verdict is not None:
        stats[state.codec.task] = verdict
    return stats


def _model_card(state: ServerState) -> dict:
    s = state.sampling
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "dgemma",
            "dgemma": {"task": state.codec.task, "canvas_length": state.canvas_length,
                       "images": state.images.card() if state.images is not None else {"accepted": False},
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
    async def invalid_body(request, error: RequestValidationError):  # 400 as OpenAI answers, not FastAPI's 422
        error = validation_error(list(error.errors()))
        return JSONResponse(error.body(), status_code=error.status)

    app.add_middleware(InternalErrors)


class InternalErrors:
    """An unexpected exception -> a 500 in OpenAI's shape, its traceback in the server's log.

    An ASGI middleware rather than an exception handler for `Exception`: Starlette answers such a handler's
    500 and then raises the exception again, and uvicorn closes the connection. A client's next request on
    that kept-alive connection then fails with a connection error (ReadError) instead of being served.
    Here the 500 is an ordinary response and the connection stays open. An exception after the response
    has started (mid-stream) still ends the connection: that is the only way left to tell the client."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_and_note(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        except Exception as error:
            if started:
                raise
            log.exception("internal error on %s %s", scope.get("method"), scope.get("path"))
            response = JSONResponse(error_body(f"internal error: {type(error).__name__}", "server_error"),
                                    status_code=500)
            await response(scope, receive, send)
