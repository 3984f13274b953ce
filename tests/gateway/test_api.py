"""Bad input, auth, tenant isolation and limits: each refused with a clear 4xx, nothing lost."""
from __future__ import annotations

import hashlib

import pytest

from gateway.demo import WEATHER, WEB_PAGE

pytestmark = pytest.mark.model

TOOL_TURN = [
    {"role": "user", "content": "weather?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": WEATHER},
]


def chat(http, messages, session=None, **extra):
    headers = {"X-Lethe-Session": session} if session else {}
    return http.post("/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 2, **extra},
                     headers=headers)


def test_health_ready_models(live_gateway):
    with live_gateway.client() as http:
        assert http.get("/healthz").json() == {"status": "ok"}
        ready = http.get("/readyz").json()
        assert ready["status"] == "ready" and len(ready["identity"]) == 64
        assert http.get("/v1/models").json()["data"][0]["object"] == "model"
        assert http.get("/metrics").status_code == 403  # a tenant admin: metrics count every tenant
        assert http.get("/no/such/path/1").status_code == 404 and http.get("/no/such/path/2").status_code == 404
    root = live_gateway.state.tenants.create_key(None, admin=True)
    with live_gateway.client(root) as admin:
        text = admin.get("/metrics").text
    assert "lethe_requests_total" in text and "/no/such" not in text
    assert 'route="unmatched",status="404"' in text and 'route="/v1/models",status="200"' in text


