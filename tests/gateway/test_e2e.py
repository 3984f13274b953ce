"""The demo scenario end to end: the real openai SDK against uvicorn on loopback, the real model."""
from __future__ import annotations

import json

import pytest
from openai import OpenAI
from typer.testing import CliRunner

from gateway.cli import app as cli
from gateway.demo import CONFIG_FILE, LEAKED_KEY, WEB_PAGE, run_scenario

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def scenario(live_gateway):
    return run_scenario(live_gateway.base, live_gateway.key, max_tokens=4)


def test_actions_follow_policy(scenario):
    actions = [s.action for s in scenario.steps]
    assert actions == ["allow", "quarantine", "allow"], scenario.steps
    assert scenario.steps[1].injection >= 0.5
    assert scenario.steps[2].secret >= 0.5


def test_quarantined_text_never_enters_cache(live_gateway, scenario, real_model):
    cache = live_gateway.state.gateway.cache(scenario.session_id)
    text = real_model.tokenizer.decode(cache.tokens)
    assert "Ignore all previous instructions" not in text
    assert "evil.example" not in text
    assert "[tool result withheld by policy: prompt-injection]" in text
    segments = live_gateway.client().get(f"/v1/sessions/{scenario.session_id}/segments").json()["segments"]
    quarantined = [s for s in segments if s["state"] == "quarantined"]
    assert len(quarantined) == 1 and quarantined[0]["tool"] == "fetch_page"


def test_forget_equals_never_saw(live_gateway, scenario):
    witness = scenario.forget["witness"]
    assert witness["equal"] is True
    assert witness["max_abs_dk"] == 0 and witness["max_abs_dv"] == 0 and witness["max_abs_dlogits"] == 0
    assert LEAKED_KEY not in json.dumps(scenario.forget)
    with live_gateway.client() as http:
        after = http.get(f"/v1/sessions/{scenario.session_id}").json()
        # a fresh session sent the same history without the leaked config file
        never_saw = [m for m in scenario.messages if m.get("content") != CONFIG_FILE][:-1]
        response = http.post("/v1/chat/completions", json={"model": "x", "messages": never_saw, "max_tokens": 2})
        assert response.status_code == 200, response.text
        fresh = http.get(f"/v1/sessions/{response.headers['x-lethe-session']}").json()
    assert after["tokens"] == fresh["tokens"]
    assert after["cache_digest"] == fresh["cache_digest"]


def test_erasure_proof_verifies(scenario):
    assert scenario.proof_ok, scenario.proof_detail


def test_audit_verify_cli_on_export(live_gateway, scenario, tmp_path, monkeypatch):
    settings = live_gateway.state.settings
    monkeypatch.setenv("LETHE_DATA_DIR", str(settings.data_dir))
    monkeypatch.setenv("LETHE_AUDIT_DATABASE_URL", settings.audit_db_url)  # the audit log has its own file
    export = tmp_path / "audit.json"
    runner = CliRunner()
    result = runner.invoke(cli, ["audit", "export", "--out", str(export)])
    assert result.exit_code == 0, result.output
    assert LEAKED_KEY not in export.read_text() and "Ignore all previous" not in export.read_text()
    pem = tmp_path / "audit-genesis.pem"
    pem.write_text(live_gateway.state.audit.keys()[0]["public_key_pem"])
    result = runner.invoke(cli, ["audit", "verify", "--export", str(export)])
    assert result.exit_code == 1 and "root of trust" in result.output, result.output  # no anchor: not accepted
    result = runner.invoke(cli, ["audit", "verify", "--export", str(export), "--public-key", str(pem)])
    assert result.exit_code == 0, result.output
    # tampering with one record is caught and named
    doc = json.loads(export.read_text())
    _tamper_first_forget(doc)
    export.write_text(json.dumps(doc))
    result = runner.invoke(cli, ["audit", "verify", "--export", str(export), "--public-key", str(pem)])
    assert result.exit_code == 1 and "leaf hash" in result.output, result.output


def _tamper_first_forget(doc: dict) -> None:
    for record in doc["records"]:
        body = record.get("body", record)
        if body.get("kind") == "forget":
            body["token_count"] = body.get("token_count", 0) + 1
            return
    raise AssertionError("no forget record in the export")


def test_streaming_with_openai_sdk(live_gateway):
    client = OpenAI(base_url=live_gateway.base + "/v1", api_key=live_gateway.key, max_retries=0)
    stream = client.chat.completions.create(
        model="smollm2", stream=True, max_tokens=4,
        messages=[{"role": "user", "content": "Say hello."},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "c1", "type": "function", "function": {"name": "fetch_page", "arguments": "{}"}}]},
                  {"role": "tool", "tool_call_id": "c1", "content": WEB_PAGE}])
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    lethe = chunks[-1].model_extra["lethe"]
    assert [a["action"] for a in lethe["actions"]] == ["quarantine"]
