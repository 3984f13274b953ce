"""Serving the proxy: stdio (one tenant, named at start) and streamable HTTP (a Lethe API key per request).

Over HTTP the caller is whoever the `Authorization: Bearer lth_...` key belongs to (the chat
endpoint's keys, stored hashed in gateway/tenants.py), checked on every request before the MCP
layer sees it (a key found in the last `KEY_CACHE_S` seconds is answered from memory, on the
loop); `X-Lethe-Session` links results to one of that tenant's chat sessions. Over stdio the
process speaks for the one tenant it was started as (`lethe mcp --tenant T`): the agent that
spawned it already holds the machine, so there is no key to present.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import mcp.types as types
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.stdio import stdio_server
from mcp.shared.exceptions import MCPError
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from ..metrics import Metrics
from ..middleware import Guard as HttpGuard
from ..middleware import replay_body
from ..tenants import Principal, TenantStore
from .proxy import Caller, Proxy

PRINCIPAL, SESSION = "lethe.principal", "lethe.session"
DEFAULT_PAGE, MAX_PAGE = 100, 1000  # crossings a listing page holds


async def serve_stdio(proxy: Proxy, principal: Principal, session_id: str | None) -> None:
    """Serve one agent on stdin/stdout until it closes them."""
    caller = Caller(principal, session_id)
    server = proxy.server(lambda _ctx: caller)
    async with proxy.running(), stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


def _http_caller(ctx: Any) -> Caller:
    request = getattr(ctx, "request", None)
    scope = getattr(request, "scope", None) or {}
    principal = scope.get(PRINCIPAL)
    if not isinstance(principal, Principal):  # the middleware always sets it; fail closed if not
        raise MCPError(types.INVALID_REQUEST, "no authenticated Lethe principal on this request")
    return Caller(principal, scope.get(SESSION), (getattr(request, "headers", None) or {}).get("mcp-session-id"))


def _error(status: int, code: str, message: str) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "code": code,
                                   "param": None}}, status_code=status, headers=headers)


def _session_owner(principal: Principal) -> AuthenticatedUser:
    """The caller as the MCP SDK's session manager knows its users: it binds each MCP session to
    the user that opened it and answers any other (another tenant's key, another user's) exactly
    as for an unknown session, 404. Without it a key of tenant B that learnt tenant A's session id
    could call tools in that session or end it. The token field holds no key: ownership is the
    tenant (client_id) and the user (subject)."""
    return AuthenticatedUser(AccessToken(token="lethe-api-key", client_id=f"tenant:{principal.tenant}", scopes=[],
                                         subject=principal.user))


class TenantAuth:
    """ASGI middleware: a tenant's API key on every HTTP request, or 401/403 before MCP sees it."""

    def __init__(self, app: ASGIApp, tenants: TenantStore) -> None:
        self.app = app
        self.tenants = tenants

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        scheme, _, key = headers.get("authorization", "").partition(" ")
        principal = None
        if scheme.lower() == "bearer" and key.strip():
            principal = self.tenants.cached(key.strip()) or \
                await anyio.to_thread.run_sync(self.tenants.authenticate, key.strip())
        if principal is None:
            response = _error(401, "invalid_api_key", "send a Lethe API key as `Authorization: Bearer lth_...` "
                                                      "(create one with `lethe key create --tenant T`)")
        elif principal.tenant is None:
            response = _error(403, "tenant_required", "the MCP proxy needs a tenant key; the global admin key "
                                                      "has no tenant")
        else:
            scope[PRINCIPAL] = principal
            scope[SESSION] = headers.get("x-lethe-session") or None
            scope["user"] = _session_owner(principal)
            await self.app(scope, receive, send)
            return
        await response(scope, receive, send)


def _bad_id(message: Any) -> bool:
    """A JSON-RPC message whose `id` is there but neither a string nor an integer (MCP forbids null)."""
    if not isinstance(message, dict) or "id" not in message:
        return False
    rid = message["id"]
    return isinstance(rid, bool) or not isinstance(rid, (str, int))


