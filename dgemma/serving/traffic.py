"""What every HTTP request passes through, outermost: its request id, its access-log line, its counts in
/metrics, and the gate that answers 503 while the server drains for a graceful stop (shutdown.py).

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

from fastapi.responses import JSONResponse

from dgemma.serving.errors import error_body
from dgemma.serving.metrics import ServerMetrics

access_log = logging.getLogger("dgemma.access")

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
