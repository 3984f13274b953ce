"""The FastAPI application: OpenAI-compatible chat, sessions and erasure, audit, health, metrics."""
from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, model_validator
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from audit import AuditLog, Signer
from audit.api import make_router
from gate import Gate, InjectionProbe
from kvkernel import GenerationConfig, Kernel, Model, load_model
from ledger import Ledger
from policies import PolicyEngine

from . import __version__
from .chat import ChatRequest, with_tools
from .config import Settings
from .decoding import TextStream, parse_tool_calls
from .errors import GatewayError
from .logging import configure_logging
from .metrics import Metrics
from .service import Components, Gateway, Turn
from .tenants import AuditViewer, Principal, TenantStore

log = structlog.get_logger(__name__)


@dataclass
class AppState:
    settings: Settings
    tenants: TenantStore
    metrics: Metrics
    ledger: Ledger
    audit: AuditLog
    policy: PolicyEngine
    gate: Gate
    gateway: Gateway | None = None
    model: Model | None = None
    load_error: str | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    sweeper: asyncio.Task[None] | None = None

    def require_gateway(self) -> Gateway:
        if self.gateway is None:
            detail = f" (model load failed: {self.load_error})" if self.load_error else "; retry shortly"
            raise GatewayError(503, "not_ready", "the model is still loading" + detail, retry_after=5)
        return self.gateway


def secret_file(path: Path, nbytes: int = 32) -> bytes:
    """A server-side secret, generated on first run with mode 0600."""
    if path.exists():
        return path.read_bytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(nbytes))
    return path.read_bytes()


def open_signer(settings: Settings) -> Signer:
    if settings.audit_key_pem:
        return Signer.from_pem(settings.audit_key_pem)
    return Signer.load_or_create(settings.resolved("audit_key_path", "audit-key.pem"))


