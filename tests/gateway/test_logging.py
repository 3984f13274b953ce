"""A library's exception never puts its text in our logs (red team 14: the MCP SDK logged a
malformed upstream reply with a validation error quoting it, key and all, to the proxy's stderr)."""
from __future__ import annotations

import hashlib
import logging

import pytest

from gateway.logging import configure_logging

KEY = "AKIA2OGYBAH6QXTR5JWK"


def test_a_library_s_exception_is_logged_by_type_and_digest_only(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("info", json=True)
    try:
        raise ValueError(f"input_value='{{\"id\": 1, \"key\": \"{KEY}\"'")
    except ValueError:
        logging.getLogger("mcp.client.stdio").exception("Failed to parse JSONRPC message from server")
    err = capsys.readouterr().err
    digest = hashlib.sha256(f"input_value='{{\"id\": 1, \"key\": \"{KEY}\"'".encode()).hexdigest()[:16]
    assert "Failed to parse JSONRPC message from server" in err and "builtins.ValueError" in err and digest in err
    assert KEY not in err and "Traceback" not in err


def test_our_own_exceptions_keep_their_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("info", json=True)
    try:
        raise RuntimeError("the ledger's schema is newer than this code")
    except RuntimeError:
        logging.getLogger("gateway.app").exception("start-up failed")
    err = capsys.readouterr().err
    assert "the ledger's schema is newer than this code" in err and "Traceback" in err