def test_auth_required_and_checked(live_gateway):
    with live_gateway.client() as http:
        missing = http.post("/v1/chat/completions", json={}, headers={"Authorization": ""})
        assert missing.status_code == 401 and "Bearer" in missing.json()["error"]["message"]
        wrong = http.get("/v1/models", headers={"Authorization": "Bearer lth_not-a-key"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"


def test_malformed_json_and_unknown_role(live_gateway):
    with live_gateway.client() as http:
        bad = http.post("/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
        role = chat(http, [{"role": "wizard", "content": "hi"}])
        assert role.status_code == 400 and role.json()["error"]["param"] == "messages[0].role"
        missing = chat(http, [{"role": "tool", "content": "x"}])
        assert missing.status_code == 400 and "tool_call_id" in missing.json()["error"]["message"]
        assert missing.json()["error"]["param"] == "messages[0]"
        empty = chat(http, [])
        assert empty.status_code == 400 and empty.json()["error"]["param"] == "messages"


def test_huge_body_and_huge_tool_result(live_gateway):
    with live_gateway.client() as http:
        huge = chat(http, [{"role": "user", "content": "x" * 400_000}])
        assert huge.status_code == 413 and "LETHE_MAX_BODY_BYTES" in huge.json()["error"]["message"]
        chunked = http.post("/v1/chat/completions", headers={"Content-Type": "application/json"},
                            content=(b"x" * 50_000 for _ in range(8)))  # no Content-Length: streamed
        assert chunked.status_code == 413
        big_tool = [*TOOL_TURN[:2], {"role": "tool", "tool_call_id": "c1", "content": "y" * 70_000}]
        response = chat(http, big_tool)
        assert response.status_code == 413 and response.json()["error"]["param"] == "messages[2].content"


def test_context_budget_is_a_clear_400(live_gateway):
    with live_gateway.client() as http:
        response = chat(http, [{"role": "user", "content": "hi"}], max_tokens=9_000)
        assert response.status_code == 400 and "context window" in response.json()["error"]["message"]


def test_invalid_utf8_in_tool_content_is_flagged_not_crashing(live_gateway):
    # a lone surrogate is how invalid UTF-8 arrives inside JSON; the gate flags it
    body = ('{"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "read"}, '
            '{"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function", '
            '"function": {"name": "read_file", "arguments": "{}"}}]}, '
            '{"role": "tool", "tool_call_id": "c", "content": "bytes \\ud800 here"}]}')
    with live_gateway.client() as http:
        response = http.post("/v1/chat/completions", content=body.encode(),
                             headers={"Content-Type": "application/json"})
    assert response.status_code == 200, response.text
    action = [a for a in response.json()["lethe"]["actions"] if a["channel"] == "tool"][0]
    assert action["gate"]["counts"].get("encoding", 0) >= 1


def test_unknown_session_and_segment_are_404(live_gateway):
    with live_gateway.client() as http:
        assert chat(http, [{"role": "user", "content": "hi"}], session="ses_nope").status_code == 404
        ok = chat(http, TOOL_TURN)
        sid = ok.headers["x-lethe-session"]
        missing = http.post(f"/v1/sessions/{sid}/forget", json={"segment_id": "seg_000"})
        assert missing.status_code == 404
        neither = http.post(f"/v1/sessions/{sid}/forget", json={})
        assert neither.status_code == 400 and neither.json()["error"]["param"] == "body"
        segments = http.get(f"/v1/sessions/{sid}/segments").json()["segments"]
        assert [s["state"] for s in segments] == ["live"] * 3  # nothing lost by the refusals


def test_cross_tenant_access_is_refused(live_gateway):
    other = live_gateway.new_key("rival", user="mallory", admin=True)
    with live_gateway.client() as http, live_gateway.client(other) as rival:
        response = chat(http, TOOL_TURN)
        sid = response.headers["x-lethe-session"]
        assert rival.get(f"/v1/sessions/{sid}/segments").status_code == 404
        assert rival.get(f"/v1/sessions/{sid}").status_code == 404
        assert rival.post(f"/v1/sessions/{sid}/forget", json={"span": [0, 5]}).status_code == 404
        assert chat(rival, [{"role": "user", "content": "hi"}], session=sid).status_code == 404
        records = rival.get("/v1/audit/records").json()["records"]
        assert all(r["body"].get("tenant") in (None, "rival") for r in records)
        # identical prompts in two tenants: different salts, separate caches
        mine = chat(http, [{"role": "user", "content": "same prompt"}])
        theirs = chat(rival, [{"role": "user", "content": "same prompt"}])
    gw = live_gateway.state.gateway
    a, b = mine.headers["x-lethe-session"], theirs.headers["x-lethe-session"]
    assert gw.cache(a) is not gw.cache(b)
    assert gw.session_salt(a) != gw.session_salt(b)


def test_another_user_of_the_tenant_cannot_see_or_touch_a_session(live_gateway):
    """Scope tenant_user (the default): sessions, segments, audit listing, erasure and continuing
    the session are the owner's; another user of the tenant gets 404 as for another tenant."""
    owner = live_gateway.new_key("users", user="olga")
    other = live_gateway.new_key("users", user="bob")
    boss = live_gateway.new_key("users", user="root", admin=True)
    with live_gateway.client(owner) as olga, live_gateway.client(other) as bob, live_gateway.client(boss) as admin:
        poisoned = [*TOOL_TURN[:2], {"role": "tool", "tool_call_id": "c1", "content": WEB_PAGE}]
        sid = chat(olga, poisoned).headers["x-lethe-session"]  # a quarantine: an audit record of the session
        assert bob.get(f"/v1/sessions/{sid}").status_code == 404
        assert bob.get(f"/v1/sessions/{sid}/segments").status_code == 404
        assert bob.post(f"/v1/sessions/{sid}/forget", json={"span": [0, 1]}).status_code == 404
        assert chat(bob, [{"role": "user", "content": "hi"}], session=sid).status_code == 404
        mine = chat(bob, [{"role": "user", "content": "mine"}]).headers["x-lethe-session"]
        listed = {r["body"].get("session") for r in bob.get("/v1/audit/records", params={"limit": 1000}).json()["records"]}
        assert sid not in listed
        assert olga.get(f"/v1/sessions/{sid}/segments").status_code == 200
        assert admin.get(f"/v1/sessions/{sid}/segments").status_code == 200
        assert admin.get(f"/v1/sessions/{mine}").status_code == 200
        assert sid in {r["body"].get("session") for r in admin.get("/v1/audit/records", params={"limit": 1000}).json()["records"]}


def test_salted_system_prompt_cache_is_per_scope(live_gateway):
    from gateway.service import PrefixCache

    system = {"role": "system", "content": "You are the prefix-cache test assistant."}
    other = live_gateway.new_key("rival2", user="eve")
    with live_gateway.client() as alice, live_gateway.client(other) as eve:
        first = chat(alice, [system, {"role": "user", "content": "hi"}]).headers["x-lethe-session"]
        second = chat(alice, [system, {"role": "user", "content": "hello"}]).headers["x-lethe-session"]
        third = chat(eve, [system, {"role": "user", "content": "hi"}]).headers["x-lethe-session"]
        end = alice.get(f"/v1/sessions/{first}/segments").json()["segments"][0]["end"]
    gw = live_gateway.state.gateway
    prompt = tuple(gw.cache(first).tokens[:end])
    assert tuple(gw.cache(second).tokens[:end]) == prompt == tuple(gw.cache(third).tokens[:end])
    salt_alice, salt_eve = gw.session_salt(first), gw.session_salt(third)
    assert salt_alice == gw.session_salt(second) != salt_eve
    assert PrefixCache.key(salt_alice, prompt) in gw.prefixes and PrefixCache.key(salt_eve, prompt) in gw.prefixes
    assert gw.cache(first) is not gw.cache(second)


def test_context_window_is_checked_before_anything_is_admitted(live_gateway):
    """A turn refused for the context window admits, stores and audits nothing of its messages."""
    from gateway.demo import CONFIG_FILE

    key = live_gateway.new_key("strictco", user="carol")
    messages = [*TOOL_TURN[:2], {"role": "tool", "tool_call_id": "c1", "content": CONFIG_FILE}]
    audit_size = live_gateway.state.audit.size
    with live_gateway.client(key) as http:
        failed = chat(http, messages, max_tokens=9_000)
        assert failed.status_code == 400 and failed.json()["error"]["code"] == "context_length_exceeded"
        sessions = live_gateway.state.ledger.list_sessions("strictco")
        assert http.get(f"/v1/sessions/{sessions[-1].id}/segments").json()["segments"] == []
    assert live_gateway.state.audit.size == audit_size
    assert not live_gateway.state.ledger.content.exists(hashlib.sha256(CONFIG_FILE.encode()).hexdigest())


def test_a_rewritten_history_keeps_no_forgotten_segment_in_its_middle(live_gateway, tmp_path, with_tenant_policy):
    """A policy that forgets a secret after its turn; a client that then rewrites that part of the
    history must get a conversation without the dead segment, reused as is by the next turn."""
    from gateway.demo import CONFIG_FILE

    key = live_gateway.new_key("rewrites", user="rita")
    secret = [*TOOL_TURN[:2], {"role": "tool", "tool_call_id": "c1", "content": CONFIG_FILE + "# rewrite\n"}]
    rewritten = [TOOL_TURN[0], {"role": "assistant", "content": "no tools today"}, {"role": "user", "content": "ok"}]
    ledger = live_gateway.state.ledger

    def conversation(sid):
        return [(s.id, s.state.value) for s in ledger.segments(sid) if s.state.value != "superseded"]
    with with_tenant_policy(live_gateway.state.policy, tmp_path, {"rewrites": {"sensitive_action": "forget"}}), \
            live_gateway.client(key) as http:
        sid = chat(http, secret).headers["x-lethe-session"]
        assert conversation(sid)[-1][1] == "forgotten"
        assert chat(http, rewritten, session=sid).status_code == 200
        after_rewrite = conversation(sid)
        assert [state for _, state in after_rewrite] == ["live"] * 3
        longer = [*rewritten, {"role": "assistant", "content": "fine"}, {"role": "user", "content": "more"}]
        assert chat(http, longer, session=sid).status_code == 200
    assert conversation(sid)[:3] == after_rewrite and len(conversation(sid)) == 5