def build_state(settings: Settings) -> AppState:
    """Everything but the model: stores, policy, gate. Cheap enough to do before serving."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    return AppState(
        settings=settings,
        tenants=TenantStore.from_url(settings.db_url, settings.admin_key),
        metrics=Metrics(),
        ledger=Ledger(settings.db_url, check_invariants=settings.debug),
        audit=AuditLog(settings.audit_db_url, open_signer(settings), origin=settings.audit_origin,
                       batch_size=settings.audit_batch_size),
        policy=PolicyEngine(settings.policy_dir, backend=settings.policy_backend, opa_url=settings.opa_url,
                            timeout_s=settings.opa_timeout_s, retries=settings.opa_retries),
        gate=Gate(gitleaks_config=settings.gitleaks_config),
    )


def load_probe(settings: Settings, model: Model) -> InjectionProbe | None:
    """The hidden-state injection probe, when enabled and trained against this very model."""
    if not settings.probe:
        return None
    probe = InjectionProbe.load()
    if probe.model_identity != model.identity:
        log.warning("probe.disabled", reason="trained on another model", probe_model=probe.model_identity[:16],
                    model=model.identity[:16])
        return None
    return probe


def attach_model(state: AppState, model: Model) -> None:
    s = state.settings
    state.model = model
    state.gateway = Gateway(Components(
        model=model, kernel=Kernel(model, tile=s.tile), ledger=state.ledger, audit=state.audit,
        policy=state.policy, gate=state.gate, metrics=state.metrics, probe=load_probe(s, model),
        salt_secret=secret_file(s.resolved("salt_secret_path", "salt.key")), witness_mode=s.witness_mode,
        max_tool_result_bytes=s.max_tool_result_bytes, check_invariants=s.debug))
    state.ready.set()
    log.info("model.ready", model=model.name, identity=model.identity, device=str(model.device),
             dtype=str(model.dtype))


def _load_in_background(state: AppState) -> None:
    s = state.settings
    try:
        model = load_model(s.model, cache_dir=s.resolved("model_cache_dir", "models"), device=s.device,
                           dtype=s.dtype, progress=False)
        attach_model(state, model)
    except Exception as exc:  # readiness reports it; the process stays up for /healthz
        state.load_error = f"{type(exc).__name__}: {exc}"
        log.error("model.load_failed", error=state.load_error)


def record_bundle(state: AppState, actor: str) -> None:
    """A `policy-bundle` audit record whenever a bundle hash becomes active."""
    state.audit.append({"kind": "policy-bundle", "actor": actor,
                        "decision": {"action": "activate", "reasons": [], "bundle_hash": state.policy.bundle_hash}})
    state.audit.checkpoint()


# ---- middleware -----------------------------------------------------------------------------

class Guard:
    """Request ids, structured access logs, metrics, the body-size limit and the in-flight limit."""

    def __init__(self, app: ASGIApp, *, max_body: int, max_inflight: int, metrics: Metrics) -> None:
        self.app = app
        self.max_body = max_body
        self.max_inflight = max_inflight
        self.metrics = metrics
        self.inflight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        request_id = headers.get(b"x-request-id", b"").decode("latin-1")[:64] or uuid.uuid4().hex
        structlog.contextvars.bind_contextvars(request_id=request_id)
        route, started, status = scope["path"], time.perf_counter(), 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            too_large = GatewayError(413, "body_too_large",
                                     f"request body exceeds {self.max_body} bytes (LETHE_MAX_BODY_BYTES)")
            if int(headers.get(b"content-length", b"0") or 0) > self.max_body:
                return await self._refuse(send_with_id, too_large)
            if b"content-length" not in headers:  # chunked: read it here, up to the limit
                body = await self._read_limited(receive)
                if body is None:
                    return await self._refuse(send_with_id, too_large)
                receive = _replay(body, receive)
            heavy = route == "/v1/chat/completions"
            if heavy and self.inflight >= self.max_inflight:
                return await self._refuse(send_with_id, GatewayError(
                    503, "overloaded", f"{self.inflight} requests in flight; retry later", retry_after=1))
            self.inflight += heavy
            try:
                await self.app(scope, receive, send_with_id)
            finally:
                self.inflight -= heavy
        finally:
            elapsed = time.perf_counter() - started
            label = _route_label(route)
            self.metrics.requests.labels(label, str(status)).inc()
            self.metrics.latency.labels(label).observe(elapsed)
            log.info("http.request", method=scope["method"], path=route, status=status, ms=round(elapsed * 1e3, 2))
            structlog.contextvars.unbind_contextvars("request_id")

    async def _read_limited(self, receive: Receive) -> bytes | None:
        """The whole body, or None once it passes the limit."""
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body:
                return None
            more = message.get("more_body", False)
        return b"".join(chunks)

    @staticmethod
    async def _refuse(send: Send, err: GatewayError) -> None:
        await error_response(err)(  # type: ignore[arg-type]
            {"type": "http", "method": "GET", "path": "/", "headers": []}, _no_body, send)


def _replay(body: bytes, channel: Receive) -> Receive:
    """The body read ahead, then the real channel: a disconnect is reported when it happens, not at
    once (a made-up disconnect made streamed responses, e.g. GET /v1/audit/export, stop at 0 bytes)."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if sent:
            return await channel()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}
    return receive


async def _no_body() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


def _route_label(path: str) -> str:
    parts = path.split("/")
    if len(parts) > 3 and parts[1:3] in (["v1", "sessions"], ["v1", "audit"]):
        return "/".join(parts[:3] + ["{id}"] + parts[4:5])
    return path


def error_response(err: GatewayError) -> JSONResponse:
    headers = {"Retry-After": str(err.retry_after)} if err.retry_after else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


# ---- the app --------------------------------------------------------------------------------

