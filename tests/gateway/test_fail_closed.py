"""Fail closed: each component fails in turn; the caller gets a 503 naming it, and the turn leaves
the cache digest, the ledger and the audit log exactly as they were; the session works afterwards.

Gate, probe, policy and kernel faults are injected at the component's boundary with the exception
it raises. The databases fail for real: a full disk is SQLite's own SQLITE_FULL (the database may
not grow by one page: `PRAGMA max_page_count` on the component's connections), a locked database
is another process holding `BEGIN EXCLUSIVE` on its file. A generation that fails after the
streamed headers went out ends the stream with an error event and rolls the turn back.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from sqlalchemy import Engine, event

from gate import Gate
from gateway.demo import CONFIG_FILE, WEATHER, WEB_PAGE
from kvkernel import KVCache
from kvkernel.errors import KernelError
from policies import PolicyEngine, PolicyError
from tests.gateway.conftest import snapshot, tenant_policy, tool_turn, turns_settled, wait_until

pytestmark = pytest.mark.model


def _raise(exc: BaseException):
    def fail(*_a, **_k):
        raise exc
    return fail


FAULTS = {
    "gate": (Gate, "scan", RuntimeError("hyperscan database corrupt")),
    "policy": (PolicyEngine, "decide", PolicyError("rego evaluation failed")),
    "kernel": (KVCache, "stage", KernelError("out of memory")),
}


@pytest.fixture
def session(live_gateway):
    key = live_gateway.new_key("faults", user="fay")
    with live_gateway.client(key) as http:
        first = http.post("/v1/chat/completions", json={"model": "m", "max_tokens": 1, "messages": tool_turn(WEATHER)})
        assert first.status_code == 200, first.text
    return key, first.headers["x-lethe-session"]


def _next_turn(*contents: str) -> list[dict]:
    """The session's first turn, then a turn calling one tool per content."""
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "fetch_page", "arguments": "{}"}}
             for i in range(2, 2 + len(contents))]
    return [*tool_turn(WEATHER), {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and this?"},
            {"role": "assistant", "content": None, "tool_calls": calls},
            *({"role": "tool", "tool_call_id": c["id"], "content": text} for c, text in zip(calls, contents))]


def _fails_closed(live_gateway, key: str, sid: str, component: str, *contents: str, stream: bool = False) -> None:
    before = snapshot(live_gateway, sid)
    with live_gateway.client(key) as http:
        response = http.post("/v1/chat/completions", headers={"X-Lethe-Session": sid},
                             json={"model": "m", "max_tokens": 2, "stream": stream, "messages": _next_turn(*contents)})
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == f"{component}_failed" and error["type"] == "server_error"
    assert response.headers["retry-after"]
    wait_until(lambda: turns_settled(live_gateway), what="the failed turn ending")
    assert snapshot(live_gateway, sid) == before


def _usable(live_gateway, key: str, sid: str, *contents: str) -> None:
    with live_gateway.client(key) as http:
        ok = http.post("/v1/chat/completions", headers={"X-Lethe-Session": sid},
                       json={"model": "m", "max_tokens": 1, "messages": _next_turn(*contents)})
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
    assert probe is not None, "the live gateway runs SmolLM2 with its shipped probe"
    key, sid = session
    monkeypatch.setattr(type(probe), "score", _raise(ValueError("probe weights missing")))
    _fails_closed(live_gateway, key, sid, "probe", WEB_PAGE)
    monkeypatch.undo()
    _usable(live_gateway, key, sid, WEB_PAGE)


# ---- real database faults -----------------------------------------------------------------------

def _sqlite_file(engine: Engine) -> Path:
    return Path(engine.url.database)


@contextmanager
def disk_full(engine: Engine) -> Iterator[None]:
    """SQLite's own SQLITE_FULL on `engine`'s connections: the database may not grow by one page.
    Freed pages are reused before the file grows, so the file is first vacuumed to have none."""
    raw = engine.raw_connection()  # autocommit: VACUUM cannot run inside a transaction
    try:
        raw.execute("VACUUM")
        pages = raw.execute("PRAGMA page_count").fetchone()[0]
        assert raw.execute("PRAGMA freelist_count").fetchone()[0] == 0
    finally:
        raw.close()

    def cap(dbapi_conn, _record) -> None:
        dbapi_conn.execute(f"PRAGMA max_page_count={pages}")
    event.listen(engine, "connect", cap)
    engine.dispose()  # every connection from now on is capped
    try:
        yield
    finally:
        event.remove(engine, "connect", cap)
        engine.dispose()


_HOLD_EXCLUSIVE = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
sys.stdin.read()  # until the test closes our stdin
db.execute("ROLLBACK")
"""


@contextmanager
def locked(engine: Engine) -> Iterator[None]:
    """Another process holds `BEGIN EXCLUSIVE` on the database file until the block ends."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_EXCLUSIVE, str(_sqlite_file(engine))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == b"locked"
        yield
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)


