"""The retention sweeper forgets what the retention policy says has expired, exactly and audited."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from gateway.demo import CONFIG_FILE, WEB_PAGE

pytestmark = pytest.mark.model


def _tool_turn(http, task: str, tool: str, content: str) -> tuple[list[dict], str, str]:
    """One turn whose last message is a tool result: (messages, session id, the tool result's action)."""
    messages = [
        {"role": "user", "content": task},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": tool, "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "t1", "content": content},
    ]
    response = http.post("/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 2})
    assert response.status_code == 200, response.text
    return messages, response.headers["x-lethe-session"], response.json()["lethe"]["actions"][0]["action"]


def test_expired_secret_is_forgotten_by_the_sweeper(live_gateway):
    gw = live_gateway.state.gateway
    with live_gateway.client() as http:
        # content unique to this test: blobs are content-addressed, and other tests' sessions on this
        # shared gateway may hold the plain demo file (their live segments keep its blob)
        messages, sid, action = _tool_turn(http, "check the env file", "read_file", CONFIG_FILE + "# retention\n")
        assert action == "allow"  # the demo tenant admits secrets
        before = http.get(f"/v1/sessions/{sid}/segments").json()["segments"]
        assert before[-1]["data_class"] == "secret" and before[-1]["state"] == "live"

        gw.sweep_retention()  # the demo tenant keeps secrets 600 s: nothing of this session expires yet
        assert http.get(f"/v1/sessions/{sid}/segments").json()["segments"][-1]["state"] == "live"
        swept = gw.sweep_retention(now=datetime.now(timezone.utc) + timedelta(seconds=601))

        assert swept >= 1
        after = http.get(f"/v1/sessions/{sid}/segments").json()["segments"]
        assert after[-1]["state"] == "forgotten" and after[-1]["start"] == after[-1]["end"]
        records = http.get("/v1/audit/records", params={"session": sid, "kind": "retention-forget"}).json()["records"]
        assert len(records) == 1
        witness = records[0]["body"]["witness"]
        assert witness["equal"] is True and witness["max_abs_dk"] == 0
        fresh = http.post("/v1/chat/completions", json={"model": "m", "messages": messages[:-1], "max_tokens": 2})
        digest_fresh = http.get(f"/v1/sessions/{fresh.headers['x-lethe-session']}").json()["cache_digest"]
        assert http.get(f"/v1/sessions/{sid}").json()["cache_digest"] == digest_fresh
    assert not gw.p.ledger.content.exists(before[-1]["content_sha256"])


def test_expired_quarantine_loses_its_content_but_keeps_its_stub(live_gateway):
    gw = live_gateway.state.gateway
    with live_gateway.client() as http:
        _, sid, action = _tool_turn(http, "summarise this page", "web_fetch", WEB_PAGE)
        assert action == "quarantine"
        quarantined = http.get(f"/v1/sessions/{sid}/segments").json()["segments"][-1]
        assert gw.p.ledger.content.exists(quarantined["content_sha256"])
        digest = http.get(f"/v1/sessions/{sid}").json()["cache_digest"]

        later = datetime.now(timezone.utc) + timedelta(days=8)  # quarantined content is kept 7 days
        gw.sweep_retention(now=later)
        gw.sweep_retention(now=later)  # a second sweep finds nothing new to retire

        after = http.get(f"/v1/sessions/{sid}/segments").json()["segments"][-1]
        assert after["state"] == "quarantined" and (after["start"], after["end"]) == (quarantined["start"], quarantined["end"])
        assert http.get(f"/v1/sessions/{sid}").json()["cache_digest"] == digest  # the stub stays in the cache
        records = http.get("/v1/audit/records", params={"session": sid, "kind": "retention-retire"}).json()["records"]
        assert len(records) == 1 and records[0]["body"]["segment_id"] == quarantined["id"]
    assert not gw.p.ledger.content.exists(quarantined["content_sha256"])
