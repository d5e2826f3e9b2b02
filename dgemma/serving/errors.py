"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, and the 400 that names the
field a request body got wrong."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException


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


def parse(model: type[BaseModel], body: Any):
    """Validate a decoded JSON body as the routes do; any problem becomes a 400 that names the field."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False)) from None