class RequestIds:
    """ASGI middleware: a JSON-RPC message whose `id` is an object, an array, null, a fraction or a
    boolean is an invalid request (JSON-RPC 2.0 section 4; MCP: a string or an integer, never
    null), answered 400 with error -32600. The SDK would read it as a notification, answer 202 and
    drop it (red team F11): the client never learns its call was not made. A body with NaN or
    Infinity is a parse error (-32700): the SDK's parser took it and the call was forwarded (red
    team 12). Runs behind the body-reading middleware, so the body arrives as one message, which
    is replayed to the app."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        message = await receive()
        body = message.get("body", b"")
        try:
            parsed = json.loads(body, parse_constant=_no_constant) if body else None
        except _NotJson as exc:
            await _rpc_error(types.PARSE_ERROR, f"Parse error: {exc}; nothing was called")(scope, receive, send)
            return
        except RecursionError:  # a red team's 30,000 nested brackets were a 500
            await _rpc_error(types.PARSE_ERROR, "Parse error: the JSON nests too deeply; nothing was called")(
                scope, receive, send)
            return
        except ValueError:
            parsed = None  # not JSON at all: the SDK answers the parse error itself
        if any(_bad_id(m) for m in (parsed if isinstance(parsed, list) else [parsed])):
            await _rpc_error(types.INVALID_REQUEST, "Invalid Request: a JSON-RPC id must be a string or an integer "
                                                    "(MCP allows no null); nothing was called")(scope, receive, send)
            return
        await self.app(scope, replay_body(body, receive), send)


class _NotJson(ValueError):
    """A literal JSON does not have (NaN, Infinity), which Python's parser and others accept."""


def _no_constant(name: str) -> Any:
    raise _NotJson(f"{name} is not JSON (RFC 8259 has no NaN or Infinity)")


def _rpc_error(code: int, message: str) -> JSONResponse:
    return JSONResponse({"jsonrpc": "2.0", "id": None, "error": {"code": code, "message": message}}, status_code=400)


def http_app(proxy: Proxy, tenants: TenantStore, host: str = "127.0.0.1") -> ASGIApp:
    """The MCP endpoint at `/mcp`, and `GET /v1/mcp/crossings`: the caller's tenant's decisions,
    oldest first, a page at a time (`?limit=`, at most `MAX_PAGE`; `?after=` the `next` of the
    page before, null on the last)."""

    async def crossings(request: Request) -> JSONResponse:
        """404 for a session the caller cannot see (another tenant's, another user's, unknown), as
        the chat API answers: an empty list would tell that the id exists nowhere near the caller."""
        principal: Principal = request.scope[PRINCIPAL]
        session = request.query_params.get("session")
        if session is not None and not await anyio.to_thread.run_sync(proxy.sees_session, principal, session):
            return _error(404, "session_not_found", f"session {session!r} not found for this caller; list "
                                                    "crossings without ?session=, or use a session id of your own")
        try:
            limit = int(request.query_params.get("limit", DEFAULT_PAGE))
        except ValueError:
            limit = 0
        if not 1 <= limit <= MAX_PAGE:
            return _error(400, "invalid_limit", f"limit must be a whole number from 1 to {MAX_PAGE}")
        try:
            rows, after = await anyio.to_thread.run_sync(proxy.crossings_seen, principal, session,
                                                         request.query_params.get("after"), limit)
        except LookupError:
            return _error(400, "invalid_cursor", "`after` is not a crossing of this tenant; pass the `next` "
                                                 "value of the page before, or leave it out for the first page")
        return JSONResponse({"crossings": [r.to_dict() for r in rows], "next": after})

    server = proxy.server(_http_caller)
    # JSON responses, not SSE: the proxy's handlers send no progress or other notifications, so a
    # stream would only cost a task group and a channel per request. A handler is then not
    # cancelled when its client hangs up: the decision is still recorded, and the reply dropped.
    inner: Starlette = server.streamable_http_app(
        host=host, json_response=True, session_idle_timeout=proxy.settings.session_idle_s,
        custom_starlette_routes=[Route("/v1/mcp/crossings", crossings, methods=["GET"])])
    serve_sessions = inner.router.lifespan_context

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with proxy.running(), serve_sessions(app):
            yield

    inner.router.lifespan_context = lifespan
    # Outermost: every body read once, whatever its framing, up to LETHE_MAX_BODY_BYTES (413 past
    # it), an access log line, and any unexpected error in the OpenAI shape; then the key; then ids.
    return HttpGuard(TenantAuth(RequestIds(inner), tenants), max_body=proxy.settings.max_body_bytes,
                     max_inflight=0, metrics=Metrics(), heavy_routes=frozenset())
