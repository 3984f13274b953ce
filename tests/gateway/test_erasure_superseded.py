"""Erasure covers superseded segments (issue 13): selectable through the API, swept by retention,
and a forget the ledger cannot complete at rest fails loudly with nothing signed."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from ledger import ErasureIncomplete

pytestmark = pytest.mark.model

SECRET_NOTE = "my locker code is 4417-superseded"


def chat(http, messages, session=None):
    headers = {"X-Lethe-Session": session} if session else {}
    response = http.post("/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 2},
                         headers=headers)
    assert response.status_code == 200, response.text
    return response.headers["x-lethe-session"]


def superseded_session(live, http, note: str) -> tuple[str, str, str]:
    """A session whose first user message was rewritten away: (session, segment id, its sha256)."""
    sid = chat(http, [{"role": "user", "content": note}])
    chat(http, [{"role": "user", "content": "something else"}], session=sid)
    seg = next(s for s in live.state.ledger.segments(sid) if s.state.value == "superseded")
    return sid, seg.id, seg.content_sha256


def test_a_superseded_segment_can_be_forgotten_through_the_api(live_gateway):
    key = live_gateway.new_key("sup-api", user="sue", admin=True)
    ledger = live_gateway.state.ledger
    with live_gateway.client(key) as http:
        sid, seg_id, digest = superseded_session(live_gateway, http, SECRET_NOTE + " (api)")
        assert ledger.content.exists(digest)
        response = http.post(f"/v1/sessions/{sid}/forget", json={"segment_id": seg_id})
    assert response.status_code == 200, response.text
    assert response.json()["segments"] == [seg_id] and len(response.json()["records"]) == 1
    assert not ledger.content.exists(digest)
    assert next(s for s in ledger.segments(sid) if s.id == seg_id).state.value == "forgotten"


def test_retention_sweeps_superseded_segments_with_an_audit_record(live_gateway):
    key = live_gateway.new_key("sup-ret", user="rex", admin=True)
    ledger = live_gateway.state.ledger
    with live_gateway.client(key) as http:
        sid, seg_id, digest = superseded_session(live_gateway, http, SECRET_NOTE + " (retention)")
        live_gateway.state.gateway.sweep_retention(now=datetime.now(timezone.utc) + timedelta(days=400))
        records = http.get("/v1/audit/records", params={"session": sid, "kind": "content-erase"}).json()["records"]
    assert seg_id in {r["body"]["segment_id"] for r in records}
    assert all(r["body"]["actor"] == "retention" and "witness" not in r["body"] for r in records)
    assert not ledger.content.exists(digest)


def test_an_incomplete_erasure_is_a_503_naming_the_ledger_and_signs_nothing(live_gateway, monkeypatch):
    key = live_gateway.new_key("sup-fail", user="fay", admin=True)
    ledger, audit = live_gateway.state.ledger, live_gateway.state.audit
    with live_gateway.client(key) as http:
        sid = chat(http, [{"role": "user", "content": "hello there"}])
        seg = ledger.segments(sid)[0]

        def stuck(timeout_s: float = 5.0) -> None:
            raise ErasureIncomplete("erased content may still be in the SQLite WAL (injected)")
        monkeypatch.setattr(ledger, "scrub", stuck)
        size = audit.size
        response = http.post(f"/v1/sessions/{sid}/forget", json={"segment_id": seg.id})
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert "ledger" in error["message"] and error["code"] == "ledger_failed"
    assert audit.size == size