class ForgetRequest(BaseModel):
    segment_id: str | None = None
    content_sha256: str | None = None
    span: tuple[int, int] | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> "ForgetRequest":
        given = [k for k in ("segment_id", "content_sha256", "span") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of segment_id, content_sha256 or span")
        if self.span is not None and not 0 <= self.span[0] < self.span[1]:
            raise ValueError("span must be [start, end) with 0 <= start < end")
        return self

    def selector(self) -> dict[str, Any]:
        return {k: v for k, v in self.model_dump().items() if v is not None}


def create_app(settings: Settings | None = None, *, model: Model | None = None) -> FastAPI:
    """The gateway app. Pass `model` to share an already loaded model (tests, the demo)."""
    settings = settings or Settings()
    configure_logging(settings.log_level, settings.log_json)
    state = build_state(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        record_bundle(state, "startup")
        if model is not None:
            attach_model(state, model)
        else:
            threading.Thread(target=_load_in_background, args=(state,), name="model-load", daemon=True).start()
        state.sweeper = asyncio.create_task(_sweep_forever(state))
        _install_sighup(state)
        yield
        state.sweeper.cancel()

    app = FastAPI(title="Lethe", version=__version__, lifespan=lifespan)
    app.state.lethe = state
    app.add_middleware(Guard, max_body=settings.max_body_bytes, max_inflight=settings.max_inflight,
                       metrics=state.metrics)

    @app.exception_handler(GatewayError)
    async def _gateway_error(_: Request, err: GatewayError) -> JSONResponse:
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in first["loc"] if p != "body")
        return error_response(GatewayError(422, "invalid_request", f"{param or 'body'}: {first['msg']}", param=param))

    def principal(request: Request) -> Principal:
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise GatewayError(401, "missing_api_key", "send `Authorization: Bearer <key>`; create a key with "
                                                       "`lethe key create --tenant NAME`")
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
    def readyz() -> JSONResponse:
        if not state.ready.is_set() or state.model is None:
            body = {"status": "loading" if state.load_error is None else "failed", "error": state.load_error}
            return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})
        return JSONResponse({"status": "ready", "model": state.model.name, "identity": state.model.identity,
                             "policy_bundle": state.policy.bundle_hash})

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    def models(_: Principal = Depends(principal)) -> dict[str, Any]:
        name = state.model.name if state.model else settings.model
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "lethe", "created": 0}]}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request, p: Principal = Depends(principal)) -> Response:
        gw = state.require_gateway()
        max_new = req.max_completion_tokens or req.max_tokens or settings.max_new_tokens
        messages = with_tools(req.messages, req.tools)
        turn = await run_in_threadpool(gw.prepare, p, request.headers.get("x-lethe-session"), messages, max_new)
        cfg = GenerationConfig(max_new_tokens=max_new, temperature=req.temperature, top_p=req.top_p,
                               seed=req.seed, stop=req.stops)
        headers = {"x-lethe-session": turn.session.record.id,
                   "x-lethe-actions": ",".join(f"{a.message_index}:{a.action}" for a in turn.actions) or "none"}
        completion = _Completion(gw, turn, cfg, req, state.model)  # type: ignore[arg-type]
        if req.stream:
            return StreamingResponse(completion.sse(), media_type="text/event-stream", headers=headers)
        body = await run_in_threadpool(completion.whole)
        return JSONResponse(body, headers=headers)

    @app.get("/v1/sessions/{session_id}")
    def session(session_id: str, p: Principal = Depends(principal)) -> dict[str, Any]:
        return state.require_gateway().inspect(p, session_id)

    @app.get("/v1/sessions/{session_id}/segments")
    def segments(session_id: str, p: Principal = Depends(principal)) -> dict[str, Any]:
        gw = state.require_gateway()
        record = gw.scoped_session(p, session_id)
        return {"session_id": record.id, "tenant": record.tenant,
                "segments": [_segment_dict(s) for s in state.ledger.segments(record.id)]}

    @app.post("/v1/sessions/{session_id}/forget")
    def forget(session_id: str, body: ForgetRequest, p: Principal = Depends(principal)) -> dict[str, Any]:
        return state.require_gateway().forget_request(p, session_id, body.selector())

    @app.post("/v1/admin/policies/reload")
    def reload_policies(p: Principal = Depends(admin)) -> dict[str, str]:
        bundle = state.policy.reload()
        record_bundle(state, f"admin:{p.user or p.tenant or '*'}")
        return {"bundle_hash": bundle}

    def audit_viewer(p: Principal = Depends(principal)) -> AuditViewer:
        return p.audit_viewer()

    app.include_router(make_router(lambda: state.audit, audit_viewer))
    return app


