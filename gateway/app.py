"""The FastAPI application: routes only. Middleware is in `middleware`, a completion's life in
`streaming`, start-up and shut-down in `wiring`, the pipeline behind them in `service`."""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import structlog
from fastapi import Depends, FastAPI, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, model_validator
from starlette.exceptions import HTTPException

from audit.api import make_router
from policies import PolicyError
from kvkernel import GenerationConfig, Model

from . import __version__
from .chat import ChatRequest
from .config import Settings
from .errors import GatewayError, error_response, fails_as
from .logging import configure_logging
from .middleware import Guard
from .streaming import CompletionStream, TurnRun, turn_headers, whole_completion
from .tenants import AuditViewer, Principal
from .wiring import AppState, build_state, lifespan, open_signer, record_bundle

__all__ = ["AppState", "create_app", "open_signer"]

log = structlog.get_logger(__name__)

SessionId = Path(min_length=1, max_length=128)


class ForgetRequest(BaseModel):
    segment_id: str | None = None
    content_sha256: str | None = None
    span: tuple[int, int] | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> "ForgetRequest":
        given = [k for k in ("segment_id", "content_sha256", "span") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of segment_id, content_sha256 or span")
        if self.span is not None and not 0 <= self.span[0] < self.span[1] <= 2**31:
            raise ValueError("span must be [start, end) with 0 <= start < end <= 2**31")
        return self

    def selector(self) -> dict[str, Any]:
        return {k: v for k, v in self.model_dump().items() if v is not None}


def create_app(settings: Settings | None = None, *, model: Model | None = None) -> FastAPI:
    """The gateway app. Pass `model` to share an already loaded model (tests, the demo)."""
    settings = settings or Settings()
    configure_logging(settings.log_level, settings.log_json)
    state = build_state(settings)

    app = FastAPI(title="Lethe", version=__version__, lifespan=lifespan(state, model))
    app.state.lethe = state
    app.add_middleware(Guard, max_body=settings.max_body_bytes, max_inflight=settings.max_inflight,
                       metrics=state.metrics)

    @app.exception_handler(GatewayError)
    async def _gateway_error(_: Request, err: GatewayError) -> JSONResponse:
        return error_response(err)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, err: HTTPException) -> JSONResponse:
        component = "audit" if request.url.path.startswith("/v1/audit") else "gateway"
        code = {404: "not_found", 403: "forbidden", 405: "method_not_allowed"}.get(err.status_code,
                                                                                 f"{component}_error")
        return error_response(GatewayError(err.status_code, code, f"{component}: {err.detail}"))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        """A 400 as OpenAI sends it, naming the first offending field as the client wrote it."""
        first: dict[str, Any] = err.errors()[0] if err.errors() else {"loc": (), "msg": "invalid request", "type": ""}
        if unread_body(first):
            sent = request.headers.get("content-type")
            return error_response(GatewayError(
                400, "unsupported_content_type",
                f"the body was not read as JSON: the request has {f'Content-Type {sent}' if sent else 'no Content-Type'}; "
                "send `Content-Type: application/json`"))
        if first.get("type") == "json_invalid":  # not a field's fault: say where the JSON broke
            at = first["loc"][-1] if first.get("loc") else "?"
            why = (first.get("ctx") or {}).get("error", "JSON decode error")
            return error_response(GatewayError(400, "invalid_json", f"the body is not valid JSON: {why} at byte {at}"))
        param = param_of(first)
        return error_response(GatewayError(400, "invalid_request", f"{param}: {first['msg']}", param=param))

    def principal(request: Request) -> Principal:
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise GatewayError(401, "missing_api_key", "send `Authorization: Bearer <key>`; create a key with "
                                                       "`lethe key create --tenant NAME`")
        with fails_as("tenants"):
            found = state.tenants.authenticate(key.strip())
        if found is None:
            raise GatewayError(401, "invalid_api_key", "unknown API key")
        structlog.contextvars.bind_contextvars(tenant=found.tenant)
        return found

    def admin(p: Principal = Depends(principal)) -> Principal:
        if not p.is_admin:
            raise GatewayError(403, "admin_required", "this endpoint needs an admin key")
        return p

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:  # on the event loop: it answers even when every thread is busy
        if not state.ready.is_set() or state.model is None:
            body = {"status": "loading" if state.load_error is None else "failed", "error": state.load_error}
            return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})
        return JSONResponse({"status": "ready", "model": state.model.name, "identity": state.model.identity,
                             "policy_bundle": state.policy.bundle_hash, "injection_scorer": state.scorer,
                             "turns_running": state.gateway.running if state.gateway else 0,
                             "retention_sweeps": state.sweeps})

    def metrics_reader(request: Request) -> None:
        """Metrics count every tenant's traffic: a global admin key, unless LETHE_METRICS_PUBLIC
        (for a scraper on a private listener)."""
        if state.settings.metrics_public:
            return
        p = principal(request)
        if not (p.is_admin and p.tenant is None):
            raise GatewayError(403, "global_admin_required",
                               "/metrics counts every tenant's traffic: use a global admin key, or set "
                               "LETHE_METRICS_PUBLIC=true behind a private listener")

    @app.get("/metrics", dependencies=[Depends(metrics_reader)])
    def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    def models(_: Principal = Depends(principal)) -> dict[str, Any]:
        name = state.model.name if state.model else settings.model
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "lethe", "created": 0}]}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request, p: Principal = Depends(principal)) -> Response:
        gw = state.require_gateway()
        assert state.model is not None
        cfg = GenerationConfig(max_new_tokens=req.max_completion_tokens or req.max_tokens or settings.max_new_tokens,
                               temperature=req.temperature, top_p=req.top_p, seed=req.seed, stop=req.stops)
        run = TurnRun(gw, state.model, req, cfg)
        run.start(state.turns, p, request.headers.get("x-lethe-session"))
        run.watch(request.receive)
        handed_over = False
        try:
            turn = await run.prepared_turn()
            if req.stream:
                handed_over = True
                return CompletionStream(run, turn_headers(turn))
            return JSONResponse(await whole_completion(run), headers=turn_headers(turn))
        finally:
            if not handed_over:
                run.close()

    @app.get("/v1/sessions/{session_id}")
    def session(p: Principal = Depends(principal), session_id: str = SessionId) -> dict[str, Any]:
        return state.require_gateway().inspect(p, session_id)

    @app.delete("/v1/sessions/{session_id}")
    def end_session(p: Principal = Depends(principal), session_id: str = SessionId) -> dict[str, Any]:
        return state.require_gateway().end_session(p, session_id)

    @app.get("/v1/sessions/{session_id}/segments")
    def segments(p: Principal = Depends(principal), session_id: str = SessionId) -> dict[str, Any]:
        record = state.require_gateway().scoped_session(p, session_id)
        with fails_as("ledger"):
            found = state.ledger.segments(record.id)
        return {"session_id": record.id, "tenant": record.tenant, "segments": [_segment_dict(s) for s in found]}

    @app.post("/v1/sessions/{session_id}/forget")
    def forget(body: ForgetRequest, p: Principal = Depends(principal), session_id: str = SessionId) -> dict[str, Any]:
        return state.require_gateway().forget_request(p, session_id, body.selector())

    @app.post("/v1/admin/policies/reload")
    def reload_policies(p: Principal = Depends(admin)) -> dict[str, str]:
        """Only a global admin key reloads the global bundle (every tenant's policy). A refused
        bundle (wrongly typed data, a failing activation probe) is a 422 naming the field; the
        active bundle stays."""
        if p.tenant is not None:
            raise GatewayError(403, "global_admin_required",
                               "reloading the policy bundle changes every tenant's policy; use a global admin key "
                               "(`lethe key create --admin` without a tenant)")
        try:
            bundle = state.policy.reload()
        except PolicyError as err:
            raise GatewayError(422, "policy_refused",
                               f"policy reload refused, the active bundle stays: {err}") from err
        with fails_as("audit"):
            record_bundle(state, f"admin:{p.user or p.tenant or '*'}")
        return {"bundle_hash": bundle}

    def audit_viewer(p: Principal = Depends(principal)) -> AuditViewer:
        return p.audit_viewer(state.require_gateway().sessions.audit_filter(p))

    app.include_router(make_router(lambda: state.audit, audit_viewer))
    return app


