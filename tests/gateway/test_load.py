"""Concurrent sessions on loopback: no 5xx, no lost or reordered ledger entries, a verifiable log."""
from __future__ import annotations

import pytest

from audit.verify import verify_export
from gateway.loadtest import run_load

pytestmark = [pytest.mark.model, pytest.mark.slow]


def test_concurrent_sessions_keep_order_and_audit(live_gateway, tmp_path):
    result = run_load(live_gateway.base, live_gateway.key, sessions=8, turns=5)
    assert result["status_5xx"] == 0 and result["status_non_200"] == 0, result["problems"]
    assert result["ledgers_ok"], result["problems"]
    assert result["tool_results"] == 8 * 5
    assert len(set(result["session_ids"])) == 8
    audit = live_gateway.state.audit
    audit.checkpoint()
    audit.export(tmp_path / "export.json")
    report = verify_export(tmp_path / "export.json", public_key_pem=audit.keys()[0]["public_key_pem"])
    assert report.ok, report.errors
    quarantines = audit.list(kind="quarantine", limit=1000)
    assert {r.body["session"] for r in quarantines} >= set(result["session_ids"])  # turn 4 of each is injected
