"""Errors in OpenAI's shape: every 4xx and 5xx of the server is {"error": {"message", "type", "param", "code"}}.

A route raises `APIError` (`bad_request` for a 400); a request body that fails validation gets the 400 that
names the field it got wrong (`validation_error`), not FastAPI's 422; an unexpected exception is a 500 that
keeps the connection open (`InternalErrors`). `add_error_handlers` installs them all on an app.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from dgemma.serving.request_checks import UNSUPPORTED_FIELD

log = logging.getLogger("dgemma.serve")


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
    if error["type"] == UNSUPPORTED_FIELD:
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


# -- the handlers ---------------------------------------------------------------------------------------

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
