"""Start-up and shut-down: the stores, the model loaded in the background, the retention sweeper,
SIGHUP policy reloads, a bounded drain of running turns at exit, and the HTTP server's
configuration (whose protocol answers even unparseable requests in the OpenAI error shape)."""
from __future__ import annotations

import asyncio
import os
import secrets
import signal
import socket
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import uvicorn
from starlette.concurrency import run_in_threadpool
from uvicorn.protocols.http.h11_impl import H11Protocol

from audit import AuditLog, Signer
from gate import Gate, GateError, InjectionProbe
from kvkernel import Kernel, Model, load_model, named_plan
from ledger import Ledger
from policies import PolicyEngine

from .config import Settings
from .errors import GatewayError, error_response
from .metrics import Metrics
from .service import Components, Gateway
from .storefiles import refuse_unwritable
from .tenants import TenantStore

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
    turns: ThreadPoolExecutor  # every chat turn runs start to end in one of these threads
    gateway: Gateway | None = None
    model: Model | None = None
    load_error: str | None = None
    scorer: str | None = None  # what scores injection once the model is in: "stack(probe, byte gate)" | "byte gate"
    ready: threading.Event = field(default_factory=threading.Event)
    sweeper: asyncio.Task[None] | None = None
    sweeps: int = 0  # completed sweeper passes (tests and /metrics read it)

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
    refuse_unwritable((settings.db_url, settings.audit_db_url))
    return AppState(
        settings=settings,
        tenants=TenantStore.from_url(settings.db_url, settings.admin_key),
        metrics=Metrics(),
        ledger=Ledger(settings.db_url, check_invariants=settings.debug),
        audit=AuditLog(settings.audit_db_url, open_signer(settings), origin=settings.audit_origin,
                       batch_size=settings.audit_batch_size),
        policy=PolicyEngine(settings.policy_dir, backend=settings.policy_backend, opa_url=settings.opa_url,
                            timeout_s=settings.opa_timeout_s, retries=settings.opa_retries),
        gate=settings.gate(),
        turns=ThreadPoolExecutor(max_workers=settings.max_inflight, thread_name_prefix="turn"),
    )


def load_probe(settings: Settings, model: Model) -> InjectionProbe | None:
    """The hidden-state injection probe, when enabled; it must have been trained on this very model.

    A probe trained on other weights reads meaningless states, and silently falling back to the
    byte gate would halve injection recall unnoticed, so an unmatched probe is refused: train one
    for this model or choose the byte gate alone explicitly (``LETHE_PROBE=false``)."""
    if not settings.probe:
        return None
    probe = InjectionProbe.load(settings.probe_path)
    if probe.model_identity != model.identity:
        raise GateError(
            f"the injection probe {settings.probe_path or 'gate/weights/probe.npz'} was trained on model "
            f"{probe.model_identity[:16]}…, not on the configured model {model.name} ({model.identity[:16]}…); "
            f"train one for it with `python -m gate.train.train_probe --model-dir <converted model dir> --out <path>` "
            f"and set LETHE_PROBE_PATH, or set LETHE_PROBE=false to score injection with the byte gate alone")
    return probe


def kernel_for(settings: Settings, model: Model) -> Kernel:
    """The kernel with its canonical plan: calibrated (cached under data_dir) or forced by name."""
    plan = named_plan(settings.kernel_plan) if settings.kernel_plan else None
    return Kernel(model, tile=settings.tile, plan=plan, plan_dir=settings.data_dir / "kernel-plans")


def injection_scorer(probe: InjectionProbe | None) -> str:
    return "stack(probe, byte gate)" if probe is not None else "byte gate"


