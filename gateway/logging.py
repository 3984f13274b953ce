"""structlog set-up: JSON lines in production (no TTY), readable console output on a terminal.

Events render in structlog and are written by the standard library's logging, whose handlers
report their own I/O errors instead of raising them: a log line must never fail a request.
"""
from __future__ import annotations

import hashlib
import logging
import sys

import structlog


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is when a record is emitted, not when logging was set up:
    a CLI runner (or a test harness) may swap the stream and close it while threads still log."""

    @property  # type: ignore[override]
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, _value: object) -> None:
        pass


OWN = ("gateway", "gate", "audit", "ledger", "policies", "kvkernel")


class ForeignExceptions(logging.Filter):
    """A library's exception is logged by its type and a digest of its text, never the text: the
    MCP SDK logs a malformed upstream reply with a traceback whose validation error quotes the
    reply (red team 14: a key in it reached the proxy's stderr, which an MCP client keeps in its
    log). Our own packages' records pass as they are; they never put content in an exception."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None and record.name.split(".")[0] not in OWN:
            exc = record.exc_info[1]
            digest = hashlib.sha256(str(exc).encode("utf-8", "replace")).hexdigest()[:16]
            record.msg = f"{record.getMessage()} [{type(exc).__module__}.{type(exc).__qualname__}, text sha256:{digest} withheld]"
            record.args, record.exc_info, record.exc_text = (), None, None
        return True


def configure_logging(level: str = "info", json: bool | None = None) -> None:
    if json is None:
        json = not sys.stderr.isatty()
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    handler = _StderrHandler()
    handler.addFilter(ForeignExceptions())
    logging.basicConfig(format="%(message)s", handlers=[handler], level=level.upper(), force=True)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.stdlib.filter_by_level,
            structlog.stdlib.add_logger_name,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
