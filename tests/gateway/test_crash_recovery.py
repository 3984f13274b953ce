"""A crash (SIGKILL) after a turn's ledger write loses nothing the turn owed.

A real `lethe serve` process is killed while its turn is parked right after the ledger write
(LETHE_TEST_HOLD_AT=turn-written: the turn's rows and intents are committed, its audit records
and its post-turn forget not yet done), then restarted on the same data directory. Before it turns
ready it must have done what the turn owed: the content admitted "for this turn, then forget" is
gone from the ledger and from the database files' bytes, forgotten by the kernel on a cache rebuilt
from the ledger, with a never-saw witness in the audit record; the quarantine record the turn owed
is in the log once; and the log verifies. (That a redone intent appends nothing twice is
tests/audit/test_log.py's `append_keyed` test and tests/ledger's intent tests.)
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from audit.verify import verify_export
from gateway.demo import CONFIG_FILE, LEAKED_KEY, WEB_PAGE, demo_bundle
from gateway.tenants import TenantStore
from tests.conftest import REPO_ROOT
from tests.gateway.conftest import PORT, tool_turn, wait_until

pytestmark = pytest.mark.model

CRASH_PORT = PORT + 1  # beside the live gateway's port, inside the worktree's range


@dataclass
class Server:
    data: Path
    key: str  # an admin key of the tenant
    root: str  # a global admin key (the audit export)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{CRASH_PORT}"

    def start(self, hold: bool) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "LETHE_DATA_DIR": str(self.data),
               "LETHE_POLICY_DIR": str(self.data / "policies"), "LETHE_PORT": str(CRASH_PORT),
               "LETHE_HOST": "127.0.0.1", "LETHE_LOG_JSON": "true", "LETHE_DEBUG": "true",
               "LETHE_MAX_NEW_TOKENS": "4", "LETHE_MODEL_CACHE_DIR": str(_model_cache())}
        env.pop("LETHE_TEST_HOLD_AT", None)
        if hold:
            env["LETHE_TEST_HOLD_AT"] = "turn-written"
        log = open(self.data / "server.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve"], env=env, cwd=REPO_ROOT,
                                     stdout=log, stderr=log)
        wait_until(self._ready, timeout_s=600, what="the gateway turning ready")

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"the gateway exited ({self.proc.returncode}): "
                                 + (self.data / "server.log").read_text()[-3000:])
        try:
            return httpx.get(self.base + "/readyz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def kill(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)  # no shutdown, no checkpoint: WAL and SHM left as they are
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()

    def client(self, key: str | None = None) -> httpx.Client:
        return httpx.Client(base_url=self.base, headers={"Authorization": f"Bearer {key or self.key}"}, timeout=300)

    def crash_mid_turn(self, content: str) -> str:
        """Start a streamed turn carrying `content`, wait for its headers (its ledger write is
        committed and it is parked), SIGKILL the server; returns the session id."""
        body = {"model": "m", "stream": True, "max_tokens": 4, "messages": tool_turn(content)}
        with self.client() as http, http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            sid = response.headers["x-lethe-session"]
            self.kill()
        return sid


def _model_cache() -> Path:
    return Path(os.environ.get("LETHE_MODEL_CACHE_DIR") or REPO_ROOT / "var" / "models").resolve()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    """A data directory with the tenant `crash` (secrets admitted for one turn, then forgotten)."""
    bundle = demo_bundle(tmp_path / "policies")
    (bundle / "data" / "tenants.json").write_text(json.dumps(
        {"lethe": {"tenants": {"crash": {"sensitive_action": "forget"}}}}))
    plans = _model_cache().parent / "kernel-plans"  # a plan calibrated on this machine: skip calibrating
    if plans.is_dir():
        shutil.copytree(plans, tmp_path / "kernel-plans")
    store = TenantStore.from_url(f"sqlite:///{tmp_path / 'lethe.db'}")
    store.create_tenant("crash")
    srv = Server(tmp_path, store.create_key("crash", user="cy", admin=True), store.create_key(None, admin=True))
    yield srv
    srv.stop()


def _files(data: Path) -> list[Path]:
    return sorted(p for p in data.iterdir() if p.name.startswith("lethe.db"))


def _records(srv: Server, sid: str, kind: str) -> list[dict]:
    with srv.client() as http:
        response = http.get("/v1/audit/records", params={"session": sid, "kind": kind})
    assert response.status_code == 200, response.text
    return response.json()["records"]


def _segments(srv: Server, sid: str) -> list[dict]:
    with srv.client() as http:
        response = http.get(f"/v1/sessions/{sid}/segments")
    assert response.status_code == 200, response.text
    return response.json()["segments"]


def _log_verifies(srv: Server) -> None:
    with srv.client(srv.root) as http:
        export = http.get("/v1/audit/export")
        genesis = http.get("/v1/audit/public-key").json()["keys"][0]["public_key_pem"]
    assert export.status_code == 200
    report = verify_export(export.json(), public_key_pem=genesis)
    assert report.ok, report


def _usable(srv: Server, sid: str) -> None:
    with srv.client() as http:
        response = http.post("/v1/chat/completions", headers={"X-Lethe-Session": sid},
                             json={"model": "m", "max_tokens": 1,
                                   "messages": [*tool_turn("ok"), {"role": "user", "content": "thanks"}]})
    assert response.status_code == 200, response.text


def test_a_forget_owed_by_a_crashed_turn_is_done_before_the_restart_is_ready(server: Server) -> None:
    secret = f"{CONFIG_FILE}# crash recovery\n"
    server.start(hold=True)
    sid = server.crash_mid_turn(secret)
    assert any(LEAKED_KEY.encode() in p.read_bytes() for p in _files(server.data))  # committed, not yet forgotten

    server.start(hold=False)
    digest = hashlib.sha256(secret.encode()).hexdigest()
    (seg,) = [s for s in _segments(server, sid) if s["content_sha256"] == digest]
    assert seg["state"] == "forgotten"
    assert not any(LEAKED_KEY.encode() in p.read_bytes() for p in _files(server.data))  # db and -wal bytes
    (record,) = _records(server, sid, "forget")
    body = record["body"]
    assert body["segment_id"] == seg["id"] and body["actor"] == "policy"
    witness = body["witness"]
    assert witness["equal"] is True and witness["max_abs_dk"] == witness["max_abs_dv"] == 0
    assert body["span"] in witness["spans"]
    _log_verifies(server)
    _usable(server, sid)


def test_the_audit_records_owed_by_a_crashed_turn_are_appended_once(server: Server) -> None:
    server.start(hold=True)
    sid = server.crash_mid_turn(WEB_PAGE)  # quarantined: the turn owes a quarantine record

    server.start(hold=False)
    (seg,) = [s for s in _segments(server, sid) if s["state"] == "quarantined"]
    (record,) = _records(server, sid, "quarantine")
    assert record["body"]["segment_id"] == seg["id"]
    _log_verifies(server)
    _usable(server, sid)
