"""Errors the gateway returns, in the OpenAI error shape, each naming its fix."""
from __future__ import annotations


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


def not_found(what: str, ident: str) -> GatewayError:
    return GatewayError(404, f"{what}_not_found", f"{what} {ident!r} not found for this tenant")


def unavailable(component: str, exc: BaseException) -> GatewayError:
    """A fail-closed refusal: the span did not enter the cache."""
    return GatewayError(503, f"{component}_failed",
                        f"{component} failed ({type(exc).__name__}); the tool result was not admitted. Retry later "
                        f"or check the {component} configuration.", retry_after=5)
