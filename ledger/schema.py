"""Tables and engine set-up. SQLAlchemy Core only: the ledger's queries are few and explicit."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sqlalchemy import (
    JSON,
    Column,
    DateTime,
    Engine,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    UniqueConstraint,
    create_engine,
    event,
)
from sqlalchemy.engine import make_url
from sqlalchemy.pool import StaticPool

metadata = MetaData()

sessions = Table(
    "ledger_sessions",
    metadata,
    Column("id", String(200), primary_key=True),
    Column("tenant", String(200), nullable=False, index=True),
    Column("user", String(200)),
    Column("salt_scope", String(200)),
    Column("created_at", DateTime(timezone=True), nullable=False),
    # Kept on the session row (updated under its lock) so appends need no scan.
    Column("token_count", Integer, nullable=False, default=0),
    Column("next_seq", Integer, nullable=False, default=0),
)

segments = Table(
    "ledger_segments",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("session_id", String(200), ForeignKey("ledger_sessions.id", ondelete="CASCADE"), nullable=False),
    Column("seq", Integer, nullable=False),
    Column("role", String(64), nullable=False),
    Column("tool", String(200)),
    # No foreign key to blobs: a forgotten segment keeps the digest after its content is erased.
    Column("content_sha256", String(64), nullable=False),
    Column("replacement_sha256", String(64)),
    Column("tok_start", Integer, nullable=False),
    Column("tok_end", Integer, nullable=False),
    Column("state", String(16), nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("data_class", String(64), nullable=False),
    Column("meta", JSON, nullable=False),
    UniqueConstraint("session_id", "seq", name="uq_ledger_segments_session_seq"),
    Index("ix_ledger_segments_content", "content_sha256"),
    Index("ix_ledger_segments_replacement", "replacement_sha256"),
)

# What crossed a boundary other than the KV cache (the MCP proxy): one row per decision, hashes
# only. `withheld` lists the digests a boundary quarantined, per tenant, so the chat endpoint can
# refuse them later (no foreign key: a crossing may name no chat session).
crossings = Table(
    "ledger_crossings",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("tenant", String(200), nullable=False),
    Column("session_id", String(200)),
    Column("channel", String(16), nullable=False),
    Column("upstream", String(200), nullable=False),
    Column("tool", String(200), nullable=False),
    Column("phase", String(16), nullable=False),
    Column("content_sha256", String(64), nullable=False),
    Column("action", String(16), nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("meta", JSON, nullable=False),
    Index("ix_ledger_crossings_tenant_session", "tenant", "session_id"),
    Index("ix_ledger_crossings_tenant_time", "tenant", "created_at", "id"),  # a page of the listing
)

withheld = Table(
    "ledger_withheld",
    metadata,
    Column("tenant", String(200), primary_key=True),
    Column("sha256", String(64), primary_key=True),
    Column("crossing_id", String(40), nullable=False),
)

# Work a committed turn still owes, written in the turn's own transaction (an outbox): its audit
# records (`audit`) and the forgets of what the policy admitted for that turn only (`forget`).
# A row goes once its work is done; one left by a crash is done at start-up (gateway/erasure.py).
intents = Table(
    "ledger_intents",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("session_id", String(200), ForeignKey("ledger_sessions.id", ondelete="CASCADE"), nullable=False),
    Column("kind", String(16), nullable=False),
    Column("payload", JSON, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Index("ix_ledger_intents_session", "session_id"),
)

# The tool calls the gateway's own model made, per session: what a `role=tool` result claims to
# answer is checked against these (names only, never arguments or content). A call id is the
# gateway's ("call_" + random hex), so a client cannot guess one it was not shown.
tool_calls = Table(
    "ledger_tool_calls",
    metadata,
    Column("session_id", String(200), ForeignKey("ledger_sessions.id", ondelete="CASCADE"), primary_key=True),
    Column("call_id", String(200), primary_key=True),
    Column("name", String(200), nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
)

blobs = Table(
    "ledger_blobs",
    metadata,
    Column("sha256", String(64), primary_key=True),
    Column("size", Integer, nullable=False),
    Column("data", LargeBinary, nullable=False),
)

WRITE = "lethe_ledger_write"
"""Execution option marking a connection whose transaction will write (SQLite: BEGIN IMMEDIATE)."""


def make_engine(url: str) -> Engine:
    """An engine for SQLite (WAL, foreign keys, writer lock taken up front) or PostgreSQL (psycopg)."""
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend == "postgresql":
        return create_engine(url, pool_pre_ping=True)
    if backend != "sqlite":
        raise ValueError(f"the ledger supports sqlite and postgresql, not {backend!r}; fix the database URL")
    in_memory = parsed.database in (None, "", ":memory:")
    kwargs: dict[str, Any] = {"connect_args": {"check_same_thread": False, "timeout": 30}}
    if in_memory:
        kwargs["poolclass"] = StaticPool  # one connection, or every connection sees its own empty DB
    else:
        _owner_only(Path(str(parsed.database)))  # not None: in_memory covers None
    engine = create_engine(url, **kwargs)
    _sqlite_transactions(engine)
    return engine


def _owner_only(db: Path) -> None:
    """Create the database file 0600 before SQLite opens it (red team #13 F9: it was 0644, readable
    by every local user). SQLite creates `-wal` and `-shm` with the database file's mode, so they
    follow; an existing file of ours (and its -wal, -shm) is narrowed to 0600 as well."""
    os.close(os.open(db, os.O_CREAT | os.O_RDWR, 0o600))
    for path in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
        if path.exists() and path.stat().st_uid == os.getuid():
            path.chmod(0o600)


def _sqlite_transactions(engine: Engine) -> None:
    """Let SQLAlchemy, not pysqlite, emit BEGIN, so a writer takes the lock before it reads.

    A deferred transaction that reads and then writes can fail with "database is locked" when
    another writer got there first; BEGIN IMMEDIATE waits (busy timeout) instead. Readers keep a
    deferred BEGIN and, with WAL, never block writers.
    """

    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        # Deleted rows' bytes are overwritten with zeros in the page (and freed pages zeroed), so
        # an erased blob cannot be read back from lethe.db; the WAL is truncated by Ledger.scrub.
        cursor.execute("PRAGMA secure_delete=ON")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get(WRITE) else "BEGIN")