_WHERE = frozenset({"body", "path", "query", "header", "cookie"})
_FIELD = re.compile(r"[a-z_][a-z0-9_]*")
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "tuple", "set"})


def unread_body(error: Mapping[str, Any]) -> bool:
    """Whether the body reached validation as raw bytes: FastAPI parses JSON only when the
    Content-Type says so (none, text/plain and forms are not), so the model saw no object at all."""
    return tuple(error.get("loc", ())) == ("body",) and isinstance(error.get("input"), (bytes, bytearray))


def param_of(error: Mapping[str, Any]) -> str:
    """A validation error's field path as the client wrote it (`messages[2].content`), never empty.

    Pydantic's location also names the member of a union it tried (`str`, `list[TextPart]`);
    those are not fields and are left out. An unparseable body is `body`."""
    if error.get("type") == "json_invalid":
        return "body"
    path = ""
    for i, part in enumerate(error.get("loc", ())):
        if i == 0 and part in _WHERE:
            continue
        if isinstance(part, int):
            path += f"[{part}]"
        elif _FIELD.fullmatch(str(part)) and part not in _TYPE_TAGS:
            path += f".{part}" if path else str(part)
    return path or "body"


def _segment_dict(s: Any) -> dict[str, Any]:
    return {"id": s.id, "seq": s.seq, "role": s.role, "tool": s.tool, "content_sha256": s.content_sha256,
            "start": s.start, "end": s.end, "state": s.state.value, "data_class": s.data_class,
            "created_at": s.created_at.isoformat()}
