"""The wire: ranges validated, every error in the OpenAI shape naming its component, indices that
are the client's own, and streamed `usage` exactly as OpenAI sends it."""
from __future__ import annotations

import json
import socket

import pytest

from gateway.demo import WEATHER
from tests.gateway.conftest import PORT, tool_turn

pytestmark = pytest.mark.model

HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("field,value", [
    ("seed", 10**30), ("seed", -1), ("max_tokens", 10**12), ("n", 2),
    ("stop", ["a", "b", "c", "d", "e"]), ("stop", "x" * 300), ("stop", [""]), ("temperature", 3),
])
def test_out_of_range_fields_are_a_400_naming_the_field(live_gateway, field, value):
    with live_gateway.client() as http:
        response = http.post("/v1/chat/completions", json={"model": "m", "messages": HI, field: value})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith(field)


@pytest.mark.parametrize("field,value,param", [
    ("stream", "yes", "stream"), ("stream", 1, "stream"), ("max_tokens", "5", "max_tokens"),
    ("temperature", "1", "temperature"), ("seed", 1.0, "seed"), ("model", 5, "model"),
    ("stream_options", {"include_usage": "true"}, "stream_options.include_usage"),
    ("logprobs", "true", "logprobs"), ("presence_penalty", "0", "presence_penalty"),
    ("messages", [*HI, {"role": "user", "content": 5}], "messages[1].content"),
    ("messages", [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}]}],
     "messages[0].tool_calls[0].function.arguments"),
])
def test_wrong_types_are_refused_naming_the_field_never_coerced(live_gateway, field, value, param):
    with live_gateway.client() as http:
        response = http.post("/v1/chat/completions", json={"model": "m", "messages": HI, field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["code"] == "invalid_request"


def test_numbers_of_either_json_spelling_are_accepted(live_gateway):
    """Strict is not pedantic: an integral temperature is a number, as in OpenAI's API."""
    with live_gateway.client() as http:
        response = http.post("/v1/chat/completions", json={"model": "m", "messages": HI, "max_tokens": 1,
                                                           "temperature": 1, "top_p": 1})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("path", ["/v1/audit/records/" + "9" * 40, "/v1/audit/erasures/" + "9" * 40 + "/proof",
                                  "/v1/audit/records/-1"])
def test_path_integers_are_bounded(live_gateway, path):
    with live_gateway.client() as http:
        response = http.get(path)
    assert response.status_code == 400 and response.json()["error"]["param"] == "index"


def test_unknown_routes_and_audit_404s_use_the_openai_shape(live_gateway):
    with live_gateway.client() as http:
        missing = http.get("/v1/nothing-here")
        record = http.get("/v1/audit/records/999999")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "invalid_request_error"
    assert record.status_code == 404 and record.json()["error"]["message"].startswith("audit:")


def test_an_unexpected_exception_is_a_500_in_the_openai_shape_logged_once(live_gateway, monkeypatch, capfd):
    gw = live_gateway.state.gateway
    monkeypatch.setattr(type(gw), "inspect", lambda *_a, **_k: {}["boom"])
    with live_gateway.client() as http:
        sid = http.post("/v1/chat/completions", json={"model": "m", "max_tokens": 1, "messages": HI}
                        ).headers["x-lethe-session"]
        capfd.readouterr()
        response = http.get(f"/v1/sessions/{sid}")
    assert response.status_code == 500
    assert response.json()["error"] == {"message": response.json()["error"]["message"], "type": "server_error",
                                        "code": "gateway_error", "param": None}
    lines = [json.loads(line) for line in capfd.readouterr().err.splitlines()
             if line.startswith("{") and "http.unhandled" in line]
    assert len(lines) == 1 and "KeyError" in lines[0]["traceback"]


def test_a_refused_policy_reload_is_a_422_naming_the_field_and_needs_a_global_admin(live_gateway, monkeypatch):
    from policies import PolicyEngine, PolicyError

    def refuse(self):
        raise PolicyError("data.lethe.tenants.acme.thresholds.injection must be a number, got string")
    monkeypatch.setattr(PolicyEngine, "reload", refuse)
    root = live_gateway.state.tenants.create_key(None, admin=True)
    with live_gateway.client() as tenant_admin, live_gateway.client(root) as http:
        scoped = tenant_admin.post("/v1/admin/policies/reload")
        response = http.post("/v1/admin/policies/reload")
    assert scoped.status_code == 403 and scoped.json()["error"]["code"] == "global_admin_required"
    assert response.status_code == 422 and response.json()["error"]["code"] == "policy_refused"
    assert "thresholds.injection must be a number" in response.json()["error"]["message"]


def test_message_index_is_the_clients_own(live_gateway):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    with live_gateway.client() as http:
        response = http.post("/v1/chat/completions",
                             json={"model": "m", "max_tokens": 1, "messages": tool_turn(WEATHER), "tools": tools})
        big = http.post("/v1/chat/completions", json={"model": "m", "max_tokens": 1, "tools": tools,
                                                      "messages": tool_turn("y" * 70_000)})
    assert response.headers["x-lethe-actions"] == "2:allow"
    assert response.json()["lethe"]["actions"][0]["message_index"] == 2
    assert big.status_code == 413 and big.json()["error"]["param"] == "messages[2].content"


def _events(http, **extra) -> list[dict]:
    with http.stream("POST", "/v1/chat/completions",
                     json={"model": "m", "max_tokens": 3, "stream": True, "messages": HI, **extra}) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_streamed_usage_only_when_asked_in_its_own_last_chunk(live_gateway):
    with live_gateway.client() as http:
        plain = _events(http)
        asked = _events(http, stream_options={"include_usage": True})
    assert all("usage" not in e for e in plain) and plain[-1]["choices"][0]["finish_reason"]
    assert all("usage" not in e for e in asked[:-1])
    assert asked[-1]["choices"] == [] and asked[-1]["usage"]["completion_tokens"] >= 1
    assert asked[-2]["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("request_bytes", [
    b"GARBAGE\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n",
    b"GET / HTTP/1.1\r\nBad Header Line\r\n\r\n",
], ids=["not-http", "bad-content-length", "bad-header"])
def test_a_malformed_http_request_gets_the_openai_error_shape(live_gateway, request_bytes):
    """The server's own 400 (before the app sees anything) is JSON in the OpenAI shape too."""
    with socket.create_connection(("127.0.0.1", PORT), timeout=60) as sock:
        sock.sendall(request_bytes)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), raw
    assert b"content-type: application/json" in head.lower()
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_http" and error["message"]


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/sessions/ses_x/forget"])
def test_a_json_body_without_a_json_content_type_is_a_400_that_says_which_header_to_send(live_gateway, content_type,
                                                                                         path):
    """Not pydantic's "Input should be a valid dictionary": the client is told what it sent and what to send."""
    body = json.dumps({"model": "m", "messages": HI, "max_tokens": 1}).encode()
    headers = {"Content-Type": content_type} if content_type else {}
    with live_gateway.client() as http:  # httpx sends raw `content` with no Content-Type of its own
        response = http.post(path, content=body, headers=headers)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "unsupported_content_type"
    assert error["param"] is None and "send `Content-Type: application/json`" in error["message"]
    assert (content_type or "no Content-Type") in error["message"]


@pytest.mark.parametrize("body", [b'{"model": "m", "messages": [', b"{'model': 'm'}", b'{"model": "m",}'],
                         ids=["truncated", "single-quotes", "trailing-comma"])
def test_a_body_that_is_not_json_is_a_400_invalid_json_that_says_where(live_gateway, body):
    with live_gateway.client() as http:
        response = http.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_json" and error["param"] is None
    assert error["message"].startswith("the body is not valid JSON: ") and " at byte " in error["message"]
