"""Errors the gateway returns, in the OpenAI error shape, each naming the failing component and its fix.

There is one error path: a step of the pipeline runs inside `fails_as(component)`, which turns any
unexpected exception into a 503 naming that component; anything that still escapes is a 500
whose `code` names the component the traceback points at (`component_of`).
"""
from __future__ import annotations

import traceback
from collections.abc import Iterator
from contextlib import contextmanager

from fastapi.responses import JSONResponse

# Top-level packages of the traceback's frames, innermost first, name the component that failed.
_COMPONENTS = {"gate": "gate", "kvkernel": "kernel", "ledger": "ledger", "audit": "audit", "policies": "policy"}


class GatewayError(Exception):
    def __init__(self, status: int, code: str, message: str, *, param: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.retry_after = retry_after

    def body(self) -> dict[str, object]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "code": self.code, "param": self.param}}


class NoRoom(GatewayError):
    """503 `kv_budget_exhausted`: the KV budget cannot hold what was asked even after evicting
    every idle session. Its own type, so that erasure can take another path on it (never wait)."""

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(503, "kv_budget_exhausted", message, retry_after=retry_after)


def error_response(err: GatewayError) -> JSONResponse:
    headers = {"Retry-After": str(err.retry_after)} if err.retry_after else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def not_found(what: str, ident: str) -> GatewayError:
    return GatewayError(404, f"{what}_not_found", f"{what} {ident!r} not found for this tenant")


def unavailable(component: str, exc: BaseException) -> GatewayError:
    """A fail-closed refusal: nothing of the turn entered the cache, the ledger or the audit log."""
    return GatewayError(503, f"{component}_failed",
                        f"{component} failed ({type(exc).__name__}); nothing of this request was admitted. "
                        f"Retry later or check the {component} configuration.", retry_after=5)


def busy(what: str, waited_s: float) -> GatewayError:
    return GatewayError(503, "session_busy", f"{what} is busy with another request (waited {waited_s:g} s); "
                        "retry after it finishes", retry_after=1)


@contextmanager
def fails_as(component: str) -> Iterator[None]:
    """Run one pipeline step: a GatewayError passes as it is, anything else becomes a 503 naming it."""
    try:
        yield
    except GatewayError:
        raise
    except Exception as exc:
        raise unavailable(component, exc) from exc


def component_of(exc: BaseException) -> str:
    """The component an unexpected exception came from: the innermost frame in one of ours."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        for package, name in _COMPONENTS.items():
            if f"/{package}/" in frame.filename and "site-packages" not in frame.filename:
                return name
    return "gateway"


def internal(exc: BaseException) -> GatewayError:
    component = component_of(exc)
    return GatewayError(500, f"{component}_error",
                        f"internal error in the {component} ({type(exc).__name__}); it was logged with the "
                        "request id, report it with the x-request-id header")