def _segment_dict(s: Any) -> dict[str, Any]:
    return {"id": s.id, "seq": s.seq, "role": s.role, "tool": s.tool, "content_sha256": s.content_sha256,
            "start": s.start, "end": s.end, "state": s.state.value, "data_class": s.data_class,
            "created_at": s.created_at.isoformat()}


@dataclass
class _Completion:
    """One completion's generation, whole or as server-sent events, always ending in `finish`."""

    gw: Gateway
    turn: Turn
    cfg: GenerationConfig
    req: ChatRequest
    model: Model
    id: str = field(default_factory=lambda: "chatcmpl-" + uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))
    finish_reason: str = "stop"
    completion_tokens: int = 0

    def _run(self, stream: TextStream) -> Iterator[str]:
        count = 0
        for token in self.gw.generate(self.turn, self.cfg):
            count += 1
            piece = stream.push(token)
            if piece:
                yield piece
            if stream.stopped:
                break
        rest = stream.flush()
        if rest:
            yield rest
        self.finish_reason = "length" if count >= self.cfg.max_new_tokens and not stream.stopped else "stop"
        self.completion_tokens = count

    def _finish(self) -> dict[str, Any]:
        erasures = self.gw.finish(self.turn)
        return {"session_id": self.turn.session.record.id, "actions": [a.to_dict() for a in self.turn.actions],
                "erasures": erasures}

    def _usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.turn.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.turn.prompt_tokens + self.completion_tokens}

    def _message(self, text: str) -> tuple[dict[str, Any], str]:
        content, calls = parse_tool_calls(text) if self.req.tools else (text, [])
        message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
        if calls:
            message["tool_calls"] = calls
        return message, ("tool_calls" if calls else self.finish_reason)

    def whole(self) -> dict[str, Any]:
        try:
            text = "".join(self._run(TextStream(self.model.tokenizer, list(self.cfg.stop))))
        except BaseException:
            self._finish()
            raise
        lethe = self._finish()
        message, reason = self._message(text)
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model.name,
                "choices": [{"index": 0, "message": message, "finish_reason": reason}], "usage": self._usage(),
                "lethe": lethe}

    def _chunk(self, delta: dict[str, Any], reason: str | None = None, **extra: Any) -> str:
        body = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model.name,
                "choices": [{"index": 0, "delta": delta, "finish_reason": reason}], **extra}
        return f"data: {json.dumps(body)}\n\n"

    def sse(self) -> Iterator[str]:
        finished = False
        try:
            yield self._chunk({"role": "assistant", "content": ""})
            pieces: list[str] = []
            for piece in self._run(TextStream(self.model.tokenizer, list(self.cfg.stop))):
                pieces.append(piece)
                if not self.req.tools:
                    yield self._chunk({"content": piece})
            lethe = self._finish()
            finished = True
            message, reason = self._message("".join(pieces))
            delta = {k: v for k, v in message.items() if k != "role"} if self.req.tools else {}
            yield self._chunk(delta, reason, usage=self._usage(), lethe=lethe)
            yield "data: [DONE]\n\n"
        finally:
            if not finished:
                try:
                    self._finish()
                except Exception as exc:
                    log.error("stream.finish_failed", error=type(exc).__name__)


async def _sweep_forever(state: AppState) -> None:
    """The retention sweeper: forget what the retention policy says has expired."""
    while True:
        await asyncio.sleep(state.settings.retention_sweep_s)
        if state.gateway is None:
            continue
        try:
            count = await run_in_threadpool(state.gateway.sweep_retention)
            if count:
                log.info("retention.swept", segments=count)
        except Exception as exc:
            log.error("retention.failed", error=f"{type(exc).__name__}: {exc}")


def _install_sighup(state: AppState) -> None:
    """SIGHUP reloads the policy bundle atomically (main thread only; tests run elsewhere)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGHUP"):
        return
    loop = asyncio.get_running_loop()

    def reload() -> None:
        try:
            state.policy.reload()
            record_bundle(state, "sighup")
            log.info("policy.reloaded", bundle=state.policy.bundle_hash)
        except Exception as exc:
            log.error("policy.reload_failed", error=f"{type(exc).__name__}: {exc}")

    loop.add_signal_handler(signal.SIGHUP, reload)
