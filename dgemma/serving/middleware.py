"""The HTTP layer around the routes: request bodies read as JSON within a size limit, a path parameter for any
model id, and outermost the traffic: each request's id, its access-log line, its counts in /metrics, and the
gate that answers 503 while the server drains for a graceful stop (lifecycle.py). Errors in OpenAI's shape,
and their handlers, are errors.py's.

Request ids: the client's `X-Request-Id` when it sent a usable one (1-128 visible ASCII characters), else
a new random one; either way the response carries it, and the access log line names it:

    127.0.0.1:50512 "POST /v1/chat/completions HTTP/1.1" 200 1.204s request_id=3f2a...

The line goes to the "dgemma.access" logger at INFO (`dgemma serve --log-level info` shows it), written
when the response's last byte is sent, so a stream's line comes at its end with its whole duration.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import time

from fastapi import Request
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.convertors import Convertor, register_url_convertor
from starlette.datastructures import Headers

from dgemma.serving.errors import APIError, bad_request, error_body
from dgemma.serving.metrics import ServerMetrics

access_log = logging.getLogger("dgemma.access")


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


# -- traffic: request ids, the access log, /metrics, the drain gate ------------------------------------

_USABLE_ID = re.compile(r"[\x21-\x7e]{1,128}")
# routes that answer during a drain: a load balancer's health check sees it, and a last scrape counts it
_DRAIN_EXEMPT = ("/health", "/metrics")


def request_id_of(headers: list[tuple[bytes, bytes]]) -> str:
    for name, value in headers:
        if name == b"x-request-id":
            text = value.decode("latin-1").strip()
            if _USABLE_ID.fullmatch(text):
                return text
    return secrets.token_hex(16)


class Traffic:
    """The server's view of its HTTP requests: how many are in flight, and whether it is draining."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.in_flight = 0  # requests counted by the drain (not /health, /metrics)
        self.draining = False


class TrafficMiddleware:
    """ASGI middleware: request id, access log, metrics, the drain gate."""

    def __init__(self, app, traffic: Traffic):
        self.app, self.traffic = app, traffic

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        traffic, metrics = self.traffic, self.traffic.metrics
        request_id = request_id_of(scope["headers"])
        scope.setdefault("state", {})["request_id"] = request_id
        start = time.perf_counter()
        status, error_bytes = 500, []
        counted = scope["path"] not in _DRAIN_EXEMPT

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", request_id.encode())]}
            elif message["type"] == "http.response.body" and status >= 400 and len(error_bytes) < 8:
                error_bytes.append(message.get("body", b""))  # an error body is one small JSON object
            await send(message)

        if traffic.draining and counted:
            response = JSONResponse(error_body("the server is shutting down; retry on another instance",
                                               "server_error", code="shutting_down"),
                                    status_code=503, headers={"Connection": "close", "Retry-After": "5"})
            await response(scope, receive, send_with_id)
            self._record(scope, status, start, request_id, error_bytes)
            return
        if counted:
            traffic.in_flight += 1
        metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            metrics.in_flight.dec()
            if counted:
                traffic.in_flight -= 1
            self._record(scope, status, start, request_id, error_bytes)

    def _record(self, scope, status: int, start: float, request_id: str, error_bytes: list[bytes]):
        seconds = time.perf_counter() - start
        route = getattr(scope.get("route"), "path", None) or "unmatched"
        metrics = self.traffic.metrics
        metrics.requests.labels(route=route, method=scope["method"], status=str(status)).inc()
        metrics.request_seconds.labels(route=route).observe(seconds)
        if status >= 400:
            metrics.errors.labels(kind=_error_kind(b"".join(error_bytes), status)).inc()
        if access_log.isEnabledFor(logging.INFO):
            client = scope.get("client")
            where = f"{client[0]}:{client[1]}" if client else "-"
            query = f"?{scope['query_string'].decode('latin-1')}" if scope.get("query_string") else ""
            access_log.info('%s "%s %s%s HTTP/%s" %d %.3fs request_id=%s', where, scope["method"], scope["path"],
                            query, scope.get("http_version", "1.1"), status, seconds, request_id)


def _error_kind(body: bytes, status: int) -> str:
    """An error response's kind: its OpenAI `code`, else its `type`, else the status."""
    try:
        error = json.loads(body)["error"]
        return str(error.get("code") or error.get("type") or status)
    except (ValueError, KeyError, TypeError):
        return str(status)
