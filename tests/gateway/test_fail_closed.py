"""Fail closed: each component fails in turn; the caller gets a 503 naming it, and the turn leaves
the cache digest, the ledger and the audit log exactly as they were; the session works afterwards.

Faults are injected at each component's boundary with the exceptions the real component raises
(SQLite's "database is locked" and "database or disk is full", a kernel error, a policy error),
on the real gateway, model and stores.
"""
from __future__ import annotations

import sqlite3

import pytest

from gate import Gate
from gateway.demo import WEATHER, WEB_PAGE
from kvkernel import KVCache
from kvkernel.errors import KernelError
from ledger import Ledger
from policies import PolicyEngine, PolicyError
from tests.gateway.conftest import snapshot, tool_turn, turns_settled, wait_until

pytestmark = pytest.mark.model


def _raise(exc: BaseException):
    def fail(*_a, **_k):
        raise exc
    return fail


FAULTS = {
    "gate": (Gate, "scan", RuntimeError("hyperscan database corrupt")),
    "policy": (PolicyEngine, "decide", PolicyError("rego evaluation failed")),
    "kernel": (KVCache, "stage", KernelError("out of memory")),
    "ledger-locked": (Ledger, "write_turn", sqlite3.OperationalError("database is locked")),
    "ledger-disk-full": (Ledger, "write_turn", sqlite3.OperationalError("database or disk is full")),
}


@pytest.fixture
def session(live_gateway):
    key = live_gateway.new_key("faults", user="fay")
    with live_gateway.client(key) as http:
        first = http.post("/v1/chat/completions", json={"model": "m", "max_tokens": 1, "messages": tool_turn(WEATHER)})
        assert first.status_code == 200, first.text
    return key, first.headers["x-lethe-session"]


def _next_turn(content: str) -> list[dict]:
    return [*tool_turn(WEATHER), {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and this?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c2", "type": "function", "function": {"name": "fetch_page", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c2", "content": content}]


def _fails_closed(live_gateway, key: str, sid: str, component: str, content: str, stream: bool = False) -> None:
    before = snapshot(live_gateway, sid)
    with live_gateway.client(key) as http:
        response = http.post("/v1/chat/completions", headers={"X-Lethe-Session": sid},
                             json={"model": "m", "max_tokens": 2, "stream": stream, "messages": _next_turn(content)})
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == f"{component}_failed" and error["type"] == "server_error"
    assert response.headers["retry-after"]
    wait_until(lambda: turns_settled(live_gateway), what="the failed turn ending")
    assert snapshot(live_gateway, sid) == before


def _usable(live_gateway, key: str, sid: str, content: str) -> None:
    with live_gateway.client(key) as http:
        ok = http.post("/v1/chat/completions", headers={"X-Lethe-Session": sid},
                       json={"model": "m", "max_tokens": 1, "messages": _next_turn(content)})
    assert ok.status_code == 200, ok.text
    snapshot(live_gateway, sid)


@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("content", [WEATHER, WEB_PAGE], ids=["allowed", "quarantined"])
def test_a_failing_component_fails_the_turn_closed(live_gateway, session, monkeypatch, fault, content):
    key, sid = session
    owner, method, exc = FAULTS[fault]
    monkeypatch.setattr(owner, method, _raise(exc))
    _fails_closed(live_gateway, key, sid, fault.split("-")[0], content)
    monkeypatch.undo()
    _usable(live_gateway, key, sid, content)


def test_a_failing_probe_fails_the_turn_closed(live_gateway, session, monkeypatch):
    probe = live_gateway.state.gateway.pipeline.p.probe
    if probe is None:
        pytest.skip("no probe trained for this model in this checkout")
    key, sid = session
    monkeypatch.setattr(type(probe), "score", _raise(ValueError("probe weights missing")))
    _fails_closed(live_gateway, key, sid, "probe", WEB_PAGE)
    monkeypatch.undo()
    _usable(live_gateway, key, sid, WEB_PAGE)


def test_a_failing_audit_log_undoes_the_ledger_write(live_gateway, session, monkeypatch):
    """The quarantine record cannot be written: the ledger rows already written are undone."""
    key, sid = session
    monkeypatch.setattr(type(live_gateway.state.audit), "append_keyed",
                        _raise(sqlite3.OperationalError("database or disk is full")))
    _fails_closed(live_gateway, key, sid, "audit", WEB_PAGE)
    monkeypatch.undo()
    _usable(live_gateway, key, sid, WEB_PAGE)


def test_a_failure_streaming_fails_before_the_headers(live_gateway, session, monkeypatch):
    key, sid = session
    monkeypatch.setattr(Gate, "scan", _raise(RuntimeError("gate down")))
    _fails_closed(live_gateway, key, sid, "gate", WEATHER, stream=True)
