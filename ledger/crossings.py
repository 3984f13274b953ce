"""Crossings: decisions taken at a boundary the KV cache does not own (the MCP proxy).

A tool result the proxy quarantined never reached the agent, but the agent (or whoever fed it)
may still paste the same bytes into the chat endpoint. The ledger keeps the digests a boundary
withheld, per tenant, so the chat pipeline can refuse them: a quarantine at one boundary holds at
the other. Rows hold hashes, kinds and offsets, never content.
"""
from __future__ import annotations

import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import Connection, Engine, insert, select, tuple_
from sqlalchemy.dialects import postgresql, sqlite

from .schema import WRITE, crossings, withheld


@dataclass(frozen=True)
class Crossing:
    """One decision at a boundary: what was decided about which bytes (by digest), for whom."""

    id: str
    tenant: str
    session_id: str | None
    channel: str
    upstream: str
    tool: str
    phase: str  # "result" | "arguments"
    content_sha256: str
    action: str
    created_at: datetime
    meta: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "tenant": self.tenant, "session_id": self.session_id, "channel": self.channel,
                "upstream": self.upstream, "tool": self.tool, "phase": self.phase,
                "content_sha256": self.content_sha256, "action": self.action,
                "created_at": self.created_at.isoformat(), "meta": self.meta}


def _row(c: Crossing) -> dict[str, Any]:
    """A crossing as a row; `meta` is copied as is (dataclasses.asdict deep-copies it, a cost per call)."""
    return {f: getattr(c, f) for f in _FIELDS}


def _insert_ignore(conn: Connection):  # type: ignore[no-untyped-def]
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    return dialect.insert(withheld).on_conflict_do_nothing()


_FIELDS = tuple(f.name for f in fields(Crossing))
_INSERT = insert(crossings)  # built once: a crossing is written on the MCP proxy's commit path


class CrossingLog:
    """Append and read crossings; `is_withheld` is the chat pipeline's re-entry check."""

    def __init__(self, engine: Engine, serial: Any) -> None:
        self._engine = engine
        self._serial = serial

    @staticmethod
    def new(*, tenant: str, session_id: str | None, channel: str, upstream: str, tool: str, phase: str,
            content_sha256: str, action: str, meta: dict[str, Any], id: str | None = None) -> Crossing:
        """A crossing with its id (a new one unless given: `new_id`), not yet written (its id can go
        into other records first)."""
        return Crossing(id or CrossingLog.new_id(), tenant, session_id, channel, upstream, tool, phase,
                        content_sha256, action, datetime.now(timezone.utc), meta)

    @staticmethod
    def new_id() -> str:
        """A fresh crossing id, for records written before their crossing (an MCP call's, ahead of its result)."""
        return "crs_" + secrets.token_hex(12)

    @property
    def database(self) -> str:
        """The database the crossings live in (password hidden)."""
        return self._engine.url.render_as_string(hide_password=True)

    def write(self, rows: Sequence[tuple[Crossing, Iterable[str]]]) -> None:
        """Crossings, each with the digests it withholds, in one transaction (one commit for a batch)."""
        if not rows:
            return
        with self._serial, self._engine.connect().execution_options(**{WRITE: True}) as conn, conn.begin():
            self.insert(conn, rows)

    @staticmethod
    def insert(conn: Connection, rows: Sequence[tuple[Crossing, Iterable[str]]]) -> None:
        """The statements of `write` on a connection whose transaction the caller commits: another
        store's writer in the same database (the audit log) commits them with its own rows."""
        withheld_rows = [{"tenant": c.tenant, "sha256": d, "crossing_id": c.id}
                         for c, digests in rows for d in sorted(set(digests))]
        if rows:  # a batch may hold records alone (an MCP call's, committed before its crossing)
            conn.execute(_INSERT, [_row(c) for c, _ in rows])
        if withheld_rows:
            conn.execute(_insert_ignore(conn), withheld_rows)

    def record(self, *, withhold: Iterable[str] = (), **fields: Any) -> Crossing:
        """One crossing written on its own; `withhold` are digests to refuse on re-entry."""
        row = self.new(**fields)
        self.write([(row, withhold)])
        return row

    def list(self, tenant: str, session_id: str | None = None, *, after: str | None = None,
             limit: int | None = None) -> list[Crossing]:
        """A tenant's crossings (one session's when given), oldest first. Never another tenant's.
        A page: at most `limit`, those after the crossing `after` (a keyset on time and id, so a
        page costs its own rows, however long the log); an `after` that is not one of this
        tenant's crossings raises LookupError."""
        query = select(crossings).where(crossings.c.tenant == tenant)
        if session_id is not None:
            query = query.where(crossings.c.session_id == session_id)
        with self._serial, self._engine.connect() as conn:
            if after is not None:
                mark = conn.execute(select(crossings.c.created_at).where(
                    crossings.c.tenant == tenant, crossings.c.id == after)).scalar_one_or_none()
                if mark is None:
                    raise LookupError(f"no crossing {after!r} for this tenant")
                query = query.where(tuple_(crossings.c.created_at, crossings.c.id) > tuple_(mark, after))
            query = query.order_by(crossings.c.created_at, crossings.c.id)
            rows = conn.execute(query if limit is None else query.limit(limit)).all()
        return [Crossing(r.id, r.tenant, r.session_id, r.channel, r.upstream, r.tool, r.phase, r.content_sha256,
                         r.action, r.created_at.replace(tzinfo=r.created_at.tzinfo or timezone.utc), dict(r.meta))
                for r in rows]

    def is_withheld(self, tenant: str, digests: Iterable[str]) -> str | None:
        """The id of a crossing that withheld bytes of any of these digests from this tenant, or None."""
        query = select(withheld.c.crossing_id).where(withheld.c.tenant == tenant,
                                                      withheld.c.sha256.in_(sorted(set(digests)))).limit(1)
        with self._serial, self._engine.connect() as conn:
            return conn.execute(query).scalar_one_or_none()
