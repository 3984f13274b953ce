"""A turn always ends: disconnects at every moment (streaming or not, chunked or not), lock
timeouts, concurrent turns on one session, and the sweeper and /readyz throughout.

Each attack runs against the real uvicorn server on 127.0.0.1 with real clients (raw sockets,
httpx). The tenant here forgets secrets after the turn (`sensitive_action: "forget"`; the shipped
default redacts them): a tool result carrying a secret is admitted for the turn and forgotten right
after it, so "the turn ended" is observable as "the secret's content is gone from the ledger, the
lock is free, the session answers".
"""
from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import pytest

from gateway.demo import CONFIG_FILE, LEAKED_KEY
from tests.gateway.conftest import PORT, raw_request, snapshot, tenant_policy, tool_turn, turns_settled, wait_until

pytestmark = pytest.mark.model



@pytest.fixture
def secret(request) -> str:
    """A leaked-key file unique to the test, so that its content blob is this test's alone."""
    return f"{CONFIG_FILE}# {request.node.name}\n"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.fixture(scope="module")
def strict_key(live_gateway, tmp_path_factory) -> Iterator[str]:
    with tenant_policy(live_gateway.state.policy, tmp_path_factory.mktemp("policy"),
                       {"lifecycle": {"sensitive_action": "forget"}}):
        yield live_gateway.new_key("lifecycle", user="dora")


_TURNS_BEFORE: dict[str, float] = {}  # session -> turns ended (all sessions) once it was opened


def _turns_ended(live_gateway) -> float:
    return sum(s.value for metric in live_gateway.state.metrics.turns.collect() for s in metric.samples
               if s.name.endswith("_total"))


def _new_session(live_gateway, key: str) -> str:
    with live_gateway.client(key) as http:
        response = http.post("/v1/chat/completions", json={"model": "m", "max_tokens": 1,
                                                           "messages": [{"role": "user", "content": "hello"}]})
    assert response.status_code == 200, response.text
    sid = response.headers["x-lethe-session"]
    wait_until(lambda: turns_settled(live_gateway), what="the opening turn ending")
    _TURNS_BEFORE[sid] = _turns_ended(live_gateway)
    return sid


def _secret_body(secret: str, stream: bool, max_tokens: int = 8) -> bytes:
    return json.dumps({"model": "m", "stream": stream, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
                                    *tool_turn(secret)]}).encode()


