"""The HTTP layer under the routes: request bodies read as JSON within a size limit, a path parameter for
any model id, every error as a response in OpenAI's shape, server-sent events."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.convertors import Convertor, register_url_convertor
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from dgemma.serving.errors import APIError, bad_request, error_body, validation_error

log = logging.getLogger("dgemma.serve")


class AnyText(Convertor):
    """A path parameter that is any text, "/" and line breaks included (Starlette's `path` stops at a line
    break, so an id holding one found no route: a 404 instead of the model_not_found every other id gets)."""

    regex = "(?s:.+)"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("any_text", AnyText())


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


def _no_constants(name: str):
    raise ValueError(f"{name} is not valid JSON")


def sse(payload: dict) -> str:
    """One server-sent event: `payload` as compact JSON."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


# -- errors in OpenAI's shape -------------------------------------------------------------------------

def add_error_handlers(app: FastAPI):
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
