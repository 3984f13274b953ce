"""The proxy's records stay bounded by what arrived (red team F7: a 180 KB result of many findings
or many tiny blocks wrote megabytes of records), and a result's size limit counts what the agent
is shown once (F11: a tool that sends its text and the same structured content was counted twice)."""
from __future__ import annotations

import base64
import hashlib
import json
import sqlite3
from pathlib import Path

import mcp.types as types
import pytest

from audit import AuditLog, Signer, verify_export
from gate import Gate
from gate.redact import LISTED_CUTS
from gateway.chat import normalised_sha256
from gateway.mcp.guard import MAX_BLOCKS, Call, Document, Guard, Outcome
from gateway.tenants import Principal
from ledger import Ledger
from policies import PolicyEngine

KEYS = ["AKIA" + base64.b32encode(hashlib.sha256(str(n).encode()).digest()).decode()[:16] for n in range(3000)]


@pytest.fixture
def guard(tmp_path: Path) -> Guard:
    url = f"sqlite:///{tmp_path / 'lethe.db'}"
    return Guard(Gate(), PolicyEngine(), Ledger(url, check_invariants=False),
                 AuditLog(url, Signer.load_or_create(tmp_path / "key.pem")), max_result_bytes=100_000)


def _screened(guard: Guard, result: types.CallToolResult) -> Outcome:
    call = Call(Principal("acme", "ann"), None, "fx", "fx__read")
    refusal, record = guard.screen_arguments(call, Document.of_arguments({"path": "x"}))
    assert refusal is None
    return guard.screen_result(call, result, guard.write_call(call, record))


def _stored(tmp_path: Path) -> tuple[int, int]:
    """The largest audit entry and the largest crossing row, in bytes."""
    with sqlite3.connect(tmp_path / "lethe.db") as conn:
        entry = conn.execute("SELECT max(length(entry)) FROM audit_records").fetchone()[0]
        meta = conn.execute("SELECT max(length(meta)) FROM ledger_crossings").fetchone()[0]
    return entry, meta


def test_a_result_of_thousands_of_keys_is_redacted_with_records_of_bounded_size(guard: Guard, tmp_path: Path) -> None:
    text = " ".join(KEYS)
    outcome = _screened(guard, types.CallToolResult(content=[types.TextContent(type="text", text=text)]))
    assert outcome.decision.action == "redact"  # not a quarantine by the policy engine's instruction limit
    [block] = outcome.result.content
    assert isinstance(block, types.TextContent) and not any(k in block.text for k in KEYS)
    [crossing] = Ledger(f"sqlite:///{tmp_path / 'lethe.db'}", check_invariants=False).crossings.list("acme")
    redaction = crossing.meta["redaction"]
    assert len(redaction["cuts"]) == LISTED_CUTS and redaction["cuts_total"] == len(KEYS)
    every = [{"end": text.index(k) + len(k), "kind": "secret", "rule_id": "aws-access-key-id", "start": text.index(k)}
             for k in KEYS]
    assert redaction["cuts_sha256"] == hashlib.sha256(json.dumps(every, separators=(",", ":")).encode()).hexdigest()
    entry, meta = _stored(tmp_path)
    assert entry < 32_000 and meta < 32_000  # listed in full, the 3,000 cuts alone are 220 KB a record


def test_a_result_of_too_many_blocks_is_withheld_with_records_of_bounded_size(guard: Guard, tmp_path: Path) -> None:
    blocks = [types.TextContent(type="text", text=f"row {n}") for n in range(MAX_BLOCKS + 1)]
    outcome = _screened(guard, types.CallToolResult(content=blocks))
    assert outcome.decision.action == "quarantine"
    assert outcome.decision.reasons == (f"result_size: {MAX_BLOCKS + 1} content blocks > {MAX_BLOCKS}",)
    entry, meta = _stored(tmp_path)
    assert entry < 2048 and meta < 2048
    with sqlite3.connect(tmp_path / "lethe.db") as conn:
        withheld = {row[0] for row in conn.execute("SELECT sha256 FROM ledger_withheld")}
    whole = "\n".join(b.text for b in blocks).encode()
    assert withheld == {hashlib.sha256(whole).hexdigest(), normalised_sha256(whole)}  # the whole, not each block


def test_a_result_at_the_block_limit_lists_each_blocks_digest(guard: Guard, tmp_path: Path) -> None:
    blocks = [types.TextContent(type="text", text=f"row {n}") for n in range(MAX_BLOCKS)]
    outcome = _screened(guard, types.CallToolResult(content=blocks))
    assert outcome.decision.action == "allow" and outcome.result.content == blocks
    [crossing] = Ledger(f"sqlite:///{tmp_path / 'lethe.db'}", check_invariants=False).crossings.list("acme")
    assert crossing.meta["parts_sha256"] == [hashlib.sha256(f"row {n}".encode()).hexdigest() for n in range(MAX_BLOCKS)]


def test_text_sent_with_the_same_structured_content_counts_once_against_the_size_limit(guard: Guard) -> None:
    text = "x" * 60_000  # under the 100 KB limit; the text and the structured copy together are over it
    both = types.CallToolResult(content=[types.TextContent(type="text", text=json.dumps({"body": text}))],
                                structured_content={"body": text})
    assert _screened(guard, both).decision.action == "allow"
    over = types.CallToolResult(content=[types.TextContent(type="text", text=text * 2)])
    assert _screened(guard, over).decision.reasons[0].startswith("result_size: 120000 bytes of text > 100000")


def test_the_records_of_large_results_still_verify(guard: Guard, tmp_path: Path) -> None:
    _screened(guard, types.CallToolResult(content=[types.TextContent(type="text", text=" ".join(KEYS))]))
    export = tmp_path / "audit.json"
    guard_audit = AuditLog(f"sqlite:///{tmp_path / 'lethe.db'}", Signer.load_or_create(tmp_path / "key.pem"))
    guard_audit.export(export)
    assert verify_export(export, public_key_pem=guard_audit.signer.verifier.public_key_pem).ok