def attach_model(state: AppState, model: Model) -> None:
    s = state.settings
    state.model = model
    state.gateway = Gateway(Components(
        model=model, kernel=kernel_for(s, model), ledger=state.ledger, audit=state.audit,
        policy=state.policy, gate=state.gate, metrics=state.metrics, probe=(probe := load_probe(s, model)),
        salt_secret=secret_file(s.resolved("salt_secret_path", "salt.key")), witness_mode=s.witness_mode,
        max_tool_result_bytes=s.max_tool_result_bytes, lock_timeout_s=s.lock_timeout_s, check_invariants=s.debug,
        hold_at=s.test_hold_at, kv_budget_bytes=s.kv_budget_bytes, kv_budget_share=s.kv_budget_share,
        kv_offload_bytes=s.kv_offload_bytes, kv_offload_min_priority=s.kv_offload_min_priority,
        offload_dir=s.data_dir / "kv-offload"))
    settled = state.gateway.settle()  # what turns cut off by a crash still owe, before any new turn
    state.scorer = injection_scorer(probe)
    state.metrics.injection_scorer.info({"scorer": state.scorer, "probe_model": probe.model_identity[:16] if probe else ""})
    state.ready.set()
    log.info("model.ready", model=model.name, identity=model.identity, device=str(model.device),
             dtype=str(model.dtype), injection_scorer=state.scorer, intents_settled=settled)


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


def lifespan(state: AppState, model: Model | None):  # type: ignore[no-untyped-def]
    @asynccontextmanager
    async def run(_app: object) -> AsyncIterator[None]:
        record_bundle(state, "startup")
        if model is not None:
            attach_model(state, model)
        else:
            threading.Thread(target=_load_in_background, args=(state,), name="model-load", daemon=True).start()
        state.sweeper = asyncio.create_task(_sweep_forever(state))
        _install_sighup(state)
        try:
            yield
        finally:
            state.sweeper.cancel()
            await shutdown(state)
    return run


async def shutdown(state: AppState) -> None:
    """Stop running turns and wait for them to end (rolled back or committed), at most the grace period."""
    grace = state.settings.shutdown_grace_s
    if state.gateway is not None:
        drained = await asyncio.to_thread(state.gateway.drain, grace)
        log.info("shutdown.drained", ok=drained)
        if drained:  # a turn still running may yet evict; its copies go with the process's data dir
            await asyncio.to_thread(state.gateway.close)
    state.turns.shutdown(wait=False, cancel_futures=True)


async def _sweep_forever(state: AppState) -> None:
    """The retention sweeper: forget what the retention policy says has expired. Busy sessions are
    skipped until the next pass; a failing pass is logged and the next one runs on time."""
    while True:
        await asyncio.sleep(state.settings.retention_sweep_s)
        if state.gateway is None:
            continue
        try:
            await run_in_threadpool(state.gateway.settle)
            count = await run_in_threadpool(state.gateway.sweep_retention)
            if count:
                log.info("retention.swept", segments=count)
        except Exception as exc:
            log.error("retention.failed", error=f"{type(exc).__name__}: {exc}")
        state.sweeps += 1


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


# ---- the HTTP server ----------------------------------------------------------------------------

def bad_request_bytes(detail: str) -> bytes:
    """The whole HTTP response for a request the server could not parse, in the OpenAI error shape
    (uvicorn's own is a plain-text 400 that no OpenAI client can read)."""
    response = error_response(GatewayError(400, "invalid_http", f"the HTTP request could not be parsed ({detail}); "
                                           "send a well-formed HTTP/1.1 request"))
    head = [b"HTTP/1.1 400 Bad Request", *(k + b": " + v for k, v in response.raw_headers), b"connection: close"]
    return b"\r\n".join(head) + b"\r\n\r\n" + response.body


class OpenAIH11Protocol(H11Protocol):
    def send_400_response(self, msg: str) -> None:
        self.transport.write(bad_request_bytes(msg))
        self.transport.close()


def http_protocol() -> type:
    """uvicorn's own choice ("auto": httptools when installed, else h11), answering malformed
    requests in the OpenAI error shape."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # httptools is not installed
        return OpenAIH11Protocol

    class OpenAIHttpToolsProtocol(HttpToolsProtocol):
        def send_400_response(self, msg: str) -> None:
            self.transport.write(bad_request_bytes(msg))
            self.transport.close()
    return OpenAIHttpToolsProtocol


def free_ports(n: int) -> list[int]:
    """`n` distinct loopback ports nobody listens on now (the demo, the benches and the tests start
    servers on them; never fixed ones, where a server left by a killed run would answer instead)."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def server_config(app: Callable[..., Any], settings: Settings, host: str, port: int) -> uvicorn.Config:
    """The one uvicorn configuration (`lethe serve`, the demo and the tests' live gateway)."""
    return uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False, http=http_protocol(),
                          timeout_graceful_shutdown=int(settings.shutdown_grace_s) + 1)
