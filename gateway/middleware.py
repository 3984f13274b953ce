"""Guard: the one ASGI middleware. Request ids, access logs, metrics, body and in-flight limits,
and the catch-all that turns any unexpected exception into the OpenAI error shape.

The request body is read here once, whatever its framing (Content-Length, chunked, none), up to
the limit; the app then receives it as one message, and every later `receive()` goes to the
server's own, so a client that disconnects is still seen as an `http.disconnect` (streaming
responses and running turns watch for it).
"""
from __future__ import annotations

import time
import traceback
import uuid

import structlog
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import GatewayError, error_response, internal
from .metrics import Metrics

log = structlog.get_logger(__name__)

HEAVY_ROUTES = frozenset({"/v1/chat/completions"})


class Guard:
    def __init__(self, app: ASGIApp, *, max_body: int, max_inflight: int, metrics: Metrics,
                 heavy_routes: frozenset[str] = HEAVY_ROUTES) -> None:
        self.app = app
        self.max_body = max_body
        self.heavy_routes = heavy_routes  # the routes `max_inflight` bounds
        self.max_inflight = max_inflight
        self.metrics = metrics
        self.inflight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        request_id = headers.get(b"x-request-id", b"").decode("latin-1")[:64] or uuid.uuid4().hex
        structlog.contextvars.bind_contextvars(request_id=request_id)
        route, started, status, response_started = scope["path"], time.perf_counter(), 500, False

        async def send_with_id(message: Message) -> None:
            nonlocal status, response_started
            if message["type"] == "http.response.start":
                status, response_started = message["status"], True
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            refusal = self._check_length(headers)
            if refusal is None:
                body, refusal = await self._read_body(receive)
            if refusal is not None:
                return await _refuse(send_with_id, refusal)
            heavy = route in self.heavy_routes
            if heavy and self.inflight >= self.max_inflight:
                return await _refuse(send_with_id, GatewayError(
                    503, "overloaded", f"{self.inflight} requests in flight; retry later", retry_after=1))
            self.inflight += heavy
            try:
                await self.app(scope, replay_body(body, receive), send_with_id)
            finally:
                self.inflight -= heavy
        except Exception as exc:  # the catch-all: one structured line, the OpenAI shape out
            err = internal(exc)
            log.error("http.unhandled", path=route, code=err.code, error=f"{type(exc).__name__}: {exc}",
                      traceback="".join(traceback.format_exception(exc)))
            if not response_started:
                await _refuse(send_with_id, err)
        finally:
            elapsed = time.perf_counter() - started
            label = _route_label(scope)
            self.metrics.requests.labels(label, str(status)).inc()
            self.metrics.latency.labels(label).observe(elapsed)
            log.info("http.request", method=scope["method"], path=route, status=status, ms=round(elapsed * 1e3, 2))
            structlog.contextvars.unbind_contextvars("request_id")

    def _check_length(self, headers: dict[bytes, bytes]) -> GatewayError | None:
        raw = headers.get(b"content-length", b"0") or b"0"
        if not raw.isdigit():
            return GatewayError(400, "bad_content_length", "Content-Length must be a non-negative integer")
        return self._too_large() if int(raw) > self.max_body else None

    def _too_large(self) -> GatewayError:
        return GatewayError(413, "body_too_large", f"request body exceeds {self.max_body} bytes (LETHE_MAX_BODY_BYTES)")

    async def _read_body(self, receive: Receive) -> tuple[bytes, GatewayError | None]:
        """The whole body (any framing), or a refusal once it passes the limit or the client left."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"", GatewayError(499, "client_disconnected", "the client closed the request")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return b"", self._too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None


def replay_body(body: bytes, receive: Receive) -> Receive:
    """The body as one message, then the server's own `receive` (which reports a disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}
    return replay


async def _refuse(send: Send, err: GatewayError) -> None:
    await error_response(err)({"type": "http", "method": "GET", "path": "/", "headers": []}, _no_body, send)


async def _no_body() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


def _route_label(scope: Scope) -> str:
    """The matched route's template (`/v1/sessions/{session_id}`), never the raw path: one label
    series per route, however many distinct paths clients send."""
    route = scope.get("route")
    return str(getattr(route, "path", "")) or "unmatched"