BIG = json.dumps({"city": "Paris", "forecast": "light rain " * 900})  # ~10 kB: new pages for its blob
QUARANTINED = [f"{WEB_PAGE}<!-- {i} -->" for i in range(10)]  # ten quarantine records: new audit pages


@pytest.mark.parametrize("fault", [disk_full, locked], ids=["disk-full", "locked"])
def test_a_failing_ledger_database_fails_the_turn_closed(live_gateway, session, fault):
    key, sid = session
    with fault(live_gateway.state.ledger._engine):
        _fails_closed(live_gateway, key, sid, "ledger", BIG)
    _usable(live_gateway, key, sid, BIG)


@pytest.mark.parametrize("fault", [disk_full, locked], ids=["disk-full", "locked"])
def test_a_failing_audit_database_undoes_the_ledger_write(live_gateway, session, fault):
    """The turn's quarantine records cannot be written: its ledger rows (and intents) are undone."""
    key, sid = session
    assert _sqlite_file(live_gateway.state.audit._engine) != _sqlite_file(live_gateway.state.ledger._engine)
    with fault(live_gateway.state.audit._engine):
        _fails_closed(live_gateway, key, sid, "audit", *QUARANTINED)
    assert live_gateway.state.ledger.pending_intents(session_id=sid) == []
    _usable(live_gateway, key, sid, *QUARANTINED)


# ---- a generation that fails after the headers ----------------------------------------------------

def test_a_generation_failing_mid_stream_ends_it_with_an_error_event_and_rolls_the_turn_back(
        live_gateway, monkeypatch, tmp_path):
    """A secret admitted for this turn only (policy `forget`) is in the ledger when generation
    starts; the kernel fails after the first token: the stream's last event is the error, in the
    OpenAI shape naming the kernel, and nothing of the turn remains (rows, intents, content)."""
    with tenant_policy(live_gateway.state.policy, tmp_path, {"midstream": {"sensitive_action": "forget"}}):
        key = live_gateway.new_key("midstream", user="mo")
        with live_gateway.client(key) as http:
            first = http.post("/v1/chat/completions", json={"model": "m", "max_tokens": 1, "messages": tool_turn(WEATHER)})
        sid = first.headers["x-lethe-session"]
        wait_until(lambda: turns_settled(live_gateway), what="the first turn ending")
        before = snapshot(live_gateway, sid)
        generate = KVCache.generate

        def fails_after_one_token(self, cfg):
            tokens = generate(self, cfg)
            yield next(tokens)
            tokens.close()
            raise KernelError("device lost")
        monkeypatch.setattr(KVCache, "generate", fails_after_one_token)
        secret = f"{CONFIG_FILE}# midstream\n"
        events = _stream(live_gateway, key, sid, _next_turn(secret))
        monkeypatch.undo()
        assert events[-1] == "[DONE]" and events[0]["choices"][0]["delta"]["role"] == "assistant"
        error = events[-2]["error"]
        assert error["code"] == "kernel_failed" and error["type"] == "server_error" and "kernel" in error["message"]
        wait_until(lambda: turns_settled(live_gateway), what="the failed turn ending")
        assert snapshot(live_gateway, sid) == before
        assert live_gateway.state.ledger.pending_intents(session_id=sid) == []
        assert not live_gateway.state.ledger.content.exists(hashlib.sha256(secret.encode()).hexdigest())
        _usable(live_gateway, key, sid, secret)  # and this time the secret is forgotten after the turn
        assert not live_gateway.state.ledger.content.exists(hashlib.sha256(secret.encode()).hexdigest())


def _stream(live_gateway, key: str, sid: str, messages: list[dict]) -> list:
    """The events of a streamed completion, read with a real streaming client (httpx)."""
    body = {"model": "m", "max_tokens": 4, "stream": True, "messages": messages}
    events: list = []
    with httpx.Client(base_url=live_gateway.base, headers={"Authorization": f"Bearer {key}", "X-Lethe-Session": sid},
                      timeout=300) as http, http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200  # the headers went out before the failure
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_a_failure_streaming_fails_before_the_headers(live_gateway, session, monkeypatch):
    key, sid = session
    monkeypatch.setattr(Gate, "scan", _raise(RuntimeError("gate down")))
    _fails_closed(live_gateway, key, sid, "gate", WEATHER, stream=True)
