"""A Guard over real parts (gate, embedded policy, SQLite ledger and audit log, a real key) in a
directory, and a call screened through it as the proxy does: arguments, the call's record, the result."""
from __future__ import annotations

import uuid
from pathlib import Path

import mcp.types as types

from audit import AuditLog, Signer
from gate import Gate
from gateway.mcp.guard import Call, Document, Guard, Outcome
from gateway.tenants import Principal
from ledger import Ledger
from policies import PolicyEngine


def new_guard(tmp: Path, max_result_bytes: int = 100_000) -> Guard:
    url = f"sqlite:///{tmp / 'lethe.db'}"
    return Guard(Gate(), PolicyEngine(), Ledger(url, check_invariants=False),
                 AuditLog(url, Signer.load_or_create(tmp / "key.pem")), max_result_bytes=max_result_bytes)


def call(tool: str = "fx__read", stream: str | None = None) -> Call:
    """A call of its own agent stream (`stream`: a fresh MCP session when not named), so no test
    reads the text another one was shown (gateway/mcp/history.py)."""
    return Call(Principal("acme", "ann"), None, "fx", tool, mcp_session=stream or uuid.uuid4().hex)


def screened(guard: Guard, result: types.CallToolResult, tool: str = "fx__read", stream: str | None = None) -> Outcome:
    """`result` as the agent would get it from `tool`, called with harmless arguments."""
    made = call(tool, stream)
    refusal, record = guard.screen_arguments(made, Document.of_arguments({"path": "x"}))
    assert refusal is None
    return guard.screen_result(made, result, guard.write_call(made, record))
