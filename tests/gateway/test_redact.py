"""The chat endpoint's redact action: the secret never enters the cache, the rest of the result does."""
from __future__ import annotations

import hashlib
import uuid

import pytest

from gateway.demo import CONFIG_FILE, LEAKED_KEY

pytestmark = pytest.mark.model

CALL = {"role": "assistant", "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": "{}"}}]}
REDACTED = CONFIG_FILE.replace(LEAKED_KEY, "[REDACTED:openai_api_key]")


def _chat(http, messages, session=None):
    return http.post("/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 2},
                     headers={"X-Lethe-Session": session} if session else {})


def test_a_secret_in_a_tool_result_is_redacted_by_default_and_only_the_redaction_enters(live_gateway):
    key = live_gateway.new_key("redactco", user="rita")
    messages = [{"role": "user", "content": "check my config"}, CALL,
                {"role": "tool", "tool_call_id": "c1", "content": CONFIG_FILE}]
    with live_gateway.client(key) as http:
        first = _chat(http, messages)
        assert first.status_code == 200, first.text
        session = first.headers["x-lethe-session"]
        action = first.json()["lethe"]["actions"][-1]
        assert action["action"] == "redact" and action["reasons"][-1].startswith("redact_rescan: 1 range(s) cut")
        segments = http.get(f"/v1/sessions/{session}/segments").json()["segments"]
        again = _chat(http, messages, session)  # the agent re-sends its history: reused, not re-admitted
        assert again.status_code == 200 and again.json()["lethe"]["actions"] == []
    tool = segments[-1]
    assert tool["state"] == "live" and tool["content_sha256"] == hashlib.sha256(CONFIG_FILE.encode()).hexdigest()
    state = live_gateway.state
    cache = state.gateway.cache(session)
    text = state.model.tokenizer.decode(list(cache.tokens))
    assert "[REDACTED:openai_api_key]" in text and LEAKED_KEY not in text
    stored = state.ledger.get_segment(session, tool["id"])
    assert state.ledger.content.get(stored.replacement_sha256) == REDACTED.encode()
    assert not state.ledger.content.exists(stored.content_sha256)  # the original, with the key, is kept nowhere
    [record] = state.audit.list(session=session, kind="redact")
    body = record.body
    assert body["content_sha256"] == stored.content_sha256
    start = CONFIG_FILE.encode().index(LEAKED_KEY.encode())
    assert body["redaction"]["cuts"] == [{"kind": "secret", "rule_id": "openai-api-key", "start": start,
                                          "end": start + len(LEAKED_KEY)}]
    assert body["redaction"]["redacted_sha256"] == hashlib.sha256(REDACTED.encode()).hexdigest()
    assert LEAKED_KEY[8:20] not in repr(body)


def test_a_result_the_mcp_proxy_quarantined_never_enters_the_chat_cache(live_gateway):
    """The same bytes, withheld at the MCP boundary, come back as a chat tool message: quarantined."""
    import mcp.types as types

    from gateway.demo import WEB_PAGE
    from gateway.mcp.guard import Call, Guard
    from gateway.tenants import Principal

    state = live_gateway.state
    key = live_gateway.new_key("boundaryco", user="bo")
    guard = Guard(state.gate, state.policy, state.ledger, state.audit, 1_000_000)
    # a page that the chat endpoint's own gate would let through: only the boundary's memory stops it
    page = f"Opening hours: 9-17. Closed on Sundays. (ref {uuid.uuid4().hex[:8]})"
    # bytes no other test stores (the content store is shared and content-addressed: another
    # session that kept WEB_PAGE's bytes would make the blob check below meaningless)
    poisoned = f"{WEB_PAGE}\n<!-- fetched by test_redact {uuid.uuid4().hex} -->"
    outcome = guard.screen_result(Call(Principal("boundaryco", "bo"), None, "web", "web__fetch"),
                                  types.CallToolResult(content=[types.TextContent(type="text", text=page)]))
    assert outcome.decision.action == "allow"
    state.ledger.crossings.write([(state.ledger.crossings.new(
        tenant="boundaryco", session_id=None, channel="mcp", upstream="web", tool="web__fetch", phase="result",
        content_sha256=hashlib.sha256(page.encode()).hexdigest(), action="quarantine", meta={}),
        [hashlib.sha256(page.encode()).hexdigest()])])
    injected = guard.screen_result(Call(Principal("boundaryco", "bo"), None, "web", "web__fetch"),
                                   types.CallToolResult(content=[types.TextContent(type="text", text=poisoned)]))
    assert injected.decision.action == "quarantine"
    fetch = {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "web__fetch", "arguments": "{}"}}]}
    with live_gateway.client(key) as http:
        for content in (page, poisoned):
            reply = _chat(http, [{"role": "user", "content": "open it"}, fetch,
                                 {"role": "tool", "tool_call_id": "c1", "content": content}])
            assert reply.status_code == 200, reply.text
            action = reply.json()["lethe"]["actions"][-1]
            assert action["action"] == "quarantine"
            assert action["reasons"][0].startswith("withheld_at_boundary: crossing crs_")
            cache = state.gateway.cache(reply.headers["x-lethe-session"])
            assert content not in state.model.tokenizer.decode(list(cache.tokens))
            # red team 14: the boundary kept only the bytes' digests, and so does the chat ledger
            [held] = [s for s in state.ledger.segments(reply.headers["x-lethe-session"]) if s.role == "tool"]
            assert held.content_retired and held.content_sha256 == hashlib.sha256(content.encode()).hexdigest()
            assert not state.ledger.content.exists(held.content_sha256)
