"""The HTTP side: OpenAI-compatible routes, the playground page, errors in OpenAI's shape.

Routes
  GET  /                      the playground (static files in ./static, no network needed)
  GET  /health                {"status": "ok", "step": "eager" | "compiling" | "compiled", "active", ...};
                              no API key needed; 503 {"status": "draining"} while stopping (lifecycle.py)
  GET  /metrics               Prometheus text format (metrics.py); the API key applies
  GET  /openapi.json          the API's schema: request bodies are the models that validate them (requests.py),
                              responses the models that build them (responses.py); the API key applies
  GET  /docs                  Swagger UI over /openapi.json (served from here, no CDN)
  GET  /v1/models             the served model, with a `dgemma` field (task, canvas, defaults), and its LoRA
                              adapters (`dgemma serve --lora NAME=PATH`), each by name with its `parent`
  POST /v1/completions        prompt(s) -> text; stream: true for server-sent events; with `logprobs`
                              (max_tokens 0 or 1) the prompts are scored instead (engine/scoring.py)
  POST /v1/chat/completions   messages -> reply, through the model's chat template; user messages may
                              hold images (image_url parts) when the model has a vision tower

A request body is validated by its model (requests.py, request_checks.py), translated into what the engine
takes (engine_inputs.py) and run through the engine by completions.py; every failure a client can cause is a
4xx in OpenAI's error shape (errors.py), and the server keeps running.
"""

from __future__ import annotations

import contextlib
import hmac
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, Request, Security
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from fastapi.security import HTTPBearer
from fastapi.staticfiles import StaticFiles

from dgemma.chat.codec import PromptError
from dgemma.compilation.steps import is_compiled
from dgemma.serving import openapi
from dgemma.serving import responses as bodies
from dgemma.serving.completions import echo_only, generate, score
from dgemma.serving.engine_inputs import image_urls, template_messages, template_variables, tool_constraint
from dgemma.serving.errors import APIError, add_error_handlers, bad_request
from dgemma.serving.health import Health
from dgemma.serving.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from dgemma.serving.middleware import JSONBodyRoute, Traffic, TrafficMiddleware
from dgemma.serving.requests import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from dgemma.serving.state import ServerState

STATIC = Path(__file__).parent / "static"


