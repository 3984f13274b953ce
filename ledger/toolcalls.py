"""Tool calls the gateway issued: the server-side record that makes a tool result's identity checkable.

On the chat endpoint the client sends back both the assistant's tool calls and the results that
answer them, so every tool name in a request is the client's word. The gateway's own model made
the calls, though: the gateway records each call id it handed out with the function name the model
chose, and a result's trust-relevant name is the recorded one (`gateway.pipeline.tool_identity`).
"""
from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from datetime import datetime, timezone

from sqlalchemy import Engine, insert, select

from .schema import WRITE, tool_calls


class ToolCallLog:
    """Record and look up the tool calls of a session (call id -> function name)."""

    def __init__(self, engine: Engine, serial: AbstractContextManager[object]) -> None:
        self._engine = engine
        self._serial = serial

    def record(self, session_id: str, calls: Mapping[str, str]) -> None:
        """Record the calls of one reply (ids are fresh random ones, so they never collide)."""
        if not calls:
            return
        now = datetime.now(timezone.utc)
        rows = [{"session_id": session_id, "call_id": cid, "name": name, "created_at": now}
                for cid, name in calls.items()]
        with self._serial, self._engine.connect().execution_options(**{WRITE: True}) as conn, conn.begin():
            conn.execute(insert(tool_calls), rows)

    def names(self, session_id: str) -> dict[str, str]:
        """call id -> function name, for every call the gateway issued in this session."""
        query = select(tool_calls.c.call_id, tool_calls.c.name).where(tool_calls.c.session_id == session_id)
        with self._serial, self._engine.connect() as conn:
            return {r.call_id: r.name for r in conn.execute(query)}