def _assert_turn_ended(live_gateway, key: str, sid: str, secret: str, admitted: bool = True) -> None:
    """Every turn ended: no lock held, the secret admitted for one turn forgotten (content gone), or
    the turn rolled back before admitting it (a client gone during the prefill stops it there), the
    ledger tiling the cache, the session usable."""
    ledger, sha = live_gateway.state.ledger, _sha(secret)

    def ended() -> bool:
        attacked_turn_ended = _turns_ended(live_gateway) > _TURNS_BEFORE[sid]
        return (attacked_turn_ended or not admitted) and turns_settled(live_gateway)
    wait_until(ended, what="the turn ending with its secret forgotten")
    assert not ledger.content.exists(sha)
    assert all(s.state.value == "forgotten" for s in ledger.segments(sid) if s.content_sha256 == sha)
    snapshot(live_gateway, sid)  # checks the ledger against the cache
    assert LEAKED_KEY[:20] not in json.dumps(ledger.segments(sid), default=str)
    with live_gateway.client(key) as http:
        again = http.post("/v1/chat/completions", headers={"X-Lethe-Session": sid},
                          json={"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "again"}]})
        assert again.status_code == 200, again.text
        assert http.get(f"/v1/sessions/{sid}").status_code == 200


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_disconnect_right_after_sending_still_ends_the_turn(live_gateway, strict_key, secret, stream, chunked):
    sid = _new_session(live_gateway, strict_key)
    sock = raw_request(PORT, "/v1/chat/completions", _secret_body(secret, stream), key=strict_key, chunked=chunked,
                       headers={"X-Lethe-Session": sid})
    sock.close()  # before the first token: the agent timed out, the user pressed stop
    _assert_turn_ended(live_gateway, strict_key, sid, secret)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_disconnect_mid_stream_ends_the_turn(live_gateway, strict_key, secret, chunked):
    sid = _new_session(live_gateway, strict_key)
    sock = raw_request(PORT, "/v1/chat/completions", _secret_body(secret, True, max_tokens=64), key=strict_key,
                       chunked=chunked, headers={"X-Lethe-Session": sid})
    sock.settimeout(300)
    received = b""
    while b"data: " not in received:  # the headers and the first event are out: generation runs
        received += sock.recv(4096)
    assert b" 200 " in received.split(b"\r\n", 1)[0]
    sock.close()
    _assert_turn_ended(live_gateway, strict_key, sid, secret)


def test_disconnect_after_the_last_token_ends_the_turn_once(live_gateway, strict_key, secret):
    sid = _new_session(live_gateway, strict_key)
    audit_before = live_gateway.state.audit.size
    sock = raw_request(PORT, "/v1/chat/completions", _secret_body(secret, True, max_tokens=2), key=strict_key,
                       headers={"X-Lethe-Session": sid})
    sock.settimeout(300)
    received = b""
    while b'"finish_reason": "' not in received:
        received += sock.recv(4096)
    sock.close()  # gone before [DONE]
    _assert_turn_ended(live_gateway, strict_key, sid, secret)
    forgets = live_gateway.state.audit.list(session=sid, kind="forget")
    assert len(forgets) == 1 and live_gateway.state.audit.size > audit_before  # forgotten and audited, once


def test_httpx_abandoned_stream_and_chunked_upload(live_gateway, strict_key, secret):
    sid = _new_session(live_gateway, strict_key)
    body = _secret_body(secret, True, max_tokens=64)
    with httpx.Client(base_url=live_gateway.base, timeout=300,
                      headers={"Authorization": f"Bearer {strict_key}", "X-Lethe-Session": sid}) as http:
        with http.stream("POST", "/v1/chat/completions", content=(body[i:i + 500] for i in range(0, len(body), 500)),
                         headers={"Content-Type": "application/json"}) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    break  # abandon the stream after the first event
    _assert_turn_ended(live_gateway, strict_key, sid, secret)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chunked_upload_reaches_the_app_intact(live_gateway, strict_key, stream):
    body = json.dumps({"model": "m", "max_tokens": 2, "stream": stream,
                       "messages": [{"role": "user", "content": "x" * 5000}]}).encode()
    sock = raw_request(PORT, "/v1/chat/completions", body, key=strict_key, chunked=True)
    sock.settimeout(300)
    data = b""
    while not (data.endswith(b"0\r\n\r\n") or (b"content-length" in data.lower() and data.count(b"}") and
                                               data.rstrip().endswith(b"}"))):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    sock.close()
    assert data.startswith(b"HTTP/1.1 200"), data[:300]
    assert (b"[DONE]" in data) if stream else (b'"chat.completion"' in data)


def test_client_that_dies_mid_upload_leaves_nothing(live_gateway, strict_key, secret):
    sid = _new_session(live_gateway, strict_key)
    before = snapshot(live_gateway, sid)
    sock = socket.create_connection(("127.0.0.1", PORT), timeout=30)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + strict_key.encode()
                 + b"\r\nX-Lethe-Session: " + sid.encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
                 + b"100\r\n" + _secret_body(secret, False)[:100])  # a chunk announced, never finished
    sock.close()
    wait_until(lambda: turns_settled(live_gateway), what="the aborted upload being dropped")
    assert snapshot(live_gateway, sid) == before
    with live_gateway.client(strict_key) as http:
        assert http.get("/readyz").status_code == 200


def test_malformed_framing_is_refused_cleanly(live_gateway, strict_key):
    sock = socket.create_connection(("127.0.0.1", PORT), timeout=30)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n")
    reply = sock.recv(4096)
    sock.close()
    assert reply.startswith(b"HTTP/1.1 400"), reply[:200]
    with live_gateway.client(strict_key) as http:
        huge_chunk = raw_request(PORT, "/v1/chat/completions", b"y" * 400_000, key=strict_key, chunked=True)
        huge_chunk.settimeout(60)
        assert huge_chunk.recv(4096).startswith(b"HTTP/1.1 413")
        huge_chunk.close()
        assert http.get("/readyz").status_code == 200


def test_a_busy_session_answers_503_with_retry_after_and_the_sweeper_keeps_sweeping(live_gateway, strict_key, secret):
    sid = _new_session(live_gateway, strict_key)
    live = live_gateway.state.gateway.sessions.get(sid)
    sweeps = live_gateway.state.sweeps
    assert live.lock.acquire(timeout=30)  # a turn that never ends, as the old gateway had
    try:
        with live_gateway.client(strict_key) as http:
            busy = http.post("/v1/chat/completions", headers={"X-Lethe-Session": sid},
                             json={"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
            assert busy.status_code == 503 and busy.json()["error"]["code"] == "session_busy"
            assert busy.headers["retry-after"] == "1"
            assert http.get(f"/v1/sessions/{sid}").status_code == 503
            assert http.get("/readyz").status_code == 200
        wait_until(lambda: live_gateway.state.sweeps >= sweeps + 2, 60, "two sweeper passes")
    finally:
        live.lock.release()
    _assert_turn_ended(live_gateway, strict_key, sid, secret, admitted=False)


def test_concurrent_turns_on_one_session_all_end(live_gateway, strict_key, secret):
    sid = _new_session(live_gateway, strict_key)
    results: list[int] = []
    ready: list[int] = []
    stop = threading.Event()

    def one(i: int) -> None:
        body = json.loads(_secret_body(secret, i % 2 == 0, max_tokens=4))
        with httpx.Client(base_url=live_gateway.base, timeout=300) as http:
            r = http.post("/v1/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {strict_key}", "X-Lethe-Session": sid})
            results.append(r.status_code)
            if r.status_code == 503:
                assert r.json()["error"]["code"] == "session_busy" and r.headers["retry-after"]

    def probe_ready() -> None:
        with httpx.Client(base_url=live_gateway.base, timeout=30) as http:
            while not stop.is_set():
                ready.append(http.get("/readyz").status_code)
                stop.wait(0.2)

    watcher = threading.Thread(target=probe_ready)
    watcher.start()
    workers = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    stop.set()
    watcher.join()
    assert len(results) == 6 and set(results) <= {200, 503} and 200 in results
    assert ready and set(ready) == {200}
    _assert_turn_ended(live_gateway, strict_key, sid, secret)


def test_audit_export_streams_its_whole_body_through_the_middleware(live_gateway, tmp_path):
    from typer.testing import CliRunner

    from gateway.cli import app as cli

    admin = live_gateway.state.tenants.create_key(None, admin=True)
    with live_gateway.client(admin) as http:
        export = http.get("/v1/audit/export")  # a bodiless GET: no Content-Length, no Transfer-Encoding
    assert export.status_code == 200 and len(export.content) > 0
    assert json.loads(export.content)["records"]
    pinned = tmp_path / "audit-public.pem"
    pinned.write_text(live_gateway.state.audit.keys()[0]["public_key_pem"])  # the root of trust, not the export's
    result = CliRunner().invoke(cli, ["audit", "verify", "--url", live_gateway.base, "--api-key", admin,
                                      "--public-key", str(pinned)])
    assert result.exit_code == 0, result.output


def test_shutdown_during_a_stream_ends_the_turn_within_the_grace_period(real_model, secret, tmp_path):
    from gateway.config import Settings
    from gateway.demo import local_gateway

    settings = Settings(max_new_tokens=8, retention_sweep_s=3600, shutdown_grace_s=2.0, log_json=True, debug=True)
    with local_gateway(settings, model=real_model, port=PORT + 1) as gw, ExitStack() as stack:
        state = gw.app.state.lethe
        state.tenants.create_tenant("shutdown")
        key = state.tenants.create_key("shutdown", user="sam")
        stack.enter_context(tenant_policy(state.policy, tmp_path, {"shutdown": {"sensitive_action": "forget"}}))
        sock = raw_request(PORT + 1, "/v1/chat/completions", _secret_body(secret, True, max_tokens=4000), key=key)
        sock.settimeout(300)
        received = b""
        while b"data: " not in received:
            received += sock.recv(4096)
        sid = next(line.split(b": ", 1)[1].decode() for line in received.split(b"\r\n")
                   if line.lower().startswith(b"x-lethe-session"))
        gw.server.should_exit = True  # SIGTERM's path: graceful shutdown, then the lifespan's drain
        wait_until(lambda: state.gateway.stopping.is_set() and state.gateway.running == 0, 120, "the drain")
        sock.close()
        segments = state.ledger.segments(sid)
        assert any(s.content_sha256 == _sha(secret) and s.state.value == "forgotten" for s in segments)
        assert not state.ledger.content.exists(_sha(secret))


def test_a_long_prompt_abandoned_by_its_client_stops_prefilling(live_gateway, strict_key):
    """Found by the red team: a ~6,000-token prompt whose client left after 0.5 s kept its session
    locked for the whole prefill (a minute here). The prefill now runs in pieces and stops at the
    next piece once the client is gone: far fewer rows than the prompt are computed, and the session
    is free and unchanged."""
    sid = _new_session(live_gateway, strict_key)
    before = snapshot(live_gateway, sid)
    prefill = live_gateway.state.metrics.tokens.labels("prefill")
    counted = prefill._value.get()
    words = " ".join(f"word{i} and a little more text" for i in range(1200))
    body = json.dumps({"model": "m", "stream": True, "max_tokens": 4,
                       "messages": [{"role": "user", "content": "hello"}, {"role": "user", "content": words}]})
    sock = raw_request(PORT, "/v1/chat/completions", body.encode(), key=strict_key,
                       headers={"X-Lethe-Session": sid})
    time.sleep(0.5)
    sock.close()
    wait_until(lambda: turns_settled(live_gateway), what="the abandoned turn ending")
    prompt_tokens = len(live_gateway.state.model.tokenizer.encode(words))
    assert prefill._value.get() - counted < prompt_tokens / 2, "the abandoned prompt was prefilled to its end"
    assert snapshot(live_gateway, sid) == before
    with live_gateway.client(strict_key) as http:
        assert http.get(f"/v1/sessions/{sid}").status_code == 200