def create_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.worker.start()
        yield
        state.worker.stop()

    # /openapi.json and /docs are routes of their own (_add_pages): they follow the API key, and /docs is served
    # without a CDN
    app = FastAPI(title="dgemma", summary="OpenAI-compatible serving of DiffusionGemma, a block-diffusion model",
                  version=_version(), lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.dgemma = state
    add_error_handlers(app)
    _add_metrics(app, state)
    key = Depends(_api_key_check(state))
    _add_pages(app, state, key)
    app.include_router(_v1_routes(state, key))
    app.include_router(_tokenizer_routes(state, key))
    return app


def _add_pages(app: FastAPI, state: ServerState, key):
    """The playground, /health, and the API's schema with Swagger UI over it."""

    @app.get("/", include_in_schema=False)
    async def playground():
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    app.mount("/swagger-ui", StaticFiles(directory=openapi.swagger_ui_folder()), name="swagger-ui")

    @app.get("/health", response_model=None, responses={200: {"model": Health},
                                                        503: {"model": Health, "description": "stopped"}})
    async def health():
        """Whether the engine runs, and its load. No API key needed."""
        ok = state.worker.alive and not state.traffic.draining
        status = "ok" if ok else "draining" if state.traffic.draining else "unavailable"
        body = Health(status=status, model=state.model_name, step=_step_kind(state), **state.worker.load())
        return JSONResponse(body.wire(), status_code=200 if ok else 503)

    @app.get("/metrics", include_in_schema=False, dependencies=[key])
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/openapi.json", include_in_schema=False, dependencies=[key])
    async def openapi_schema():
        return JSONResponse(_openapi(app))

    @app.get("/docs", include_in_schema=False)
    async def docs():
        return HTMLResponse(openapi.DOCS_PAGE, headers={"Cache-Control": "no-cache"})


def _v1_routes(state: ServerState, key) -> APIRouter:
    """OpenAI's routes: the model list, completions and chat completions."""
    v1 = APIRouter(prefix="/v1", dependencies=[key], route_class=JSONBodyRoute)

    @v1.get("/models", response_model=None, responses={200: {"model": bodies.ModelList},
                                                       **openapi.error_responses(401)})
    async def models():
        """The served model, with a `dgemma` field: task, canvas, images, limits and sampler defaults; then
        its LoRA adapters (`dgemma serve --lora NAME=PATH`)."""
        cards = [_model_card(state).wire()] + [_adapter_card(state, n) for n in state.adapters]
        return {"object": "list", "data": cards}

    # any_text: middleware.AnyText, so that every id (line breaks included) reaches the check
    @v1.get("/models/{model_id:any_text}", response_model=None,
            responses={200: {"model": bodies.ModelCard}, **openapi.error_responses(401, 404)})
    async def model(model_id: str):
        """The served model's card, or an adapter's; another id is a 404 (model_not_found)."""
        adapter = _check_model(state, model_id)
        return _model_card(state).wire() if adapter == 0 else _adapter_card(state, model_id)

    @v1.post("/completions", response_model=None,
             responses=openapi.generation_responses(bodies.Completion, bodies.CompletionChunk))
    async def completions(body: CompletionRequest, request: Request):
        """Prompts continued by the diffusion sampler, or scored (`logprobs` with max_tokens 0 or 1)."""
        adapter = _check_model(state, body.model)
        prompts = [_encode(state.codec.encode_text if isinstance(p, str) else state.codec.check_ids, p)
                   for p in body.prompt]
        # echo: the prompt as sent, or decoded from its ids
        echoes = [p if isinstance(p, str) else state.codec.decode(ids) for p, ids in zip(body.prompt, prompts)]
        if body.scoring:
            if adapter != 0:
                raise bad_request("scoring (logprobs with max_tokens 0 or 1) runs the base model only; send the "
                                  "base model's name", param="model")
            return await score(state, request, body, prompts, echoes)
        if body.max_tokens == 0:
            return echo_only(state, body, prompts, echoes)
        return await generate(state, request, body, prompts, chat=False, echoes=echoes if body.echo else None,
                              adapter=adapter)

    @v1.post("/chat/completions", response_model=None,
             responses=openapi.generation_responses(bodies.ChatCompletion, bodies.ChatCompletionChunk))
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        """Messages through the model's chat template (images, tools, thinking), answered by the sampler."""
        adapter = _check_model(state, body.model)
        variables = template_variables(body)
        images = await _images(state, body)
        prompt = _encode(state.codec.encode_chat, template_messages(body), variables)
        if images is not None:
            prompt = state.images.expand(prompt, images)
        constraint = await tool_constraint(state, body, variables)
        return await generate(state, request, body, [prompt], chat=True, parse_tools=body.tool_mode != "none",
                              tools_constraint=constraint, images=images, adapter=adapter)

    return v1


def _tokenizer_routes(state: ServerState, key) -> APIRouter:
    """The tokenizer, as vLLM serves it: lm-eval's local-completions finds these and counts with them."""
    tokenizer = APIRouter(dependencies=[key], route_class=JSONBodyRoute)

    @tokenizer.get("/tokenizer_info", response_model=None,
                   responses={200: {"model": bodies.TokenizerInfo}, **openapi.error_responses(401)})
    async def tokenizer_info():
        """The tokenizer's special tokens and chat template (text models; 404 otherwise)."""
        tok = _text_tokenizer(state)
        return bodies.TokenizerInfo(
            tokenizer_class="dgemma", bos_token=tok.bos_token, eos_token=tok.eos_token,
            pad_token=tok.backend.id_to_token(state.sampling.pad_token_id), chat_template=tok.chat_template,
            model_max_length=state.worker.max_length).wire()

    @tokenizer.post("/tokenize", response_model=None,
                    responses={200: {"model": bodies.Tokens}, **openapi.error_responses(400, 401, 404, 413)})
    async def tokenize(body: TokenizeRequest):
        """Text to token ids, as vLLM's route."""
        _check_model(state, body.model)
        tokens = _text_tokenizer(state).encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return bodies.Tokens(count=len(tokens), max_model_len=state.worker.max_length, tokens=tokens,
                             token_strs=None).wire()

    @tokenizer.post("/detokenize", response_model=None,
                    responses={200: {"model": bodies.Detokenized}, **openapi.error_responses(400, 401, 404, 413)})
    async def detokenize(body: DetokenizeRequest):
        """Token ids to text, special tokens written out."""
        _check_model(state, body.model)
        tok = _text_tokenizer(state)
        ids = _encode(state.codec.check_ids, body.tokens) if body.tokens else []
        return bodies.Detokenized(prompt=tok.decode(ids, skip_special_tokens=False)).wire()

    return tokenizer


def _add_metrics(app: FastAPI, state: ServerState):
    """The app's own registry (metrics.py), fed by the engine worker and by the outermost middleware."""
    if state.metrics is None:
        state.metrics = ServerMetrics(state.model_name)
    if state.traffic is None:
        state.traffic = Traffic(state.metrics)
    state.metrics.watch(state.worker, lambda: _step_kind(state))
    state.metrics.model_of = lambda request: state.served_name(request.adapter)
    state.worker.observer = state.metrics
    app.add_middleware(TrafficMiddleware, traffic=state.traffic)  # added last: outermost


def _step_kind(state: ServerState) -> str:
    if state.step_kind is not None:
        return state.step_kind()
    return "compiled" if is_compiled(state.worker.model) else "eager"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dgemma")
    except PackageNotFoundError:
        return "0"


def _openapi(app: FastAPI) -> dict:
    """The schema, built once: request bodies from requests.py's models, responses from responses.py's."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes,
                             description="dgemma's extensions ride in the OpenAI bodies: the diffusion sampler's "
                                         "`sampler`, `steps`, `entropy_bound`, `accept_order`, `t_min`, `t_max`, "
                                         "`fixed_steps`, `step_cache` and block refinement's and DDIM's settings; "
                                         "`stream_options.include_drafts`; a `dgemma` object in every answer. "
                                         "See docs/serving.md.")
        app.openapi_schema = openapi.without_422(openapi.add_stream_chunks(schema))
    return app.openapi_schema


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


def _check_model(state: ServerState, name: str | None) -> int:
    """The served model `name` asks for: 0 the base model (also for no name), i the adapter state.adapters[i - 1];
    a 404 in OpenAI's shape for any other name."""
    if name is None or name == state.model_name:
        return 0
    if name in state.adapters:
        return state.adapters.index(name) + 1
    served = ", ".join(repr(n) for n in (state.model_name, *state.adapters))
    raise APIError(404, f"model {name!r} does not exist; this server serves {served}", param="model",
                   code="model_not_found")


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
    urls = image_urls(body)
    if not urls:
        return None
    if state.images is None:
        raise bad_request("messages: this model has no vision tower: it does not accept images", param="messages",
                          code="images_not_supported")
    return await state.images.read(urls)


def _model_card(state: ServerState) -> bodies.ModelCard:
    s = state.sampling
    images = state.images.card() if state.images is not None else {"accepted": False}
    defaults = bodies.Defaults(sampler=s.sampler, steps=s.max_denoising_steps, entropy_bound=s.entropy_bound,
                               accept_order=s.accept_order, t_min=s.t_min,
                               t_max=s.t_max, max_tokens=s.max_new_tokens)
    extra = bodies.ModelCardExtra(task=state.codec.task, canvas_length=state.canvas_length,
                                  images=bodies.ImagesCard(**images), vocab_size=state.codec.vocab_size,
                                  max_length=state.worker.max_length, max_batch=state.worker.max_batch,
                                  max_queue=state.worker.max_queue, defaults=defaults)
    return bodies.ModelCard(id=state.model_name, object="model", created=state.created, owned_by="dgemma",
                            dgemma=extra)


def _adapter_card(state: ServerState, name: str) -> dict:
    """A LoRA adapter in /v1/models, with its `parent` (the base model) as vLLM lists them."""
    i = state.adapters.index(name)
    return {"id": name, "object": "model", "created": state.created, "owned_by": "dgemma",
            "parent": state.model_name, "root": state.adapter_paths[i] if state.adapter_paths else None,
            "dgemma": {"kind": "lora"}}
